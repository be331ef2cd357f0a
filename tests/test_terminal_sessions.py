"""Terminal sessions end to end (issue 22, docs/lifecycles/terminal-session.md): a real WebSocket
client against the gateway served by uvicorn, the control-plane worker, and the node's real
`gpucloud-agent` process, whose bare-metal backend created the tenant's account on the machine's
disk and whose `terminal.open` runs a login shell for it on a PTY and dials the gateway back.

Nothing here writes lifecycle state: sessions open and end through the HTTP API, the WebSockets
and the workflows only."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from contracts.terminal_session import MAX_FRAME_BYTES, terminal_workflow_id
from schema.models import AuditEntry, NodeTask, TerminalSession, TerminalSessionEvent
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.terminal_fixtures import TerminalRig

Rig = Callable[..., Awaitable[TerminalRig]]
HISTORIES = "terminal_session"


async def _row(sessions: async_sessionmaker[AsyncSession], session_id: str) -> TerminalSession:
    async with sessions() as session:
        row = await session.get(TerminalSession, uuid.UUID(session_id))
        assert row is not None
        return row


async def test_open_type_resize_and_close(
    terminal_rig: Rig,
    db_sessions: async_sessionmaker[AsyncSession],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id, token = created["session_id"], created["open_token"]
    assert created["status"] == "opening"
    assert token.startswith("gts_")
    assert created["stream_url"] == (
        rig.gateway.url.replace("http://", "ws://")
        + f"/api/v1/terminal-sessions/{session_id}/stream"
    )
    row = await _row(db_sessions, session_id)
    assert row.open_token_sha256 == hashlib.sha256(token.encode()).hexdigest()

    async with rig.terminal(created) as term:
        active = await rig.wait_session(session_id, "active")
        assert active["opened_at"] is not None
        # The shell is the allocation's user's login shell, in that user's home on the node.
        output = await term.run('echo "user=$USER home=$HOME sum=$((6*7))"', b"sum=42")
        username = f"gpu-{rig.allocation_id.replace('-', '')[:12]}"
        assert f"user={username}".encode() in output
        # Confined (agent/shell_confinement.py): the home is bound at its path inside.
        assert f"home=/home/{username}".encode() in output
        await term.send_control(type="resize", cols=132, rows=43)
        await term.run("stty size", b"43 132")
        await term.send_control(type="ping")
        assert await term.control("pong")

    closed = await rig.wait_session(session_id, "closed")
    assert closed["close_reason"] == "client_closed"
    assert closed["closed_at"] is not None

    timeline = (await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/timeline")).json()
    tasks = [i for i in timeline["items"] if i["kind"] == "node_task"]
    (stream_task,) = [t for t in tasks if t["name"] == "terminal.open"]
    assert stream_task["status"] == "succeeded"
    assert stream_task["summary"] == "Terminal session stream"

    # The token and the session's bytes never reach Temporal: only the token's hash is in the
    # input, and every payload is encrypted by the codec.
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    raw = (await handle.fetch_history()).to_json()
    for secret in (token, "sum=42", username):
        assert secret not in raw
    # Nor any log: the gateway's (this process, every logger at DEBUG) and the agent's file.
    gateway_logs = "\n".join(record.getMessage() for record in caplog.records)
    agent_log = rig.agent.log.read_text(errors="replace")
    assert session_id in agent_log  # the agent does log the session, by id
    for secret in (token, "sum=42", "43 132"):
        assert secret not in gateway_logs
        assert secret not in agent_log
    await record_history(handle, HISTORIES, "client_closed")


async def test_token_is_single_use_and_one_session_per_allocation(
    terminal_rig: Rig, db_sessions: async_sessionmaker[AsyncSession]
) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id = created["session_id"]
    async with rig.terminal(created) as term:
        # The same token again: refused, the first stream goes on.
        replay = await rig.connect(created)
        error = await replay.control("error")
        assert error["code"] == "open_token_invalid"
        # A second open while this one lives: 409 with the live session's id.
        second = await rig.tenant.post(f"/api/v1/allocations/{rig.allocation_id}/terminal-sessions")
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "terminal_session_active"
        assert second.json()["error"]["details"]["active_session_id"] == session_id
        await term.run("echo still-$((40+2))", b"still-42")

        # An admin force-closes it (audited); the tenant is told why.
        forced = await rig.admin.post(
            f"/api/v1/admin/terminal-sessions/{session_id}/force-close",
            json={"reason": "abuse report OPS-7"},
        )
        assert forced.status_code == 202, forced.text
        assert forced.json()["expected_status"] == "closed"
        closed_frame = await term.control("closed")
        assert closed_frame["reason"] == "admin_force_closed"

    closed = await rig.wait_session(session_id, "closed")
    assert closed["close_reason"] == "admin_force_closed"
    assert closed["closed_by"] == "admin"
    listed = await rig.admin.get(
        "/api/v1/admin/terminal-sessions", params={"allocation_id": rig.allocation_id}
    )
    assert [i["session_id"] for i in listed.json()["items"]] == [session_id]
    async with db_sessions() as session:
        audit = (
            await session.scalars(select(AuditEntry).where(AuditEntry.target_id == session_id))
        ).one()
    assert audit.action == "terminal_session.force_close"
    assert audit.reason == "abuse report OPS-7"
    again = await rig.admin.post(
        f"/api/v1/admin/terminal-sessions/{session_id}/force-close", json={"reason": "again"}
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "terminal_session_not_live"

    # A reopen is a new session with a new token.
    reopened = await rig.open_session()
    assert reopened["session_id"] != session_id
    assert reopened["open_token"] != created["open_token"]
    # The allocation's list is paged, newest first.
    path = f"/api/v1/allocations/{rig.allocation_id}/terminal-sessions"
    page = (await rig.tenant.get(path, params={"limit": 1})).json()
    assert [i["session_id"] for i in page["items"]] == [reopened["session_id"]]
    rest = (await rig.tenant.get(path, params={"limit": 1, "cursor": page["next_cursor"]})).json()
    assert [i["session_id"] for i in rest["items"]] == [session_id]
    assert rest["next_cursor"] is None
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    await record_history(handle, HISTORIES, "admin_force_closed")


async def test_max_ttl_ends_the_session_in_error(
    terminal_rig: Rig, db_sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The max TTL is a policy timeout (docs/lifecycles/terminal-session.md): the agent is told to
    close the shell, and the session goes active → error with session_ttl_expired (never through
    closing)."""
    rig = await terminal_rig(terminal_session_max_ttl_seconds=4.0)
    created = await rig.open_session()
    async with rig.terminal(created) as term:
        await term.run("echo up-$((1+1))", b"up-2")
        closed_frame = await term.control("closed", timeout=60)
        assert closed_frame["reason"] == "session_ttl_expired"
    ended = await rig.wait_session(created["session_id"], "error")
    assert ended["close_reason"] == "session_ttl_expired"
    assert ended["closed_by"] == "system"
    async with db_sessions() as session:
        events = (
            await session.scalars(
                select(TerminalSessionEvent.to_status)
                .where(TerminalSessionEvent.session_id == uuid.UUID(created["session_id"]))
                .order_by(TerminalSessionEvent.id)
            )
        ).all()
    assert list(events) == ["opening", "active", "error"]
    timeline = (await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/timeline")).json()
    tasks = {i["name"]: i for i in timeline["items"] if i["kind"] == "node_task"}
    assert tasks["terminal.close"]["status"] == "succeeded"
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(created["session_id"]))
    await record_history(handle, HISTORIES, "ttl_expired_error")


