"""The terminal stream (docs/lifecycles/terminal-session.md): the tenant's AnySocket bridged to the
node agent's.

1. The tenant connects to `/api/v1/terminal-sessions/{id}/stream` and sends its open token as
   the first frame (`{"type": "auth", "token": …}`: never in a URL, where access logs keep it).
2. This gateway makes the session's agent secret, keeps only its sha256 here (in memory, for this
   socket), and sends the `claim` update: the workflow spends the token (single use, expiry) and
   schedules `terminal.open` on the node with this gateway's stream URL and the secret.
3. The agent dials `/api/v1/internal/agent/terminal-sessions/{id}/stream` (outbound from the
   node) and sends the secret; on a match the two sockets are paired and the bytes relayed.

Hostile sockets (issue 36). Nothing another socket can see changes before a token checks out:
each tenant socket's slot is keyed by the session *and* its own fresh secret's hash, so a second
socket for the same session (a wrong token, a replay) adds a slot only it could ever fill and
never replaces the opening one. A wrong token never reaches workflow history: the `claim`
update's validator rejects it, and a rejected update writes no event. Failed claims (no or
malformed auth frame, a token that is unknown, used or expired, a session that does not exist)
are counted per session and per caller (the connection's peer address) over a sliding window
(CLAIM_LIMITS, the one place that policy lives): past either limit the handshake is refused with
HTTP 429 and `Retry-After`, and a socket already open when the limit is reached is told
`rate_limited` with `retry_after` (close 1013). A correct token is refused too while its session
is over the limit; the window is short, and a reopen is a new session (a new id).

Frames are relayed as they come, each awaited before the next is read, so nothing queues here
beyond one frame per direction; a frame over MAX_FRAME_BYTES ends the stream (1009), refused by
the server's WebSocket protocol before it is buffered (UVICORN_WS_OPTIONS). The tenant's
`ping` is answered here (browsers cannot send AnySocket pings); `resize` goes to the agent.

The pairing lives in this process: the agent is sent to the gateway that holds the tenant's
socket (GPUCLOUD_PUBLIC_API_URL). Behind a load balancer with several gateways, that URL must
reach this replica (one per replica, or sticky routing by session id).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import WebSocket, websocket
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.types import WebSocketResponseBodyEvent, WebSocketResponseStartEvent
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from contracts.terminal_session import (
    AUTH_TIMEOUT_SECONDS,
    CLAIM_UPDATE,
    FRAME_ATTACHED,
    FRAME_AUTH,
    FRAME_CLOSE,
    FRAME_CLOSED,
    FRAME_ERROR,
    FRAME_PING,
    FRAME_PONG,
    FRAME_READY,
    FRAME_RESIZE,
    MAX_FRAME_BYTES,
    NODE_STREAM_PATH,
    OPEN_TOKEN_INVALID,
    TENANT_STREAM_PATH,
    ClaimAccepted,
    ClaimRequest,
    CloseReason,
    TerminalSessionResult,
    close_reason_of,
    control_frame,
    parse_control,
    terminal_size,
    terminal_workflow_id,
)
from gateway.errors import ServiceUnavailable
from gateway.runtime import Runtime, get_runtime
from gateway.terminal_sessions import policy_from, websocket_url
from gateway.tokens import hash_token

log = logging.getLogger("gateway.terminal")
AnySocket = WebSocket[Any, Any, Any]

RELAY_STATE_KEY = "gpucloud_terminal_relay"
# How uvicorn serves these routes (gateway.serve, and the tests' server): the websockets library's
# sans-I/O protocol (not its deprecated legacy server), which reads one message at a time and
# closes a connection whose message would exceed MAX_FRAME_BYTES (1009) before buffering it.
UVICORN_WS_OPTIONS: dict[str, Any] = {"ws": "websockets-sansio", "ws_max_size": MAX_FRAME_BYTES}
# AnySocket close codes: normal, policy violation (refused auth), too big, server error, try
# again later (rate limited).
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_ERROR = 1011
CLOSE_TRY_LATER = 1013
RATE_LIMITED = "rate_limited"
# Slack beyond the workflow's own attach deadline before this socket gives up waiting.
ATTACH_SLACK_SECONDS = 5.0


class _Refused(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        close_code: int = CLOSE_POLICY,
        *,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code
        self.retry_after = retry_after


@dataclass(frozen=True)
class ClaimLimits:
    """The failed-claim policy of the tenant's stream: at most `per_session` failures for one
    session and `per_caller` failures from one peer address within `window_seconds`; past
    either, claims are refused (429, `Retry-After`) until the oldest failure leaves the window.
    `max_tracked`: the most sessions and callers remembered (the least recently failing are
    forgotten first), so a flood of made-up session ids cannot grow this process."""

    window_seconds: float = 60.0
    per_session: int = 5
    per_caller: int = 20
    max_tracked: int = 10_000


CLAIM_LIMITS = ClaimLimits()


class ClaimThrottle:
    """Failed claims per session and per caller over a sliding window (in this process)."""

    def __init__(
        self, limits: ClaimLimits = CLAIM_LIMITS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._failures: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()

    def _keys(self, session_id: str, caller: str) -> list[tuple[tuple[str, str], int]]:
        return [
            (("session", session_id), self.limits.per_session),
            (("caller", caller), self.limits.per_caller),
        ]

    def _recent(self, key: tuple[str, str], now: float) -> deque[float]:
        failures = self._failures.get(key)
        if failures is None:
            return deque()
        while failures and failures[0] <= now - self.limits.window_seconds:
            failures.popleft()
        if not failures:
            del self._failures[key]
        return failures

    def retry_after(self, session_id: str, caller: str) -> int:
        """Seconds until a claim for this session from this caller is admitted; 0: now."""
        now = self._clock()
        wait = 0.0
        for key, limit in self._keys(session_id, caller):
            failures = self._recent(key, now)
            if len(failures) >= limit:
                oldest_counted = failures[len(failures) - limit]
                wait = max(wait, oldest_counted + self.limits.window_seconds - now)
        return max(1, math.ceil(wait)) if wait > 0 else 0

    def failed(self, session_id: str, caller: str) -> None:
        now = self._clock()
        for key, _ in self._keys(session_id, caller):
            failures = self._recent(key, now)
            failures.append(now)
            self._failures[key] = failures
            self._failures.move_to_end(key)
        while len(self._failures) > self.limits.max_tracked:
            self._failures.popitem(last=False)


@dataclass
class _Pending:
    """A tenant socket waiting for its node stream."""

    secret_sha256: str = field(repr=False)
    node: asyncio.Future[AnySocket] = field(default_factory=asyncio.Future)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class TerminalRelay:
    """This process's tenant sockets waiting for, or bridged to, their node streams, and the
    failed claims they made.

    A slot is keyed by (session id, sha256 of the socket's own agent secret): made before the
    claim, it can only be filled by an agent holding that secret, which leaves this process only
    inside an accepted claim. So a socket whose claim fails changes nothing another socket of
    the same session depends on, and an accepted claim's slot exists before its agent can dial."""

    def __init__(self, limits: ClaimLimits = CLAIM_LIMITS) -> None:
        self._pending: dict[tuple[str, str], _Pending] = {}
        self.throttle = ClaimThrottle(limits)

    def expect(self, session_id: str) -> tuple[str, _Pending]:
        """A fresh agent secret for the session (returned once) and the slot the node fills."""
        secret = secrets.token_urlsafe(32)
        pending = _Pending(hash_token(secret))
        self._pending[(session_id, pending.secret_sha256)] = pending
        return secret, pending

    def forget(self, session_id: str, pending: _Pending) -> None:
        key = (session_id, pending.secret_sha256)
        if self._pending.get(key) is pending:
            del self._pending[key]
        if not pending.node.done():
            pending.node.cancel()
        pending.done.set()

    def attach(self, session_id: str, secret: str) -> _Pending | None:
        pending = self._pending.get((session_id, hash_token(secret)))
        if pending is None or pending.node.done():
            return None
        return pending


def relay_of(state: State) -> TerminalRelay:
    relay = state.get(RELAY_STATE_KEY)
    if not isinstance(relay, TerminalRelay):
        relay = TerminalRelay()
        state[RELAY_STATE_KEY] = relay
    return relay


def _caller(socket: AnySocket) -> str:
    """Who is claiming: the connection's peer address (the gateway serves without proxy
    headers; behind a proxy every tenant shares its address, and the per-session limit still
    holds)."""
    client = socket.client
    return client.host if client is not None else "unknown"


async def _deny_rate_limited(socket: AnySocket, retry_after: int) -> None:
    """Refuse the WebSocket handshake with HTTP 429 and Retry-After (the ASGI WebSocket denial
    response); a server without that extension gets an accepted socket told `rate_limited`."""
    message = "too many failed terminal claims; retry later"
    extensions = socket.scope.get("extensions") or {}
    if "websocket.http.response" not in extensions:
        await socket.accept()
        await _refuse(socket, _rate_limited(retry_after))
        return
    body = json.dumps(
        {
            "error": {
                "code": RATE_LIMITED,
                "message": message,
                "details": {"retry_after_seconds": retry_after},
            }
        }
    ).encode()
    await socket.receive()  # websocket.connect
    start: WebSocketResponseStartEvent = {
        "type": "websocket.http.response.start",
        "status": 429,
        "headers": [
            (b"retry-after", str(retry_after).encode()),
            (b"content-type", b"application/json"),
            (b"cache-control", b"no-store"),
        ],
    }
    await socket.send(start)
    end: WebSocketResponseBodyEvent = {
        "type": "websocket.http.response.body",
        "body": body,
        "more_body": False,
    }
    await socket.send(end)


def _rate_limited(retry_after: int) -> _Refused:
    return _Refused(
        RATE_LIMITED,
        "too many failed terminal claims; retry later",
        CLOSE_TRY_LATER,
        retry_after=retry_after,
    )


async def _receive(socket: AnySocket) -> dict[str, Any]:
    """The next ASGI message; a disconnect once the socket is gone."""
    try:
        message: dict[str, Any] = dict(await socket.receive())
    except Exception:  # litestar raises once the disconnect was seen
        return {"type": "websocket.disconnect", "code": 1006}
    return message


async def _auth_field(socket: AnySocket, name: str) -> str:
    """The first frame: `{"type": "auth", name: value}`, within AUTH_TIMEOUT_SECONDS."""
    try:
        async with asyncio.timeout(AUTH_TIMEOUT_SECONDS):
            message = await _receive(socket)
    except TimeoutError:
        raise _Refused(OPEN_TOKEN_INVALID, "no auth frame in time") from None
    control = parse_control(message.get("text"))
    value = control.get(name)
    if control.get("type") != FRAME_AUTH or not value:
        raise _Refused(OPEN_TOKEN_INVALID, f"the first frame must be an auth frame with {name}")
    return str(value)


async def _refuse(socket: AnySocket, refused: _Refused) -> None:
    extra: dict[str, Any] = {}
    if refused.retry_after is not None:
        extra["retry_after"] = refused.retry_after
    with contextlib.suppress(Exception):
        await socket.send_text(
            control_frame(FRAME_ERROR, code=refused.code, message=refused.message, **extra)
        )
        await socket.close(code=refused.close_code, reason=refused.code)


@websocket(TENANT_STREAM_PATH.replace("{session_id}", "{session_id:uuid}"))
async def tenant_stream(socket: AnySocket, session_id: FromPath[uuid.UUID]) -> None:
    """The tenant's end of a terminal session."""
    relay = relay_of(socket.app.state)
    key, caller = str(session_id), _caller(socket)
    wait = relay.throttle.retry_after(key, caller)
    if wait:
        await _deny_rate_limited(socket, wait)
        return
    await socket.accept()
    runtime = get_runtime(socket.app.state)
    pending: _Pending | None = None
    try:
        try:
            token = await _auth_field(socket, "token")
        except _Refused:
            relay.throttle.failed(key, caller)
            raise
        # Others may have failed while this socket waited for its auth frame.
        if wait := relay.throttle.retry_after(key, caller):
            raise _rate_limited(wait)
        secret, pending = relay.expect(key)
        try:
            await _claim(runtime, key, token, secret)
        except _Refused as refused:
            if refused.code == OPEN_TOKEN_INVALID:
                relay.throttle.failed(key, caller)
            raise
        policy = policy_from(runtime.settings)  # the deadlines the workflow was started with
        wait_s = (
            policy.node_schedule_to_start_seconds
            + policy.attach_timeout_seconds
            + ATTACH_SLACK_SECONDS
        )
        node = await _node_or_end(runtime, key, pending, wait_s)
        await socket.send_text(control_frame(FRAME_READY, session_id=key))
        await _bridge(socket, node)
    except _Refused as refused:
        await _refuse(socket, refused)
    finally:
        if pending is not None:
            relay.forget(key, pending)


async def _node_or_end(
    runtime: Runtime, session_id: str, pending: _Pending, wait: float
) -> AnySocket:
    """The node's stream once the agent attaches it. The session's workflow is watched
    meanwhile: when it ends first (the node's queue found no poller before its deadline, the
    shell could not start), the tenant is told its reason then, not when `wait` runs out."""

    async def ended() -> TerminalSessionResult:
        handle = runtime.temporal.client.get_workflow_handle(
            terminal_workflow_id(session_id), result_type=TerminalSessionResult
        )
        result: TerminalSessionResult = await handle.result()
        return result

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    node: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(pending.node))
    end: asyncio.Future[Any] = asyncio.ensure_future(ended())
    try:
        await asyncio.wait([node, end], timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if end.done() and not node.done():
            if not end.cancelled() and end.exception() is None:
                reason = end.result().close_reason or CloseReason.OPEN_FAILED.value
                raise _Refused(
                    reason, "the session ended before the node attached its stream", CLOSE_ERROR
                )
            # The watch itself failed (Temporal out of reach a moment): the node alone decides.
            await asyncio.wait([node], timeout=max(0.0, deadline - loop.time()))
        if node.done() and not node.cancelled():
            attached: AnySocket = node.result()
            return attached
        raise _Refused(
            CloseReason.NODE_UNREACHABLE.value,
            "the node did not attach the session's stream",
            CLOSE_ERROR,
        )
    finally:
        for task in (node, end):
            task.cancel()


async def _claim(runtime: Runtime, session_id: str, token: str, secret: str) -> None:
    request = ClaimRequest(
        open_token_sha256=hash_token(token),
        node_stream_url=websocket_url(
            runtime.settings, NODE_STREAM_PATH.format(session_id=session_id)
        ),
        agent_secret=secret,
    )

    async def claim(client: Client) -> ClaimAccepted:
        handle = client.get_workflow_handle(terminal_workflow_id(session_id))
        accepted: ClaimAccepted = await handle.execute_update(
            CLAIM_UPDATE,
            request,
            result_type=ClaimAccepted,
            rpc_timeout=runtime.temporal.rpc_timeout,
        )
        return accepted

    invalid = _Refused(OPEN_TOKEN_INVALID, "the open token is unknown, used or expired")
    try:
        await runtime.temporal.update(claim)
    except (WorkflowUpdateFailedError, RPCError):
        raise invalid from None
    except ServiceUnavailable as err:
        raise _Refused(err.code, err.message, CLOSE_ERROR) from None


@websocket(NODE_STREAM_PATH.replace("{session_id}", "{session_id:uuid}"))
async def node_stream(socket: AnySocket, session_id: FromPath[uuid.UUID]) -> None:
    """The agent's end: authenticated by the session's secret, then handed to the tenant's
    handler, which relays until either side ends."""
    await socket.accept()
    relay = relay_of(socket.app.state)
    try:
        secret = await _auth_field(socket, "secret")
    except _Refused as refused:
        await _refuse(socket, refused)
        return
    pending = relay.attach(str(session_id), secret)
    if pending is None:
        log.warning("terminal %s: node stream refused (unknown session or secret)", session_id)
        await _refuse(socket, _Refused("stream_refused", "unknown session or wrong secret"))
        return
    await socket.send_text(control_frame(FRAME_ATTACHED))
    pending.node.set_result(socket)
    await pending.done.wait()


async def _bridge(tenant: AnySocket, node: AnySocket) -> None:
    tenant_lock = asyncio.Lock()  # pongs and output share the tenant's socket

    async def to_tenant_text(text: str) -> None:
        async with tenant_lock:
            await tenant.send_text(text)

    async def tenant_to_node() -> tuple[str, int]:
        """Until the tenant leaves: the reason for the agent and the tenant's close code."""
        while True:
            message = await _receive(tenant)
            if message["type"] == "websocket.disconnect":
                return CloseReason.CLIENT_CLOSED.value, CLOSE_NORMAL
            data, text = message.get("bytes"), message.get("text")
            if data is not None:
                if len(data) > MAX_FRAME_BYTES:
                    return CloseReason.CLIENT_CLOSED.value, CLOSE_TOO_BIG
                await node.send_bytes(data)
                continue
            control = parse_control(text)
            kind = control.get("type")
            if kind == FRAME_PING:
                await to_tenant_text(control_frame(FRAME_PONG))
            elif kind == FRAME_RESIZE and (size := terminal_size(control)) is not None:
                cols, rows = size
                await node.send_text(control_frame(FRAME_RESIZE, cols=cols, rows=rows))
            elif kind == FRAME_CLOSE:
                return CloseReason.CLIENT_CLOSED.value, CLOSE_NORMAL

    async def node_to_tenant() -> str:
        """Until the node's stream ends: the close reason it gave, or node_stream_dropped."""
        while True:
            message = await _receive(node)
            if message["type"] == "websocket.disconnect":
                return CloseReason.NODE_STREAM_DROPPED.value
            data, text = message.get("bytes"), message.get("text")
            if data is not None:
                if len(data) > MAX_FRAME_BYTES:
                    return CloseReason.NODE_STREAM_DROPPED.value
                async with tenant_lock:
                    await tenant.send_bytes(data)
                continue
            control = parse_control(text)
            if control.get("type") == FRAME_CLOSED:
                return close_reason_of(control)

    upstream = asyncio.create_task(tenant_to_node())
    downstream = asyncio.create_task(node_to_tenant())
    try:
        done, _ = await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (upstream, downstream):
            task.cancel()
        await asyncio.gather(upstream, downstream, return_exceptions=True)
    if downstream in done and downstream.exception() is None:
        reason = downstream.result()
        with contextlib.suppress(Exception):
            await tenant.send_text(control_frame(FRAME_CLOSED, reason=reason))
            await tenant.close(code=CLOSE_NORMAL, reason=reason)
        with contextlib.suppress(Exception):
            await node.close(code=CLOSE_NORMAL)
        return
    reason, code = (
        upstream.result()
        if upstream in done and upstream.exception() is None
        else (CloseReason.CLIENT_CLOSED.value, CLOSE_ERROR)
    )
    with contextlib.suppress(Exception):
        await node.send_text(control_frame(FRAME_CLOSE, reason=reason))
        await node.close(code=CLOSE_NORMAL, reason=reason)
    with contextlib.suppress(Exception):
        await tenant.close(code=code)
