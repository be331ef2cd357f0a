"""Bearer-token authentication and role guards.

The token row is looked up on every request, so revocation is immediate. Guards run before the
body is read: an unauthenticated caller learns nothing about validation. A tenant asking for
another project's resource gets the same 404 as for an id that does not exist (handlers filter
by project), and admins use the admin routes (tenant routes answer them 403 tenant_only).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from contracts.states import TokenRole
from gateway import codec_session, tokens
from gateway.errors import ApiError, Forbidden, Unauthenticated
from gateway.runtime import get_runtime
from schema.db import driver_connection

_PRINCIPAL_KEY = "principal"


@dataclass(frozen=True)
class Principal:
    token_id: uuid.UUID
    name: str
    role: str
    project_id: uuid.UUID | None

    @property
    def is_admin(self) -> bool:
        return self.role == TokenRole.ADMIN

    @property
    def project(self) -> uuid.UUID:
        """The tenant's project (tenant routes only ever see tenant principals)."""
        if self.project_id is None:
            raise Forbidden("this token is not bound to a project", code="tenant_only")
        return self.project_id


Connection = ASGIConnection[Any, Any, Any, Any]


def _bearer(connection: Connection) -> str:
    header = connection.headers.get("authorization")
    if not header:
        raise Unauthenticated("missing bearer token")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    if not tokens.looks_like_token(token):
        raise Unauthenticated("invalid or revoked token")
    return token


# Plain SQL on a pooled connection: this runs for every request (schema.db.driver_connection).
_PRINCIPAL_ROW = "SELECT id, name, role, project_id, revoked_at FROM api_tokens WHERE "
_PRINCIPAL_BY_HASH = _PRINCIPAL_ROW + "token_sha256 = $1"
_PRINCIPAL_BY_ID = _PRINCIPAL_ROW + "id = $1"


async def _load(connection: Connection, query: str, key: object) -> Principal:
    async with driver_connection(get_runtime(connection.app.state).engine) as pg:
        row = await pg.fetchrow(query, key)
    if row is None or row["revoked_at"] is not None:
        raise Unauthenticated("invalid or revoked token")
    return Principal(
        token_id=row["id"], name=row["name"], role=row["role"], project_id=row["project_id"]
    )


async def authenticate(connection: Connection) -> Principal:
    return await principal_for_token(connection, _bearer(connection))


async def principal_for_token(connection: Connection, token: str) -> Principal:
    """The principal of an API token (a bearer header's, or the one typed into the console's
    sign-in form)."""
    if not tokens.looks_like_token(token):
        raise Unauthenticated("invalid or revoked token")
    return await _load(connection, _PRINCIPAL_BY_HASH, tokens.hash_token(token))


def remember(connection: Connection, principal: Principal) -> None:
    """Hand the guard's principal to the handler (the `principal` dependency)."""
    connection.state[_PRINCIPAL_KEY] = principal


async def admin_guard(connection: Connection, _: BaseRouteHandler) -> None:
    principal = await authenticate(connection)
    if not principal.is_admin:
        raise Forbidden("this route needs an admin token")
    remember(connection, principal)


async def tenant_guard(connection: Connection, _: BaseRouteHandler) -> None:
    principal = await authenticate(connection)
    if principal.is_admin:
        raise ApiError(
            "tenant routes act for a project; admins use /api/v1/admin/...",
            code="tenant_only",
            status_code=403,
        )
    remember(connection, principal)


async def session_principal(connection: Connection, cookie: str, key: bytes) -> Principal:
    """The principal of a browser session cookie (codec_session), re-checked against its token
    row: a revoked token ends its sessions at once."""
    token_id = codec_session.verify(key, cookie)
    if token_id is None:
        raise Unauthenticated("the session has expired or is invalid")
    return await _load(connection, _PRINCIPAL_BY_ID, token_id)


async def codec_guard(connection: Connection, _: BaseRouteHandler) -> None:
    """Admin by bearer token, or by the codec or the console session cookie (Temporal Web in a
    browser, opened directly or from the console)."""
    codec_key = get_runtime(connection.app.state).settings.codec_key
    codec_cookie = connection.cookies.get(codec_session.COOKIE_NAME)
    console_cookie = connection.cookies.get(codec_session.CONSOLE_COOKIE_NAME)
    if connection.headers.get("authorization"):
        principal = await authenticate(connection)
    elif codec_cookie:
        principal = await session_principal(
            connection, codec_cookie, codec_session.signing_key(codec_key)
        )
    elif console_cookie:
        principal = await session_principal(
            connection, console_cookie, codec_session.console_signing_key(codec_key)
        )
    else:
        raise Unauthenticated("a bearer token or a codec session cookie is required")
    if not principal.is_admin:
        raise Forbidden("the codec endpoint needs an admin token")
    remember(connection, principal)


async def provide_principal(request: Request[Any, Any, Any]) -> Principal:
    principal = request.state.get(_PRINCIPAL_KEY)
    if not isinstance(principal, Principal):  # a route without a guard asked for one
        raise Unauthenticated()
    return principal
