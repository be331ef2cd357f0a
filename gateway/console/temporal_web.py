"""Temporal Web for operators only (issue 36, item 7): the gateway serves `temporalio/ui-server`
under /temporal/ to admins signed in to the console, and to no one else.

- The ui-server listens on a private loopback address (Settings.temporal_web_upstream, bin/stack
  sets it) with `publicPath: /temporal`, so every page, asset and API call of the UI stays under
  this path on the gateway's origin. This route checks the console's session first
  (session.console_guard, the console's own sign-in: no second auth scheme); a page without a
  session goes to the sign-in form (which comes back here), an API call without one gets 401.
  A bearer token is no session: a tenant's token opens nothing, and an admin's opens nothing
  either except through the sign-in form.
- The ui-server runs with `disableWriteActions` (devstack.temporal_cluster.ui_server_config):
  it refuses every write of its API (cancel, terminate, reset, signal, update, start, batch
  operations) with 405; reads and workflow queries pass. Operators act through the console and
  the admin API, whose verbs ask for a reason and are audited.
- What goes upstream: the method, the path and query as sent, the body (bounded), and the
  request headers less the gateway's own credentials (the Authorization header and the
  gateway's session cookies never reach the ui-server, which would pass an Authorization header
  on to Temporal). The ui-server's own cookies (its CSRF token) pass both ways.
- The ui-server drops its page's Content-Security-Policy when a publicPath is set (its inline
  bootstrap script changes); this route puts an equivalent one back, hashing the inline
  scripts of each HTML page it serves.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any
from urllib.parse import quote

import httpx
from litestar import Request, Response
from litestar.handlers import asgi
from litestar.response import Redirect
from litestar.types import (
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)

from gateway import codec_session
from gateway.console import session
from gateway.errors import exception_handler
from gateway.runtime import Runtime, get_runtime

PUBLIC_PATH = "/temporal"
API_PREFIX = f"{PUBLIC_PATH}/api/"
# Workflow queries are the UI's largest request bodies, a few KiB; nothing else it posts is
# allowed through (the ui-server refuses writes).
MAX_BODY_BYTES = 1024 * 1024
UPSTREAM_TIMEOUT_S = 30.0

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never upstream: the gateway's credentials, and what the proxy sets itself.
_REQUEST_DROPPED = _HOP_BY_HOP | {
    "host",
    "authorization",
    "authorization-extras",
    "cookie",
    "content-length",
    "accept-encoding",
}
_RESPONSE_DROPPED = _HOP_BY_HOP | {"content-length", "content-encoding"}
_GATEWAY_COOKIES = frozenset({codec_session.CONSOLE_COOKIE_NAME, codec_session.COOKIE_NAME})
_INLINE_SCRIPT = re.compile(rb"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.S | re.I)


def temporal_web_base(runtime: Runtime) -> str:
    """Where the console links into Temporal Web: this path when the gateway serves it, else
    the configured origin of a Temporal Web run elsewhere (docker-compose.temporal.yml)."""
    return (
        PUBLIC_PATH if runtime.settings.temporal_web_upstream else runtime.config.temporal_ui_origin
    )


def _upstream_cookie(header: str | None) -> str | None:
    """The browser's cookies less the gateway's own sessions."""
    if not header:
        return None
    kept = [
        part.strip()
        for part in header.split(";")
        if part.strip() and part.split("=", 1)[0].strip() not in _GATEWAY_COOKIES
    ]
    return "; ".join(kept) or None


def content_security_policy(html: bytes) -> str:
    """The policy the ui-server's page carries without a publicPath, for the page as served:
    its inline scripts by hash, whatever they load ('strict-dynamic'), nothing else."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body).digest()).decode()}'"
        for body in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"script-src 'strict-dynamic' {hashes}; object-src 'none'; base-uri 'self'; "
        "frame-ancestors 'self'"
    )


def _original_path(scope: Scope) -> str:
    """The path as the browser sent it, /temporal included (a mount's routing rewrites
    scope["path"] to what follows the mount point)."""
    raw = scope.get("raw_path") or f"{PUBLIC_PATH}{scope['path']}".encode()
    return raw.split(b"?", 1)[0].decode("latin-1")


def _refused(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """A page without a session goes to the console's sign-in and back; anything else (the
    UI's API calls, other methods) gets the API's error answer, 401 without a session."""
    path = _original_path(request.scope)
    if (
        isinstance(exc, session.SignInRequired)
        and request.method in ("GET", "HEAD")
        and not path.startswith(API_PREFIX)
    ):
        target = path + (f"?{request.url.query}" if request.url.query else "")
        return Redirect(f"{session.SIGN_IN_PATH}?next={quote(target)}", status_code=303)
    return exception_handler(request, exc)


def _error(status: int, code: str, message: str) -> Response[Any]:
    return Response({"error": {"code": code, "message": message}}, status_code=status)


async def _body(receive: Receive) -> bytes | None:
    """The request body, or None when it is larger than MAX_BODY_BYTES."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


@asgi(
    PUBLIC_PATH,
    is_mount=True,
    copy_scope=True,
    guards=[session.console_guard],
    exception_handlers={Exception: _refused},
    include_in_schema=False,
)
async def temporal_web(scope: Scope, receive: Receive, send: Send) -> None:
    """Temporal Web, for a signed-in admin (the guard has checked the console session)."""
    request: Request[Any, Any, Any] = Request(scope, receive)
    upstream = get_runtime(request.app.state).settings.temporal_web_upstream
    if not upstream:
        answer = _error(
            503,
            "temporal_web_unavailable",
            "Temporal Web is not served by this gateway (GPUCLOUD_TEMPORAL_WEB_UPSTREAM is unset)",
        )
        await answer.to_asgi_response(None, request)(scope, receive, send)
        return
    path = _original_path(scope)
    if path == PUBLIC_PATH:  # the UI's routes all live below its base path
        await Redirect(f"{PUBLIC_PATH}/", status_code=308).to_asgi_response(None, request)(
            scope, receive, send
        )
        return
    body = await _body(receive)
    if body is None:
        answer = _error(413, "payload_too_large", "request body too large for Temporal Web")
        await answer.to_asgi_response(None, request)(scope, receive, send)
        return
    headers = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope["headers"]
        if name.decode("latin-1").lower() not in _REQUEST_DROPPED
    ]
    cookie = _upstream_cookie("; ".join(request.headers.getall("cookie", [])))
    if cookie:
        headers.append(("cookie", cookie))
    headers.append(("accept-encoding", "identity"))
    query = scope.get("query_string", b"").decode("latin-1")
    url = upstream.rstrip("/") + path + (f"?{query}" if query else "")
    try:
        async with httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S) as client:
            reply = await client.request(request.method, url, headers=headers, content=body)
    except httpx.HTTPError:
        answer = _error(502, "temporal_web_unavailable", "Temporal Web is not answering")
        await answer.to_asgi_response(None, request)(scope, receive, send)
        return
    content = reply.content
    out_headers = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in reply.headers.multi_items()
        if name.lower() not in _RESPONSE_DROPPED
    ]
    if reply.headers.get("content-type", "").startswith("text/html") and (
        "content-security-policy" not in reply.headers
    ):
        out_headers.append((b"content-security-policy", content_security_policy(content).encode()))
    out_headers.append((b"content-length", str(len(content)).encode()))
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": reply.status_code,
        "headers": out_headers,
    }
    await send(start)
    end: HTTPResponseBodyEvent = {
        "type": "http.response.body",
        "body": b"" if request.method == "HEAD" else content,
        "more_body": False,
    }
    await send(end)
