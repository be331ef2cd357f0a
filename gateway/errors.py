"""The one exception → HTTP mapper.

Every error leaves the gateway as ``{"error": {"code", "message", "details"}}`` with a
machine-readable code. A refusal (4xx) is logged as one line with its status and code; a 5xx we
can name (Temporal or the database unavailable) as one warning line with its cause chain. Only
unknown exceptions, real faults, become a generic 500 logged with a traceback, by type and stack
frames only: exception messages can quote request data (SQL parameters hold SSH keys), so they
are never written to the log or the response.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import sqlalchemy.exc
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from temporalio.service import RPCError, RPCStatusCode

from core.secrets import SecretStoreError

log = logging.getLogger("gateway.errors")

# RPC codes that mean "Temporal is not answering", not "Temporal said no".
TEMPORAL_UNAVAILABLE_CODES = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED}
)

_ASYNCPG_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.OperatorInterventionError,
)


class ApiError(Exception):
    """An error with a known HTTP status and machine code; the message is safe to show."""

    status_code = 400
    code = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status_code: int | None = None,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
        self.details: dict[str, Any] = dict(details or {})
        self.headers: dict[str, str] = dict(headers or {})


class InvalidRequest(ApiError):
    status_code = 400
    code = "invalid_request"


class Unauthenticated(ApiError):
    status_code = 401
    code = "unauthenticated"

    def __init__(self, message: str = "a valid bearer token is required") -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="gpucloud"'})


class Forbidden(ApiError):
    status_code = 403
    code = "forbidden"


class NotFound(ApiError):
    status_code = 404
    code = "not_found"

    def __init__(self, message: str = "not found") -> None:
        super().__init__(message)


class Conflict(ApiError):
    status_code = 409


class Unprocessable(ApiError):
    status_code = 422


@dataclass(frozen=True)
class FieldError:
    """One invalid field of a request (`source`: body or query), as a 422 lists it."""

    key: str
    code: str
    message: str
    source: str = "body"

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "source": self.source, "code": self.code, "message": self.message}


def unprocessable(errors: Sequence[FieldError], **extra: Any) -> Unprocessable:
    """422 with every field error; its code is theirs when they agree, else validation_failed."""
    codes = {e.code for e in errors}
    code = next(iter(codes)) if len(codes) == 1 else "validation_failed"
    message = errors[0].message if len(errors) == 1 else f"{len(errors)} fields are invalid"
    return Unprocessable(
        message, code=code, details={"errors": [e.as_dict() for e in errors], **extra}
    )


def unknown_query_value(key: str, allowed: Sequence[str]) -> Unprocessable:
    """422 `unknown_{key}` for a query filter outside its values, listing them."""
    return unprocessable(
        [
            FieldError(
                key,
                f"unknown_{key}",
                f"{key} must be one of: " + ", ".join(allowed),
                source="query",
            )
        ],
        allowed=list(allowed),
    )


class ServiceUnavailable(ApiError):
    status_code = 503

    def __init__(self, message: str, *, code: str, details: Mapping[str, Any] | None = None):
        super().__init__(message, code=code, details=details, headers={"Retry-After": "2"})


class TemporalUnavailable(ServiceUnavailable):
    def __init__(
        self,
        message: str = "Temporal is not reachable; retry shortly",
        *,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, code="temporal_unavailable", details=details)


class TemporalBusy(ServiceUnavailable):
    """Temporal refused the call for load (RESOURCE_EXHAUSTED): most often more concurrent
    updates on one workflow than the server admits (history.maxInFlightUpdates, 10 by default).
    The SDK retried it already; nothing was applied, so the same request again is safe."""

    def __init__(self) -> None:
        super().__init__(
            "Temporal is busy with this resource's other requests; retry shortly",
            code="temporal_busy",
        )


class SecretStoreUnavailable(ServiceUnavailable):
    def __init__(self, message: str = "the secret store is not reachable; retry shortly") -> None:
        super().__init__(message, code="secret_store_unavailable")


class DatabaseUnavailable(ServiceUnavailable):
    def __init__(self, message: str = "the database is not reachable; retry shortly") -> None:
        super().__init__(message, code="database_unavailable")


# --- classification of foreign errors ---


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what it wraps (SQLAlchemy's .orig) and its causes, without cycles."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen or len(seen) > 16:
            continue
        seen.add(id(current))
        yield current
        for nxt in (getattr(current, "orig", None), current.__cause__, current.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def is_temporal_unavailable(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(e, RPCError) and e.status in TEMPORAL_UNAVAILABLE_CODES:
            return True
        # A lazy client that cannot connect raises RuntimeError("Failed client connect: ...").
        if isinstance(e, RuntimeError) and "client connect" in str(e).lower():
            return True
    return False


def is_temporal_busy(exc: BaseException) -> bool:
    return any(
        isinstance(e, RPCError) and e.status == RPCStatusCode.RESOURCE_EXHAUSTED
        for e in _chain(exc)
    )


def cause_summary(exc: BaseException) -> str:
    """What an operator needs to tell one 5xx from another: the types along the cause chain,
    and for Temporal's RPC errors their status and message (a server message, never our
    payloads). Database messages are left out: they may quote SQL parameters."""
    parts = []
    for e in _chain(exc):
        if isinstance(e, RPCError):
            parts.append(f"RPCError({e.status.name}: {e.message[:160]})")
        else:
            parts.append(type(e).__name__)
    return " <- ".join(parts)


def is_database_unavailable(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(
            e,
            sqlalchemy.exc.OperationalError
            | sqlalchemy.exc.InterfaceError
            | sqlalchemy.exc.TimeoutError
            | sqlalchemy.exc.DisconnectionError,
        ):
            return True
        if isinstance(e, sqlalchemy.exc.DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, _ASYNCPG_CONNECTION_ERRORS):
            return True
        if isinstance(e, OSError | TimeoutError | ConnectionError):
            return True
    return False


def translate(exc: BaseException) -> ApiError | None:
    """The ApiError for a foreign exception we know how to describe, else None.

    Temporal calls go through gateway.temporal, which raises TemporalUnavailable itself, so a raw
    OSError or TimeoutError reaching this point came from the database.
    """
    if isinstance(exc, ApiError):
        return exc
    if is_temporal_unavailable(exc):
        return TemporalUnavailable()
    if is_temporal_busy(exc):
        return TemporalBusy()
    if is_database_unavailable(exc):
        return DatabaseUnavailable()
    if isinstance(exc, SecretStoreError):
        # Vault down, refusing us or misconfigured: the answer names none of it.
        return SecretStoreUnavailable()
    return None


# --- the handler ---

_STATUS_CODES = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
}

_SAFE_MESSAGES = {
    404: "no such route or resource",
    405: "method not allowed on this route",
    413: "request body too large",
}


def error_body(code: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": dict(details or {})}}


def _validation_details(exc: ValidationException) -> dict[str, Any]:
    """Keep only the parts of Litestar/msgspec validation errors that describe *where* and *what
    kind*; they never carry the submitted value."""
    errors: list[dict[str, str]] = []
    extra = exc.extra if isinstance(exc.extra, list) else []
    for item in extra[:20]:
        if not isinstance(item, dict):
            continue
        entry = {k: str(item[k])[:300] for k in ("key", "source", "message") if k in item}
        if "source" in entry:  # "ParamType.QUERY" -> "query"
            entry["source"] = entry["source"].removeprefix("ParamType.").lower()
        if entry:
            errors.append(entry)
    return {"errors": errors}


def _http_exception_response(exc: HTTPException) -> tuple[int, dict[str, Any], dict[str, str]]:
    status = exc.status_code
    code = _STATUS_CODES.get(status, f"http_{status}")
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() in {"allow"}}
    if isinstance(exc, ValidationException) or status == 400:
        if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
            details = _validation_details(exc)
        else:  # e.g. malformed JSON: Litestar's detail names the problem, never the input
            details = {"errors": [{"source": "body", "message": str(exc.detail)[:300]}]}
        message = "the request is malformed or failed validation"
        return 400, error_body("invalid_request", message, details), headers
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="gpucloud"'
    message = _SAFE_MESSAGES.get(status) or (exc.detail if status < 500 else "internal error")
    return status, error_body(code, message), headers


def _log_refusal(request: Request[Any, Any, Any], status: int, code: str) -> None:
    """One line per refusal, its code and nothing the client sent beyond the route."""
    log.info("%s %s -> %d %s", request.method, request.url.path, status, code)


def exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    api_error = translate(exc)
    if api_error is not None:
        if api_error.status_code < 500:
            _log_refusal(request, api_error.status_code, api_error.code)
        else:
            log.warning(
                "%s %s -> %s (%s)",
                request.method,
                request.url.path,
                api_error.code,
                cause_summary(exc),
            )
        return Response(
            error_body(api_error.code, api_error.message, api_error.details),
            status_code=api_error.status_code,
            headers=api_error.headers,
        )
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        status, body, headers = _http_exception_response(exc)
        _log_refusal(request, status, body["error"]["code"])
        return Response(body, status_code=status, headers=headers)
    # Type and frames only: str(exc) may quote the request (SQL parameters, payloads).
    frames = "".join(traceback.format_tb(exc.__traceback__))
    log.error(
        "unhandled %s.%s on %s %s\n%s",
        type(exc).__module__,
        type(exc).__qualname__,
        request.method,
        request.url.path,
        frames,
    )
    return Response(
        error_body("internal_error", "internal error; the operator has the details"),
        status_code=500,
    )
