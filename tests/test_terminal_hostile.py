"""Hostile sockets on the terminal stream (issue 36, item 6), through the real gateway served by
uvicorn, the control-plane worker and the node's real `gpucloud-agent` (tests/terminal_fixtures):

- a second WebSocket with a wrong token (or the right token again) does not disturb a session
  that is opening: the tenant's own open still succeeds end to end;
- 50 wrong tokens: refused one by one up to the limit, then 429 with Retry-After at the
  handshake, and the session's workflow history does not grow with any of them;
- the public URL every process the stack starts is given is the gateway's own port (devstack).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle, WorkflowHistory
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from contracts.terminal_session import (
    CLAIM_UPDATE,
    NODE_STREAM_PATH,
    TENANT_STREAM_PATH,
    terminal_workflow_id,
)
from core import vault_policies
from core.config import Settings
from devstack.up import Stack, StackOptions
from gateway.config import GatewayConfig
from gateway.terminal_relay import CLAIM_LIMITS, ClaimLimits, ClaimThrottle, TerminalRelay
from gateway.terminal_sessions import websocket_url
from tests.histories import _settled_history
from tests.lifecycle_support import eventually
from tests.terminal_fixtures import Terminal, TerminalRig

Rig = Callable[..., Awaitable[TerminalRig]]


async def _history_length(handle: WorkflowHandle[Any, Any]) -> int:
    return len((await _settled_history(handle)).events)


def _claims(history: WorkflowHistory) -> list[HistoryEvent]:
    """The `claim` updates the workflow accepted (a rejected update leaves no event)."""
    return [
        e
        for e in history.events
        if e.HasField("workflow_execution_update_accepted_event_attributes")
        and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
        == CLAIM_UPDATE
    ]


async def _attempt(rig: TerminalRig, url: str, token: str) -> tuple[str, str | None]:
    """One claim with `token` on the stream at `url`: ("frame", error code) when the socket was
    accepted and refused in-band, ("http", Retry-After) when the handshake was refused."""
    response: Response | None = None
    try:
        ws = await connect(url, open_timeout=10)
    except InvalidStatus as refused:
        response = refused.response
    if response is not None:
        assert response.status_code == 429, response.status_code
        assert response.headers.get("Content-Type") == "application/json"
        return "http", response.headers.get("Retry-After")
    async with ws:
        term = Terminal(ws)
        await term.send_control(type="auth", token=token)
        error = await term.control("error", timeout=30)
        return "frame", str(error["code"])


async def test_a_wrong_token_does_not_disturb_an_opening_session(terminal_rig: Rig) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(created["session_id"]))
    # The tenant's socket claims; while its node stream is still being dialled, a stranger who
    # knows the session id tries a wrong token, then the tenant's own token again once the
    # tenant's claim has spent it.
    tenant = await rig.connect(created)
    stranger = await rig.connect(created, token="gts_a-guess-at-the-token")
    assert (await stranger.control("error"))["code"] == "open_token_invalid"

    async def claimed() -> bool:
        return bool(_claims(await handle.fetch_history()))

    await eventually(claimed, timeout=30, interval=0.05)
    replay = await rig.connect(created)
    assert (await replay.control("error"))["code"] == "open_token_invalid"

    ready = await tenant.control("ready", timeout=60)
    assert ready["session_id"] == created["session_id"]
    await rig.wait_session(created["session_id"], "active")
    output = await tenant.run("echo still-mine-$((40+2))", b"still-mine-42")
    assert b"still-mine-42" in output
    await tenant.ws.close()
    closed = await rig.wait_session(created["session_id"], "closed")
    assert closed["close_reason"] == "client_closed"

    # Neither failed claim reached the history: one claim update, the tenant's.
    assert len(_claims(await _settled_history(handle))) == 1


async def test_fifty_wrong_tokens_are_throttled_and_leave_no_history(terminal_rig: Rig) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id = created["session_id"]
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    before = await _history_length(handle)

    outcomes = [await _attempt(rig, created["stream_url"], f"gts_wrong-{n}") for n in range(50)]
    limit = CLAIM_LIMITS.per_session
    assert outcomes[:limit] == [("frame", "open_token_invalid")] * limit
    throttled = outcomes[limit:]
    assert all(kind == "http" for kind, _ in throttled), throttled
    for _, retry_after in throttled:
        assert retry_after is not None
        assert 1 <= int(retry_after) <= CLAIM_LIMITS.window_seconds

    # The session's workflow never saw a single one of them.
    assert await _history_length(handle) == before
    row = await rig.session(session_id)
    assert row["status"] == "opening"

    # Per caller too: made-up session ids from this same address are refused once this caller
    # has failed per_caller times in the window (the 5 above count).
    base = rig.gateway.url.replace("http://", "ws://")
    others = [
        await _attempt(rig, base + TENANT_STREAM_PATH.format(session_id=uuid.uuid4()), "gts_x")
        for _ in range(CLAIM_LIMITS.per_caller - limit + 3)
    ]
    first = CLAIM_LIMITS.per_caller - limit
    assert others[:first] == [("frame", "open_token_invalid")] * first
    assert all(kind == "http" for kind, _ in others[first:]), others


def test_the_claim_throttle_slides_its_window() -> None:
    now = [1000.0]
    throttle = ClaimThrottle(
        ClaimLimits(window_seconds=10, per_session=2, per_caller=3, max_tracked=4),
        clock=lambda: now[0],
    )
    assert throttle.retry_after("s1", "c1") == 0
    throttle.failed("s1", "c1")
    now[0] += 4
    throttle.failed("s1", "c1")
    # The session is at its limit: admitted again once the first failure leaves the window.
    assert throttle.retry_after("s1", "c1") == 6
    assert throttle.retry_after("s2", "c2") == 0  # another session from another caller
    throttle.failed("s2", "c1")
    assert throttle.retry_after("s3", "c1") == 6  # this caller is at its limit of 3
    assert throttle.retry_after("s3", "c2") == 0
    now[0] += 6.5
    assert throttle.retry_after("s1", "c2") == 0  # one of s1's failures left the window
    throttle.failed("s1", "c2")
    assert throttle.retry_after("s1", "c2") == 4  # until its failure at +4 s leaves it too
    assert throttle.retry_after("s3", "c1") == 0  # c1 has 2 failures in the window
    # Never more than max_tracked keys: a flood of made-up ids forgets the oldest.
    for n in range(10):
        throttle.failed(f"flood-{n}", "c9")
    assert len(throttle._failures) <= 4


def test_a_pending_slot_belongs_to_its_own_secret() -> None:
    """A second socket of the same session gets its own slot: the first one's agent secret
    still attaches the first one, and a slot forgotten does not take the other with it."""

    async def run() -> None:
        relay = TerminalRelay()
        first_secret, first = relay.expect("s")
        second_secret, second = relay.expect("s")
        relay.forget("s", second)
        assert relay.attach("s", second_secret) is None
        assert relay.attach("s", "not-a-secret") is None
        assert relay.attach("s", first_secret) is first
        relay.forget("s", first)

    asyncio.run(run())


@pytest.mark.parametrize("port", [8000, 18123])
def test_every_stack_process_gets_the_gateways_public_url(
    port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bin/stack's processes (devstack/up.py): the worker, the gateway and the fleet all get the
    one public URL, derived from the port the gateway listens on; a stale one in the caller's
    environment does not leak through."""
    monkeypatch.setenv("GPUCLOUD_PUBLIC_API_URL", "http://127.0.0.1:8000")
    options = StackOptions(
        state_dir=tmp_path,
        pg_port=55432,
        temporal_port=7233,
        ui_port=8233,
        gateway_host="127.0.0.1",
        gateway_port=port,
        phase_delay=0.0,
        jitter=0.0,
        agents=True,
        check=False,
        reset=False,
    )
    approle: dict[str, dict[str, str]] = {
        vault_policies.WORKER.role: {},
        vault_policies.GATEWAY.role: {},
    }
    envs = Stack(options).process_envs("postgresql://x@127.0.0.1/db", approle, "token")
    assert set(envs) == {"worker", "gateway", "fleet"}
    expected = f"http://127.0.0.1:{port}"
    assert GatewayConfig.from_env(envs["gateway"]).port == port
    for name, env in envs.items():
        settings = Settings.from_env(env)
        assert settings.public_api_url == expected, name
        session = str(uuid.uuid4())
        tenant_url = websocket_url(settings, TENANT_STREAM_PATH.format(session_id=session))
        agent_url = websocket_url(settings, NODE_STREAM_PATH.format(session_id=session))
        assert tenant_url.startswith(f"ws://127.0.0.1:{port}/api/v1/"), name
        assert agent_url.startswith(f"ws://127.0.0.1:{port}/api/v1/internal/"), name


def test_an_unset_public_url_follows_the_gateway_port() -> None:
    """Outside bin/stack: a gateway told only its port hands out URLs on that port."""
    assert Settings.from_env({"GPUCLOUD_GATEWAY_PORT": "18124"}).public_api_url == (
        "http://127.0.0.1:18124"
    )
    assert Settings.from_env({}).public_api_url == "http://127.0.0.1:8000"
    explicit = {"GPUCLOUD_GATEWAY_PORT": "18124", "GPUCLOUD_PUBLIC_API_URL": "https://api.x"}
    assert Settings.from_env(explicit).public_api_url == "https://api.x"
