"""The failure taxonomy of docs/runbooks/index.md: every failure that leaves a MAAS-side activity is
one of these classes, so retry, resume, rerun and manual intervention are decided by the class and
never by parsing message text.

Foreign errors (httpx, MAAS status codes, Vault answers) are classified where they are caught,
as a `ClassifiedError`; an activity turns one into a Temporal `ApplicationError` whose `type` is
the class name and whose `non_retryable` follows the class's default handling:

    except ClassifiedError as err:
        raise to_application_error(err) from err
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from temporalio.exceptions import ApplicationError


class FailureClass(StrEnum):
    INPUT_CONFIG_ERROR = "input_config_error"
    SITE_CAPABILITY_MISSING = "site_capability_missing"
    UPSTREAM_TRANSIENT = "upstream_transient"
    BMC_POWER_FAILURE = "bmc_power_failure"
    PXE_DISCOVERY_FAILURE = "pxe_discovery_failure"
    HARDWARE_MISMATCH = "hardware_mismatch"
    DEPLOY_CLOUD_INIT_FAILURE = "deploy_cloud_init_failure"
    POST_DEPLOY_CONNECTIVITY_FAILURE = "post_deploy_connectivity_failure"
    HARDWARE_SYNC_FAILURE = "hardware_sync_failure"
    AGENT_ENROLLMENT_FAILURE = "agent_enrollment_failure"
    STATE_AMBIGUITY = "state_ambiguity"
    # Not of docs/runbooks/index.md (issue 35): an operator protected the node, and a destructive
    # step (MAAS release, erase, power-off, delete) refused to run on it.
    NODE_PROTECTED = "node_protected"


class NextStep(StrEnum):
    """What happens once automatic handling of a failure is exhausted (§4.7, §4.8, §4.11)."""

    FIX_INPUT = "fix_input"  # the request or site config is wrong: nothing to retry
    FIX_SITE = "fix_site"  # an operator fixes the site's capability, then resumes
    MANUAL_INTERVENTION = "manual_intervention"  # automation stops: failed_manual_intervention
    RECOVERY_PATH = "recovery_path"  # the workflow's bounded recovery (release, redeploy)
    RECONCILE = "reconcile"  # stop automation; an operator reconciles or adopts observed state
    # the node is protected: an operator unprotects it (the audited admin route), then retries
    UNPROTECT = "unprotect"


@dataclass(frozen=True)
class Handling:
    """A class's default handling. `retryable`: the failing step may be retried automatically
    (bounded by the caller's retry policy); otherwise the error is non-retryable and the
    workflow goes straight to `then`."""

    retryable: bool
    then: NextStep


DEFAULT_HANDLING: dict[FailureClass, Handling] = {
    # fail immediately, no automatic retry
    FailureClass.INPUT_CONFIG_ERROR: Handling(retryable=False, then=NextStep.FIX_INPUT),
    # fail immediately, operator fixes site capability
    FailureClass.SITE_CAPABILITY_MISSING: Handling(retryable=False, then=NextStep.FIX_SITE),
    # bounded automatic retry; a step that keeps failing is surfaced for a human
    FailureClass.UPSTREAM_TRANSIENT: Handling(retryable=True, then=NextStep.MANUAL_INTERVENTION),
    # bounded retry, then manual intervention
    FailureClass.BMC_POWER_FAILURE: Handling(retryable=True, then=NextStep.MANUAL_INTERVENTION),
    FailureClass.PXE_DISCOVERY_FAILURE: Handling(retryable=True, then=NextStep.MANUAL_INTERVENTION),
    # fail and block for manual intervention
    FailureClass.HARDWARE_MISMATCH: Handling(retryable=False, then=NextStep.MANUAL_INTERVENTION),
    # classify and allow the bounded recovery path: re-running the same step (a deploy on a
    # Failed deployment machine) cannot succeed, the workflow releases and redeploys instead
    FailureClass.DEPLOY_CLOUD_INIT_FAILURE: Handling(retryable=False, then=NextStep.RECOVERY_PATH),
    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE: Handling(
        retryable=True, then=NextStep.MANUAL_INTERVENTION
    ),
    # bounded retry/reseed, then manual intervention
    FailureClass.HARDWARE_SYNC_FAILURE: Handling(retryable=True, then=NextStep.MANUAL_INTERVENTION),
    # bounded retry with token refresh, then manual intervention
    FailureClass.AGENT_ENROLLMENT_FAILURE: Handling(
        retryable=True, then=NextStep.MANUAL_INTERVENTION
    ),
    # stop automation and require a reconcile/adopt decision
    FailureClass.STATE_AMBIGUITY: Handling(retryable=False, then=NextStep.RECONCILE),
    # nothing to retry while the flag is set: an operator unprotects the node
    # (POST /api/v1/admin/nodes/{id}/unprotect, audited), then retries the stage
    FailureClass.NODE_PROTECTED: Handling(retryable=False, then=NextStep.UNPROTECT),
}


def handling(failure_class: FailureClass) -> Handling:
    return DEFAULT_HANDLING[failure_class]


class ClassifiedError(Exception):
    """An error whose failure class is known. Subclasses set `failure_class`; the message must
    already be safe to store (no secrets): it ends up in Temporal history and read models."""

    failure_class: FailureClass = FailureClass.UPSTREAM_TRANSIENT

    def __init__(self, message: str, *, failure_class: FailureClass | None = None) -> None:
        super().__init__(message)
        if failure_class is not None:
            self.failure_class = failure_class

    @property
    def message(self) -> str:
        return str(self)


def application_error(
    failure_class: FailureClass,
    message: str,
    *details: object,
    non_retryable: bool | None = None,
) -> ApplicationError:
    """An ApplicationError of `failure_class`; `non_retryable` defaults to the class's handling.
    `details` travel with it (encrypted by the payload codec), so they must be serialisable."""
    if non_retryable is None:
        non_retryable = not DEFAULT_HANDLING[failure_class].retryable
    return ApplicationError(
        message, *details, type=failure_class.value, non_retryable=non_retryable
    )


def to_application_error(
    error: ClassifiedError, *details: object, non_retryable: bool | None = None
) -> ApplicationError:
    return application_error(
        error.failure_class, error.message, *details, non_retryable=non_retryable
    )


def failure_class_of(error: BaseException) -> FailureClass | None:
    """The class of a ClassifiedError, or of an ApplicationError raised from one (as seen by a
    workflow, possibly wrapped in ActivityError/ChildWorkflowError causes); None otherwise."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ClassifiedError):
            return seen.failure_class
        if isinstance(seen, ApplicationError) and seen.type is not None:
            try:
                return FailureClass(seen.type)
            except ValueError:
                return None
        seen = seen.__cause__
    return None
