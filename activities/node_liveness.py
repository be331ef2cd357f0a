"""Agent heartbeats are the primary liveness signal (seed 003 §6.3): an active node whose agent
has been silent longer than the threshold goes offline (placement only uses active nodes), and
comes back when heartbeats resume: at once, when its heartbeat is recorded (node_presence), and
here for any offline node whose agent was heard from since. Nodes that never heartbeated are left
alone."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import ColumnElement, func, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from contracts.node_liveness import LivenessInput, LivenessResult
from contracts.states import NodeStatus
from schema.models import Node


async def bring_back_online(
    session: AsyncSession, heard_from: ColumnElement[bool]
) -> list[uuid.UUID]:
    """Offline nodes matching `heard_from` are active again (compare-and-set); their ids."""
    back = await session.scalars(
        update(Node)
        .where(Node.status == NodeStatus.OFFLINE, heard_from)
        .values(status=NodeStatus.ACTIVE, updated_at=func.clock_timestamp())
        .returning(Node.id)
    )
    return list(back.all())


class NodeLivenessActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    @activity.defn(name="node.check_liveness")
    async def check_liveness(self, input: LivenessInput) -> LivenessResult:
        cutoff = func.clock_timestamp() - dt.timedelta(seconds=input.offline_after_seconds)
        async with self._sessions() as session, session.begin():
            # Compare-and-set both ways in one transaction: a node flips at most once per run.
            offline = (
                await session.scalars(
                    update(Node)
                    .where(
                        Node.status == NodeStatus.ACTIVE,
                        Node.last_agent_contact_at.is_not(None),
                        Node.last_agent_contact_at < cutoff,
                    )
                    .values(status=NodeStatus.OFFLINE, updated_at=func.clock_timestamp())
                    .returning(Node.id)
                )
            ).all()
            back = await bring_back_online(session, Node.last_agent_contact_at >= cutoff)
        if offline or back:
            activity.logger.info("nodes offline: %s; back: %s", list(offline), list(back))
        return LivenessResult([str(n) for n in offline], [str(n) for n in back])
