"""Recording an agent's heartbeat: liveness (clock_timestamp(), the control plane's clock, not
the agent's) and the reported GPU inventory compared with the node's GPU slots. A node that went
offline because its agent fell silent is active again with its agent's first heartbeat
(node_liveness.bring_back_online): the liveness sweep (every 30 s) would bring it back too, but
until then it took no work, and a restarted stack answered `sku_unavailable` for up to half a
minute."""

from __future__ import annotations

import dataclasses
import uuid

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.node_liveness import bring_back_online
from contracts.node_presence import RecordHeartbeatInput, node_presence_workflow_id
from contracts.states import NodeStatus
from schema.models import GpuSlot, Node


class NodePresenceActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    @activity.defn(name="node.record_heartbeat")
    async def record_heartbeat(self, input: RecordHeartbeatInput) -> list[str]:
        """Returns the PCI addresses on which inventory and slots disagree (empty: they match,
        or no inventory was reported)."""
        beat = input.heartbeat
        # The heartbeat's node is the one its presence workflow is for: the workflow id is all a
        # node's Temporal identity is bound to (temporal-authz: a node may signal only its own
        # `node-presence-{id}`), while the payload is the node's own word. A heartbeat naming
        # another node would let one node keep another online or rewrite its inventory.
        workflow_id = activity.info().workflow_id
        if workflow_id != node_presence_workflow_id(beat.node_id):
            activity.logger.warning(
                "dropped a heartbeat naming node %s sent to %s", beat.node_id, workflow_id
            )
            return []
        node_id = uuid.UUID(beat.node_id)
        values: dict[str, object] = {"last_agent_contact_at": func.clock_timestamp()}
        if beat.agent_version:
            values["agent_version"] = beat.agent_version[:64]
        mismatched: list[str] = []
        async with self._sessions() as session, session.begin():
            if beat.gpus is not None:
                slots = set(
                    (
                        await session.scalars(
                            select(GpuSlot.pci_address).where(GpuSlot.node_id == node_id)
                        )
                    ).all()
                )
                reported = {g.pci_address.lower() for g in beat.gpus}
                mismatched = sorted(slots.symmetric_difference(reported))
                values["gpu_inventory"] = [dataclasses.asdict(g) for g in beat.gpus]
                values["inventory_matches"] = not mismatched
            status = await session.scalar(
                update(Node).where(Node.id == node_id).values(**values).returning(Node.status)
            )
            # Only a node the sweep took offline needs the way back: one statement per beat.
            back = (
                await bring_back_online(session, Node.id == node_id)
                if status == NodeStatus.OFFLINE
                else []
            )
        if back:
            activity.logger.info("node %s is back: its agent heartbeats again", node_id)
        if mismatched:
            activity.logger.warning(
                "node %s reports GPUs that do not match its slots: %s", node_id, mismatched
            )
        return mismatched
