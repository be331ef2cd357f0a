"""One signed request to the MAAS 2.0 API, with bounded retries and error classification.

Operations go in the query string (`?op=deploy`); bodies are always
`application/x-www-form-urlencoded`, because MAAS reads a JSON body as no form data at all and
silently ignores its fields. Only requests the caller marks `retry_safe` are retried, and only
on upstream_transient errors: a POST that timed out may have taken effect, and repeating e.g. a
deploy or a link_subnet is not harmless.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlencode

import httpx
import msgspec

from activities.maas.auth import MaasApiKey, oauth_header
from activities.maas.errors import (
    MaasAuthError,
    MaasBmcError,
    MaasCapabilityMissing,
    MaasError,
    MaasNotFound,
    MaasProtocolError,
    MaasStateConflict,
    MaasUnavailable,
    MaasValidationError,
    is_bmc_failure,
    sanitise,
    status_named_in,
)

log = logging.getLogger(__name__)

API_PATH = "/api/2.0/"
FormFields = Sequence[tuple[str, str]]

# Errors raised before the request left this process: it cannot have taken effect.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def api_root(base_url: str) -> str:
    """The API root for a site's base URL: `http://host:5240/MAAS` (how sites store it, seed
    003 §3.1) or the API root itself."""
    root = base_url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError("MAAS base URL must start with http:// or https://")
    if not root.endswith(API_PATH.rstrip("/")):
        root += API_PATH.rstrip("/")
    return root + "/"


def form_bool(value: bool) -> str:
    return "true" if value else "false"


class MaasTransport:
    def __init__(
        self,
        http: httpx.AsyncClient,
        key: MaasApiKey,
        *,
        max_attempts: int,
        backoff_initial: float,
        backoff_max: float,
    ) -> None:
        self._http = http
        self._key = key
        self._max_attempts = max_attempts
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

    async def request(
        self,
        method: str,
        path: str,
        *,
        op: str | None = None,
        query: FormFields = (),
        form: FormFields | None = None,
        retry_safe: bool,
        secrets: Iterable[str] = (),
        decode_json: Callable[[bytes], Any] | None = None,
    ) -> Any:
        """The decoded answer: JSON, or text for MAAS's plain-text answers ("OK"). A JSON answer
        is decoded by `decode_json` when given (raising msgspec.DecodeError on a body it cannot
        read), else as a whole."""
        operation = f"{method} {path}" + (f"?op={op}" if op else "")
        params = ([("op", op)] if op else []) + list(query)
        scrub = (*self._key.secrets(), *secrets)
        content = None if form is None else urlencode(list(form))
        attempt = 0
        while True:
            attempt += 1
            headers = {"Authorization": oauth_header(self._key), "Accept": "application/json"}
            if content is not None:
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            try:
                response = await self._http.request(
                    method, path, params=tuple(params), content=content, headers=headers
                )
            except httpx.TransportError as exc:
                error: MaasError = _transport_error(exc, method, operation, scrub)
            else:
                if response.is_success:
                    return _decode(response, operation, decode_json)
                error = classify(response, method, operation, scrub)
            if not (retry_safe and isinstance(error, MaasUnavailable)):
                raise error
            if attempt >= self._max_attempts:
                raise error
            delay = min(self._backoff_max, self._backoff_initial * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)  # jitter: sites' workers must not retry in step
            log.warning(
                "%s; attempt %d of %d, retrying in %.2fs", error, attempt, self._max_attempts, delay
            )
            await asyncio.sleep(delay)


def _transport_error(
    exc: httpx.TransportError, method: str, operation: str, scrub: Sequence[str]
) -> MaasUnavailable:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "unreachable"
    detail = sanitise(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, scrub)
    return MaasUnavailable(
        f"MAAS {operation} {kind} ({detail})",
        operation=operation,
        maybe_applied=method != "GET" and not isinstance(exc, _NOT_SENT),
    )


def _decode(
    response: httpx.Response, operation: str, decode_json: Callable[[bytes], Any] | None
) -> Any:
    if "json" not in response.headers.get("content-type", ""):
        return response.text
    try:
        return response.json() if decode_json is None else decode_json(response.content)
    except (json.JSONDecodeError, msgspec.DecodeError) as exc:
        raise MaasProtocolError(
            f"MAAS {operation} answered {response.status_code} with malformed JSON",
            operation=operation,
            status_code=response.status_code,
        ) from exc


def _body(response: httpx.Response) -> tuple[str, dict[str, tuple[str, ...]]]:
    """MAAS's error text, and its field errors when the body is `{"field": ["msg", …]}`."""
    text = response.text
    if "json" not in response.headers.get("content-type", ""):
        return text, {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, {}
    if not isinstance(data, dict):
        return text, {}
    fields = {
        str(name): tuple(str(m) for m in (msgs if isinstance(msgs, list) else [msgs]))
        for name, msgs in data.items()
    }
    flat = "; ".join(f"{name}: {' '.join(msgs)}" for name, msgs in fields.items())
    return flat, fields


def classify(
    response: httpx.Response, method: str, operation: str, secrets: Sequence[str]
) -> MaasError:
    """The MaasError for a non-2xx answer (the table in activities/maas/errors.py)."""
    code = response.status_code
    raw, raw_fields = _body(response)
    text = sanitise(raw, secrets)
    fields = {name: tuple(sanitise(m, secrets) for m in msgs) for name, msgs in raw_fields.items()}
    message = f"MAAS {operation} answered {code}: {text or response.reason_phrase}"
    common: dict[str, Any] = {"operation": operation, "status_code": code, "maas_text": text}
    if code in (401, 403):
        return MaasAuthError(message + " (is the site's API key valid, and an admin's?)", **common)
    if code >= 500 and is_bmc_failure(text):
        return MaasBmcError(message, **common)
    if code == 429 or code >= 500:
        # 5xx on a mutating request: MAAS (or a proxy in front of it) may have applied it.
        return MaasUnavailable(message, maybe_applied=method != "GET", **common)
    if code == 404 and "matches the given query" in text:
        return MaasNotFound(message, **common)
    # Any other 404 ("Unknown API endpoint", or a base URL that is no MAAS at all), a 405, or an
    # op this MAAS does not know: the site lacks what the client needs.
    if code in (404, 405) or "Unrecognised signature" in text:
        return MaasCapabilityMissing(message, **common)
    if code == 409 or (code == 400 and "current state" in text):
        return MaasStateConflict(message, current_status=status_named_in(text), **common)
    return MaasValidationError(message, field_errors=fields, **common)
