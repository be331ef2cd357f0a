"""Storage namespaces and attachments (docs/lifecycles/storage-attachment.md).

Namespaces are project-owned storage with a quota; the worker creates them (an
AdminOperationWorkflow operation, which checks the project's storage limits under its lock) and
deletes them (StorageNamespaceDeleteWorkflow: 202 once `deleting`, `deleted` once the provider
reports the data gone); a delete is refused while the namespace is attached. An
attachment is a StorageAttachmentWorkflow: POST starts it with update-with-start and answers once
it is on record (`requested`); the worker prechecks, grants and has the node's agent mount it.
DELETE asks the workflow to detach (also from failed or detach_failed: the retry). Admins see
the stuck attachments (failed, detach_failed) and retry their detach, audited. Nothing here
touches a node or the storage.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import BALANCE_DEPLETED
from contracts.billing_meter import STORAGE_NOT_PRICED, BalanceState
from contracts.storage import (
    ABANDON_REFUSALS,
    ABANDON_UPDATE,
    ACCEPT_DELETE_UPDATE,
    ALLOCATION_NOT_ATTACHABLE,
    DETACH_UPDATE,
    NAMESPACE_ATTACHED,
    NAMESPACE_CREATE,
    NAMESPACE_DELETE_WORKFLOW,
    NAMESPACE_DELETING,
    NAMESPACE_EXISTS,
    NAMESPACE_NOT_FOUND,
    OPEN_UPDATE,
    QUOTA_EXCEEDED,
    STUCK,
    WORKFLOW_NAME,
    AbandonRequest,
    AttachmentInput,
    AttachmentStatus,
    AttachmentView,
    DetachActor,
    DetachRequest,
    NamespaceCreateInput,
    NamespaceDeleteResult,
    NamespaceDeleteWorkflowInput,
    NamespaceState,
    NamespaceStatus,
    StoragePolicy,
    WriteMode,
    attachment_workflow_id,
    namespace_delete_workflow_id,
)
from core.config import Settings
from gateway import allocations, audit
from gateway.admin_operations import actor, run_admin_operation
from gateway.allocations import IDEMPOTENCY_HEADER
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.controllers.common import audit_reason
from gateway.errors import ApiError, Conflict, NotFound
from gateway.openapi import errors
from gateway.pagination import newest_first_page
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from gateway.temporal import TemporalOps
from schema.models import BillingAccount, StorageAttachment, StorageNamespace

# Fixed forever: ids derived from idempotency keys must not change.
_ID_NAMESPACE = uuid.UUID("1d7e3c52-8a4f-4f0e-9b61-2c5a7e9d4b13")
NAME_PATTERN = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# Provider-side limits are the provider's business; this bounds what a request can ask for.
MAX_QUOTA_BYTES = 1 << 50  # 1 PiB

_NAMESPACE_STATUSES = {
    NAMESPACE_NOT_FOUND: 404,
    NAMESPACE_EXISTS: 409,
    NAMESPACE_ATTACHED: 409,
    STORAGE_NOT_PRICED: 409,
    QUOTA_EXCEEDED: 403,
}


class NamespaceCreate(RequestBody):
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    quota_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_QUOTA_BYTES)]
    # Policy half of multi_writer: attachments may share writes only where this allows it.
    allow_multi_writer: bool = False


class NamespaceView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    provider: str
    quota_bytes: int
    allow_multi_writer: bool
    status: str  # active | deleting (its data being removed) | deleted (the data gone)
    created_at: dt.datetime
    # The provider's last measure of the bytes stored (the meter measures every few minutes,
    # off any tenant's path; an attach's precheck too), and when; null until first measured.
    # Billing is by quota_bytes (provisioned), not by this.
    used_bytes: int | None = None
    usage_measured_at: dt.datetime | None = None


class NamespaceList(msgspec.Struct, kw_only=True):
    items: list[NamespaceView]
    next_cursor: str | None = None


class AttachmentCreate(RequestBody):
    namespace_id: uuid.UUID
    mode: WriteMode = WriteMode.READ_ONLY


class AttachmentDetail(msgspec.Struct, kw_only=True):
    attachment_id: uuid.UUID
    allocation_id: uuid.UUID
    namespace_id: uuid.UUID
    project_id: uuid.UUID
    node_id: uuid.UUID
    mode: str
    status: str
    mount_path: str | None  # on the node, once mounted
    # A gpu_slice allocation's VM gets the mount as a virtiofs filesystem with this tag: inside
    # the VM, `mount -t virtiofs <tag> <dir>`. None for bare metal (mount_path is on the host).
    guest_mount_tag: str | None
    failure_reason: str | None
    failure_message: str | None
    detach_attempts: int
    created_at: dt.datetime
    updated_at: dt.datetime
    mounted_at: dt.datetime | None
    detached_at: dt.datetime | None


class AttachmentList(msgspec.Struct, kw_only=True):
    items: list[AttachmentDetail]
    next_cursor: str | None = None


class DetachAccepted(msgspec.Struct, kw_only=True):
    attachment_id: uuid.UUID
    status: str  # the status when the detach was accepted; it runs next
    detach_pending: bool


class RetryDetach(RequestBody):
    reason: Reason


class AbandonAttachment(RequestBody):
    reason: Reason


def _namespace_view(row: StorageNamespace) -> NamespaceView:
    return NamespaceView(
        id=row.id,
        name=row.name,
        provider=row.provider,
        quota_bytes=row.quota_bytes,
        allow_multi_writer=row.allow_multi_writer,
        status=row.status,
        created_at=row.created_at,
        used_bytes=row.used_bytes,
        usage_measured_at=row.usage_measured_at,
    )


def _state_view(state: NamespaceState) -> NamespaceView:
    created_at = dt.datetime.fromisoformat(state.created_at)
    return NamespaceView(
        id=uuid.UUID(state.id),
        name=state.name,
        provider=state.provider,
        quota_bytes=state.quota_bytes,
        allow_multi_writer=state.allow_multi_writer,
        status=state.status,
        created_at=created_at,
    )


def attachment_detail(row: StorageAttachment) -> AttachmentDetail:
    return AttachmentDetail(
        attachment_id=row.id,
        allocation_id=row.allocation_id,
        namespace_id=row.namespace_id,
        project_id=row.project_id,
        node_id=row.node_id,
        mode=row.mode,
        status=row.status,
        mount_path=row.mount_path,
        guest_mount_tag=row.guest_mount_tag,
        failure_reason=row.failure_reason,
        failure_message=row.failure_message,
        detach_attempts=row.detach_attempts,
        created_at=row.created_at,
        updated_at=row.updated_at,
        mounted_at=row.mounted_at,
        detached_at=row.detached_at,
    )


def _check_same_namespace(view: NamespaceView, data: NamespaceCreate) -> None:
    """422 idempotency_key_reused when the key's namespace was asked for with another body."""
    if (view.name, view.quota_bytes, view.allow_multi_writer) != (
        data.name,
        data.quota_bytes,
        data.allow_multi_writer,
    ):
        raise ApiError(
            "this X-Idempotency-Key was already used with a different request body",
            code="idempotency_key_reused",
            status_code=422,
        )


