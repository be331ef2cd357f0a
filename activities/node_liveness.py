"""Agent liveness (docs/lifecycles/node.md#detection): an active node whose agent has been silent
longer than the threshold goes offline (placement only uses active nodes), and comes back when it is
heard from again: at once, when its agent's presence signal is recorded (node_presence), and here
for any offline node whose agent was heard from since. Nodes that never reported are left alone.
Both ways are one set-based statement through the one transition function
(node_lifecycle.transition_nodes), which records each node's `node.status_changed` event.

"Heard from" is read from what an idle agent already does, not from a signal per beat: its node
worker long-polls `node-{id}`, and Temporal reports each queue's pollers with the time it last
saw them (DescribeTaskQueue; a live idle agent's is at most one long poll, about a minute, old,
a dead agent's stops at its death). Each sweep describes the queues of the active nodes whose
recorded contact is older than half the threshold, and of every node out of service that has an
agent (offline: the way back; quarantined, draining, retired: the operator's health proof wants a
recent contact), a bounded number, a bounded number at once: the active ones first (each leaves
that set once described, refreshed or offline, while a dead out-of-service agent stays in its
set for good and would otherwise hold the bound), the stalest contact first within each; and
records the newer contact for all of them in one statement before the offline compare-and-set.
Only a node whose queue this sweep described can go offline: one Temporal could not describe,
or one left for the next sweep by the bound, stays as it is (silence is never assumed).

DescribeTaskQueue reads the queue's root partition: the deployment runs node queues with one
partition (devstack/temporal_cluster.py, `task_queue_partitions`), so that is every poller."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    DateTime,
    Uuid,
    any_,
    bindparam,
    func,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from activities.node_lifecycle import transition_nodes
from contracts.node_liveness import LivenessInput, LivenessResult
from contracts.states import NodeStatus
from core.task_queues import node_task_queue
from schema.models import Node

ACTOR = "node_liveness"
# Out-of-service nodes whose agent is described every sweep (few at any time).
PROBED_EVERY_SWEEP = (
    NodeStatus.OFFLINE,
    NodeStatus.QUARANTINED,
    NodeStatus.DRAINING,
    NodeStatus.RETIRED,
)
# A sweep's work stays bounded whatever the fleet: at most this many queues described per run
# (active nodes first, then the stalest contacts; the rest wait for the next sweep, 30 s later),
# this many at once.
MAX_QUEUES_PER_SWEEP = 5_000
DESCRIBES_IN_FLIGHT = 32


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
        reason="agent heard from again",
    )
    return [moved.node_id for moved in back]


class NodeLivenessActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    async def _pollers_last_seen(self, node_id: uuid.UUID) -> dt.datetime | None:
        """When Temporal last saw a poller on the node's queue (None: no poller in its memory,
        about the last five minutes)."""
        described = await self._client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self._client.namespace,
                task_queue=TaskQueue(name=node_task_queue(str(node_id))),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        seen = [p.last_access_time.ToDatetime(dt.UTC) for p in described.pollers]
        return max(seen, default=None)

    async def _agents_last_seen(
        self, node_ids: list[uuid.UUID]
    ) -> tuple[dict[uuid.UUID, dt.datetime], list[uuid.UUID]]:
        """Each node's newest poller time, and the nodes whose queue could not be described."""
        limit = asyncio.Semaphore(DESCRIBES_IN_FLIGHT)

        async def one(node_id: uuid.UUID) -> dt.datetime | None:
            async with limit:
                return await self._pollers_last_seen(node_id)

        answers = await asyncio.gather(*(one(n) for n in node_ids), return_exceptions=True)
        seen: dict[uuid.UUID, dt.datetime] = {}
        unknown: list[uuid.UUID] = []
        for node_id, answer in zip(node_ids, answers, strict=True):
            if isinstance(answer, RPCError):
                unknown.append(node_id)
            elif isinstance(answer, BaseException):
                raise answer
            elif answer is not None:
                seen[node_id] = answer
        if unknown:
            activity.logger.warning(
                "could not describe %d node queue(s): their nodes stay as they are this sweep",
                len(unknown),
            )
        return seen, unknown

    @activity.defn(name="node.check_liveness")
    async def check_liveness(self, input: LivenessInput) -> LivenessResult:
        contact = Node.last_agent_contact_at
        async with self._sessions() as session:
            due = list(
                await session.scalars(
                    select(Node.id)
                    .where(
                        contact.is_not(None),
                        (
                            (Node.status == NodeStatus.ACTIVE.value)
                            & (
                                contact
                                < func.clock_timestamp()
                                - dt.timedelta(seconds=input.probe_after_seconds)
                            )
                        )
                        | Node.status.in_([s.value for s in PROBED_EVERY_SWEEP]),
                    )
                    .order_by(Node.status != NodeStatus.ACTIVE.value, contact)
                    .limit(MAX_QUEUES_PER_SWEEP)
                )
            )
        seen, unknown = await self._agents_last_seen(due)
        described = list(set(due).difference(unknown))
        cutoff = func.clock_timestamp() - dt.timedelta(seconds=input.offline_after_seconds)
        async with self._sessions() as session, session.begin():
            if seen:
                await self._record_contact(session, seen)
            # Compare-and-set both ways in one transaction: a node flips at most once per run.
            silent = await transition_nodes(
                session,
                [NodeStatus.ACTIVE],
                NodeStatus.OFFLINE,
                (contact < cutoff)
                & (Node.id == any_(bindparam("described", described, type_=ARRAY(Uuid())))),
                actor=ACTOR,
                reason=f"agent silent for more than {input.offline_after_seconds:g} s",
            )
            offline = [moved.node_id for moved in silent]
            back = await bring_back_online(session, contact >= cutoff)
        if offline or back:
            activity.logger.info("nodes offline: %s; back: %s", list(offline), list(back))
        return LivenessResult([str(n) for n in offline], [str(n) for n in back], len(described))

    @staticmethod
    async def _record_contact(session: AsyncSession, seen: dict[uuid.UUID, dt.datetime]) -> None:
        """One statement for every node heard from: contact moves forward, never back (a row
        whose contact is already as new is not rewritten)."""
        heard = select(
            func.unnest(bindparam("ids", list(seen), type_=ARRAY(Uuid()))).label("id"),
            func.unnest(
                bindparam("seen", list(seen.values()), type_=ARRAY(DateTime(timezone=True)))
            ).label("seen"),
        ).subquery("heard")
        await session.execute(
            update(Node)
            .where(
                Node.id == heard.c.id,
                Node.last_agent_contact_at.is_(None) | (Node.last_agent_contact_at < heard.c.seen),
            )
            .values(last_agent_contact_at=heard.c.seen)
            .execution_options(synchronize_session=False)
        )
