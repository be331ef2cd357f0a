"""Node decommission use cases behind the admin controller (docs/lifecycles/decommission.md;
docs/lifecycles/decommission.md#job-states, docs/lifecycles/decommission.md#actions), with their
request and response bodies.

Starting a decommission checks the request (422 with field errors for invalid combinations:
erase on soft_reset, an unknown storage scope, remove_maas_record outside full_decommission),
the node (404; 410 once deleted: a deleted identity is never reused; 409 when its state does not
allow the mode), and the live job for the node (one at a time, a partial unique index backs it):
the same request again answers the live job (200: a rerun never conflicts with the action
already in progress), a different one is 409 decommission_in_progress. Then the worker writes
the pending row and starts the workflow (the DECOMMISSION_SUBMIT operation) and the gateway
writes the audit row; if Temporal does not take the workflow the worker withdraws the row again,
and a 503 leaves nothing behind.

Operator actions (retry, resume, adopt, cancel, mark-manual-intervention) are the workflow's
`operator_action` update, audited with actor, role, reason, prior state and stage, requested
action, expected state and workflow id. `POST /nodes/{id}/resume` is the node-level resume of
docs/lifecycles/decommission.md#actions: it forwards to the node's live decommission, or re-issues
the drain of a node a retire put in draining (idempotent: a live drain is answered, not duplicated).
It never starts a decommission: a node in draining or removing that no live operation owns is
refused (`no_owning_operation`, audited) and the operator starts what they mean explicitly.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import exists, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from contracts.admin_operation import (
    DECOMMISSION_SUBMIT,
    NODE_LIFECYCLE_IN_PROGRESS,
    NODE_RETIRE,
    NODE_STATUS_CONFLICT,
    NodeActionInput,
    NodeActionResult,
)
from contracts.decommission import (
    DecommissionInput,
    DecommissionPolicy,
    Erase,
    Mode,
    OperatorAction,
    StorageScope,
    decommission_workflow_id,
)
from contracts.lifecycle_submissions import DecommissionRecorded, DecommissionSubmission
from contracts.node_drain import DrainStatus
from contracts.onboarding import LIVE_JOB_STATUSES, JobStatus
from contracts.states import LIVE_ALLOCATION_STATUSES, AllocationStatus, NodeStatus
from core.config import Settings
from gateway import audit
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import Principal
from gateway.errors import (
    ApiError,
    Conflict,
    FieldError,
    NotFound,
    unknown_query_value,
    unprocessable,
)
from gateway.lifecycle_jobs import (
    JobEventView,
    LifecycleJob,
    checked_reason,
    recent_events,
    run_operator_action,
)
from gateway.maas_sites import usable_profile
from gateway.pagination import newest_first_page
from gateway.schemas import Reason, Request
from gateway.temporal import TemporalOps
from schema.lifecycle_tables import DECOMMISSION_TABLES
from schema.models import Allocation, Node, NodeDecommission, NodeDrain, NodeMaasState

log = logging.getLogger("gateway.decommissions")
_LIVE = [s.value for s in LIVE_JOB_STATUSES]
# Node states each mode may start from. draining/removing: a lost owning operation is resumed
# (docs/lifecycles/node.md#who-moves-it guardrail), never left stranded.
_STARTABLE: dict[Mode, frozenset[str]] = {
    Mode.SOFT_RESET: frozenset({"active", "offline", "quarantined", "draining"}),
    Mode.REIMAGE: frozenset({"active", "offline", "quarantined", "draining"}),
    Mode.FULL_DECOMMISSION: frozenset(
        {"active", "offline", "quarantined", "draining", "retired", "removing"}
    ),
    Mode.STORAGE_CLEANUP: frozenset({"active", "offline", "quarantined"}),
}

# --- bodies ------------------------------------------------------------------------------------


class DecommissionCreate(Request):
    """docs/lifecycles/decommission.md#modes. `erase`: none | quick | secure | standard, or a
    boolean (true: MAAS's standard erase); `storage_cleanup`: none | local | weka | all, or a
    boolean (true: local)."""

    mode: str
    reason: Reason
    erase: bool | str = False
    storage_cleanup: bool | str = False
    remove_maas_record: bool = False
    force_release_allocations: bool = False
    # A profile of the node's MAAS site (docs/maas-sites.md#site-profiles): its policy governs the
    # MAAS stages. Absent: the profile the node was onboarded with, else the site's default.
    profile_id: uuid.UUID | None = None


class StorageCleanupCreate(Request):
    scope: str
    reason: Reason
    force_release_allocations: bool = False


class DecommissionCreated(msgspec.Struct, kw_only=True):
    decommission_id: uuid.UUID
    node_id: uuid.UUID
    mode: str
    status: str  # "started", or the live job's status when the same request is repeated
    workflow_id: str
    replayed: bool = False


class DecommissionView(msgspec.Struct, kw_only=True):
    """One row of node_decommissions (docs/lifecycles/decommission.md#monitoring; docs/console.md:
    workflow state, stage, attempt, failure class, last MAAS state, recommended next action)."""

    decommission_id: uuid.UUID
    node_id: uuid.UUID
    hostname: str | None
    site_id: uuid.UUID | None
    maas_system_id: str | None
    mode: str
    erase: str
    storage_cleanup: str
    remove_maas_record: bool
    force_release_allocations: bool
    reason: str | None
    status: str
    current_stage: str
    current_attempt: int
    failure_class: str | None
    error_code: str | None
    error_message: str | None
    error_details: dict[str, Any]
    recommended_action: str | None
    last_maas_status: str | None
    last_maas_power_state: str | None
    followups: list[dict[str, Any]]
    requested_by: str | None
    workflow_id: str
    workflow_run_id: str | None
    requested_at: Any
    started_at: Any
    completed_at: Any
    updated_at: Any


class DecommissionDetail(DecommissionView, kw_only=True):
    events: list[JobEventView]


class DecommissionList(msgspec.Struct, kw_only=True):
    items: list[DecommissionView]
    next_cursor: str | None = None


class ActionRequest(Request):
    reason: Reason


class ActionAnswer(msgspec.Struct, kw_only=True):
    decommission_id: uuid.UUID
    action: str
    accepted: bool
    prior_status: str
    prior_stage: str
    expected_status: str
    message: str


# --- field errors ------------------------------------------------------------------------------


def _erase(value: bool | str, errors: list[FieldError]) -> Erase:
    if isinstance(value, bool):
        return Erase.STANDARD if value else Erase.NONE
    try:
        return Erase(value)
    except ValueError:
        errors.append(
            FieldError(
                "erase", "invalid_erase", "erase must be none, quick, secure, standard or a bool"
            )
        )
        return Erase.NONE


def _scope(value: bool | str, key: str, errors: list[FieldError]) -> StorageScope:
    if isinstance(value, bool):
        return StorageScope.LOCAL if value else StorageScope.NONE
    try:
        return StorageScope(value)
    except ValueError:
        errors.append(
            FieldError(key, "invalid_storage_scope", f"{key} must be none, local, weka or all")
        )
        return StorageScope.NONE


@dataclass(frozen=True)
class Plan:
    mode: Mode
    erase: Erase
    scope: StorageScope
    remove_maas_record: bool
    force_release_allocations: bool
    reason: str
    profile_id: uuid.UUID | None = None


def plan_from(body: DecommissionCreate) -> Plan:
    """The request's combination, or 422 with a field error for each invalid part."""
    errors: list[FieldError] = []
    try:
        mode = Mode(body.mode)
    except ValueError:
        mode = Mode.SOFT_RESET
        errors.append(
            FieldError(
                "mode", "invalid_mode", "mode must be soft_reset, reimage or full_decommission"
            )
        )
    if mode == Mode.STORAGE_CLEANUP:
        errors.append(
            FieldError(
                "mode",
                "invalid_mode",
                "storage-only cleanup has its own route: POST /nodes/{id}/storage-cleanup",
            )
        )
    erase = _erase(body.erase, errors)
    scope = _scope(body.storage_cleanup, "storage_cleanup", errors)
    if mode == Mode.SOFT_RESET and erase != Erase.NONE:
        errors.append(
            FieldError(
                "erase",
                "erase_not_allowed",
                "soft_reset keeps the OS and MAAS state: erase applies to reimage and "
                "full_decommission only",
            )
        )
    if mode == Mode.FULL_DECOMMISSION and scope != StorageScope.NONE:
        errors.append(
            FieldError(
                "storage_cleanup",
                "storage_cleanup_not_allowed",
                "full_decommission releases (and erases) the machine: storage_cleanup applies "
                "to soft_reset and reimage",
            )
        )
    if mode != Mode.FULL_DECOMMISSION and body.remove_maas_record:
        errors.append(
            FieldError(
                "remove_maas_record",
                "remove_maas_record_not_allowed",
                "only full_decommission may remove the MAAS record",
            )
        )
    reason = body.reason.strip()
    if not reason:
        errors.append(FieldError("reason", "blank_reason", "reason must not be blank"))
    if errors:
        raise unprocessable(errors)
    return Plan(
        mode,
        erase,
        scope,
        body.remove_maas_record,
        body.force_release_allocations or mode == Mode.FULL_DECOMMISSION,
        reason,
        body.profile_id,
    )


def storage_plan(body: StorageCleanupCreate) -> Plan:
    errors: list[FieldError] = []
    scope = _scope(body.scope, "scope", errors)
    if not errors and scope == StorageScope.NONE:
        errors.append(
            FieldError("scope", "invalid_storage_scope", "scope must be local, weka or all")
        )
    reason = body.reason.strip()
    if not reason:
        errors.append(FieldError("reason", "blank_reason", "reason must not be blank"))
    if errors:
        raise unprocessable(errors)
    return Plan(
        Mode.STORAGE_CLEANUP,
        Erase.NONE,
        scope,
        False,
        body.force_release_allocations,
        reason,
    )


def policy_from(settings: Settings) -> DecommissionPolicy:
    return DecommissionPolicy(
        node_schedule_to_start_seconds=settings.node_schedule_to_start_seconds,
        node_heartbeat_timeout_seconds=max(settings.host_heartbeat_timeout_seconds, 10.0),
    )


# --- start -------------------------------------------------------------------------------------


def _same(row: NodeDecommission, plan: Plan) -> bool:
    return (
        row.mode == plan.mode.value
        and row.erase == plan.erase.value
        and row.storage_cleanup == plan.scope.value
        and row.remove_maas_record == plan.remove_maas_record
    )


async def _live_job(db: AsyncSession, node_id: uuid.UUID) -> NodeDecommission | None:
    return await db.scalar(
        select(NodeDecommission).where(
            NodeDecommission.node_id == node_id, NodeDecommission.status.in_(_LIVE)
        )
    )


def _created(row: NodeDecommission, *, replayed: bool) -> DecommissionCreated:
    return DecommissionCreated(
        decommission_id=row.decommission_id,
        node_id=row.node_id,
        mode=row.mode,
        status=row.status if replayed else "started",
        workflow_id=row.workflow_id,
        replayed=replayed,
    )


@dataclass(frozen=True)
class Started:
    body: DecommissionCreated
    replayed: bool


async def start(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    principal: Principal,
    node_id: uuid.UUID,
    plan: Plan,
) -> Started:
    node = await db.get(Node, node_id)
    if node is None:
        raise NotFound("node not found")
    if node.status == NodeStatus.DELETED:
        raise ApiError(
            "the node was deleted by a full decommission; its identity cannot be reused "
            "(re-onboard the machine as a new node)",
            code="node_deleted",
            status_code=410,
        )
    if node.protected:
        raise Conflict(
            f"the node is protected ({node.protected_reason or 'no reason given'}); no "
            "decommission may start until an operator unprotects it",
            code="node_protected",
            details={"protected_reason": node.protected_reason},
        )
    live = await _live_job(db, node_id)
    if live is not None:
        if _same(live, plan):
            answer = _created(live, replayed=True)
            await db.rollback()
            return Started(answer, replayed=True)
        raise Conflict(
            f"a {live.mode} decommission of this node is already {live.status}",
            code="decommission_in_progress",
            details={"decommission_id": str(live.decommission_id), "mode": live.mode},
        )
    if node.status not in _STARTABLE[plan.mode]:
        raise Conflict(
            f"a node in {node.status} cannot start a {plan.mode.value}",
            code="node_not_decommissionable",
            details={"node_status": node.status, "mode": plan.mode.value},
        )
    binding = await db.get(NodeMaasState, node_id)
    if plan.mode == Mode.REIMAGE and binding is None:
        raise Conflict(
            "reimage needs a MAAS-managed node (this one has no MAAS binding)",
            code="node_not_maas_managed",
        )
    if plan.profile_id is not None:
        # An active profile of the node's MAAS site (a node without one has none to name).
        site_id = binding.site_id if binding is not None else None
        _, problem = await usable_profile(db, site_id, plan.profile_id)
        if problem is not None:
            raise unprocessable([problem])
    if plan.mode != Mode.FULL_DECOMMISSION and not plan.force_release_allocations:
        held = await db.scalar(
            select(exists().where(Allocation.node_id == node_id, Allocation.status.in_(
                [s.value for s in LIVE_ALLOCATION_STATUSES - {AllocationStatus.RELEASING}]
            )))
        )  # fmt: skip
        if held:
            raise Conflict(
                "live allocations hold this node; release them first or set "
                "force_release_allocations",
                code="node_has_allocations",
            )
    prior_node_status, hostname = node.status, node.hostname
    await db.close()  # never hold a database connection across a Temporal call
    decommission_id = uuid.uuid4()
    workflow_id = decommission_workflow_id(str(decommission_id))
    arg = DecommissionInput(
        decommission_id=str(decommission_id),
        node_id=str(node_id),
        mode=plan.mode.value,
        erase=plan.erase.value,
        storage_cleanup=plan.scope.value,
        remove_maas_record=plan.remove_maas_record,
        force_release_allocations=plan.force_release_allocations,
        reason=plan.reason,
        requested_by=principal.name,
        policy=policy_from(settings),
        profile_id=str(plan.profile_id) if plan.profile_id is not None else None,
    )
    # The worker writes the pending row and starts the workflow, together.
    submitted = await run_admin_operation(
        temporal,
        settings.control_plane_task_queue,
        DECOMMISSION_SUBMIT,
        DecommissionSubmission(
            start=arg,
            hostname=hostname,
            requested_by_token_id=str(principal.token_id) if principal.token_id else None,
        ),
        key=str(decommission_id),
        result_type=DecommissionRecorded,
    )
    if not submitted.recorded:
        raise Conflict(
            "another decommission of this node was submitted at the same time",
            code="decommission_in_progress",
        )
    audit.record_by(
        db,
        principal,
        action=f"node.decommission.{plan.mode.value}",
        target_type="node",
        target_id=str(node_id),
        reason=plan.reason,
        prior_state=prior_node_status,
        expected_state=_expected_node_state(plan.mode),
        workflow_ids=[workflow_id],
        details={
            "decommission_id": str(decommission_id),
            "mode": plan.mode.value,
            "erase": plan.erase.value,
            "storage_cleanup": plan.scope.value,
            "remove_maas_record": plan.remove_maas_record,
            "force_release_allocations": plan.force_release_allocations,
            "profile_id": str(plan.profile_id) if plan.profile_id is not None else None,
            "actor_role": principal.role,
        },
    )
    await db.commit()
    return Started(
        DecommissionCreated(
            decommission_id=decommission_id,
            node_id=node_id,
            mode=plan.mode.value,
            status="started",
            workflow_id=workflow_id,
            replayed=False,
        ),
        replayed=False,
    )


def _expected_node_state(mode: Mode) -> str:
    return "deleted" if mode == Mode.FULL_DECOMMISSION else "active"


# --- reads -------------------------------------------------------------------------------------


def _fields(row: NodeDecommission) -> dict[str, Any]:
    return {
        "decommission_id": row.decommission_id,
        "node_id": row.node_id,
        "hostname": row.hostname,
        "site_id": row.site_id,
        "maas_system_id": row.maas_system_id,
        "mode": row.mode,
        "erase": row.erase,
        "storage_cleanup": row.storage_cleanup,
        "remove_maas_record": row.remove_maas_record,
        "force_release_allocations": row.force_release_allocations,
        "reason": row.reason,
        "status": row.status,
        "current_stage": row.current_stage,
        "current_attempt": row.current_attempt,
        "failure_class": row.failure_class,
        "error_code": row.error_code,
        "error_message": row.error_message,
        "error_details": dict(row.error_details or {}),
        "recommended_action": row.recommended_action,
        "last_maas_status": row.last_maas_status,
        "last_maas_power_state": row.last_maas_power_state,
        "followups": list(row.followups or []),
        "requested_by": row.requested_by,
        "workflow_id": row.workflow_id,
        "workflow_run_id": row.workflow_run_id,
        "requested_at": row.requested_at,
        "started_at": row.started_at,
        "completed_at": row.completed_at,
        "updated_at": row.updated_at,
    }


async def load(db: AsyncSession, decommission_id: uuid.UUID) -> NodeDecommission:
    row = await db.get(NodeDecommission, decommission_id)
    if row is None:
        raise NotFound("decommission not found")
    return row


async def detail(db: AsyncSession, decommission_id: uuid.UUID) -> DecommissionDetail:
    row = await load(db, decommission_id)
    return DecommissionDetail(
        **_fields(row), events=await recent_events(db, DECOMMISSION_TABLES, decommission_id)
    )


async def list_rows(
    db: AsyncSession,
    *,
    node_id: uuid.UUID | None,
    status: str | None,
    mode: str | None,
    limit: int,
    cursor: str | None,
) -> DecommissionList:
    statuses = [s.value for s in JobStatus]
    modes = [m.value for m in Mode]
    filters: list[ColumnElement[bool]] = []
    if status is not None:
        if status == "failed":  # docs/lifecycles/decommission.md#monitoring ?status=failed: both
            # failed states
            filters.append(
                NodeDecommission.status.in_(
                    [JobStatus.FAILED_RETRYABLE.value, JobStatus.FAILED_MANUAL_INTERVENTION.value]
                )
            )
        elif status in statuses:
            filters.append(NodeDecommission.status == status)
        else:
            raise unknown_query_value("status", [*statuses, "failed"])
    if mode is not None:
        if mode not in modes:
            raise unknown_query_value("mode", modes)
        filters.append(NodeDecommission.mode == mode)
    if node_id is not None:
        filters.append(NodeDecommission.node_id == node_id)
    rows, next_cursor = await newest_first_page(
        db,
        select(NodeDecommission).where(*filters),
        created=NodeDecommission.requested_at,
        row_id=NodeDecommission.decommission_id,
        limit=limit,
        cursor=cursor,
    )
    return DecommissionList(
        items=[DecommissionView(**_fields(r)) for r in rows], next_cursor=next_cursor
    )


# --- operator actions --------------------------------------------------------------------------


async def operator_action(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    decommission_id: uuid.UUID,
    action: OperatorAction,
    reason: str,
    *,
    details: dict[str, Any] | None = None,
) -> ActionAnswer:
    reason = checked_reason(reason)
    row = await load(db, decommission_id)
    job = LifecycleJob(
        kind="decommission",
        job_id=decommission_id,
        workflow_id=row.workflow_id,
        status=row.status,
        stage=row.current_stage,
        version=row.updated_at.isoformat() if row.updated_at else str(row.current_attempt),
        audit_action_prefix="node.decommission",
        audit_target_type="node_decommission",
        closed_code="decommission_closed",
        audit_details={"node_id": str(row.node_id)},
    )
    await db.close()  # never hold a database connection across a Temporal call
    result = await run_operator_action(
        db, temporal, principal, job, action.value, reason, details=details
    )
    return ActionAnswer(
        decommission_id=decommission_id,
        action=result.action,
        accepted=result.accepted,
        prior_status=result.prior_status,
        prior_stage=result.prior_stage,
        expected_status=result.expected_status,
        message=result.message,
    )


class NodeResumed(msgspec.Struct, kw_only=True):
    """docs/lifecycles/decommission.md#actions resume of a node whose owner is its drain lifecycle
    (retire): `node.drain` re-issued, or the live drain named (nothing duplicated)."""

    node_id: uuid.UUID
    action: str  # "resume"
    accepted: bool
    owner: str  # "drain"
    drain_id: uuid.UUID
    workflow_id: str
    prior_status: str
    status: str
    requeued: bool  # False: the drain was live and answered; True: its workflow was re-issued
    message: str


async def _drain_running(temporal: TemporalOps, workflow_id: str) -> bool:
    async def call(client: Client) -> bool:
        try:
            described = await client.get_workflow_handle(workflow_id).describe(
                rpc_timeout=temporal.rpc_timeout
            )
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return described.status == WorkflowExecutionStatus.RUNNING

    return await temporal.read(call)


async def _resume_drain(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    principal: Principal,
    node: Node,
    drain: NodeDrain,
    reason: str,
) -> NodeResumed:
    """Re-issue the node's drain (its workflow started with USE_EXISTING by the retire
    operation: a running drain is answered, a lost one is started again). Nothing destructive:
    no decommission, no MAAS call, no allocation released."""
    node_id, drain_id, workflow_id = node.id, drain.drain_id, drain.workflow_id
    prior = node.status
    await db.close()  # never hold a database connection across a Temporal call
    live = await _drain_running(temporal, workflow_id)
    result = await run_admin_operation(
        temporal,
        settings.control_plane_task_queue,
        NODE_RETIRE,
        NodeActionInput(actor=actor(principal, reason), node_id=str(node_id)),
        key=str(node_id),
        result_type=NodeActionResult,
        statuses={NODE_STATUS_CONFLICT: 409, NODE_LIFECYCLE_IN_PROGRESS: 409},
    )
    message = (
        f"resume: drain {drain_id} is live; nothing was requeued"
        if live
        else f"resume: node.drain re-issued (drain {drain_id}, workflow {workflow_id})"
    )
    audit.record_by(
        db,
        principal,
        action="node.resume",
        target_type="node",
        target_id=str(node_id),
        reason=reason,
        prior_state=prior,
        expected_state=NodeStatus.RETIRED.value,
        workflow_ids=[workflow_id],
        details={
            "owner": "drain",
            "drain_id": str(drain_id),
            "requeued": not live,
            "actor_role": principal.role,
            "message": message,
        },
    )
    await db.commit()
    return NodeResumed(
        node_id=node_id,
        action="resume",
        accepted=True,
        owner="drain",
        drain_id=uuid.UUID(result.drain_id) if result.drain_id else drain_id,
        workflow_id=workflow_id,
        prior_status=prior,
        status=result.status,
        requeued=not live,
        message=message,
    )


async def resume_node(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    principal: Principal,
    node_id: uuid.UUID,
    reason: str,
) -> ActionAnswer | NodeResumed:
    """docs/lifecycles/decommission.md#actions for a node in draining or removing: resume goes to
    the operation that owns the state, and only to it. A live decommission answers resume (a no-op
    while its task is live, a fresh task once it failed); a retire's drain is re-issued
    (`node.drain`, idempotent). Resume never starts a decommission: without an owner to resume, it
    is refused (`no_owning_operation`), and the operator starts what they mean explicitly."""
    reason = checked_reason(reason)
    node = await db.get(Node, node_id)
    if node is None:
        raise NotFound("node not found")
    if node.status not in (NodeStatus.DRAINING, NodeStatus.REMOVING):
        raise Conflict(
            f"resume applies to a node in draining or removing, not {node.status}",
            code="node_not_in_progress",
            details={"node_status": node.status},
        )
    live = await _live_job(db, node_id)
    if live is not None:
        return await operator_action(
            db, temporal, principal, live.decommission_id, OperatorAction.RESUME, reason
        )
    if node.status == NodeStatus.DRAINING:
        drain = await db.scalar(
            select(NodeDrain).where(
                NodeDrain.node_id == node_id, NodeDrain.status == DrainStatus.RUNNING.value
            )
        )
        if drain is not None:
            return await _resume_drain(db, temporal, settings, principal, node, drain, reason)
    last = await db.scalar(
        select(NodeDecommission)
        .where(NodeDecommission.node_id == node_id)
        .order_by(NodeDecommission.requested_at.desc())
        .limit(1)
    )
    details: dict[str, Any] = {"node_status": node.status}
    if last is not None:
        details |= {
            "last_decommission_id": str(last.decommission_id),
            "last_decommission_status": last.status,
            "last_decommission_mode": last.mode,
        }
    status = node.status
    audit.record_by(
        db,
        principal,
        action="node.resume",
        target_type="node",
        target_id=str(node_id),
        reason=reason,
        prior_state=status,
        expected_state=status,
        details={**details, "accepted": False, "refused": "no_owning_operation"},
    )
    await db.commit()
    raise Conflict(
        f"the node is {status} but no live operation owns it: resume does not start a new "
        "decommission; start the one you mean (POST /nodes/{id}/decommission) after checking "
        "the node",
        code="no_owning_operation",
        details=details,
    )
