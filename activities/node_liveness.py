"""Agent heartbeats are the primary liveness signal (seed 003 §6.3): an active node whose agent
has been silent longer than the threshold goes offline (placement only uses active nodes), and
comes back when heartbeats resume: at once, when its heartbeat is recorded (node_presence), and
here for any offline node whose agent was heard from since. Nodes that never heartbeated are left
alone. Both ways are one set-based statement through the one transition function
(node_lifecycle.transition_nodes), which records each node's `node.status_changed` event."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import ColumnElement, func
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.node_lifecycle import transition_nodes
from contracts.node_liveness import LivenessInput, LivenessResult
from contracts.states import NodeStatus
from schema.models import Node

ACTOR = "node_liveness"


async def bring_back_online(
    session: AsyncSession, heard_from: ColumnElement[bool]
) -> list[uuid.UUID]:
    """Offline nodes matching `heard_from` are active again (compare-and-set); their ids."""
    back = await transition_nodes(
        session,
        [NodeStatus.OFFLINE],
        NodeStatus.ACTIVE,
        heard_from,
        actor=ACTOR,
        reason="agent heartbeats again",
    )
    return [moved.node_id for moved in back]


class NodeLivenessActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    @activity.defn(name="node.check_liveness")
    async def check_liveness(self, input: LivenessInput) -> LivenessResult:
        cutoff = func.clock_timestamp() - dt.timedelta(seconds=input.offline_after_seconds)
        async with self._sessions() as session, session.begin():
            # Compare-and-set both ways in one transaction: a node flips at most once per run.
            silent = await transition_nodes(
                session,
                [NodeStatus.ACTIVE],
                NodeStatus.OFFLINE,
                Node.last_agent_contact_at.is_not(None) & (Node.last_agent_contact_at < cutoff),
                actor=ACTOR,
                reason=f"agent silent for more than {input.offline_after_seconds:g} s",
            )
            offline = [moved.node_id for moved in silent]
            back = await bring_back_online(session, Node.last_agent_contact_at >= cutoff)
        if offline or back:
            activity.logger.info("nodes offline: %s; back: %s", list(offline), list(back))
        return LivenessResult([str(n) for n in offline], [str(n) for n in back])
