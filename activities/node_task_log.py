"""The node_tasks mirror every timeline reads (docs/lifecycles/allocation.md#task-timeline): one
writer for every workflow that dispatches host work (allocations, decommissions).

A task row goes queued → dispatched (the agent reported an attempt starting: `record_progress`)
→ completed / failed (`record_task_outcome`), with the phases of each attempt in
node_task_events. Every free-text field (phase messages, error messages) passes
`core.redaction.redact` here, where it enters the record, so no reader needs to filter it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.lifecycle_read_model import MAX_SNIPPET
from contracts.host_tasks import RECORD_TASK_PROGRESS, HostPhase, HostTaskProgress
from contracts.states import NodeTaskStatus
from core.redaction import redact, redact_optional
from core.timestamps import parse_iso
from schema.models import NodeTask, NodeTaskEvent


async def queue_task(
    session: AsyncSession,
    task_id: str,
    allocation_id: uuid.UUID | None,
    node_id: uuid.UUID | None,
    kind: str,
    workflow_id: str,
) -> None:
    """The task is about to be scheduled on the node's queue: its row, `queued` (once)."""
    await session.execute(
        pg_insert(NodeTask)
        .values(
            id=uuid.UUID(task_id),
            node_id=node_id,
            allocation_id=allocation_id,
            kind=kind,
            status=NodeTaskStatus.QUEUED,
            workflow_id=workflow_id,
        )
        .on_conflict_do_nothing(index_elements=[NodeTask.id])
    )


async def record_task_outcome(
    session: AsyncSession,
    task_id: uuid.UUID,
    status: str,
    *,
    started_at: str | None = None,
    finished_at: str | None = None,
    phases: Iterable[HostPhase] = (),
    output: dict[str, Any] | None = None,
    error_type: str | None = None,
    error_message: str | None = None,
) -> None:
    """The task ended: its row (the agent's own start and finish times when it reported them)
    and the phases of its last attempt, each recorded once however often this is repeated."""
    phases = list(phases)
    # The attempts the agent reported, or those the phases name; at least the one that ended.
    attempts = func.greatest(NodeTask.attempts, 1, *(p.attempt for p in phases))
    row = (
        await session.execute(
            update(NodeTask)
            .where(NodeTask.id == task_id)
            .values(
                status=status,
                attempts=attempts,
                dispatched_at=func.coalesce(NodeTask.dispatched_at, parse_iso(started_at)),
                completed_at=parse_iso(finished_at) or func.clock_timestamp(),
                output=output or {},
                error_type=error_type,
                error_message=redact_optional(error_message, limit=MAX_SNIPPET),
            )
            .returning(NodeTask.allocation_id, NodeTask.attempts)
        )
    ).one_or_none()
    if row is not None:
        await _record_phases(session, task_id, row.allocation_id, row.attempts, phases)


async def record_task_progress(
    session: AsyncSession, workflow_id: str, report: HostTaskProgress
) -> None:
    """An attempt of the task started or moved on (the agent's report): the row is `dispatched`
    (unless it already ended), counts the attempt, and the phases so far are recorded."""
    task_id = uuid.UUID(report.task_id)
    row = (
        await session.execute(
            update(NodeTask)
            # A report names the workflow it was sent to: it cannot touch another's tasks.
            .where(NodeTask.id == task_id, NodeTask.workflow_id == workflow_id)
            .values(
                # A late report never moves an ended task back.
                status=func.coalesce(
                    func.nullif(NodeTask.status, NodeTaskStatus.QUEUED.value),
                    NodeTaskStatus.DISPATCHED.value,
                ),
                attempts=func.greatest(NodeTask.attempts, report.attempt),
                dispatched_at=func.coalesce(
                    NodeTask.dispatched_at, parse_iso(report.started_at), func.clock_timestamp()
                ),
            )
            .returning(NodeTask.allocation_id)
        )
    ).one_or_none()
    if row is not None:
        await _record_phases(session, task_id, row.allocation_id, report.attempt, report.phases)


async def _record_phases(
    session: AsyncSession,
    task_id: uuid.UUID,
    allocation_id: uuid.UUID | None,
    attempt: int,
    phases: Iterable[HostPhase],
) -> None:
    rows = [
        {
            "node_task_id": task_id,
            "allocation_id": allocation_id,
            "attempt": p.attempt or attempt,
            "phase": p.phase[:64],
            "status": p.status[:16],
            "message": redact(p.message, limit=MAX_SNIPPET),
            "occurred_at": parse_iso(p.at) or dt.datetime.now(dt.UTC),
        }
        for p in phases
    ]
    if rows:
        await session.execute(
            pg_insert(NodeTaskEvent)
            .values(rows)
            .on_conflict_do_nothing(constraint="node_task_events_once")
        )


class NodeTaskLogActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    @activity.defn(name=RECORD_TASK_PROGRESS)
    async def record_progress(self, report: HostTaskProgress) -> None:
        """Run as a local activity by the workflow the report was signalled to."""
        async with self._sessions() as session, session.begin():
            await record_task_progress(session, activity.info().workflow_id or "", report)
