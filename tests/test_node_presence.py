"""Agent heartbeats through Temporal: liveness and GPU inventory land on the node, and an
inventory that does not match the node's GPU slots is flagged."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from agent.heartbeat import run_heartbeats, send_heartbeat
from contracts.node_presence import (
    PresenceView,
    ReportedGpu,
    node_presence_workflow_id,
)
from schema.models import GpuSlot, Node
from tests.factories import create_node, create_sku
from tests.histories import record_history
from tests.lifecycle_support import eventually

pytestmark = pytest.mark.usefixtures("control_plane")


async def node_row(db_sessions: Any, node_id: uuid.UUID) -> Node:
    async with db_sessions() as session:
        node = await session.get(Node, node_id)
        assert node is not None
        return node


async def test_heartbeats_record_liveness_and_inventory(
    temporal_client: Any, settings: Any, db_sessions: Any
) -> None:
    await create_sku(db_sessions)
    node = await create_node(db_sessions, gpus=2)
    async with db_sessions() as session:
        slots = (
            await session.execute(
                select(GpuSlot.pci_address, GpuSlot.numa_node).where(GpuSlot.node_id == node.id)
            )
        ).all()
    matching = [
        ReportedGpu(address, numa, "NVIDIA H100 80GB HBM3", 81559) for address, numa in slots
    ]
    queue = settings.control_plane_task_queue

    await send_heartbeat(temporal_client, str(node.id), control_plane_queue=queue,
                         agent_version="0.1.0", gpus=matching)  # fmt: skip

    async def recorded() -> Node | None:
        row = await node_row(db_sessions, node.id)
        return row if row.last_agent_contact_at is not None else None

    row = await eventually(recorded)
    assert row.inventory_matches is True
    assert row.agent_version == "0.1.0"
    assert [g["pci_address"] for g in row.gpu_inventory] == [a for a, _ in slots]
    first_contact = row.last_agent_contact_at

    # One GPU missing, a stranger present: flagged, and the workflow knows which.
    wrong = [matching[0], ReportedGpu("0000:ff:00.0", 1)]
    await send_heartbeat(temporal_client, str(node.id), control_plane_queue=queue, gpus=wrong)

    async def flagged() -> Node | None:
        row = await node_row(db_sessions, node.id)
        return row if row.inventory_matches is False else None

    row = await eventually(flagged)
    assert row.last_agent_contact_at > first_contact
    handle = temporal_client.get_workflow_handle(node_presence_workflow_id(str(node.id)))
    view = await handle.query("presence", result_type=PresenceView)
    assert sorted(view.mismatched_pci_addresses) == sorted(["0000:ff:00.0", slots[1][0]])
    await record_history(handle, "node_presence", "heartbeats_and_mismatch")


async def test_agent_heartbeat_loop_keeps_reporting_until_stopped(
    temporal_client: Any, settings: Any, db_sessions: Any
) -> None:
    await create_sku(db_sessions)
    node = await create_node(db_sessions, gpus=1)
    stop = asyncio.Event()
    calls = 0

    def inventory() -> list[ReportedGpu] | None:
        nonlocal calls
        calls += 1
        return None  # inventory unreadable this time: liveness is still recorded

    loop = asyncio.create_task(
        run_heartbeats(temporal_client, str(node.id), stop=stop, inventory=inventory,
                       control_plane_queue=settings.control_plane_task_queue, interval=0.05)
    )  # fmt: skip

    async def reported_twice() -> bool:
        row = await node_row(db_sessions, node.id)
        return calls >= 2 and row.last_agent_contact_at is not None

    await eventually(reported_twice)
    stop.set()
    await asyncio.wait_for(loop, timeout=5)
    assert (await node_row(db_sessions, node.id)).inventory_matches is None


async def test_simulated_fleet_agents_heartbeat_too(
    temporal_client: Any, settings: Any, db_sessions: Any
) -> None:
    from sim.fleet import AgentNode, SimFleet

    await create_sku(db_sessions)
    node = await create_node(db_sessions, gpus=1)
    fleet = SimFleet(
        temporal_client,
        heartbeat_queue=settings.control_plane_task_queue,
        heartbeat_seconds=0.05,
    )
    fleet.start([AgentNode(str(node.id))])
    try:

        async def alive() -> bool:
            row = await node_row(db_sessions, node.id)
            return row.last_agent_contact_at is not None and row.agent_version == "sim"

        await eventually(alive)
    finally:
        await fleet.stop()
