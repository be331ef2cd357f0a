"""Admin routes for MAAS node onboarding (docs/lifecycles/onboarding.md): submit one node or a
batch, read the job read model, and the operator recovery actions (workflow updates)."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.onboarding import JobStatus, OperatorAction
from gateway import onboardings
from gateway.allocations import IDEMPOTENCY_HEADER
from gateway.auth import Principal, admin_guard
from gateway.errors import NotFound
from gateway.onboarding_schemas import (
    BatchCreated,
    OnboardingBatchCreate,
    OnboardingCreate,
    OnboardingCreated,
    OnboardingDetail,
    OnboardingList,
    OperatorActionAnswer,
    OperatorActionRequest,
)
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.temporal import TemporalOps

IdempotencyKey = Annotated[str | None, HeaderParameter(name=IDEMPOTENCY_HEADER, required=False)]

_CREATE_NOTES = (
    " 422 carries field errors in error.details.errors ({key, source, code, message}); codes "
    "invalid_hostname, invalid_ipmi_ip, unknown_site, unknown_profile, profile_disabled, "
    "unknown_sku, site_disabled (several different ones: validation_failed), "
    "idempotency_key_reused. "
    "With X-Idempotency-Key a retry gets the same answer (Idempotent-Replayed: true). 503 "
    "temporal_unavailable leaves nothing behind."
)
_ACTION_NOTES = (
    " Answers the workflow's decision: 409 action_not_allowed (with the workflow's reason) when "
    "the job's state does not allow it, 409 onboarding_closed once the workflow has ended, 409 "
    "onboarding_not_started for a batch node the batch has not started yet. A repeated request "
    "(same X-Idempotency-Key, or without one the same reason while the job has not changed) "
    "gets the first answer. Audited as onboarding.<action>."
)


# How each action is spelled in the URL (docs/lifecycles/onboarding.md#actions), and what it does.
ACTION_PATHS: dict[str, OperatorAction] = {
    "retry": OperatorAction.RETRY_STAGE,
    "resume": OperatorAction.RESUME,
    "rerun": OperatorAction.RERUN,
    "restart-clean": OperatorAction.RESTART_CLEAN,
    "cancel": OperatorAction.CANCEL,
    "adopt": OperatorAction.ADOPT,
    "mark-manual-intervention": OperatorAction.MARK_MANUAL_INTERVENTION,
}
_ACTION_MEANINGS = (
    "retry: rerun only the failed stage, then go on. resume: continue from the failed stage's "
    "last safe checkpoint, state refreshed. rerun: from the top, every stage adopting what is "
    "already done. restart-clean: compensate known progress, then start again from the top. "
    "cancel: stop the workflow and compensate where possible. adopt: accept externally "
    "advanced MAAS/node state and go on. mark-manual-intervention: freeze automation until a "
    "human resolves it. Unknown action: 404."
)


class AdminOnboardingsController(Controller):
    path = "/api/v1/admin/onboardings"
    guards = [admin_guard]
    tags = ["admin: onboarding"]

    @post(
        "/",
        status_code=201,
        summary="Onboard one MAAS node (starts MaasNodeOnboardWorkflow)",
        description="201 {onboarding_id, status: pending, node_id}. 409 onboarding_in_progress "
        "(a live onboarding of this hostname at this site; details.onboarding_id) or node_exists "
        "(a node with this hostname that is not deleted)." + _CREATE_NOTES,
        responses=errors(400, 403, 409, 413, 422),
    )
    async def create_onboarding(
        self,
        data: JSONBody[OnboardingCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        idempotency_key: IdempotencyKey = None,
    ) -> Response[OnboardingCreated]:
        outcome = await onboardings.create(
            db, temporal, runtime.settings, principal, data, idempotency_key
        )
        headers = {"Idempotent-Replayed": "true"} if outcome.replayed else {}
        return Response(outcome.body, status_code=201, headers=headers)

    @post(
        "/batch",
        status_code=201,
        summary="Onboard 1-500 nodes of one site, profile and SKU (starts "
        "MaasNodeBatchOnboardWorkflow, which starts one child per node)",
        description="201 {batch_id, onboardings: [{hostname, onboarding_id, node_id}]}; field "
        "errors name the node (nodes[3].hostname; also duplicate_hostname, duplicate_ipmi_ip, "
        "empty_batch, batch_too_large). 409 when a hostname is already onboarding or exists as "
        "a node (details.hostnames, details.conflicts): nothing is submitted." + _CREATE_NOTES,
        responses=errors(400, 403, 409, 413, 422),
    )
    async def create_batch(
        self,
        data: JSONBody[OnboardingBatchCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        idempotency_key: IdempotencyKey = None,
    ) -> Response[BatchCreated]:
        outcome = await onboardings.create_batch(
            db, temporal, runtime.settings, principal, data, idempotency_key
        )
        headers = {"Idempotent-Replayed": "true"} if outcome.replayed else {}
        return Response(outcome.body, status_code=201, headers=headers)

    @get(
        "/",
        summary="Onboardings, newest first; with ?batch_id= also the batch's counts per job "
        "state (summary, total)",
        description="Filters: batch_id, status (a job state: pending, running, completed, "
        "failed_retryable, failed_manual_intervention, cancelled, compensating, reconciled; "
        "anything else is 422 unknown_status), site_id, hostname. Pages with limit and cursor.",
        responses=errors(400, 403, 422),
    )
    async def list_onboardings(
        self,
        db: NamedDependency[AsyncSession],
        batch_id: FromQuery[uuid.UUID | None] = None,
        status: Annotated[str | None, QueryParameter(schema_extra=one_of(JobStatus))] = None,
        site_id: FromQuery[uuid.UUID | None] = None,
        hostname: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> OnboardingList:
        return await onboardings.list_rows(
            db,
            batch_id=batch_id,
            status=status,
            site_id=site_id,
            hostname=hostname,
            limit=limit,
            cursor=cursor,
        )

    @get(
        "/{onboarding_id:uuid}",
        summary="One onboarding: the job read model and its 50 most recent stage events",
        responses=errors(403, 404),
    )
    async def get_onboarding(
        self, db: NamedDependency[AsyncSession], onboarding_id: FromPath[uuid.UUID]
    ) -> OnboardingDetail:
        return await onboardings.detail(db, onboarding_id)

    # --- operator actions (docs/lifecycles/onboarding.md#actions): one route each, the same shape
    # ---

    @post(
        "/{onboarding_id:uuid}/{action:str}",
        status_code=200,
        summary="Operator action: retry | resume | rerun | restart-clean | "
        "cancel | adopt | mark-manual-intervention",
        description=_ACTION_MEANINGS + _ACTION_NOTES,
        responses=errors(400, 403, 404, 409, 413),
    )
    async def act(
        self,
        data: JSONBody[OperatorActionRequest],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        onboarding_id: FromPath[uuid.UUID],
        action: FromPath[str],
        idempotency_key: IdempotencyKey = None,
    ) -> OperatorActionAnswer:
        chosen = ACTION_PATHS.get(action)
        if chosen is None:
            raise NotFound(f"no action {action!r}; one of: {', '.join(ACTION_PATHS)}")
        return await onboardings.operator_action(
            db, temporal, principal, onboarding_id, chosen, data.reason, idempotency_key
        )