async def test_the_tenant_closes_its_own_session(
    terminal_rig: Rig, make_project: Any, make_token: Any
) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id = created["session_id"]
    path = f"/api/v1/allocations/{rig.allocation_id}/terminal-sessions/{session_id}/close"
    async with rig.terminal(created) as term:
        await rig.wait_session(session_id, "active")
        # Another project's tenant cannot see it, let alone close it.
        outsider = await make_token("tenant", await make_project())
        refused = await rig.tenant.post(path, headers={"Authorization": f"Bearer {outsider}"})
        assert refused.status_code == 404, refused.text
        elsewhere = await rig.tenant.post(
            f"/api/v1/allocations/{uuid.uuid4()}/terminal-sessions/{session_id}/close"
        )
        assert elsewhere.status_code == 404, elsewhere.text

        closing = await rig.tenant.post(path)
        assert closing.status_code == 202, closing.text
        assert closing.json()["prior_status"] == "active"
        assert closing.json()["expected_status"] == "closed"
        closed_frame = await term.control("closed", timeout=60)
        assert closed_frame["reason"] == "client_closed"
    closed = await rig.wait_session(session_id, "closed")
    assert closed["close_reason"] == "client_closed"
    assert closed["closed_by"] == "user"
    again = await rig.tenant.post(path)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "terminal_session_not_live"


