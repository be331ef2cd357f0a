"""How a host task ended, in the node_tasks mirror every timeline reads (seed 002): one writer
for every workflow that dispatches host work (allocations, decommissions)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.lifecycle_read_model import bounded
from contracts.host_tasks import HostPhase
from core.timestamps import parse_iso
from schema.models import NodeTask, NodeTaskEvent


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
    """One attempt of the task ended: its row (the agent's own start and finish times when it
    reported them) and its phases, each recorded once however often this is repeated."""
    allocation_id = await session.scalar(
        update(NodeTask)
        .where(NodeTask.id == task_id)
        .values(
            status=status,
            attempts=NodeTask.attempts + 1,
            dispatched_at=func.coalesce(NodeTask.dispatched_at, parse_iso(started_at)),
            completed_at=parse_iso(finished_at) or func.clock_timestamp(),
            output=output or {},
            error_type=error_type,
            error_message=bounded(error_message),
        )
        .returning(NodeTask.allocation_id)
    )
    rows = [
        {
            "node_task_id": task_id,
            "allocation_id": allocation_id,
            "phase": p.phase[:64],
            "status": p.status[:16],
            "message": bounded(p.message),
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
