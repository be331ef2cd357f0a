"""MAAS errors, each carrying its docs/runbooks/index.md failure class.

How an answer is classified (maas-api-notes.md "Errors"):

- timeout, connection refused/reset, 5xx, 429 → MaasUnavailable (upstream_transient)
- 5xx whose text is a power driver's error ("Failed talking to node's BMC: …", "Could not
  contact node's BMC: …"; MAAS answers PowerProblem as 503) → MaasBmcError (bmc_power_failure)
- 401 (bad key, expired timestamp), 403 (not permitted) → MaasAuthError (site_capability_missing)
- a valid key whose user is not a superuser (`require_admin`, users/?op=whoami) → MaasNotAdmin
  (site_capability_missing)
- 404 "Unknown API endpoint" (or any 404 that is not MAAS's "No X matches the given query."),
  405, 400 "Unrecognised signature" (this MAAS lacks the operation, or the base URL is no MAAS)
  → MaasCapabilityMissing (site_capability_missing)
- a 2xx body this client cannot read → MaasProtocolError (site_capability_missing)
- 404 "No Machine matches the given query." (deleted out of band) → MaasNotFound
  (state_ambiguity)
- 409 NodeStateViolation, 400 "… current state …" → MaasStateConflict (state_ambiguity)
- any other 4xx (form validation) → MaasValidationError (input_config_error)

Messages quote MAAS's own (truncated) text, scrubbed of the API key and of any BMC password
sent in the request: MAAS's 401 bodies echo the token key and the expected PLAINTEXT signature
(the valid token secret, withheld whatever key the client holds).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import quote

from activities.maas.types import MachineStatus
from core.failures import ClassifiedError, FailureClass

MAX_MAAS_TEXT = 300
REDACTED = "***"


class MaasError(ClassifiedError):
    """A MAAS call failed. `operation` is e.g. "POST machines/abc123/?op=deploy"; `status_code`
    is None when no answer came back."""

    failure_class = FailureClass.UPSTREAM_TRANSIENT

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        status_code: int | None = None,
        maas_text: str = "",
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.status_code = status_code
        self.maas_text = maas_text


class MaasUnavailable(MaasError):
    """MAAS did not answer usefully in time. `maybe_applied`: the request may have reached MAAS
    and taken effect (a read timeout after sending); refresh observed state before acting."""

    failure_class = FailureClass.UPSTREAM_TRANSIENT

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        status_code: int | None = None,
        maas_text: str = "",
        maybe_applied: bool = False,
    ) -> None:
        super().__init__(message, operation=operation, status_code=status_code, maas_text=maas_text)
        self.maybe_applied = maybe_applied


class MaasBmcError(MaasError):
    """MAAS is fine but could not drive the machine's BMC (query_power_state, power_on/off)."""

    failure_class = FailureClass.BMC_POWER_FAILURE


class MaasAuthError(MaasError):
    failure_class = FailureClass.SITE_CAPABILITY_MISSING


class MaasCapabilityMissing(MaasError):
    failure_class = FailureClass.SITE_CAPABILITY_MISSING


class MaasNotAdmin(MaasError):
    """The key is valid but its user is no MAAS administrator (`users/?op=whoami` answers
    is_superuser false): the onboarding calls (accept, commission, link_subnet, …) would be
    refused with 403. `username` is whose key it is."""

    failure_class = FailureClass.SITE_CAPABILITY_MISSING

    def __init__(self, message: str, *, operation: str, username: str | None) -> None:
        super().__init__(message, operation=operation)
        self.username = username


class MaasProtocolError(MaasError):
    failure_class = FailureClass.SITE_CAPABILITY_MISSING


class MaasNotFound(MaasError):
    """The object is gone from MAAS: deleted out of band
    (docs/lifecycles/onboarding.md#mark-manual-intervention,
    docs/lifecycles/onboarding.md#safe-re-entry)."""

    failure_class = FailureClass.STATE_AMBIGUITY


class MaasStateConflict(MaasError):
    """MAAS refused because the machine is not in a state that allows the action: the caller's
    belief and MAAS's state differ. `current_status` is read from MAAS's message when it names
    the state (e.g. "Can't deploy a machine that is in the 'Failed deployment' state")."""

    failure_class = FailureClass.STATE_AMBIGUITY

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        status_code: int | None = None,
        maas_text: str = "",
        current_status: MachineStatus | None = None,
    ) -> None:
        super().__init__(message, operation=operation, status_code=status_code, maas_text=maas_text)
        self.current_status = current_status


class MaasValidationError(MaasError):
    """MAAS rejected the request's fields. `field_errors` is MAAS's `{"field": ["msg", …]}`
    (non-field errors under `__all__`), empty when MAAS answered with plain text."""

    failure_class = FailureClass.INPUT_CONFIG_ERROR

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        status_code: int | None = None,
        maas_text: str = "",
        field_errors: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(message, operation=operation, status_code=status_code, maas_text=maas_text)
        self.field_errors: dict[str, tuple[str, ...]] = dict(field_errors or {})


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` without any of `secrets`, raw or percent-encoded (the OAuth header form)."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        for form in {secret, quote(secret, safe="~")}:
            text = text.replace(form, REDACTED)
    return text


# MAAS's "Invalid signature" 401 quotes the signature it expected, i.e. the *valid* token
# secret, which a client holding a wrong secret cannot redact by value: withhold the tail.
_EXPECTED_SIGNATURE = re.compile(r"(Expected signature base string:).*", re.DOTALL)


def sanitise(text: str, secrets: Iterable[str]) -> str:
    """MAAS's text made safe to store: no expected signature, no known secret, bounded."""
    return shorten(redact(_EXPECTED_SIGNATURE.sub(r"\1 [withheld]", text), secrets))


def shorten(text: str, limit: int = MAX_MAAS_TEXT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# A quoted state name; an apostrophe inside a word ("Can't") does not open a quote.
# provisioningserver/drivers/power get_error_message: what MAAS says when a BMC fails it.
_BMC_FAILURE = re.compile(
    r"node's BMC|Missing or invalid power setting|Failed to complete power action|"
    r"Missing power tool",
    re.IGNORECASE,
)


def is_bmc_failure(text: str) -> bool:
    return _BMC_FAILURE.search(text) is not None


_QUOTED = re.compile(r"(?<!\w)'([^']+)'")
_IN_STATE = re.compile(r"is in state (.+?)\.?$")


def status_named_in(text: str) -> MachineStatus | None:
    """The machine status a NodeStateViolation message names, if any."""
    candidates = _QUOTED.findall(text)
    match = _IN_STATE.search(text)
    if match:
        candidates.append(match.group(1))
    for candidate in candidates:
        try:
            return MachineStatus.from_label(candidate.strip())
        except ValueError:
            continue
    return None
