"""The read-model writes every node lifecycle job shares (onboarding, decommission): a job row
with its current stage, status and failure classification, an append-only stage-event table, and
domain events (docs/lifecycles/onboarding.md#monitoring,
docs/lifecycles/decommission.md#monitoring). Each job kind describes its tables once (`JobTables`)
and adds only what is its own (its state columns)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from typing import Any, Protocol

from sqlalchemy import func, insert, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.lifecycle import JobStatus
from schema.lifecycle_tables import LifecycleTables
from schema.models import DomainEvent

MAX_SNIPPET = 500  # a diagnostic snippet is bounded (§4.12)
CLOSED = (JobStatus.COMPLETED, JobStatus.RECONCILED, JobStatus.CANCELLED)


def bounded(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= MAX_SNIPPET else text[: MAX_SNIPPET - 1] + "…"


class ProgressFields(Protocol):
    """What every job kind's ProgressRecord carries besides its own id and state."""

    status: str
    stage: str
    attempt: int
    event_status: str | None
    message: str
    details: dict[str, Any]
    failure_class: str | None
    error_code: str | None
    recommended_action: str | None
    clear_error: bool
    workflow_run_id: str | None
    domain_event: str | None


@dataclass(frozen=True)
class JobTables(LifecycleTables):
    """A job kind's tables (schema.lifecycle_tables) with the writes every job kind shares."""

    @classmethod
    def of(cls, tables: LifecycleTables) -> JobTables:
        return cls(**{f.name: getattr(tables, f.name) for f in fields(LifecycleTables)})

    async def update_job(
        self, session: AsyncSession, job_id: uuid.UUID, values: dict[str, Any]
    ) -> None:
        await session.execute(update(self.job).where(self.job_id == job_id).values(values))

    async def add_event(
        self,
        session: AsyncSession,
        job_id: uuid.UUID,
        *,
        stage: str,
        attempt: int,
        status: str,
        message: str = "",
        details: dict[str, Any] | None = None,
    ) -> None:
        await session.execute(
            insert(self.event).values(
                {
                    "id": uuid.uuid4(),
                    self.event_job_column: job_id,
                    "stage": stage,
                    "attempt": attempt,
                    "status": status,
                    "message": bounded(message) or None,
                    "details": details or {},
                }
            )
        )

    async def stage_started(
        self, session: AsyncSession, job_id: uuid.UUID, stage: str, attempt: int
    ) -> None:
        await self.update_job(
            session,
            job_id,
            {
                "current_stage": stage,
                "current_attempt": attempt,
                "updated_at": func.clock_timestamp(),
            },
        )
        await self.add_event(session, job_id, stage=stage, attempt=attempt, status="started")

    def status_values(
        self,
        *,
        status: str,
        stage: str,
        attempt: int,
        workflow_run_id: str | None,
        clear_error: bool,
        failure_class: str | None,
        error_code: str | None,
        message: str,
        details: dict[str, Any],
        recommended_action: str | None,
    ) -> dict[str, Any]:
        """The job row's new values for one of the workflow's own status writes."""
        values: dict[str, Any] = {
            "status": status,
            "current_stage": stage,
            "current_attempt": attempt,
            "updated_at": func.clock_timestamp(),
        }
        if workflow_run_id is not None:
            values["workflow_run_id"] = workflow_run_id
            values["started_at"] = func.coalesce(self.job.started_at, func.clock_timestamp())
        if clear_error:
            values.update(
                failure_class=None,
                error_code=None,
                error_message=None,
                error_details={},
                recommended_action=None,
            )
        if failure_class is not None or error_code is not None:
            values.update(
                failure_class=failure_class,
                error_code=error_code,
                error_message=bounded(message),
                error_details=details,
                recommended_action=recommended_action,
            )
        if status in CLOSED:
            values["completed_at"] = func.clock_timestamp()
            # A closed job takes no operator action (docs/lifecycles/decommission.md#actions): a
            # cancelled one keeps the failure it was cancelled from, but not that failure's
            # recommendation (a rerun is a new request now).
            values["recommended_action"] = None
        return values

    async def domain_event(
        self, session: AsyncSession, kind: str, job_id: str, payload: dict[str, Any]
    ) -> None:
        await session.execute(
            insert(DomainEvent).values(
                type=kind, subject_type=self.subject_type, subject_id=job_id, payload=payload
            )
        )

    async def stage_finished(
        self,
        session: AsyncSession,
        job_id: uuid.UUID,
        stage: str,
        attempt: int,
        *,
        status: str,
        columns: dict[str, Any],
        message: str = "",
        details: dict[str, Any] | None = None,
    ) -> None:
        """A stage activity's own outcome: the job row's state columns and the stage event."""
        await self.update_job(session, job_id, {"updated_at": func.clock_timestamp(), **columns})
        await self.add_event(
            session,
            job_id,
            stage=stage,
            attempt=attempt,
            status=status,
            message=message,
            details=details,
        )

    async def record_progress(
        self,
        session: AsyncSession,
        job_id: uuid.UUID,
        record: ProgressFields,
        *,
        columns: dict[str, Any],
        domain_payload: dict[str, Any],
    ) -> None:
        """The workflow's own write: job status and classification (plus the job kind's state
        `columns`), an optional stage event and an optional domain event, in one transaction."""
        values = self.status_values(
            status=record.status,
            stage=record.stage,
            attempt=record.attempt,
            workflow_run_id=record.workflow_run_id,
            clear_error=record.clear_error,
            failure_class=record.failure_class,
            error_code=record.error_code,
            message=record.message,
            details=record.details,
            recommended_action=record.recommended_action,
        )
        await self.update_job(session, job_id, values | columns)
        if record.event_status is not None:
            await self.add_event(
                session,
                job_id,
                stage=record.stage,
                attempt=record.attempt,
                status=record.event_status,
                message=record.message,
                details=record.details,
            )
        if record.domain_event is not None:
            await self.domain_event(
                session,
                record.domain_event,
                str(job_id),
                {
                    "status": record.status,
                    "stage": record.stage,
                    "failure_class": record.failure_class,
                    "error_code": record.error_code,
                    **domain_payload,
                },
            )
