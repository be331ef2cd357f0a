"""NodeDrainWorkflow's activities (contracts/node_drain.py): a look at the draining node's
allocations, and the end of the drain, draining → retired through the one transition function.
Each keeps the node_drains row (the drain's read model) current in the same transaction. A drain
whose node something else moved out of draining (a decommission took it over, an operator's
recovery) has nothing left to finish: its row ends `stopped`."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.node_lifecycle import transition_node
from contracts.node_drain import (
    CHECK_ACTIVITY,
    FINISH_ACTIVITY,
    DrainCheck,
    DrainStatus,
    NodeDrainInput,
    NodeDrainResult,
)
from contracts.states import LIVE_ALLOCATION_STATUSES, NodeStatus
from schema.models import Allocation, Node, NodeDrain

ACTOR = "node_drain"


async def _running_drain(session: AsyncSession, input: NodeDrainInput) -> NodeDrain | None:
    """The drain's row while it runs and its node is still draining, locked; else None (and a
    row still marked running is ended `stopped`). The node row is locked first: the retire
    operation holds that lock until it commits (it starts this workflow before its commit), so
    the drain row is read once that transaction has ended, never before."""
    node_status = await session.scalar(
        select(Node.status).where(Node.id == uuid.UUID(input.node_id)).with_for_update()
    )
    drain = await session.get(NodeDrain, uuid.UUID(input.drain_id), with_for_update=True)
    if drain is None or drain.status != DrainStatus.RUNNING:
        return None
    if node_status != NodeStatus.DRAINING:
        await _end(session, drain, DrainStatus.STOPPED)
        return None
    return drain


async def _end(session: AsyncSession, drain: NodeDrain, status: DrainStatus) -> None:
    await session.execute(
        update(NodeDrain)
        .where(NodeDrain.drain_id == drain.drain_id)
        .values(
            status=status.value,
            completed_at=func.clock_timestamp(),
            updated_at=func.clock_timestamp(),
        )
    )


async def _live_allocations(session: AsyncSession, node_id: uuid.UUID) -> int:
    count = await session.scalar(
        select(func.count())
        .select_from(Allocation)
        .where(
            Allocation.node_id == node_id,
            Allocation.status.in_([s.value for s in LIVE_ALLOCATION_STATUSES]),
        )
    )
    return count or 0


class NodeDrainActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    @activity.defn(name=CHECK_ACTIVITY)
    async def drain_check(self, input: NodeDrainInput) -> DrainCheck:
        async with self._sessions() as session, session.begin():
            drain = await _running_drain(session, input)
            if drain is None:
                return DrainCheck(draining=False, live_allocations=0)
            live = await _live_allocations(session, drain.node_id)
            await session.execute(
                update(NodeDrain)
                .where(NodeDrain.drain_id == drain.drain_id)
                .values(live_allocations=live, updated_at=func.clock_timestamp())
            )
        return DrainCheck(draining=True, live_allocations=live)

    @activity.defn(name=FINISH_ACTIVITY)
    async def drain_finish(self, input: NodeDrainInput) -> NodeDrainResult:
        """draining → retired once no allocation lives on the node (counted again here, in the
        transaction that moves it: a draining node takes no new allocation)."""
        async with self._sessions() as session, session.begin():
            drain = await _running_drain(session, input)
            if drain is None:
                current = await session.scalar(
                    select(Node.status).where(Node.id == uuid.UUID(input.node_id))
                )
                done = current == NodeStatus.RETIRED
                status = DrainStatus.COMPLETED if done else DrainStatus.STOPPED
                return NodeDrainResult(input.node_id, status.value, current)
            if await _live_allocations(session, drain.node_id):
                return NodeDrainResult(input.node_id, DrainStatus.RUNNING.value, "draining")
            await transition_node(
                session,
                drain.node_id,
                [NodeStatus.DRAINING],
                NodeStatus.RETIRED,
                actor=ACTOR,
                reason=drain.reason,
            )
            await _end(session, drain, DrainStatus.COMPLETED)
        return NodeDrainResult(input.node_id, DrainStatus.COMPLETED.value, NodeStatus.RETIRED)
