"""node_decommissions / node_decommission_events / domain_events writes (seed 003 §5.7), and the
node_tasks rows of the host tasks a decommission dispatches.

Two writers, as for onboarding: each control-plane stage activity records its own `started` and
`succeeded`/`failed`/`skipped` events, and the workflow records what only it knows (job status,
failure classification, operator actions, host-task stage events, completion) through the
`record_progress` local activity. Nothing here reads Temporal."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.lifecycle_read_model import JobTables, bounded
from core.timestamps import parse_iso
from schema.models import (
    NodeDecommission,
    NodeDecommissionEvent,
    NodeTask,
    NodeTaskEvent,
)
from schema.states import NodeTaskStatus
from workflows.decommission_contract import DecommissionState, NodeTaskRecord, ProgressRecord

DECOMMISSION = JobTables(
    job=NodeDecommission,
    job_id=NodeDecommission.decommission_id,
    event=NodeDecommissionEvent,
    event_job_column="decommission_id",
    subject_type="node_decommission",
)
add_event = DECOMMISSION.add_event
stage_started = DECOMMISSION.stage_started


def state_columns(state: DecommissionState) -> dict[str, Any]:
    values: dict[str, Any] = {
        "last_maas_status": state.maas_status,
        "last_maas_power_state": state.power_state,
        "followups": list(state.followups),
    }
    if state.system_id is not None:
        values["maas_system_id"] = state.system_id
    if state.site_id is not None:
        values["site_id"] = uuid.UUID(state.site_id)
    if state.hostname is not None:
        values["hostname"] = state.hostname
    return values


async def stage_finished(
    session: AsyncSession,
    decommission_id: uuid.UUID,
    stage: str,
    attempt: int,
    *,
    status: str,
    state: DecommissionState | None,
    message: str = "",
    details: dict[str, Any] | None = None,
    maas: tuple[str | None, str | None] | None = None,
) -> None:
    columns = state_columns(state) if state is not None else {}
    if maas is not None:
        columns.update(last_maas_status=maas[0], last_maas_power_state=maas[1])
    await DECOMMISSION.stage_finished(
        session,
        decommission_id,
        stage,
        attempt,
        status=status,
        columns=columns,
        message=message,
        details=details,
    )


async def record_progress(session: AsyncSession, record: ProgressRecord) -> None:
    columns = state_columns(record.state) if record.state is not None else {}
    if record.failure_class is not None or record.error_code is not None:
        # The failing stage recorded what it last saw in MAAS; the workflow's copy of the
        # state predates the stage and would overwrite it with stale values.
        columns.pop("last_maas_status", None)
        columns.pop("last_maas_power_state", None)
    await DECOMMISSION.record_progress(
        session,
        uuid.UUID(record.decommission_id),
        record,
        columns=columns,
        domain_payload={
            "node_id": record.details.get("node_id"),
            "mode": record.details.get("mode"),
        },
    )


# --------------------------------------------------------------------------- node tasks


async def supersede_stale_tasks(
    session: AsyncSession, node_id: uuid.UUID, kind: str, keep: uuid.UUID
) -> int:
    """Seed 004 §8: before a host task is (re)queued, earlier rows of the same kind on the node
    that are still queued or dispatched are stale (their workflow no longer waits on them, or
    the lease expired): they are closed as failed/`superseded`, so the timeline never shows two
    live drains. Answers how many were closed."""
    closed = await session.scalars(
        update(NodeTask)
        .where(
            NodeTask.node_id == node_id,
            NodeTask.kind == kind,
            NodeTask.id != keep,
            NodeTask.status.in_([NodeTaskStatus.QUEUED.value, NodeTaskStatus.DISPATCHED.value]),
        )
        .values(
            status=NodeTaskStatus.FAILED.value,
            completed_at=func.clock_timestamp(),
            error_type="superseded",
            error_message="stale: requeued by a decommission resume",
        )
        .returning(NodeTask.id)
    )
    return len(list(closed))


async def record_node_task(session: AsyncSession, record: NodeTaskRecord) -> None:
    task_id = uuid.UUID(record.task_id)
    node_id = uuid.UUID(record.node_id)
    if record.status == NodeTaskStatus.QUEUED.value:
        await supersede_stale_tasks(session, node_id, record.kind, task_id)
        await session.execute(
            pg_insert(NodeTask)
            .values(
                id=task_id,
                node_id=node_id,
                allocation_id=None,
                kind=record.kind,
                status=NodeTaskStatus.QUEUED.value,
                workflow_id=record.workflow_id,
            )
            .on_conflict_do_nothing(index_elements=[NodeTask.id])
        )
        return
    started = parse_iso(record.started_at)
    finished = parse_iso(record.finished_at)
    await session.execute(
        update(NodeTask)
        .where(NodeTask.id == task_id)
        .values(
            status=record.status,
            attempts=NodeTask.attempts + 1,
            dispatched_at=func.coalesce(NodeTask.dispatched_at, started),
            completed_at=finished if finished is not None else func.clock_timestamp(),
            output=record.output,
            error_type=record.error_type,
            error_message=bounded(record.error_message),
        )
    )
    rows = [
        {
            "node_task_id": task_id,
            "allocation_id": None,
            "phase": str(p.get("phase", ""))[:64],
            "status": str(p.get("status", ""))[:16],
            "message": bounded(str(p.get("message", ""))),
            "occurred_at": parse_iso(p.get("at")) or dt.datetime.now(dt.UTC),
        }
        for p in record.phases
    ]
    if rows:
        await session.execute(
            pg_insert(NodeTaskEvent)
            .values(rows)
            .on_conflict_do_nothing(constraint="node_task_events_once")
        )


async def live_task(session: AsyncSession, node_id: uuid.UUID, kind: str) -> NodeTask | None:
    return await session.scalar(
        select(NodeTask)
        .where(
            NodeTask.node_id == node_id,
            NodeTask.kind == kind,
            NodeTask.status.in_([NodeTaskStatus.QUEUED.value, NodeTaskStatus.DISPATCHED.value]),
        )
        .order_by(NodeTask.created_at.desc())
        .limit(1)
    )
