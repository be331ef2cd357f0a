"""The allocation task timeline (docs/lifecycles/allocation.md#task-timeline): lifecycle events
merged with node tasks, in time order.

Lifecycle items come from `allocation_events`; node-task items from `node_tasks` with their
phases from `node_task_events`. The node's agent reports each attempt of a running task and its
phase changes to the workflow, which records them (activities/node_task_log.py), so a running
task reads `running` with its phases from the database. Between two reports the heartbeat of
the pending activity may be further along: the phases only it has are added; when Temporal
cannot be asked, the database part is still answered.

Sanitising is by allow-list: only the fields and detail keys named here ever leave, so SSH keys,
secrets, signatures and cloud-init content cannot, whatever an activity stored. Free text was
redacted where it entered the record; a heartbeat's, which is no record, is redacted here by
the same sanitiser.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowExecutionDescription
from temporalio.service import RPCError

from contracts.host_tasks import TASK_SUMMARIES, HostPhase
from contracts.states import AllocationStatus, NodeTaskStatus
from core.redaction import redact
from core.timestamps import parse_iso
from gateway.allocations import get_row
from gateway.errors import TemporalUnavailable
from gateway.schemas import (
    Timeline,
    TimelineItem,
    TimelinePhase,
    TimelineStateItem,
    TimelineTaskItem,
)
from gateway.temporal import TemporalOps
from schema.models import (
    Allocation,
    AllocationEvent,
    AllocationGroupEvent,
    NodeTask,
    NodeTaskEvent,
)

log = logging.getLogger("gateway.timeline")

# Scalar detail keys that may be shown; everything else in `details` / `output` is dropped.
EVENT_DETAIL_KEYS = frozenset(
    {"node_id", "shape", "gpu_count", "attempt", "attempts", "hard_stopped", "force", "task_kind"}
)
TASK_OUTPUT_KEYS = frozenset(
    {"adopted_existing", "hard_stopped", "wiped", "released", "leases_released"}
)
_MAX_TEXT = 500

_TASK_STATUS = {
    NodeTaskStatus.QUEUED: "queued",
    NodeTaskStatus.DISPATCHED: "running",
    NodeTaskStatus.COMPLETED: "succeeded",
    NodeTaskStatus.FAILED: "failed",
}
_LIVE = frozenset({NodeTaskStatus.QUEUED, NodeTaskStatus.DISPATCHED})
_FAILED_STATES = frozenset({AllocationStatus.FAILED, AllocationStatus.RELEASE_FAILED})


def _text(value: str | None) -> str | None:
    if value is None:
        return None
    return value[:_MAX_TEXT]


def _allowed(source: Mapping[str, Any] | None, keys: frozenset[str]) -> dict[str, Any] | None:
    if not source:
        return None
    kept = {
        k: v
        for k, v in source.items()
        if k in keys and (v is None or isinstance(v, bool | int | float | str))
    }
    return {k: (v[:200] if isinstance(v, str) else v) for k, v in kept.items()} or None


def event_item(event: AllocationEvent | AllocationGroupEvent) -> TimelineStateItem:
    """A lifecycle transition: an allocation's, or an allocation group's
    (docs/lifecycles/allocation-group.md)."""
    failed = event.to_status in _FAILED_STATES
    return TimelineStateItem(
        name=event.event,
        status="failed" if failed else "succeeded",
        started_at=event.occurred_at,
        state=event.to_status,
        reason=_text(event.reason),
        actor=event.actor,
        details=_allowed(event.details, EVENT_DETAIL_KEYS),
    )


def task_item(
    task: NodeTask, phases: Sequence[NodeTaskEvent], now: dt.datetime
) -> TimelineTaskItem:
    started = task.dispatched_at or task.created_at
    end = task.completed_at or (None if task.status not in _LIVE else now)
    duration = None if end is None else max(0.0, (end - started).total_seconds())
    status = _TASK_STATUS.get(NodeTaskStatus(task.status), task.status)
    return TimelineTaskItem(
        name=task.kind,
        status=status,
        task_id=task.id,
        started_at=started,
        completed_at=task.completed_at,
        duration_seconds=None if duration is None else round(duration, 3),
        summary=TASK_SUMMARIES.get(task.kind),
        attempts=task.attempts,
        phases=[
            TimelinePhase(
                phase=p.phase,
                status=p.status,
                at=p.occurred_at,
                message=_text(p.message),
                attempt=p.attempt or None,
            )
            for p in phases
        ],
        phases_source="database",
        error_type=task.error_type if task.status == NodeTaskStatus.FAILED else None,
        details=_allowed(task.output, TASK_OUTPUT_KEYS),
    )


async def _decode_phases(client: Client, payloads: Sequence[Payload]) -> list[TimelinePhase] | None:
    """The first heartbeat detail as list[HostPhase], or None if it is something else."""
    if not payloads:
        return None
    try:
        decoded = await client.data_converter.decode([payloads[0]], [list[HostPhase]])
    except Exception:  # a detail of another shape: not a phase list
        return None
    value = decoded[0] if decoded else None
    if not isinstance(value, list) or not all(isinstance(p, HostPhase) for p in value):
        return None
    return [
        TimelinePhase(
            phase=p.phase,
            status=p.status,
            at=parse_iso(p.at),
            message=redact(p.message, limit=_MAX_TEXT),
            attempt=p.attempt or None,
        )
        for p in value
    ]


async def live_phases(
    temporal: TemporalOps, workflow_id: str, task_kinds: set[str]
) -> dict[str, list[TimelinePhase]]:
    """Phases heartbeated by the allocation workflow's pending host activities, by task kind."""

    async def describe(client: Client) -> WorkflowExecutionDescription:
        handle = client.get_workflow_handle(workflow_id)
        return await handle.describe(rpc_timeout=temporal.read_timeout)

    description = await temporal.read(describe)
    found: dict[str, list[TimelinePhase]] = {}
    for pending in description.raw_description.pending_activities:
        kind = pending.activity_type.name
        if kind not in task_kinds or not pending.HasField("heartbeat_details"):
            continue
        phases = await _decode_phases(temporal.client, pending.heartbeat_details.payloads)
        if phases is not None:
            found[kind] = phases
    return found


