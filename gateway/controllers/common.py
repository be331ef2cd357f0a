"""Small helpers shared by controllers."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.openapi.datastructures import ResponseSpec

from gateway.errors import InvalidRequest
from gateway.schemas import ErrorResponse

AUDIT_REASON_HEADER = "X-Audit-Reason"
MAX_REASON_CHARS = 500


def audit_reason(request: Request[Any, Any, Any], body_reason: str | None = None) -> str | None:
    """The `reason` of a JSON body where it has one, else the X-Audit-Reason header."""
    if body_reason:
        return body_reason
    header = request.headers.get(AUDIT_REASON_HEADER)
    if header is None:
        return None
    header = header.strip()
    if len(header) > MAX_REASON_CHARS:
        raise InvalidRequest(
            f"{AUDIT_REASON_HEADER} may be at most {MAX_REASON_CHARS} characters",
            details={"header": AUDIT_REASON_HEADER},
        )
    return header or None


_DESCRIPTIONS = {
    400: "invalid_request: malformed JSON, wrong types, failed validation",
    401: "unauthenticated: missing, invalid or revoked bearer token",
    402: "balance_depleted: add credit to the project before allocating",
    403: "forbidden (admin route, tenant token) or tenant_only (tenant route, admin token)",
    404: "not_found (also for another project's resources)",
    409: "conflict (see the code)",
    410: "gone: the resource was deleted for good (see the code)",
    413: "payload_too_large",
    422: "unprocessable (see the code)",
    503: "database_unavailable or temporal_unavailable",
}


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for the error envelope; 401 and 503 apply to every guarded route."""
    wanted = sorted({401, 503, *statuses})
    return {
        s: ResponseSpec(data_container=ErrorResponse, description=_DESCRIPTIONS[s]) for s in wanted
    }