def _derived_id(scope: uuid.UUID, key: str | None) -> uuid.UUID:
    """A retried request with the same idempotency key names the same resource."""
    return uuid.uuid5(_ID_NAMESPACE, f"{scope}:{key}") if key else uuid.uuid4()


async def _attachment_row(
    db: AsyncSession, attachment_id: uuid.UUID, allocation_id: uuid.UUID | None, project: Any
) -> StorageAttachment:
    row = await db.get(StorageAttachment, attachment_id)
    if (
        row is None
        or (allocation_id is not None and row.allocation_id != allocation_id)
        or (project is not None and row.project_id != project)
    ):
        raise NotFound("storage attachment not found")
    return row


async def request_detach(
    db: AsyncSession,
    temporal: TemporalOps,
    row: StorageAttachment,
    request: DetachRequest,
) -> DetachAccepted:
    """The workflow's detach update; a closed workflow means the attachment is detached."""
    workflow_id, attachment_id = row.workflow_id, row.id
    await db.close()

    async def call(client: Client) -> AttachmentView:
        view: AttachmentView = await client.get_workflow_handle(workflow_id).execute_update(
            DETACH_UPDATE, request, result_type=AttachmentView, rpc_timeout=temporal.rpc_timeout
        )
        return view

    try:
        view = await temporal.update(call)
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        detached = AttachmentStatus.DETACHED.value
        return DetachAccepted(attachment_id=attachment_id, status=detached, detach_pending=False)
    pending = view.status != AttachmentStatus.DETACHED
    return DetachAccepted(attachment_id=attachment_id, status=view.status, detach_pending=pending)


