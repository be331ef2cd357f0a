"""The one place a lifecycle operation changes `nodes.status`
(docs/lifecycles/node.md#states-and-transitions, docs/lifecycles/node.md#who-moves-it).

Every coarse node transition the decommission workflow makes goes through `transition_node`,
which refuses a transition NODE_TRANSITIONS does not allow (a programming error: raised, never
applied) and applies the allowed one as a compare-and-set (`UPDATE … WHERE status IN (:from)`)
together with a `node.status_changed` domain event in the caller's transaction. Zero rows
updated means the node is not where the caller expected: the caller gets the node's current
status back and decides (adopt, or fail as state ambiguity); nothing is written.

`transition_nodes` is the same compare-and-set for a set of nodes at once (the liveness sweep,
the reconciler's quarantines): ONE statement locks the matching rows, moves them and writes one
`node.status_changed` event per node moved, however many there are; `transition_node` is its
one-node case.

`transition_path` walks several allowed hops in one transaction, for moves the table only
allows through an intermediate state, e.g. a failed validation while draining:
draining → offline ("drain failed", §3.3) → quarantined ("cleanup validation", §3.3).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Text, cast, func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import NODE_TRANSITIONS, NodeStatus, node_transition_allowed
from schema.models import DomainEvent, Node


class TransitionNotAllowed(ValueError):
    """A transition docs/lifecycles/node.md#states-and-transitions does not list: a bug in the
    caller, never applied."""


@dataclass(frozen=True)
class Transition:
    applied: bool
    prior: NodeStatus | None  # None: no such node
    current: NodeStatus | None


@dataclass(frozen=True)
class Moved:
    """One node `transition_nodes` moved, and the status it left."""

    node_id: uuid.UUID
    prior: NodeStatus


STATUS_CHANGED = "node.status_changed"


def _allowed_sources(sources: Iterable[NodeStatus], target: NodeStatus) -> list[NodeStatus]:
    allowed = [s for s in sources if s != target]
    for source in allowed:
        if not node_transition_allowed(source, target):
            raise TransitionNotAllowed(f"{source.value} -> {target.value} is not a node transition")
    return allowed


async def transition_nodes(
    session: AsyncSession,
    sources: Iterable[NodeStatus],
    target: NodeStatus,
    where: ColumnElement[bool],
    *,
    actor: str,
    reason: str = "",
) -> list[Moved]:
    """Move every node matching `where` that stands in one of `sources` to `target`, in one
    statement: the rows are locked (a row another transaction moved meanwhile is re-checked and
    skipped), moved, and each gets its `node.status_changed` event. Each source→target pair must
    be allowed by NODE_TRANSITIONS. Returns the nodes moved, with the status each left."""
    allowed = _allowed_sources(sources, target)
    if not allowed:
        return []
    locked = (
        select(Node.id, Node.status)
        .where(Node.status.in_([s.value for s in allowed]), where)
        .with_for_update()
        .cte("locked")
    )
    moved = (
        update(Node)
        .where(Node.id == locked.c.id, Node.status == locked.c.status)
        .values(status=target.value, updated_at=func.clock_timestamp())
        .returning(Node.id.label("node_id"), locked.c.status.label("prior"))
        .cte("moved")
    )
    payload = func.jsonb_build_object(
        "from",
        moved.c.prior,
        "to",
        cast(literal(target.value), Text),
        "actor",
        cast(literal(actor), Text),
        "reason",
        cast(literal(reason[:500]), Text),
    )
    events = (
        insert(DomainEvent)
        .from_select(
            ["type", "subject_type", "subject_id", "payload"],
            select(
                cast(literal(STATUS_CHANGED), Text),
                cast(literal("node"), Text),
                cast(moved.c.node_id, Text),
                payload,
            ),
        )
        .returning(DomainEvent.subject_id, DomainEvent.payload["from"].astext)
    )
    rows = await session.execute(events)
    return [Moved(uuid.UUID(node_id), NodeStatus(prior)) for node_id, prior in rows]


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
    moved = await transition_nodes(
        session, sources, target, Node.id == node_id, actor=actor, reason=reason
    )
    if moved:
        return Transition(True, moved[0].prior, target)
    current = await session.scalar(select(Node.status).where(Node.id == node_id))
    status = NodeStatus(current) if current is not None else None
    return Transition(False, status, status)


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
