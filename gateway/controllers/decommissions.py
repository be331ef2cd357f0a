"""Admin routes for node decommission (docs/lifecycles/decommission.md;
docs/lifecycles/decommission.md#actions): start one of the four modes, read the job read model, and
the operator recovery actions (workflow updates)."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.decommission import Mode, OperatorAction
from contracts.onboarding import JobStatus
from gateway import decommissions
from gateway.auth import Principal, admin_guard
from gateway.decommissions import (
    ActionAnswer,
    ActionRequest,
    DecommissionCreate,
    DecommissionCreated,
    DecommissionDetail,
    DecommissionList,
    NodeResumed,
    StorageCleanupCreate,
)
from gateway.errors import NotFound
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.schemas import DiskDispositionRecord
from gateway.temporal import TemporalOps

_START_NOTES = (
    " 201 {decommission_id, node_id, mode, status: started, workflow_id}; the same request while "
    "its job is live answers that job (200, replayed: true). 404 unknown node, 410 node_deleted "
    "(its identity is never reused), 409 decommission_in_progress (another mode is live; "
    "details.decommission_id), node_not_decommissionable, node_not_maas_managed (reimage), "
    "node_has_allocations (set force_release_allocations). 422 field errors in "
    "error.details.errors. 503 temporal_unavailable leaves nothing behind. Audited."
)
_ACTION_NOTES = (
    " Answers the workflow's decision: 409 action_not_allowed when the job's state does not "
    "allow it, 409 decommission_closed once the workflow has ended. A repeated identical "
    "request gets the first answer. Audited as node.decommission.<action>."
)


# How each action is spelled in the URL, and what it does.
ACTION_PATHS: dict[str, OperatorAction] = {
    "retry": OperatorAction.RETRY_STAGE,
    "resume": OperatorAction.RESUME,
    "adopt": OperatorAction.ADOPT,
    "mark-manual-intervention": OperatorAction.MARK_MANUAL_INTERVENTION,
    "cancel": OperatorAction.CANCEL,
}
_ACTION_MEANINGS = (
    "retry: rerun the failed stage, then go on. resume: continue from the failed stage's "
    "checkpoint (a fresh host task); a no-op while the job runs. adopt: accept what MAAS, the "
    "node and its agent show now and go on; ends reconciled. Host work is observed again, "
    "never vouched for: a fresh validate_clean must pass, a reimage's agent enrollment is "
    "waited for again, and cleanup_storage and scrub_gpu are never adopted (retry them); a "
    "refused adopt stops the job with cannot_adopt. "
    "mark-manual-intervention: freeze automation until a human resolves it. cancel: stop (best "
    "effort) and compensate where possible; MAAS is not rolled back. Unknown action: 404."
)


class AdminDecommissionsController(Controller):
    path = "/api/v1/admin"
    guards = [admin_guard]
    tags = ["admin: decommission"]

    @post(
        "/nodes/{node_id:uuid}/decommission",
        status_code=201,
        summary="Decommission a node: soft_reset, reimage or full_decommission (starts "
        "NodeDecommissionWorkflow)",
        description="Body {mode, erase, storage_cleanup, remove_maas_record, "
        "force_release_allocations, reason}. erase (none|quick|secure|standard or bool) applies "
        "to reimage and full_decommission; storage_cleanup (none|local|weka|all or bool) to "
        "soft_reset and reimage; remove_maas_record (default false: MAAS keeps the record) to "
        "full_decommission." + _START_NOTES,
        responses=errors(400, 403, 404, 409, 410, 413, 422),
    )
    async def decommission(
        self,
        data: JSONBody[DecommissionCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        node_id: FromPath[uuid.UUID],
    ) -> Response[DecommissionCreated]:
        plan = decommissions.plan_from(data)
        started = await decommissions.start(
            db, temporal, runtime.settings, principal, node_id, plan
        )
        return Response(started.body, status_code=200 if started.replayed else 201)

    @post(
        "/nodes/{node_id:uuid}/storage-cleanup",
        status_code=201,
        summary="Storage-only cleanup between tenants: disable_node, "
        "force_release_allocations, cleanup_storage, validate_clean_node, enable_node",
        description="Body {scope: local|weka|all, force_release_allocations, reason}; an "
        "unknown scope is 422 invalid_storage_scope. The node takes no new placements while it "
        "runs; live allocations are released through their workflows with "
        "force_release_allocations, else the request is 409 node_has_allocations." + _START_NOTES,
        responses=errors(400, 403, 404, 409, 410, 413, 422),
    )
    async def storage_cleanup(
        self,
        data: JSONBody[StorageCleanupCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        node_id: FromPath[uuid.UUID],
    ) -> Response[DecommissionCreated]:
        plan = decommissions.storage_plan(data)
        started = await decommissions.start(
            db, temporal, runtime.settings, principal, node_id, plan
        )
        return Response(started.body, status_code=200 if started.replayed else 201)

    @post(
        "/nodes/{node_id:uuid}/resume",
        status_code=200,
        summary="Resume a node's lifecycle in draining or removing",
        description="Forwards resume to the node's live decommission (a no-op while its host "
        "task is live; a fresh task once it expired or failed); for a node a retire put in "
        "draining, re-issues its drain (node.drain; a live drain is answered, never duplicated: "
        "body {owner: drain, drain_id, requeued}). Never starts a decommission: 409 "
        "no_owning_operation when no live operation owns the node (details name its last "
        "decommission), 409 node_not_in_progress for any other node state." + _ACTION_NOTES,
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def resume_node(
        self,
        data: JSONBody[ActionRequest],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        node_id: FromPath[uuid.UUID],
    ) -> ActionAnswer | NodeResumed:
        return await decommissions.resume_node(
            db, temporal, runtime.settings, principal, node_id, data.reason
        )

    @get(
        "/decommissions",
        summary="Decommissions, newest first",
        description="Filters: node_id, status (a job state, or `failed` for both failed "
        "states; else 422 unknown_status), mode (else 422 unknown_mode). Pages with limit and "
        "cursor.",
        responses=errors(400, 403, 422),
    )
    async def list_decommissions(
        self,
        db: NamedDependency[AsyncSession],
        node_id: FromQuery[uuid.UUID | None] = None,
        status: Annotated[
            str | None, QueryParameter(schema_extra=one_of([*JobStatus, "failed"]))
        ] = None,
        mode: Annotated[str | None, QueryParameter(schema_extra=one_of(Mode))] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> DecommissionList:
        return await decommissions.list_rows(
            db, node_id=node_id, status=status, mode=mode, limit=limit, cursor=cursor
        )

    @get(
        "/decommissions/{decommission_id:uuid}",
        summary="One decommission: status, stage, error, recommended action and its 50 most "
        "recent stage events",
        responses=errors(403, 404),
    )
    async def get_decommission(
        self, db: NamedDependency[AsyncSession], decommission_id: FromPath[uuid.UUID]
    ) -> DecommissionDetail:
        return await decommissions.detail(db, decommission_id)

    @post(
        "/decommissions/{decommission_id:uuid}/record-disk-disposition",
        status_code=200,
        summary="Record where the disks of a machine that vanished from MAAS went, then adopt "
        "(a full decommission stopped with host_not_wiped only)",
        description="Body {disposition: destroyed|wiped_out_of_band|retained_quarantined, "
        "reason, reference (optional: the certificate of destruction or custody ticket)}. The "
        "machine left MAAS before MAAS released and erased it, so the job cannot observe the "
        "disks' fate: the operator's record replaces `not_erased / machine_vanished` in the "
        "job's followups (source: operator, recorded_by, recorded_reason, reference) and on "
        "the release_maas_node event, and the adopt it allows goes on: the node is retired and "
        "deleted, the job ends reconciled. Refused (409 action_not_allowed, audited) in any "
        "other job state or failure; a refused adopt after it stops the job with cannot_adopt "
        "and keeps the record." + _ACTION_NOTES,
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def record_disk_disposition(
        self,
        data: JSONBody[DiskDispositionRecord],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        decommission_id: FromPath[uuid.UUID],
    ) -> ActionAnswer:
        details: dict[str, str] = {"disposition": data.disposition.value}
        if data.reference is not None:
            details["reference"] = data.reference
        return await decommissions.operator_action(
            db,
            temporal,
            principal,
            decommission_id,
            OperatorAction.RECORD_DISK_DISPOSITION,
            data.reason,
            details=details,
        )

    # --- operator actions: one route each, the same shape ---

    @post(
        "/decommissions/{decommission_id:uuid}/{action:str}",
        status_code=200,
        summary="Operator action: retry | resume | adopt | mark-manual-intervention | cancel",
        description=_ACTION_MEANINGS + _ACTION_NOTES,
        responses=errors(400, 403, 404, 409, 413),
    )
    async def act(
        self,
        data: JSONBody[ActionRequest],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        decommission_id: FromPath[uuid.UUID],
        action: FromPath[str],
    ) -> ActionAnswer:
        chosen = ACTION_PATHS.get(action)
        if chosen is None:
            raise NotFound(f"no action {action!r}; one of: {', '.join(ACTION_PATHS)}")
        return await decommissions.operator_action(
            db, temporal, principal, decommission_id, chosen, data.reason
        )