async def test_release_closes_the_session_before_the_host_release(
    terminal_rig: Rig, db_sessions: async_sessionmaker[AsyncSession]
) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id = created["session_id"]
    async with rig.terminal(created) as term:
        await rig.wait_session(session_id, "active")
        released = await rig.tenant.post(f"/api/v1/allocations/{rig.allocation_id}/release")
        assert released.status_code == 202, released.text
        closed_frame = await term.control("closed", timeout=60)
        assert closed_frame["reason"] == "allocation_released"

    closed = await rig.wait_session(session_id, "closed")
    assert closed["close_reason"] == "allocation_released"

    async def released_allocation() -> dict[str, Any] | None:
        body: dict[str, Any] = (
            await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}")
        ).json()
        return body if body["status"] == "released" else None

    await eventually(released_allocation, timeout=60, interval=0.2)

    # The timeline shows the order: the stream ended (its ack) before the host release ran.
    timeline = (await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/timeline")).json()
    tasks = {i["name"]: i for i in timeline["items"] if i["kind"] == "node_task"}
    stream, release = tasks["terminal.open"], tasks["allocation.deprovision_user"]
    assert stream["status"] == "succeeded"
    assert release["status"] == "succeeded"
    assert tasks["terminal.close"]["status"] == "succeeded"
    assert stream["completed_at"] <= release["phases"][0]["at"]
    async with db_sessions() as session:
        release_row = await session.get(NodeTask, uuid.UUID(release["task_id"]))
        assert release_row is not None
        assert release_row.dispatched_at is not None
    row = await _row(db_sessions, session_id)
    assert row.closed_at is not None
    assert row.closed_at <= release_row.dispatched_at

    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    await record_history(handle, HISTORIES, "allocation_released")
    allocation = rig.temporal.get_workflow_handle(f"allocation-{rig.allocation_id}")
    await record_history(allocation, "allocation", "baremetal_release_closes_terminal_session")


async def test_a_killed_agent_drops_the_stream(terminal_rig: Rig) -> None:
    rig = await terminal_rig()
    created = await rig.open_session()
    session_id = created["session_id"]
    async with rig.terminal(created) as term:
        await rig.wait_session(session_id, "active")
        rig.agent.kill()
        closed_frame = await term.control("closed", timeout=60)
        assert closed_frame["reason"] == "node_stream_dropped"
    failed = await rig.wait_session(session_id, "error")
    assert failed["close_reason"] == "node_stream_dropped"
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    await record_history(handle, HISTORIES, "node_stream_dropped")


async def test_an_unclaimed_open_token_expires(terminal_rig: Rig) -> None:
    """opening → error: nobody presents the open token in time. The session ends with
    open_token_expired, the node never got a task, and the spent token opens nothing."""
    rig = await terminal_rig(terminal_open_token_ttl_seconds=2.0)
    created = await rig.open_session()
    session_id = created["session_id"]
    failed = await rig.wait_session(session_id, "error")
    assert failed["close_reason"] == "open_token_expired"
    assert failed["opened_at"] is None
    late = await rig.connect(created)
    assert (await late.control("error"))["code"] == "open_token_invalid"
    timeline = (await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/timeline")).json()
    assert not [i for i in timeline["items"] if i.get("name", "").startswith("terminal.")]
    # The allocation has no live session any more: a reopen is a new one.
    reopened = await rig.open_session()
    assert reopened["session_id"] != session_id
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    await record_history(handle, HISTORIES, "open_token_expired")


async def test_an_unreachable_node_fails_the_open(
    terminal_rig: Rig, db_sessions: async_sessionmaker[AsyncSession]
) -> None:
    """opening → error: the token is claimed but the node's agent is gone, so terminal.open
    waits in the node's queue past its schedule-to-start deadline. The tenant's stream is told
    node_unreachable as soon as the workflow ends, the session ends in error with that reason,
    and its task is failed."""
    rig = await terminal_rig(node_schedule_to_start_seconds=4.0)
    rig.agent.kill()
    created = await rig.open_session()
    session_id = created["session_id"]
    connected = time.monotonic()
    term = await rig.connect(created)
    error = await term.control("error", timeout=90)
    assert error["code"] == "node_unreachable"
    # Told when the workflow gave up (the 4 s deadline), not when the gateway's own wait for
    # the stream (deadline + the 30 s attach timeout) would have run out.
    assert time.monotonic() - connected < 25
    failed = await rig.wait_session(session_id, "error")
    assert failed["close_reason"] == "node_unreachable"
    assert failed["opened_at"] is None
    async with db_sessions() as session:
        (task,) = (
            await session.scalars(
                select(NodeTask)
                .where(NodeTask.allocation_id == uuid.UUID(rig.allocation_id))
                .where(NodeTask.kind == "terminal.open")
            )
        ).all()
    assert task.status == "failed"
    handle = rig.temporal.get_workflow_handle(terminal_workflow_id(session_id))
    await record_history(handle, HISTORIES, "node_unreachable")


async def test_another_projects_allocation_is_not_found(
    terminal_rig: Rig, make_project: Any, make_token: Any
) -> None:
    rig = await terminal_rig()
    outsider = await make_project()
    token = await make_token("tenant", outsider)
    headers = {"Authorization": f"Bearer {token}"}
    path = f"/api/v1/allocations/{rig.allocation_id}/terminal-sessions"
    opened = await rig.tenant.post(path, headers=headers)
    assert opened.status_code == 404, opened.text
    assert opened.json()["error"]["code"] == "not_found"
    listed = await rig.tenant.get(path, headers=headers)
    assert listed.status_code == 404
    # A token that does not belong to the session opens nothing either.
    created = await rig.open_session()
    stranger = await rig.connect(created, token="gts_not-this-sessions-token")
    assert (await stranger.control("error"))["code"] == "open_token_invalid"


async def test_the_command_line_client_runs_a_shell(terminal_rig: Rig) -> None:
    """`gpucloud-terminal` as a user runs it, stdin piped: the lines are typed into the shell,
    whose exit ends the session (shell_exited)."""
    rig = await terminal_rig()
    env = {**os.environ, "GPUCLOUD_API": rig.gateway.url, "GPUCLOUD_TOKEN": rig.tenant_token}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.terminal_cli",
        rig.allocation_id,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    async with asyncio.timeout(90):
        stdout, stderr = await process.communicate(b"echo cli-$((20+22))\nexit\n")
    assert process.returncode == 0, stderr.decode()
    assert b"cli-42" in stdout
    assert b"terminal session closed: shell_exited" in stderr
    listed = await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/terminal-sessions")
    (session,) = listed.json()["items"]
    # The client hears the stream end first; the workflow records closed once the agent acks.
    session = await rig.wait_session(session["session_id"], "closed")
    assert session["close_reason"] == "shell_exited"


async def test_the_demo_fleets_simulated_agent_serves_terminals(terminal_rig: Rig) -> None:
    """`gpucloud-agent --backend simulated` (the demo fleet): the tenant's user lives in the
    simulated host, and the shell is a confined one in its home under the machine's root. A frame
    over MAX_FRAME_BYTES (text too) ends the tenant's stream with 1009."""
    rig = await terminal_rig(backend="simulated")
    created = await rig.open_session()
    async with rig.terminal(created) as term:
        output = await term.run('echo "home=$HOME sum=$((3*3))"', b"sum=9")
        assert b"home=/home/gpu-" in output
        await term.ws.send("x" * (MAX_FRAME_BYTES + 1))
        async with asyncio.timeout(30):
            await term.ws.wait_closed()
        assert term.ws.close_code == 1009
    closed = await rig.wait_session(created["session_id"], "closed")
    assert closed["close_reason"] == "client_closed"