# At most this many describes at once when several allocations' timelines are built together.
_DESCRIBES_AT_ONCE = 8


async def build(
    db: AsyncSession,
    temporal: TemporalOps,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID | None,
) -> Timeline:
    row: Allocation = await get_row(db, allocation_id, project_id)
    (timeline,) = await build_many(db, temporal, [row])
    return timeline


async def build_many(
    db: AsyncSession, temporal: TemporalOps, rows: Sequence[Allocation]
) -> list[Timeline]:
    """The timelines of these allocations, in their order: one query per table for them all,
    and the describes of those with a live task at once (a few at a time). Closes `db`."""
    if not rows:
        return []
    ids = [r.id for r in rows]
    events = (
        await db.scalars(
            select(AllocationEvent)
            .where(AllocationEvent.allocation_id.in_(ids))
            .order_by(AllocationEvent.occurred_at, AllocationEvent.id)
        )
    ).all()
    tasks = (
        await db.scalars(
            select(NodeTask)
            .where(NodeTask.allocation_id.in_(ids))
            .order_by(NodeTask.created_at, NodeTask.id)
        )
    ).all()
    phase_rows = (
        (
            await db.scalars(
                select(NodeTaskEvent)
                .where(NodeTaskEvent.node_task_id.in_([t.id for t in tasks]))
                .order_by(NodeTaskEvent.occurred_at, NodeTaskEvent.id)
            )
        ).all()
        if tasks
        else []
    )
    heads = [(r.id, r.status, r.workflow_id) for r in rows]
    now = dt.datetime.now(dt.UTC)
    await db.close()  # nothing of the database is held while Temporal is asked

    events_of: dict[uuid.UUID, list[AllocationEvent]] = {}
    for e in events:
        events_of.setdefault(e.allocation_id, []).append(e)
    tasks_of: dict[uuid.UUID, list[NodeTask]] = {}
    for t in tasks:
        if t.allocation_id is not None:
            tasks_of.setdefault(t.allocation_id, []).append(t)
    phases_of: dict[uuid.UUID, list[NodeTaskEvent]] = {}
    for p in phase_rows:
        phases_of.setdefault(p.node_task_id, []).append(p)

    describes = asyncio.Semaphore(_DESCRIBES_AT_ONCE)

    async def one(allocation_id: uuid.UUID, status: str, workflow_id: str) -> Timeline:
        own_tasks = tasks_of.get(allocation_id, [])
        items: list[TimelineItem] = [event_item(e) for e in events_of.get(allocation_id, [])]
        task_items = [task_item(t, phases_of.get(t.id, []), now) for t in own_tasks]
        warnings: list[str] = []
        if any(t.status in _LIVE for t in own_tasks):
            async with describes:
                live = await _add_live_phases(temporal, workflow_id, own_tasks, task_items)
            if not live:
                warnings.append("live_phases_unavailable")
        items.extend(task_items)
        # Time order; at the same instant the lifecycle event comes before the task it started.
        items.sort(key=lambda i: (i.started_at, isinstance(i, TimelineTaskItem)))
        return Timeline(allocation_id=allocation_id, status=status, items=items, warnings=warnings)

    return list(await asyncio.gather(*(one(*head) for head in heads)))


async def _add_live_phases(
    temporal: TemporalOps,
    workflow_id: str,
    tasks: Sequence[NodeTask],
    task_items: Sequence[TimelineTaskItem],
) -> bool:
    """Adds to the newest live task of each kind the phases only its pending activity's
    heartbeat has; False when Temporal could not say."""
    live = [t for t in tasks if t.status in _LIVE]
    try:
        heartbeats = await live_phases(temporal, workflow_id, {t.kind for t in live})
    except TemporalUnavailable:
        return False
    except RPCError as err:  # e.g. the workflow is gone from Temporal's retention
        log.info("no live phases for %s: %s", workflow_id, err.status)
        return False
    # The newest live task of a kind is the one the pending activity runs.
    latest: dict[str, TimelineTaskItem] = {}
    for task, item in zip(tasks, task_items, strict=True):
        if task.status in _LIVE:
            latest[task.kind] = item
    for kind, item in latest.items():
        recorded = {(p.attempt, p.phase, p.status) for p in item.phases}
        newer = [
            p for p in heartbeats.get(kind, []) if (p.attempt, p.phase, p.status) not in recorded
        ]
        if newer:  # the heartbeat is ahead of the last recorded report
            item.phases = [*item.phases, *newer]
            item.phases_source = "temporal"
    return True
