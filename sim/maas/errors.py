"""The region's error answers (maasserver/exceptions.py, middleware.py): status codes, bodies and
content types exactly as MAAS writes them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TEXT = "text/plain; charset=utf-8"
JSON = "application/json; charset=utf-8"


class ApiError(Exception):
    """An answer other than success; raised anywhere below the handler, rendered by the app."""

    def __init__(
        self,
        status: int,
        body: str | Mapping[str, Any] | Sequence[Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body
        self.headers = dict(headers or {})

    @property
    def content_type(self) -> str:
        return TEXT if isinstance(self.body, str) else JSON

    def encoded(self) -> bytes:
        if isinstance(self.body, str):
            return self.body.encode()
        return json.dumps(self.body).encode()


def bad_request(message: str) -> ApiError:
    """MAASAPIBadRequest: a bare message, text/plain."""
    return ApiError(400, message)


def field_errors(errors: Mapping[str, str | Sequence[str]]) -> ApiError:
    """Form validation: {"field": ["message", ...]}, non-field errors under "__all__"."""
    body = {k: [v] if isinstance(v, str) else list(v) for k, v in errors.items()}
    return ApiError(400, body)


def conflict(message: str) -> ApiError:
    """NodeStateViolation."""
    return ApiError(409, message)


def not_found(model: str = "Machine") -> ApiError:
    return ApiError(404, f"No {model} matches the given query.")


def forbidden(message: str = "") -> ApiError:
    return ApiError(403, message)


def unauthorized(message: str, challenge: bool = True) -> ApiError:
    headers = {"WWW-Authenticate": 'OAuth realm="OAuth"'} if challenge else {}
    return ApiError(401, message, headers)


def unavailable(message: str) -> ApiError:
    """PowerProblem and friends: 503 with the reason."""
    return ApiError(503, message)
