"""node_decommissions / node_decommission_events / domain_events writes
(docs/lifecycles/decommission.md#monitoring), and the node_tasks rows of the host tasks a
decommission dispatches.

Two writers, as for onboarding: each control-plane stage activity records its own `started` and
`succeeded`/`failed`/`skipped` events, and the workflow records what only it knows (job status,
failure classification, operator actions, host-task stage events, completion) through the
`record_progress` local activity. Nothing here reads Temporal."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.lifecycle_read_model import JobTables
from activities.node_task_log import record_task_outcome
from contracts.decommission import DecommissionState, NodeTaskRecord, ProgressRecord
from contracts.host_tasks import HostPhase
from contracts.states import NodeTaskStatus
from schema.lifecycle_tables import DECOMMISSION_TABLES
from schema.models import (
    NodeTask,
)

DECOMMISSION = JobTables.of(DECOMMISSION_TABLES)
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
    """docs/lifecycles/decommission.md#actions: before a host task is (re)queued, earlier rows of
    the same kind on the node that are still queued or dispatched are stale (their workflow no
    longer waits on them, or the lease expired): they are closed as failed/`superseded`, so the
    timeline never shows two live drains. Answers how many were closed."""
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
    await record_task_outcome(
        session,
        task_id,
        record.status,
        started_at=record.started_at,
        finished_at=record.finished_at,
        phases=[
            HostPhase(
                phase=str(p.get("phase", "")),
                status=str(p.get("status", "")),
                at=str(p.get("at", "")),
                message=str(p.get("message", "")),
            )
            for p in record.phases
        ],
        output=record.output,
        error_type=record.error_type,
        error_message=record.error_message,
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
