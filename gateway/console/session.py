"""Console sign-in: an admin token traded once for a signed session cookie (gateway.codec_session's
scheme, its own key), which the console's guard checks on every page and the codec endpoint
accepts too. Forms carry an anti-forgery token bound to the cookie, and requests another origin
sends (Temporal Web's, which CORS lets call the gateway with credentials) are refused."""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler

from gateway import codec_session
from gateway.auth import Principal, remember, session_principal
from gateway.errors import ApiError, Forbidden, Unauthenticated
from gateway.runtime import Runtime, get_runtime

Connection = ASGIConnection[Any, Any, Any, Any]
SIGN_IN_PATH = "/console/sign-in"
CSRF_FIELD = "csrf_token"


class SignInRequired(ApiError):
    """No valid console session: pages redirect to the sign-in form."""

    status_code = 401
    code = "unauthenticated"


def _key(runtime: Runtime) -> bytes:
    return codec_session.console_signing_key(runtime.settings.codec_key)


def session_cookie(runtime: Runtime, token_principal: Principal, *, https: bool) -> Cookie:
    """The signed cookie for an admin's console session (never the token itself)."""
    ttl = runtime.config.console_session_ttl_seconds
    value, _ = codec_session.issue(_key(runtime), token_principal.token_id, ttl)
    secure = runtime.config.cookie_secure
    return Cookie(
        key=codec_session.CONSOLE_COOKIE_NAME,
        value=value,
        path=codec_session.CONSOLE_COOKIE_PATH,
        max_age=ttl,
        httponly=True,
        # Lax: links into the console from elsewhere (Temporal Web, a ticket) arrive signed in,
        # while other sites' POSTs carry no cookie; same-site ones are stopped by the form token.
        samesite="lax",
        secure=https if secure is None else secure,
    )


def cleared_cookie() -> Cookie:
    return Cookie(
        key=codec_session.CONSOLE_COOKIE_NAME,
        value="",
        path=codec_session.CONSOLE_COOKIE_PATH,
        max_age=0,
        httponly=True,
        samesite="lax",
    )


def csrf_for(connection: Connection) -> str:
    cookie = connection.cookies.get(codec_session.CONSOLE_COOKIE_NAME, "")
    return codec_session.csrf_token(_key(get_runtime(connection.app.state)), cookie)


def check_csrf(connection: Connection, submitted: str | None) -> None:
    if not submitted or not hmac.compare_digest(submitted, csrf_for(connection)):
        raise Forbidden(
            "the form is stale or was not sent by the console; reload the page",
            code="csrf_failed",
        )


def _own_origin(connection: Connection) -> str:
    url = urlsplit(str(connection.url))
    return f"{url.scheme}://{url.netloc}"


def check_origin(connection: Connection) -> None:
    """Browsers name the origin of cross-origin requests (and of every POST): only the
    console's own pages may call it."""
    origin = connection.headers.get("origin")
    if origin is not None and origin != _own_origin(connection):
        raise Forbidden("the console answers only its own pages", code="cross_origin_refused")


async def console_guard(connection: Connection, _: BaseRouteHandler) -> None:
    """An admin's console session, else the sign-in form. A bearer header is not a session:
    the console never reads tokens from anything but its sign-in form."""
    check_origin(connection)
    cookie = connection.cookies.get(codec_session.CONSOLE_COOKIE_NAME)
    if not cookie:
        raise SignInRequired("sign in to use the console")
    try:
        principal = await session_principal(
            connection, cookie, _key(get_runtime(connection.app.state))
        )
    except Unauthenticated:
        raise SignInRequired("the console session has expired; sign in again") from None
    if not principal.is_admin:
        raise Forbidden("the console is for admins")
    remember(connection, principal)
