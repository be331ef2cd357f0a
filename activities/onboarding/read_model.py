"""node_onboardings / node_onboarding_events / domain_events writes (seed 003 §4.2.1, §4.12).

Two writers: each stage activity records its own `started` and `succeeded`/`failed` events
(`stage_started`, `stage_finished`), and the workflow records what only it knows (job status,
failure classification, operator actions, completion) through the `record_progress` local
activity. Both only ever move the row forward; nothing here reads Temporal."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, insert, update
from sqlalchemy.ext.asyncio import AsyncSession

from schema.models import DomainEvent, NodeOnboarding, NodeOnboardingEvent
from workflows.onboarding_contract import JobStatus, OnboardState, ProgressRecord

MAX_SNIPPET = 500  # a diagnostic snippet is bounded (§4.12)


def bounded(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= MAX_SNIPPET else text[: MAX_SNIPPET - 1] + "…"


def state_columns(state: OnboardState) -> dict[str, Any]:
    """The job row's columns that mirror the run's state (§4.5)."""
    values: dict[str, Any] = {
        "maas_system_id": state.system_id,
        "boss_disk_id": state.boss_disk_id,
        "deploy_attempts": state.deploy_attempts,
        "last_maas_status": state.observed.maas_status,
        "last_maas_power_state": state.observed.power_state,
        "last_maas_ips": list(state.observed.ip_addresses),
    }
    if state.cloud_init_version is not None:
        values["cloud_init_version"] = state.cloud_init_version
    return values


async def add_event(
    session: AsyncSession,
    onboarding_id: uuid.UUID,
    *,
    stage: str,
    attempt: int,
    status: str,
    message: str = "",
    details: dict[str, Any] | None = None,
) -> None:
    await session.execute(
        insert(NodeOnboardingEvent).values(
            id=uuid.uuid4(),
            onboarding_id=onboarding_id,
            stage=stage,
            attempt=attempt,
            status=status,
            message=bounded(message) or None,
            details=details or {},
        )
    )


async def stage_started(
    session: AsyncSession, onboarding_id: uuid.UUID, stage: str, attempt: int
) -> None:
    await session.execute(
        update(NodeOnboarding)
        .where(NodeOnboarding.onboarding_id == onboarding_id)
        .values(current_stage=stage, current_attempt=attempt, updated_at=func.clock_timestamp())
    )
    await add_event(session, onboarding_id, stage=stage, attempt=attempt, status="started")


async def stage_finished(
    session: AsyncSession,
    onboarding_id: uuid.UUID,
    stage: str,
    attempt: int,
    *,
    status: str,
    state: OnboardState | None,
    message: str = "",
    details: dict[str, Any] | None = None,
) -> None:
    values: dict[str, Any] = {"updated_at": func.clock_timestamp()}
    if state is not None:
        values.update(state_columns(state))
    await session.execute(
        update(NodeOnboarding).where(NodeOnboarding.onboarding_id == onboarding_id).values(values)
    )
    await add_event(
        session,
        onboarding_id,
        stage=stage,
        attempt=attempt,
        status=status,
        message=message,
        details=details,
    )


async def record_progress(session: AsyncSession, record: ProgressRecord) -> None:
    """The workflow's own write: job status and classification, plus an optional event and
    domain event, in one transaction."""
    onboarding_id = uuid.UUID(record.onboarding_id)
    values: dict[str, Any] = {
        "status": record.status,
        "current_stage": record.stage,
        "current_attempt": record.attempt,
        "updated_at": func.clock_timestamp(),
    }
    if record.state is not None:
        values.update(state_columns(record.state))
    if record.workflow_run_id is not None:
        values["workflow_run_id"] = record.workflow_run_id
        values["started_at"] = func.coalesce(NodeOnboarding.started_at, func.clock_timestamp())
    if record.clear_error:
        values.update(
            failure_class=None,
            error_code=None,
            error_message=None,
            error_details={},
            recommended_action=None,
        )
    if record.failure_class is not None or record.error_code is not None:
        values.update(
            failure_class=record.failure_class,
            error_code=record.error_code,
            error_message=bounded(record.message),
            error_details=record.details,
            recommended_action=record.recommended_action,
        )
    if record.status in (JobStatus.COMPLETED, JobStatus.RECONCILED, JobStatus.CANCELLED):
        values["completed_at"] = func.clock_timestamp()
    await session.execute(
        update(NodeOnboarding).where(NodeOnboarding.onboarding_id == onboarding_id).values(values)
    )
    if record.event_status is not None:
        await add_event(
            session,
            onboarding_id,
            stage=record.stage,
            attempt=record.attempt,
            status=record.event_status,
            message=record.message,
            details=record.details,
        )
    if record.domain_event is not None:
        await session.execute(
            insert(DomainEvent).values(
                type=record.domain_event,
                subject_type="node_onboarding",
                subject_id=record.onboarding_id,
                payload={
                    "status": record.status,
                    "stage": record.stage,
                    "failure_class": record.failure_class,
                    "error_code": record.error_code,
                    "node_id": record.details.get("node_id"),
                },
            )
        )
