"""What the gateway does alike for every node lifecycle job (onboarding, decommission): show its
recent stage events, and send an operator action to the job's workflow as its `operator_action`
update, map the workflow's answer to HTTP and audit it (docs/lifecycles/onboarding.md#actions,
docs/lifecycles/onboarding.md#monitoring). The job modules describe their job (`LifecycleJob`,
`LifecycleTables`) and shape their own answers.

Idempotency: the update id is derived from the request (the idempotency key when given, else
the job's version and the reason), so Temporal answers a repeated request with the first
result instead of applying the action twice."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from contracts.lifecycle import (
    ACTION_NOT_ALLOWED,
    OPERATOR_ACTION_UPDATE,
    ActionResult,
    OperatorRequest,
)
from gateway import audit
from gateway.auth import Principal
from gateway.errors import ApiError, Conflict, InvalidRequest
from gateway.temporal import TemporalOps
from schema.lifecycle_tables import LifecycleTables

EVENTS_SHOWN = 50  # a job's detail shows its newest stage events


class JobEventView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    stage: str
    attempt: int
    status: str
    message: str | None
    details: dict[str, Any]
    occurred_at: dt.datetime


async def recent_events(
    db: AsyncSession, tables: LifecycleTables, job_id: uuid.UUID
) -> list[JobEventView]:
    """The job's newest stage events, newest first."""
    event = tables.event
    rows = await db.scalars(
        select(event)
        .where(getattr(event, tables.event_job_column) == job_id)
        .order_by(event.occurred_at.desc(), event.id.desc())
        .limit(EVENTS_SHOWN)
    )
    return [
        JobEventView(
            id=e.id,
            stage=e.stage,
            attempt=e.attempt,
            status=e.status,
            message=e.message,
            details=dict(e.details or {}),
            occurred_at=e.occurred_at,
        )
        for e in rows
    ]


@dataclass(frozen=True)
class LifecycleJob:
    """What the action path needs to know about one job, read before the Temporal call (no
    database connection is held across it)."""

    kind: str  # "onboarding" | "decommission": wording in errors
    job_id: uuid.UUID
    workflow_id: str
    status: str
    stage: str
    version: str  # changes whenever the job row does (its updated_at)
    audit_action_prefix: str  # "onboarding" | "node.decommission"
    audit_target_type: str
    closed_code: str  # 409 code once the workflow has ended
    not_started_code: str | None = None  # 409 code when no workflow exists yet (batch pending)
    audit_details: dict[str, Any] = field(default_factory=dict)


def update_id(action: str, key: str | None, version: str, reason: str) -> str:
    if key is not None:
        return f"{action}:{key}"
    digest = hashlib.sha256(reason.encode()).hexdigest()[:16]
    return f"{action}:{version}:{digest}"


def checked_reason(reason: str) -> str:
    reason = reason.strip()
    if not reason:
        raise InvalidRequest(
            "reason must not be blank",
            details={"errors": [{"key": "reason", "source": "body", "message": "blank"}]},
        )
    return reason


async def run_operator_action(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    job: LifecycleJob,
    action: str,
    reason: str,
    *,
    idempotency_key: str | None = None,
    details: dict[str, Any] | None = None,
) -> ActionResult:
    """Send the action, audit it (actor, role, reason, prior and expected state, workflow id,
    and the action's `details` where it has any) and commit the audit row; an action the
    workflow refuses (or that finds no workflow to take it) is audited too, `accepted: false`
    with the refusal. The caller has already closed its read of the job row."""
    details = dict(details or {})
    # Different details with the same reason are a different request, never the first's answer.
    said = reason + ("\n" + json.dumps(details, sort_keys=True) if details else "")
    request_id = update_id(action, idempotency_key, job.version, said)

    async def call(client: Client) -> ActionResult:
        result: ActionResult = await client.get_workflow_handle(job.workflow_id).execute_update(
            OPERATOR_ACTION_UPDATE,
            OperatorRequest(action=action, actor=principal.name, reason=reason, details=details),
            id=request_id,
            result_type=ActionResult,
            rpc_timeout=temporal.rpc_timeout,
        )
        return result

    state = {"status": job.status, "stage": job.stage, "action": action}

    async def audited(*, accepted: bool, expected_status: str, message: str) -> None:
        """Every action is audited, a refused one too (with what refused it)."""
        audit.record_by(
            db,
            principal,
            action=f"{job.audit_action_prefix}.{action}",
            target_type=job.audit_target_type,
            target_id=str(job.job_id),
            reason=reason,
            prior_state=job.status,
            expected_state=expected_status,
            workflow_ids=[job.workflow_id],
            details={
                **job.audit_details,
                "workflow_id": job.workflow_id,
                "actor_role": principal.role,
                "prior_stage": job.stage,
                "requested_action": action,
                "accepted": accepted,
                "message": message,
                "update_id": request_id,
                **({"request": details} if details else {}),
            },
        )
        await db.commit()

    try:
        result = await temporal.update(call)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.type == ACTION_NOT_ALLOWED:
            await audited(accepted=False, expected_status=job.status, message=cause.message)
            raise Conflict(cause.message, code=ACTION_NOT_ALLOWED, details=state) from None
        raise ApiError(
            f"the {job.kind} workflow refused the action unexpectedly",
            code="workflow_error",
            status_code=502,
            details={
                **state,
                "type": cause.type if isinstance(cause, ApplicationError) else "unknown",
            },
        ) from None
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        if job.not_started_code is not None:
            message = f"this {job.kind} has not started yet; act on it once it runs"
            await audited(accepted=False, expected_status=job.status, message=message)
            raise Conflict(message, code=job.not_started_code, details=state) from None
        message = f"this {job.kind}'s workflow has ended; it takes no more actions"
        await audited(accepted=False, expected_status=job.status, message=message)
        raise Conflict(message, code=job.closed_code, details=state) from None
    await audited(
        accepted=result.accepted, expected_status=result.expected_status, message=result.message
    )
    return result
