"""A hostile node's heartbeats: its Temporal identity may signal only its own presence workflow
(temporal-authz), so what it could still forge is the payload; the control plane takes the node
from the workflow id, never from the payload."""

from __future__ import annotations

import datetime as dt
from typing import Any

from temporalio.common import WorkflowIDConflictPolicy

from agent.heartbeat import send_heartbeat
from contracts.node_presence import (
    HEARTBEAT_SIGNAL,
    WORKFLOW_NAME,
    Heartbeat,
    NodePresenceInput,
    node_presence_workflow_id,
)
from tests.enrolled_fleet import EnrolledFleet
from tests.lifecycle_support import eventually
from tests.test_node_presence import node_row


async def test_a_node_cannot_heartbeat_for_another_node(
    temporal_client: Any, settings: Any, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    """A hostile agent may signal its own presence workflow only (the Authorizer binds it to
    the workflow id), but writes the heartbeat's payload itself: one naming another node, with
    an inventory that is not that node's, changes nothing of the other node."""
    node_a, node_b = await enrolled_fleet.create(slice_nodes=2)
    before = await node_row(db_sessions, node_b.id)
    assert before.inventory_matches is True
    queue = settings.control_plane_task_queue
    forged = Heartbeat(str(node_b.id), dt.datetime.now(dt.UTC).isoformat(), "evil", [])
    await temporal_client.start_workflow(
        WORKFLOW_NAME,
        NodePresenceInput(str(node_a.id)),
        id=node_presence_workflow_id(str(node_a.id)),
        task_queue=queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=HEARTBEAT_SIGNAL,
        start_signal_args=[forged],
    )
    # Signals are handled in order: once A's own next heartbeat is recorded, the forged one
    # before it was handled too.
    await send_heartbeat(temporal_client, str(node_a.id), control_plane_queue=queue,
                         agent_version="0.1.0-marker")  # fmt: skip

    async def a_recorded() -> bool:
        return (await node_row(db_sessions, node_a.id)).agent_version == "0.1.0-marker"

    await eventually(a_recorded)
    after = await node_row(db_sessions, node_b.id)
    assert after.inventory_matches is True
    assert after.gpu_inventory == before.gpu_inventory
    assert after.agent_version != "evil"