async def _refuse_depleted(db: AsyncSession, project_id: uuid.UUID) -> None:
    """Issue 37: a depleted project creates no namespace (402 balance_depleted; no account yet is
    a balance of 0). The limits on namespaces and their total quota (403 quota_exceeded) are
    checked by the worker, in the transaction that creates the namespace, under the project's
    lock (activities/storage.py), so concurrent creates cannot all pass them."""
    state = await db.scalar(
        select(BillingAccount.state).where(BillingAccount.project_id == project_id)
    )
    if state in (None, BalanceState.DEPLETED.value):
        raise ApiError(
            "the project's balance is depleted; add credit to create storage",
            code=BALANCE_DEPLETED,
            status_code=402,
        )


class StorageNamespacesController(Controller):
    path = "/api/v1/storage/namespaces"
    guards = [tenant_guard]
    tags = ["storage"]

    @post(
        "/",
        status_code=201,
        summary="Create a storage namespace with a quota (with X-Idempotency-Key: once)",
        description=(
            "402 balance_depleted for a depleted project; 403 quota_exceeded beyond the "
            "project's limits on namespaces and their total quota (GET "
            "/api/v1/billing/storage-limits); 409 storage_not_priced when the storage catalog "
            "has no price in the account's currency. The namespace is billed for its quota per "
            "GB-hour from now until it is deleted."
        ),
        responses=errors(400, 402, 403, 409, 413, 422),
    )
    async def create_namespace(
        self,
        data: JSONBody[NamespaceCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        idempotency_key: Annotated[
            str | None, HeaderParameter(name=IDEMPOTENCY_HEADER, required=False, max_length=200)
        ] = None,
    ) -> NamespaceView:
        namespace_id = _derived_id(principal.project, idempotency_key)
        existing = None
        if idempotency_key is not None:
            # The key's namespace exists already: the same body is answered from the record (by
            # the operation below), another body is refused before anything runs.
            existing = await db.get(StorageNamespace, namespace_id)
            if existing is not None:
                _check_same_namespace(_namespace_view(existing), data)
        if existing is None:  # a retry of a created one is answered whatever the limits now
            await _refuse_depleted(db, principal.project)
        await db.close()
        state = await run_admin_operation(
            temporal,
            runtime.settings.control_plane_task_queue,
            NAMESPACE_CREATE,
            NamespaceCreateInput(
                actor=actor(principal, None),
                namespace_id=str(namespace_id),
                project_id=str(principal.project),
                name=data.name,
                quota_bytes=data.quota_bytes,
                allow_multi_writer=data.allow_multi_writer,
            ),
            key=str(namespace_id),
            result_type=NamespaceState,
            statuses=_NAMESPACE_STATUSES,
        )
        view = _state_view(state)
        if idempotency_key is not None:  # a concurrent first request with another body
            _check_same_namespace(view, data)
        return view

    @get(
        "/",
        summary="The project's storage namespaces (active and deleting), newest first",
        responses=errors(400, 403),
    )
    async def list_namespaces(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> NamespaceList:
        rows, next_cursor = await newest_first_page(
            db,
            select(StorageNamespace).where(
                StorageNamespace.project_id == principal.project,
                StorageNamespace.status.in_(
                    [NamespaceStatus.ACTIVE.value, NamespaceStatus.DELETING.value]
                ),
            ),
            created=StorageNamespace.created_at,
            row_id=StorageNamespace.id,
            limit=limit,
            cursor=cursor,
        )
        return NamespaceList(items=[_namespace_view(r) for r in rows], next_cursor=next_cursor)

    @get("/{namespace_id:uuid}", summary="One storage namespace", responses=errors(403, 404))
    async def get_namespace(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        namespace_id: FromPath[uuid.UUID],
    ) -> NamespaceView:
        row = await db.get(StorageNamespace, namespace_id)
        if row is None or row.project_id != principal.project:
            raise NotFound("storage namespace not found")
        return _namespace_view(row)

    @delete(
        "/{namespace_id:uuid}",
        status_code=202,
        summary="Delete a namespace and its data (StorageNamespaceDeleteWorkflow)",
        description=(
            "202 with status `deleting`: the namespace takes no new attachment and is no longer "
            "billed, and the worker removes its data; GET shows `deleted` once the provider "
            "reports the data gone. A deleted one answers 202 `deleted` again. 409 "
            "`storage_namespace_attached` (details.attachment_ids) while any attachment of it "
            "is not detached; nothing is changed then."
        ),
        responses=errors(403, 404, 409),
    )
    async def delete_namespace(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        namespace_id: FromPath[uuid.UUID],
    ) -> Response[NamespaceView]:
        # Another project's namespace is 404 before any workflow is asked: the delete workflow's
        # id is the namespace's, and its answer must reach its owner only.
        row = await db.get(StorageNamespace, namespace_id)
        if row is None or row.project_id != principal.project:
            raise NotFound("storage namespace not found")
        if row.status == NamespaceStatus.DELETED:
            return Response(_namespace_view(row), status_code=202)
        await db.close()
        workflow_input = NamespaceDeleteWorkflowInput(
            actor=actor(principal, None),
            namespace_id=str(namespace_id),
            project_id=str(principal.project),
        )
        try:
            await temporal.update_with_start(
                lambda: WithStartWorkflowOperation(
                    NAMESPACE_DELETE_WORKFLOW,
                    workflow_input,
                    id=namespace_delete_workflow_id(str(namespace_id)),
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                    task_queue=runtime.settings.control_plane_task_queue,
                    result_type=NamespaceDeleteResult,
                ),
                ACCEPT_DELETE_UPDATE,
                result_type=NamespaceState,
            )
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == NAMESPACE_ATTACHED:
                details = cause.details[0] if cause.details else None
                raise Conflict(
                    cause.message,
                    code=NAMESPACE_ATTACHED,
                    details=details if isinstance(details, dict) else None,
                ) from None
            if isinstance(cause, ApplicationError) and cause.type == NAMESPACE_NOT_FOUND:
                raise NotFound("storage namespace not found") from None
            raise
        # The record, which the workflow may have moved on already (deleting, or deleted).
        fresh = await db.get(StorageNamespace, namespace_id, populate_existing=True)
        assert fresh is not None
        return Response(_namespace_view(fresh), status_code=202)


class AllocationAttachmentsController(Controller):
    path = "/api/v1/allocations/{allocation_id:uuid}/attachments"
    guards = [tenant_guard]
    tags = ["storage"]

    @post(
        "/",
        status_code=201,
        summary="Attach a storage namespace to an active allocation (StorageAttachmentWorkflow)",
        description=(
            "Answers once the attachment is on record (status requested); the worker then "
            "prechecks the write mode against the namespace's quota and other writers, grants "
            "the node access and has the node's agent mount it (status mounted, mount_path). "
            "With X-Idempotency-Key, a retry answers the same attachment."
        ),
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def attach(
        self,
        data: JSONBody[AttachmentCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        idempotency_key: Annotated[
            str | None, HeaderParameter(name=IDEMPOTENCY_HEADER, required=False, max_length=200)
        ] = None,
    ) -> AttachmentDetail:
        settings: Settings = runtime.settings
        attachment_id = _derived_id(allocation_id, idempotency_key)
        workflow_id = attachment_workflow_id(str(attachment_id))
        workflow_input = AttachmentInput(
            attachment_id=str(attachment_id),
            project_id=str(principal.project),
            allocation_id=str(allocation_id),
            namespace_id=str(data.namespace_id),
            mode=data.mode.value,
            requested_by=principal.name,
            policy=StoragePolicy(
                node_schedule_to_start_seconds=settings.node_schedule_to_start_seconds,
                host_task_timeout_seconds=settings.host_provision_timeout_seconds,
                host_heartbeat_timeout_seconds=settings.host_heartbeat_timeout_seconds,
                retry_initial_seconds=settings.release_retry_initial_seconds,
            ),
        )
        try:
            await temporal.update_with_start(
                lambda: WithStartWorkflowOperation(
                    WORKFLOW_NAME,
                    workflow_input,
                    id=workflow_id,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    task_queue=settings.control_plane_task_queue,
                    result_type=AttachmentView,
                ),
                OPEN_UPDATE,
                result_type=AttachmentView,
            )
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                if cause.type in (ALLOCATION_NOT_ATTACHABLE, NAMESPACE_DELETING):
                    raise Conflict(cause.message, code=cause.type) from None
                if cause.type == NAMESPACE_NOT_FOUND:
                    raise ApiError(
                        cause.message, code=NAMESPACE_NOT_FOUND, status_code=404
                    ) from None
                raise NotFound("allocation not found") from None
            raise
        except WorkflowAlreadyStartedError:
            pass  # the key's attachment closed already (detached): answered from the record
        return attachment_detail(
            await _attachment_row(db, attachment_id, allocation_id, principal.project)
        )

    @get("/", summary="The allocation's storage attachments", responses=errors(400, 403, 404))
    async def list_attachments(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AttachmentList:
        # Another project's allocation, or none: 404, as its terminal sessions' list answers.
        await allocations.get_row(db, allocation_id, principal.project)
        rows, next_cursor = await newest_first_page(
            db,
            select(StorageAttachment).where(
                StorageAttachment.allocation_id == allocation_id,
                StorageAttachment.project_id == principal.project,
            ),
            created=StorageAttachment.created_at,
            row_id=StorageAttachment.id,
            limit=limit,
            cursor=cursor,
        )
        return AttachmentList(items=[attachment_detail(r) for r in rows], next_cursor=next_cursor)

    @get("/{attachment_id:uuid}", summary="One storage attachment", responses=errors(403, 404))
    async def get_attachment(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        attachment_id: FromPath[uuid.UUID],
    ) -> AttachmentDetail:
        row = await _attachment_row(db, attachment_id, allocation_id, principal.project)
        return attachment_detail(row)

    @delete(
        "/{attachment_id:uuid}",
        status_code=202,
        summary="Detach (workflow update detach); also retries a failed or detach_failed one",
        description="The namespace's data is kept: a detach never deletes storage.",
        responses=errors(403, 404),
    )
    async def detach(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        attachment_id: FromPath[uuid.UUID],
    ) -> Response[DetachAccepted]:
        row = await _attachment_row(db, attachment_id, allocation_id, principal.project)
        answer = await request_detach(db, temporal, row, DetachRequest(DetachActor.TENANT))
        return Response(answer, status_code=202)


class AdminStorageController(Controller):
    path = "/api/v1/admin/storage"
    guards = [admin_guard]
    tags = ["admin", "storage"]

    @get(
        "/attachments",
        summary="Storage attachments across projects; by default the stuck ones",
        description="Default status: failed and detach_failed (retry their detach below).",
        responses=errors(400, 403),
    )
    async def list_attachments(
        self,
        db: NamedDependency[AsyncSession],
        status: FromQuery[list[AttachmentStatus] | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AttachmentList:
        statuses = [s.value for s in (status or sorted(STUCK))]
        rows, next_cursor = await newest_first_page(
            db,
            select(StorageAttachment).where(StorageAttachment.status.in_(statuses)),
            created=StorageAttachment.created_at,
            row_id=StorageAttachment.id,
            limit=limit,
            cursor=cursor,
        )
        return AttachmentList(items=[attachment_detail(r) for r in rows], next_cursor=next_cursor)

    @post(
        "/attachments/{attachment_id:uuid}/retry-detach",
        status_code=202,
        summary="Retry the detach of a stuck attachment (failed → detaching → detached); audited",
        responses=errors(400, 403, 404, 409),
    )
    async def retry_detach(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[RetryDetach],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        attachment_id: FromPath[uuid.UUID],
    ) -> Response[DetachAccepted]:
        row = await _attachment_row(db, attachment_id, None, None)
        if row.status not in STUCK:
            raise Conflict(
                f"the attachment is {row.status}; only failed or detach_failed ones are retried",
                code="attachment_not_stuck",
                details={"status": row.status},
            )
        prior, workflow_id = row.status, row.workflow_id
        reason = audit_reason(request, data.reason)
        answer = await request_detach(
            db, temporal, row, DetachRequest(DetachActor.ADMIN, reason=reason)
        )
        audit.record_by(
            db,
            principal,
            action="storage_attachment.retry_detach",
            target_type="storage_attachment",
            target_id=str(attachment_id),
            reason=reason,
            prior_state=prior,
            expected_state=AttachmentStatus.DETACHED.value,
            workflow_ids=[workflow_id],
        )
        await db.commit()
        return Response(answer, status_code=202)

    @post(
        "/attachments/{attachment_id:uuid}/abandon",
        status_code=200,
        summary="Abandon a detach_failed attachment on a node observed gone; audited",
        description=(
            "Issue 35: the way out of detach_failed when the node never comes back. The "
            "attachment's workflow observes the node now (its agent not heard from within the "
            "liveness window, or no node at all), revokes the grant without any unmount and ends "
            "the attachment detached with failure_reason `abandoned`: the namespace takes a new "
            "writer and can be deleted. 409 `attachment_not_detach_failed`, "
            "`attachment_detach_in_progress`, `node_alive` (retry the detach instead), "
            "`node_liveness_unknown`, `storage_grant_failed`; a refusal changes nothing."
        ),
        responses=errors(400, 403, 404, 409),
    )
    async def abandon(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[AbandonAttachment],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        attachment_id: FromPath[uuid.UUID],
    ) -> AttachmentDetail:
        row = await _attachment_row(db, attachment_id, None, None)
        if row.status != AttachmentStatus.DETACH_FAILED:
            raise Conflict(
                f"the attachment is {row.status}; only a detach_failed one is abandoned",
                code="attachment_not_detach_failed",
                details={"status": row.status},
            )
        prior, workflow_id = row.status, row.workflow_id
        reason = audit_reason(request, data.reason) or data.reason
        abandon = AbandonRequest(
            actor=DetachActor.ADMIN.value,
            reason=reason,
            liveness_window_seconds=runtime.settings.node_offline_after_seconds,
        )
        await db.close()

        async def call(client: Client) -> AttachmentView:
            view: AttachmentView = await client.get_workflow_handle(workflow_id).execute_update(
                ABANDON_UPDATE,
                abandon,
                result_type=AttachmentView,
                rpc_timeout=temporal.rpc_timeout,
            )
            return view

        try:
            await temporal.update(call)
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type in ABANDON_REFUSALS:
                details = cause.details[0] if cause.details else None
                raise Conflict(
                    cause.message,
                    code=cause.type,
                    details=details if isinstance(details, dict) else None,
                ) from None
            raise
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            raise Conflict(  # its workflow has closed: the attachment is detached
                "the attachment is detached", code="attachment_not_detach_failed"
            ) from None
        row = await _attachment_row(db, attachment_id, None, None)
        await db.refresh(row)
        audit.record_by(
            db,
            principal,
            action="storage_attachment.abandon",
            target_type="storage_attachment",
            target_id=str(attachment_id),
            reason=reason,
            prior_state=prior,
            expected_state=AttachmentStatus.DETACHED.value,
            workflow_ids=[workflow_id],
            details={"node_id": str(row.node_id), "failure_message": row.failure_message},
        )
        await db.commit()
        return attachment_detail(row)
