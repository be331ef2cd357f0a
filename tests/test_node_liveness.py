"""Heartbeats as the liveness signal: a silent agent's node goes offline (and gets no new
allocations); its next heartbeat brings it back (and the sweep would too); a node that never
heartbeated is left alone."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import update

from agent.heartbeat import send_heartbeat
from contracts.node_liveness import LivenessInput
from schema.models import Node
from tests.histories import record_history
from tests.lifecycle_support import create_fleet, eventually, slice_request
from workflows.node_liveness import NodeLivenessWorkflow

pytestmark = pytest.mark.usefixtures("control_plane")


async def sweep(client: Any, settings: Any, record: bool = False) -> Any:
    handle = await client.start_workflow(
        NodeLivenessWorkflow.run,
        LivenessInput(offline_after_seconds=300),
        id=f"node-liveness-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    result = await handle.result()
    if record:
        await record_history(handle, "node_liveness", "offline_then_back")
    return result


async def status_of(db_sessions: Any, node_id: uuid.UUID) -> str:
    async with db_sessions() as session:
        node = await session.get(Node, node_id)
        assert node is not None
        return node.status


async def test_silent_node_goes_offline_and_comes_back(
    db_sessions: Any, temporal_client: Any, settings: Any, api: Any, make_token: Any
) -> None:
    silent, never = await create_fleet(db_sessions, slice_nodes=2)
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(Node)
            .where(Node.id == silent.id)
            .values(last_agent_contact_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10))
        )

    result = await sweep(temporal_client, settings, record=True)
    assert result.went_offline == [str(silent.id)]
    assert await status_of(db_sessions, silent.id) == "offline"
    assert await status_of(db_sessions, never.id) == "active"

    # Offline nodes take no new work: only the other node has capacity left for 8 GPUs.
    tenant = await api(token=await make_token("tenant"))
    first = await tenant.post("/api/v1/allocations", json=slice_request(8))
    assert first.json()["node_id"] == str(never.id)
    second = await tenant.post("/api/v1/allocations", json=slice_request(8))
    assert second.status_code == 409

    await send_heartbeat(
        temporal_client, str(silent.id), control_plane_queue=settings.control_plane_task_queue
    )

    async def back() -> bool:
        return await status_of(db_sessions, silent.id) == "active"

    await eventually(back)  # the heartbeat itself, no sweep in between
    third = await tenant.post("/api/v1/allocations", json=slice_request(8))
    assert third.json()["node_id"] == str(silent.id)


async def test_the_sweep_brings_back_an_offline_node_whose_agent_is_heard_from(
    db_sessions: Any, temporal_client: Any, settings: Any
) -> None:
    """The sweep's own way back, for a node whose contact was recorded without flipping it
    (a heartbeat recorded by an older worker)."""
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(Node)
            .where(Node.id == node.id)
            .values(status="offline", last_agent_contact_at=dt.datetime.now(dt.UTC))
        )
    result = await sweep(temporal_client, settings)
    assert result.came_back == [str(node.id)]
    assert await status_of(db_sessions, node.id) == "active"
