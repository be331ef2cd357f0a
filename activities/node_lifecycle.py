"""The one place a lifecycle operation changes `nodes.status` (seed 004 §3.2, §3.3).

Every coarse node transition the decommission workflow makes goes through `transition_node`,
which refuses a transition NODE_TRANSITIONS does not allow (a programming error: raised, never
applied) and applies the allowed one as a compare-and-set (`UPDATE … WHERE status IN (:from)`)
together with a `node.status_changed` domain event in the caller's transaction. Zero rows
updated means the node is not where the caller expected: the caller gets the node's current
status back and decides (adopt, or fail as state ambiguity); nothing is written.

`transition_path` walks several allowed hops in one transaction, for moves the table only
allows through an intermediate state, e.g. a failed validation while draining:
draining → offline ("drain failed", §3.3) → quarantined ("cleanup validation", §3.3).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import NODE_TRANSITIONS, NodeStatus, node_transition_allowed
from schema.models import DomainEvent, Node


class TransitionNotAllowed(ValueError):
    """A transition seed 004 §3.2 does not list: a bug in the caller, never applied."""


@dataclass(frozen=True)
class Transition:
    applied: bool
    prior: NodeStatus | None  # None: no such node
    current: NodeStatus | None


async def transition_node(
    session: AsyncSession,
    node_id: uuid.UUID,
    sources: Iterable[NodeStatus],
    target: NodeStatus,
    *,
    actor: str,
    reason: str = "",
) -> Transition:
    """Move the node from any of `sources` to `target` (compare-and-set). Each source→target pair
    must be allowed by NODE_TRANSITIONS. Already at `target`: not applied, current == target
    (callers treat that as done: re-entry converges)."""
    allowed = [s for s in sources if s != target]
    for source in allowed:
        if not node_transition_allowed(source, target):
            raise TransitionNotAllowed(f"{source.value} -> {target.value} is not a node transition")
    prior = await session.scalar(select(Node.status).where(Node.id == node_id).with_for_update())
    if prior is None:
        return Transition(False, None, None)
    prior_status = NodeStatus(prior)
    if prior_status not in allowed:
        return Transition(False, prior_status, prior_status)
    changed = await session.scalar(
        update(Node)
        .where(Node.id == node_id, Node.status == prior_status.value)
        .values(status=target.value, updated_at=func.clock_timestamp())
        .returning(Node.id)
    )
    if changed is None:  # lost a race after the lock: cannot happen, but never pretend
        current = await session.scalar(select(Node.status).where(Node.id == node_id))
        return Transition(False, prior_status, NodeStatus(current) if current else None)
    await session.execute(
        insert(DomainEvent).values(
            type="node.status_changed",
            subject_type="node",
            subject_id=str(node_id),
            payload={
                "from": prior_status.value,
                "to": target.value,
                "actor": actor,
                "reason": reason[:500],
            },
        )
    )
    return Transition(True, prior_status, target)


async def transition_path(
    session: AsyncSession,
    node_id: uuid.UUID,
    path: Sequence[NodeStatus],
    *,
    actor: str,
    reason: str = "",
) -> Transition:
    """Walk `path` (e.g. [draining, offline, quarantined]) from wherever the node stands on it,
    one allowed hop at a time, in the caller's transaction. A node that is not on the path is
    left alone (applied=False, current = its status)."""
    current = await session.scalar(select(Node.status).where(Node.id == node_id).with_for_update())
    if current is None:
        return Transition(False, None, None)
    status = NodeStatus(current)
    if status not in path:
        return Transition(False, status, status)
    prior = status
    applied = False
    for hop in path[path.index(status) + 1 :]:
        step = await transition_node(session, node_id, [status], hop, actor=actor, reason=reason)
        if not step.applied:
            return Transition(applied, prior, step.current)
        status, applied = hop, True
    return Transition(applied, prior, status)


def sources_into(target: NodeStatus) -> frozenset[NodeStatus]:
    """Every state the table allows to move into `target`."""
    return frozenset(s for s, targets in NODE_TRANSITIONS.items() if target in targets)
