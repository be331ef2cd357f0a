"""Storage namespaces and attachments in the worker (docs/lifecycles/storage-attachment.md).

- Namespace create is an AdminOperationWorkflow operation: the provider's directory, then the
  row and its audit row in one transaction that holds the project's storage lock and checks its
  limits (403 quota_exceeded). Delete is StorageNamespaceDeleteWorkflow's (workflows/
  storage_namespace.py): begin (active → deleting, refused while any attachment of the namespace
  is not `detached`), remove the data in bounded heartbeating chunks, finish (→ deleted once the
  provider reports it gone). It is the only path that deletes a namespace's data.
- StorageAttachmentWorkflow's activities: open (the row, `requested`), transitions
  (compare-and-set on docs/lifecycles/storage-attachment.md's table with an event row in the same
  transaction), the precheck (write mode against quota posture, provider capability and policy,
  other writers: decided and applied in one transaction holding the namespace row, so two prechecks
  never both see no writer), the provider's grant and revoke, and the node_tasks rows of the mount
  tasks.
- `storage.detach_for_release`: AllocationWorkflow's release detaches every attachment of the
  allocation first (each through its own workflow's detach update) and waits for them.
- Billing (issue 37): a namespace's storage usage record (its quota, priced per GB-hour) is
  opened in the transaction that creates it and closed in the one that makes it `deleting`
  (activities/billing/storage_usage.py); a namespace with no price in its account's currency is
  refused. The meter runs `storage.measure_usage` (used bytes for the namespace view, measured
  off any tenant's path) and `storage.detach_for_billing` (a depleted account's attachments once
  its grace period is over, each through its own workflow, actor billing).

Provider calls block (filesystem): they run in a thread, never inside a database transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy.exc
from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.billing.storage_usage import (
    StorageNotPriced,
    close_storage_usage,
    open_storage_usage,
)
from activities.node_task_log import queue_task, record_task_outcome
from activities.operation_support import record_audit, refusal, transaction
from activities.storage_provider import DELETE_CHUNK_ENTRIES, StorageProvider
from contracts.admin_operation import NOT_FOUND
from contracts.billing_meter import (
    STORAGE_DETACH_FOR_BILLING,
    STORAGE_MEASURE_USAGE,
    STORAGE_NOT_PRICED,
    StorageDetachForBillingInput,
    StorageDetachForBillingResult,
    StorageMeasureInput,
    StorageMeasureResult,
)
from contracts.states import AllocationStatus, NodeTaskStatus, ReleaseActor
from contracts.storage import (
    ALLOCATION_NOT_ATTACHABLE,
    ATTACHMENT_NODE_OBSERVE,
    ATTACHMENT_NODE_STATUS,
    ATTACHMENT_OPEN,
    ATTACHMENT_PRECHECK,
    ATTACHMENT_PRECHECK_WITH_USAGE,
    ATTACHMENT_TRANSITION,
    DETACH_FOR_RELEASE,
    DETACH_UPDATE,
    GRANT_APPLY,
    GRANT_REVOKE,
    HOST_TASK_FINISH,
    HOST_TASK_QUEUE,
    MULTI_WRITER_NOT_ALLOWED,
    NAMESPACE_ATTACHED,
    NAMESPACE_CREATE,
    NAMESPACE_DELETE,
    NAMESPACE_DELETE_BEGIN,
    NAMESPACE_DELETE_FINISH,
    NAMESPACE_DELETE_WORKFLOW,
    NAMESPACE_DELETING,
    NAMESPACE_EXISTS,
    NAMESPACE_NOT_FOUND,
    NAMESPACE_REMOVE_DATA,
    NAMESPACE_USAGE,
    NODE_ALIVE,
    NODE_LIVENESS_UNKNOWN,
    PROVIDER_UNAVAILABLE,
    QUOTA_EXCEEDED,
    STORAGE_DETACH_FAILED,
    TRANSITIONS,
    WRITE_MODES,
    WRITER_CONFLICT,
    AttachmentStatus,
    AttachmentView,
    DetachActor,
    DetachForReleaseInput,
    DetachForReleaseResult,
    DetachRequest,
    GrantInput,
    HostTaskFinishInput,
    HostTaskQueueInput,
    NamespaceCreateInput,
    NamespaceDeleteFinishInput,
    NamespaceDeleteInput,
    NamespaceDeleteWorkflowInput,
    NamespaceRemoveDataResult,
    NamespaceState,
    NamespaceStatus,
    NodeObservation,
    NodeObserveInput,
    OpenInput,
    PrecheckInput,
    PrecheckResult,
    TransitionInput,
    WriteMode,
    namespace_delete_workflow_id,
)
from core.task_queues import node_task_queue
from schema.models import (
    DEFAULT_STORAGE_NAMESPACE_LIMIT,
    DEFAULT_STORAGE_QUOTA_LIMIT_BYTES,
    Allocation,
    BillingAccount,
    Node,
    StorageAttachment,
    StorageAttachmentEvent,
    StorageNamespace,
)

# A failed attachment refused by its precheck, or failed before it (the provider could not
# measure the namespace), never held a grant or a mount: it is no writer.
PRECHECK_REFUSALS = (
    QUOTA_EXCEEDED,
    MULTI_WRITER_NOT_ALLOWED,
    WRITER_CONFLICT,
    PROVIDER_UNAVAILABLE,
)
# The meter measures a namespace's used bytes again once its last measure is this old.
MEASURE_INTERVAL_SECONDS = 5 * 60
# How often detach_for_release heartbeats while it waits, without a heartbeat timeout (with one:
# three times per timeout).
_HEARTBEAT_S = 5.0
TRANSITION_CONFLICT = "storage_transition_conflict"
# One NAMESPACE_REMOVE_DATA attempt removes chunks for about this long, then answers its
# progress (the workflow calls again): an attempt is bounded, and the history grows per attempt,
# not per chunk.
REMOVE_BUDGET_SECONDS = 20.0


def attachment_view(row: StorageAttachment) -> AttachmentView:
    return AttachmentView(
        attachment_id=str(row.id),
        status=row.status,
        node_id=str(row.node_id),
        mount_path=row.mount_path,
        failure_reason=row.failure_reason,
        failure_message=row.failure_message,
        detach_attempts=row.detach_attempts,
        guest_mount_tag=row.guest_mount_tag,
    )


def namespace_state(row: StorageNamespace, usage_bytes: int = 0) -> NamespaceState:
    return NamespaceState(
        id=str(row.id),
        project_id=str(row.project_id),
        name=row.name,
        provider=row.provider,
        quota_bytes=row.quota_bytes,
        allow_multi_writer=row.allow_multi_writer,
        status=row.status,
        created_at=row.created_at.isoformat(),
        usage_bytes=usage_bytes,
    )


def _from_statuses(to_status: AttachmentStatus) -> list[str]:
    return [src.value for src, targets in TRANSITIONS.items() if to_status in targets]


async def _apply_transition(session: AsyncSession, input: TransitionInput) -> StorageAttachment:
    """Compare-and-set from any status docs/lifecycles/storage-attachment.md allows into
    `to_status`, with its event row. Repeating a transition that already happened answers the row (a
    retried activity)."""
    to_status = AttachmentStatus(input.to_status)
    attachment_id = uuid.UUID(input.attachment_id)
    current = await session.scalar(
        select(StorageAttachment).where(StorageAttachment.id == attachment_id).with_for_update()
    )
    if current is None:
        raise refusal(NOT_FOUND, "storage attachment not found")
    if current.status == to_status:
        return current
    if current.status not in _from_statuses(to_status):
        raise refusal(
            TRANSITION_CONFLICT, f"attachment is {current.status}, not a status before {to_status}"
        )
    prior = current.status
    values: dict[str, Any] = {"status": to_status.value, "updated_at": func.clock_timestamp()}
    if to_status in (AttachmentStatus.FAILED, AttachmentStatus.DETACH_FAILED) or (
        # An abandoned attachment (ATTACHMENT_ABANDONED) says so, and why, on its detached row.
        to_status == AttachmentStatus.DETACHED and input.failure_reason
    ):
        values |= {"failure_reason": input.failure_reason, "failure_message": input.failure_message}
    if to_status == AttachmentStatus.MOUNTED:
        values |= {
            "mount_path": input.mount_path,
            "guest_mount_tag": input.guest_mount_tag,
            "mounted_at": func.clock_timestamp(),
        }
    if to_status == AttachmentStatus.DETACHING:
        values["detach_attempts"] = StorageAttachment.detach_attempts + 1
    if to_status == AttachmentStatus.DETACHED:
        values |= {
            "detached_at": func.clock_timestamp(),
            "mount_path": None,
            "guest_mount_tag": None,
        }
    row = await session.scalar(
        update(StorageAttachment)
        .where(StorageAttachment.id == attachment_id)
        .values(**values)
        .returning(StorageAttachment)
        .execution_options(populate_existing=True)
    )
    assert row is not None
    details = {"failure_reason": input.failure_reason} if input.failure_reason else {}
    await session.execute(
        insert(StorageAttachmentEvent).values(
            attachment_id=attachment_id,
            from_status=prior,
            to_status=to_status.value,
            actor=input.actor,
            reason=input.reason or input.failure_message,
            details=details,
        )
    )
    return row


async def _record_measure(session: AsyncSession, namespace_id: uuid.UUID, usage: int) -> None:
    await session.execute(
        update(StorageNamespace)
        .where(StorageNamespace.id == namespace_id)
        .values(used_bytes=usage, usage_measured_at=func.clock_timestamp())
    )


async def _lock_project_storage(session: AsyncSession, project_id: uuid.UUID) -> None:
    """The project's storage lock, until the transaction ends: namespace creates of one project
    take it in turn, so each counts what the ones before it made."""
    await session.execute(
        select(func.pg_advisory_xact_lock(func.hashtextextended(f"storage-limits:{project_id}", 0)))
    )


async def _refuse_beyond_limits(
    session: AsyncSession, project_id: uuid.UUID, quota_bytes: int
) -> None:
    """403 quota_exceeded beyond the project's limits (admin-set on its billing account, else the
    policy's defaults) on its active namespaces and their total quota. A deleting namespace no
    longer counts: it is no longer billed nor usable (its data is on its way out)."""
    limits = (
        await session.execute(
            select(
                BillingAccount.storage_namespace_limit, BillingAccount.storage_quota_limit_bytes
            ).where(BillingAccount.project_id == project_id)
        )
    ).first()
    namespace_limit, quota_limit = (
        (int(limits[0]), int(limits[1]))
        if limits is not None
        else (DEFAULT_STORAGE_NAMESPACE_LIMIT, DEFAULT_STORAGE_QUOTA_LIMIT_BYTES)
    )
    count, total = (
        await session.execute(
            select(func.count(), func.coalesce(func.sum(StorageNamespace.quota_bytes), 0)).where(
                StorageNamespace.project_id == project_id,
                StorageNamespace.status == NamespaceStatus.ACTIVE,
            )
        )
    ).one()
    if count + 1 > namespace_limit or int(total) + quota_bytes > quota_limit:
        raise refusal(
            QUOTA_EXCEEDED,
            "the project's storage limits do not allow this namespace",
            {
                "namespace_limit": namespace_limit,
                "namespaces": int(count),
                "quota_limit_bytes": quota_limit,
                "quota_bytes": int(total),
                "requested_quota_bytes": quota_bytes,
            },
        )


class StorageActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        provider: StorageProvider,
        client: Client,
        *,
        measure_interval_seconds: int = MEASURE_INTERVAL_SECONDS,
        delete_chunk_entries: int = DELETE_CHUNK_ENTRIES,
        remove_budget_seconds: float = REMOVE_BUDGET_SECONDS,
    ) -> None:
        self._sessions = sessions
        self._provider = provider
        self._client = client
        self._measure_interval = dt.timedelta(seconds=measure_interval_seconds)
        self._delete_chunk_entries = delete_chunk_entries
        self._remove_budget_seconds = remove_budget_seconds

    def activities(self) -> list[Callable[..., Any]]:
        """The attachment workflow's and the release's activities."""
        return [
            self.attachment_open,
            self.attachment_transition,
            self.attachment_precheck,
            self.namespace_usage,
            self.attachment_precheck_with_usage,
            self.attachment_node_status,
            self.attachment_node_observe,
            self.grant_apply,
            self.grant_revoke,
            self.host_task_queue,
            self.host_task_finish,
            self.detach_for_release,
            self.measure_usage,
            self.detach_for_billing,
            self.namespace_delete_begin,
            self.namespace_remove_data,
            self.namespace_delete_finish,
        ]

    def operations(self) -> list[Callable[..., Any]]:
        """The AdminOperationWorkflow operations."""
        return [self.namespace_create, self.namespace_delete]

    # ------------------------------------------------------------------ namespaces

    @activity.defn(name=NAMESPACE_CREATE)
    async def namespace_create(self, input: NamespaceCreateInput) -> NamespaceState:
        """The provider's directory first (idempotent), then the row and its audit row, in one
        transaction that holds the project's storage lock and checks its limits there (403
        quota_exceeded), so concurrent creates at the limit cannot all pass. The same namespace
        id answers the same, whatever the limits now. A refused create takes its (empty)
        directory away again."""
        await asyncio.to_thread(self._provider.create, input.namespace_id, input.quota_bytes)
        namespace_id = uuid.UUID(input.namespace_id)
        try:
            async with transaction(self._sessions) as session:
                existing = await session.get(StorageNamespace, namespace_id)
                if existing is not None:
                    return namespace_state(existing)
                project_id = uuid.UUID(input.project_id)
                await _lock_project_storage(session, project_id)
                await _refuse_beyond_limits(session, project_id, input.quota_bytes)
                row = await session.scalar(
                    pg_insert(StorageNamespace)
                    .values(
                        id=namespace_id,
                        project_id=project_id,
                        name=input.name,
                        provider=self._provider.kind,
                        quota_bytes=input.quota_bytes,
                        allow_multi_writer=input.allow_multi_writer,
                    )
                    .returning(StorageNamespace)
                )
                assert row is not None
                try:
                    await open_storage_usage(
                        session,
                        namespace_id=namespace_id,
                        project_id=row.project_id,
                        provider=row.provider,
                        quota_bytes=row.quota_bytes,
                    )
                except StorageNotPriced as err:
                    raise refusal(
                        STORAGE_NOT_PRICED,
                        f"{err}: storage cannot be created for this account",
                        {"provider": err.provider, "currency": err.currency},
                    ) from None
                record_audit(
                    session,
                    input.actor,
                    action="storage_namespace.create",
                    target_type="storage_namespace",
                    target_id=input.namespace_id,
                    expected_state=NamespaceStatus.ACTIVE.value,
                    details={
                        "project_id": input.project_id,
                        "name": input.name,
                        "quota_bytes": input.quota_bytes,
                        "allow_multi_writer": input.allow_multi_writer,
                    },
                )
                return namespace_state(row)
        except sqlalchemy.exc.IntegrityError:
            await self._discard_refused(namespace_id)
            raise refusal(
                NAMESPACE_EXISTS, "the project already has a storage namespace with this name"
            ) from None
        except ApplicationError:
            await self._discard_refused(namespace_id)
            raise

    async def _discard_refused(self, namespace_id: uuid.UUID) -> None:
        """The directory of a create that was refused, unless a namespace row names it after all
        (a retried create of one that exists keeps its data)."""
        async with transaction(self._sessions) as session:
            if await session.get(StorageNamespace, namespace_id) is not None:
                return
        await asyncio.to_thread(self._provider.delete, str(namespace_id))

    @activity.defn(name=NAMESPACE_DELETE)
    async def namespace_delete(self, input: NamespaceDeleteInput) -> NamespaceState:
        """The delete of older builds' AdminOperationWorkflow (one in flight at a deploy): the
        namespace becomes `deleting` as NAMESPACE_DELETE_BEGIN does, and its
        StorageNamespaceDeleteWorkflow is started to remove the data."""
        state = await self.namespace_delete_begin(input)
        await self._client.start_workflow(
            NAMESPACE_DELETE_WORKFLOW,
            NamespaceDeleteWorkflowInput(
                actor=input.actor, namespace_id=input.namespace_id, project_id=input.project_id
            ),
            id=namespace_delete_workflow_id(input.namespace_id),
            task_queue=activity.info().task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        )
        return state

    @activity.defn(name=NAMESPACE_DELETE_BEGIN)
    async def namespace_delete_begin(self, input: NamespaceDeleteInput) -> NamespaceState:
        """active → deleting, refused (409 storage_namespace_attached) while an attachment of it
        is not detached; no new attachment opens against a deleting one (attachment_open holds
        the row FOR SHARE, this FOR UPDATE). Billing stops here: the usage record is closed in
        this transaction, as the tenant can no longer use the namespace. A deleting or deleted
        namespace answers as it is (a retry)."""
        namespace_id = uuid.UUID(input.namespace_id)
        async with transaction(self._sessions) as session:
            row = await session.scalar(
                select(StorageNamespace)
                .where(StorageNamespace.id == namespace_id)
                .with_for_update()
            )
            if row is None or (
                input.project_id is not None and str(row.project_id) != input.project_id
            ):
                raise refusal(NAMESPACE_NOT_FOUND, "storage namespace not found")
            if row.status != NamespaceStatus.ACTIVE:
                return namespace_state(row)
            attached = list(
                await session.scalars(
                    select(StorageAttachment.id).where(
                        StorageAttachment.namespace_id == namespace_id,
                        StorageAttachment.status != AttachmentStatus.DETACHED,
                    )
                )
            )
            if attached:
                raise refusal(
                    NAMESPACE_ATTACHED,
                    "the namespace is attached: detach it first",
                    {"attachment_ids": [str(a) for a in attached]},
                )
            row = await session.scalar(
                update(StorageNamespace)
                .where(StorageNamespace.id == namespace_id)
                .values(status=NamespaceStatus.DELETING)
                .returning(StorageNamespace)
                .execution_options(populate_existing=True)
            )
            assert row is not None
            await close_storage_usage(session, namespace_id)  # billed until now
            record_audit(
                session,
                input.actor,
                action="storage_namespace.delete",
                target_type="storage_namespace",
                target_id=input.namespace_id,
                prior_state=NamespaceStatus.ACTIVE.value,
                expected_state=NamespaceStatus.DELETED.value,
                details={"project_id": str(row.project_id), "name": row.name},
            )
            return namespace_state(row)

    @activity.defn(name=NAMESPACE_REMOVE_DATA)
    async def namespace_remove_data(self, namespace_id: str) -> NamespaceRemoveDataResult:
        """Remove the namespace's data at the provider, one bounded chunk at a time in a thread,
        heartbeating after each, until the provider reports it gone or this attempt's time is
        up (the workflow calls again). A cancelled or timed-out attempt stops at its next
        heartbeat: at most the chunk it was in keeps running beside the retry, and the provider
        takes that. A refusal of the filesystem raises, and is retried."""
        result = NamespaceRemoveDataResult()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._remove_budget_seconds
        while True:
            removed, gone = await asyncio.to_thread(
                self._provider.delete_chunk, namespace_id, self._delete_chunk_entries
            )
            result.removed_entries += removed
            result.chunks += 1
            activity.heartbeat(result.removed_entries)
            if gone:
                result.gone = True
                return result
            if loop.time() >= deadline:
                return result

    @activity.defn(name=NAMESPACE_DELETE_FINISH)
    async def namespace_delete_finish(self, input: NamespaceDeleteFinishInput) -> NamespaceState:
        """deleting → deleted, once the provider reported the data gone (deleted_at is then), with
        an audit row saying what was removed. A deleted namespace answers as it is."""
        namespace_id = uuid.UUID(input.namespace_id)
        async with transaction(self._sessions) as session:
            row = await session.scalar(
                update(StorageNamespace)
                .where(
                    StorageNamespace.id == namespace_id,
                    StorageNamespace.status == NamespaceStatus.DELETING,
                )
                .values(status=NamespaceStatus.DELETED, deleted_at=func.clock_timestamp())
                .returning(StorageNamespace)
                .execution_options(populate_existing=True)
            )
            if row is None:
                row = await session.get(StorageNamespace, namespace_id)
                if row is None:
                    raise refusal(NAMESPACE_NOT_FOUND, "storage namespace not found")
                return namespace_state(row)
            record_audit(
                session,
                input.actor,
                action="storage_namespace.data_removed",
                target_type="storage_namespace",
                target_id=input.namespace_id,
                prior_state=NamespaceStatus.DELETING.value,
                expected_state=NamespaceStatus.DELETED.value,
                details={
                    "project_id": str(row.project_id),
                    "removed_entries": input.removed_entries,
                    "chunks": input.chunks,
                },
            )
            return namespace_state(row)

    # ------------------------------------------------------------------ attachments

    @activity.defn(name=ATTACHMENT_OPEN)
    async def attachment_open(self, input: OpenInput) -> AttachmentView:
        """The attachment on record as `requested`, if its allocation is active and its
        namespace active, both the project's. The rows are held (FOR SHARE) against a release
        or a namespace delete that would otherwise not see this attachment."""
        attachment_id = uuid.UUID(input.attachment_id)
        project_id = uuid.UUID(input.project_id)
        async with transaction(self._sessions) as session:
            existing = await session.get(StorageAttachment, attachment_id)
            if existing is not None:
                return attachment_view(existing)
            allocation = await session.scalar(
                select(Allocation)
                .where(Allocation.id == uuid.UUID(input.allocation_id))
                .with_for_update(read=True)
            )
            if allocation is None or allocation.project_id != project_id:
                raise refusal(NOT_FOUND, "allocation not found")
            if allocation.status != AllocationStatus.ACTIVE:
                raise refusal(
                    ALLOCATION_NOT_ATTACHABLE,
                    f"the allocation is {allocation.status}; storage attaches to active ones",
                    {"status": allocation.status},
                )
            namespace = await session.scalar(
                select(StorageNamespace)
                .where(StorageNamespace.id == uuid.UUID(input.namespace_id))
                .with_for_update(read=True)
            )
            if (
                namespace is not None
                and namespace.project_id == project_id
                and namespace.status == NamespaceStatus.DELETING
            ):
                raise refusal(
                    NAMESPACE_DELETING,
                    "the storage namespace is being deleted",
                    {"status": namespace.status},
                )
            if (
                namespace is None
                or namespace.project_id != project_id
                or namespace.status != NamespaceStatus.ACTIVE
            ):
                raise refusal(NAMESPACE_NOT_FOUND, "storage namespace not found")
            row = await session.scalar(
                pg_insert(StorageAttachment)
                .values(
                    id=attachment_id,
                    project_id=project_id,
                    namespace_id=namespace.id,
                    allocation_id=allocation.id,
                    node_id=allocation.node_id,
                    mode=WriteMode(input.mode).value,
                    status=AttachmentStatus.REQUESTED,
                    workflow_id=input.workflow_id,
                    requested_by=input.requested_by,
                )
                .returning(StorageAttachment)
            )
            assert row is not None
            await session.execute(
                insert(StorageAttachmentEvent).values(
                    attachment_id=attachment_id,
                    to_status=AttachmentStatus.REQUESTED,
                    actor=input.requested_by,
                    details={"mode": input.mode, "namespace_id": input.namespace_id},
                )
            )
            return attachment_view(row)

    @activity.defn(name=ATTACHMENT_TRANSITION)
    async def attachment_transition(self, input: TransitionInput) -> AttachmentView:
        async with transaction(self._sessions) as session:
            return attachment_view(await _apply_transition(session, input))

    @activity.defn(name=NAMESPACE_USAGE)
    async def namespace_usage(self, namespace_key: str) -> int:
        """The namespace's usage in bytes, as its provider measures it; raises (and is retried)
        while the provider cannot, e.g. its directory is not in the export."""
        usage: int = await asyncio.to_thread(self._provider.usage_bytes, namespace_key)
        return usage

    @activity.defn(name=STORAGE_MEASURE_USAGE)
    async def measure_usage(self, input: StorageMeasureInput) -> StorageMeasureResult:
        """The meter's measure of the active namespaces' used bytes, for the namespace view: the
        ones never measured or measured longest ago first, each at most every
        MEASURE_INTERVAL_SECONDS, for at most `max_seconds` per run (the rest waits
        for the next run). A namespace the provider cannot measure here keeps its last measure."""
        result = StorageMeasureResult()
        async with transaction(self._sessions) as session:
            now = await session.scalar(select(func.clock_timestamp()))
            assert now is not None
            stale_before = now - self._measure_interval
            keys = list(
                await session.scalars(
                    select(StorageNamespace.id)
                    .where(
                        StorageNamespace.status == NamespaceStatus.ACTIVE,
                        or_(
                            StorageNamespace.usage_measured_at.is_(None),
                            StorageNamespace.usage_measured_at <= stale_before,
                        ),
                    )
                    .order_by(StorageNamespace.usage_measured_at.asc().nulls_first())
                    .limit(1000)
                )
            )
        deadline = asyncio.get_running_loop().time() + input.max_seconds
        heartbeats = asyncio.create_task(self._heartbeat())
        try:
            for key in keys:
                if asyncio.get_running_loop().time() >= deadline:
                    break
                try:
                    usage = await asyncio.to_thread(self._provider.usage_bytes, str(key))
                except OSError:
                    result.unavailable += 1
                    continue
                async with transaction(self._sessions) as session:
                    await _record_measure(session, key, usage)
                result.measured += 1
        finally:
            heartbeats.cancel()
        return result

    @activity.defn(name=STORAGE_DETACH_FOR_BILLING)
    async def detach_for_billing(
        self, input: StorageDetachForBillingInput
    ) -> StorageDetachForBillingResult:
        """A depleted account's grace is over: each attachment is asked to detach by its own
        workflow (actor billing, on its event rows and the allocation's timeline), not waited
        for (a detach that fails is asked again by a later meter run). The data is kept."""
        result = StorageDetachForBillingResult()
        request = DetachRequest(ReleaseActor.BILLING.value, input.reason, wait=False)
        for attachment_id in input.attachment_ids:
            async with transaction(self._sessions) as session:
                workflow_id = await session.scalar(
                    select(StorageAttachment.workflow_id).where(
                        StorageAttachment.id == uuid.UUID(attachment_id)
                    )
                )
            if workflow_id is None:
                result.skipped.append(attachment_id)
                continue
            handle = self._client.get_workflow_handle(workflow_id)
            try:
                await handle.execute_update(DETACH_UPDATE, request, result_type=AttachmentView)
                result.requested.append(attachment_id)
            except (RPCError, WorkflowUpdateFailedError) as err:
                if isinstance(err, RPCError) and err.status != RPCStatusCode.NOT_FOUND:
                    raise
                result.skipped.append(attachment_id)  # its workflow closed: detached
            activity.heartbeat(len(result.requested) + len(result.skipped))
        return result

    @activity.defn(name=ATTACHMENT_PRECHECK)
    async def attachment_precheck(self, attachment_id: str) -> PrecheckResult:
        """What workflows of older builds run: the measure and the decision in one activity."""
        async with transaction(self._sessions) as session:
            loaded = await session.get(StorageAttachment, uuid.UUID(attachment_id))
            if loaded is None:
                raise refusal(NOT_FOUND, "storage attachment not found")
        usage = await self.namespace_usage(str(loaded.namespace_id))
        return await self._precheck(attachment_id, usage)

    @activity.defn(name=ATTACHMENT_PRECHECK_WITH_USAGE)
    async def attachment_precheck_with_usage(self, input: PrecheckInput) -> PrecheckResult:
        return await self._precheck(input.attachment_id, input.usage_bytes)

    async def _precheck(self, attachment_id: str, usage: int) -> PrecheckResult:
        """prechecking → grant_applying, or → failed with the reason the mode is not allowed:
        read_only always is; a writer needs the namespace under quota and no other writer
        (single_writer: none at all; multi_writer: no single_writer, and both the provider's
        capability and the namespace's policy)."""
        key = uuid.UUID(attachment_id)
        async with transaction(self._sessions) as session:
            loaded = await session.get(StorageAttachment, key)
            if loaded is None:
                raise refusal(NOT_FOUND, "storage attachment not found")
            namespace = await session.scalar(
                select(StorageNamespace)
                .where(StorageNamespace.id == loaded.namespace_id)
                .with_for_update()
            )
            attachment = await session.get(StorageAttachment, key, populate_existing=True)
            allocation = await session.get(Allocation, loaded.allocation_id)
            assert namespace is not None
            assert attachment is not None
            assert allocation is not None
            result = PrecheckResult(
                node_id=str(attachment.node_id),
                namespace_key=str(namespace.id),
                provider=namespace.provider,
                usage_bytes=usage,
                quota_bytes=namespace.quota_bytes,
                allocation_shape=allocation.shape,
            )
            if attachment.status != AttachmentStatus.PRECHECKING:
                # A retried activity whose first attempt committed: answer what it decided.
                result.refusal = attachment.failure_reason
                return result
            result.refusal, result.message = await self._refusal(
                session, attachment, namespace, allocation, usage
            )
            await _apply_transition(
                session,
                TransitionInput(
                    attachment_id=attachment_id,
                    to_status=(
                        AttachmentStatus.FAILED
                        if result.refusal
                        else AttachmentStatus.GRANT_APPLYING
                    ),
                    actor="precheck",
                    failure_reason=result.refusal,
                    failure_message=result.message or None,
                ),
            )
            return result

    @activity.defn(name=ATTACHMENT_NODE_STATUS)
    async def attachment_node_status(self, attachment_id: str) -> str:
        """The coarse status of the node the attachment is on
        (docs/lifecycles/node.md#states-and-transitions), as liveness and the operators last set
        it."""
        async with transaction(self._sessions) as session:
            status = await session.scalar(
                select(Node.status)
                .join(StorageAttachment, StorageAttachment.node_id == Node.id)
                .where(StorageAttachment.id == uuid.UUID(attachment_id))
            )
        if status is None:
            raise refusal(NOT_FOUND, "storage attachment or its node not found")
        return str(status)

    @activity.defn(name=ATTACHMENT_NODE_OBSERVE)
    async def attachment_node_observe(self, input: NodeObserveInput) -> NodeObservation:
        """Whether the attachment's node is gone, observed now rather than taken from its status
        (an `offline` status may be a sweep old, a `retired` node may still run its agent): the
        node's recorded agent contact and, asked of Temporal now, when a poller was last on its
        `node-{id}` queue. Gone: no node row, or neither within the liveness window. A queue
        Temporal cannot describe is no evidence of silence (NODE_LIVENESS_UNKNOWN)."""
        async with transaction(self._sessions) as session:
            found = (
                await session.execute(
                    select(StorageAttachment.node_id, Node.status, Node.last_agent_contact_at)
                    .outerjoin(Node, Node.id == StorageAttachment.node_id)
                    .where(StorageAttachment.id == uuid.UUID(input.attachment_id))
                )
            ).one_or_none()
            now = await session.scalar(select(func.clock_timestamp()))
        if found is None:
            raise refusal(NOT_FOUND, "storage attachment not found")
        assert now is not None
        node_id, status, contact = found
        observation = NodeObservation(
            node_id=str(node_id),
            node_status=None if status is None else str(status),
            last_seen=None,
            observed_at=now.isoformat(),
        )
        if status is None:
            observation.message = f"node {node_id} is not on record"
            return observation
        try:
            polled = await self._pollers_last_seen(str(node_id))
        except RPCError as err:
            observation.refusal = NODE_LIVENESS_UNKNOWN
            observation.message = f"the node's queue could not be described ({err.status.name})"
            return observation
        seen = [t for t in (contact, polled) if t is not None]
        last_seen = max(seen, default=None)
        observation.last_seen = None if last_seen is None else last_seen.isoformat()
        window = dt.timedelta(seconds=input.liveness_window_seconds)
        if last_seen is not None and now - last_seen < window:
            observation.refusal = NODE_ALIVE
            observation.message = (
                f"node {node_id} ({status}): its agent was heard from at "
                f"{last_seen.isoformat()}, within the {window.total_seconds():g} s liveness "
                "window; retry the detach instead"
            )
        else:
            observation.message = (
                f"node {node_id} ({status}): agent last heard from "
                f"{'never' if last_seen is None else last_seen.isoformat()}, observed "
                f"{now.isoformat()}"
            )
        return observation

    async def _pollers_last_seen(self, node_id: str) -> dt.datetime | None:
        """When Temporal last saw a poller on the node's queue (as node liveness asks it)."""
        described = await self._client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self._client.namespace,
                task_queue=TaskQueue(name=node_task_queue(node_id)),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        return max((p.last_access_time.ToDatetime(dt.UTC) for p in described.pollers), default=None)

    async def _refusal(
        self,
        session: AsyncSession,
        attachment: StorageAttachment,
        namespace: StorageNamespace,
        allocation: Allocation,
        usage: int,
    ) -> tuple[str | None, str]:
        mode = WriteMode(attachment.mode)
        if allocation.status != AllocationStatus.ACTIVE:
            return ALLOCATION_NOT_ATTACHABLE, f"the allocation is {allocation.status}"
        if mode not in WRITE_MODES:
            return None, ""
        if mode == WriteMode.MULTI_WRITER and not (
            self._provider.capabilities.multi_writer and namespace.allow_multi_writer
        ):
            return (
                MULTI_WRITER_NOT_ALLOWED,
                "multi_writer needs both the provider's capability and the namespace's policy",
            )
        if usage >= namespace.quota_bytes:
            return (
                QUOTA_EXCEEDED,
                f"the namespace uses {usage} of its {namespace.quota_bytes} bytes: "
                "read_only attachments only",
            )
        conflicting = [WriteMode.SINGLE_WRITER.value]
        if mode == WriteMode.SINGLE_WRITER:
            conflicting.append(WriteMode.MULTI_WRITER.value)
        other_writers = await session.scalar(
            select(func.count())
            .select_from(StorageAttachment)
            .where(
                StorageAttachment.namespace_id == namespace.id,
                StorageAttachment.id != attachment.id,
                StorageAttachment.mode.in_(conflicting),
                StorageAttachment.status.not_in(
                    [AttachmentStatus.DETACHED, AttachmentStatus.REQUESTED]
                ),
                or_(
                    StorageAttachment.status != AttachmentStatus.FAILED,
                    StorageAttachment.failure_reason.is_(None),
                    StorageAttachment.failure_reason.not_in(
                        [*PRECHECK_REFUSALS, ALLOCATION_NOT_ATTACHABLE]
                    ),
                ),
            )
        )
        if other_writers:
            return WRITER_CONFLICT, f"the namespace has another writer ({mode} allows none)"
        return None, ""

    @activity.defn(name=GRANT_APPLY)
    async def grant_apply(self, input: GrantInput) -> None:
        await asyncio.to_thread(
            self._provider.grant,
            input.namespace_key,
            input.attachment_id,
            input.node_id,
            input.mode,
        )

    @activity.defn(name=GRANT_REVOKE)
    async def grant_revoke(self, input: GrantInput) -> None:
        await asyncio.to_thread(self._provider.revoke, input.namespace_key, input.attachment_id)

    @activity.defn(name=HOST_TASK_QUEUE)
    async def host_task_queue(self, input: HostTaskQueueInput) -> None:
        """The mount task's node_tasks row, on the allocation's timeline."""
        async with transaction(self._sessions) as session:
            attachment = await session.get(StorageAttachment, uuid.UUID(input.attachment_id))
            assert attachment is not None
            await queue_task(
                session,
                input.task_id,
                attachment.allocation_id,
                attachment.node_id,
                input.kind,
                input.workflow_id,
            )

    @activity.defn(name=HOST_TASK_FINISH)
    async def host_task_finish(self, input: HostTaskFinishInput) -> None:
        result = input.mount or input.unmount
        output: dict[str, Any] = {}
        if input.mount is not None:
            output = {"mount_path": input.mount.mount_path, "read_only": input.mount.read_only}
        elif input.unmount is not None:
            output = {"was_mounted": input.unmount.was_mounted}
        async with transaction(self._sessions) as session:
            await record_task_outcome(
                session,
                uuid.UUID(input.task_id),
                NodeTaskStatus.FAILED if input.error_type else NodeTaskStatus.COMPLETED,
                started_at=result.started_at if result else None,
                finished_at=result.finished_at if result else None,
                phases=result.phases if result else input.phases,
                output=output,
                error_type=input.error_type,
                error_message=input.error_message,
            )

    # ------------------------------------------------------------------ allocation release

    @activity.defn(name=DETACH_FOR_RELEASE)
    async def detach_for_release(self, input: DetachForReleaseInput) -> DetachForReleaseResult:
        """Every attachment of the allocation not yet detached is detached through its own
        workflow, and waited for. Called after the allocation became `releasing`, which no new
        attachment can open against (attachment_open holds the allocation row). Any that ends
        detach_failed fails the release (its node still has the mount)."""
        async with transaction(self._sessions) as session:
            rows = list(
                await session.execute(
                    select(StorageAttachment.id, StorageAttachment.workflow_id).where(
                        StorageAttachment.allocation_id == uuid.UUID(input.allocation_id),
                        StorageAttachment.status != AttachmentStatus.DETACHED,
                    )
                )
            )
        request = DetachRequest(DetachActor.ALLOCATION_RELEASE, input.reason, wait=True)
        heartbeats = asyncio.create_task(self._heartbeat())
        try:
            views = await asyncio.gather(
                *(self._detach(str(row.id), row.workflow_id, request) for row in rows)
            )
        finally:
            heartbeats.cancel()
        result = DetachForReleaseResult()
        for view in views:
            if view.status == AttachmentStatus.DETACHED:
                result.detached.append(view.attachment_id)
            else:
                result.failed.append(view.attachment_id)
        if result.failed:
            raise ApplicationError(
                f"{len(result.failed)} storage attachment(s) did not detach",
                {"failed": result.failed},
                type=STORAGE_DETACH_FAILED,
                non_retryable=True,
            )
        return result

    async def _detach(
        self, attachment_id: str, workflow_id: str, request: DetachRequest
    ) -> AttachmentView:
        handle = self._client.get_workflow_handle(workflow_id)
        try:
            view: AttachmentView = await handle.execute_update(
                DETACH_UPDATE, request, result_type=AttachmentView
            )
            return view
        except (RPCError, WorkflowUpdateFailedError) as err:
            if isinstance(err, RPCError) and err.status != RPCStatusCode.NOT_FOUND:
                raise
        # Its workflow has closed: it ended detached (the only way it closes).
        async with transaction(self._sessions) as session:
            row = await session.get(StorageAttachment, uuid.UUID(attachment_id))
            assert row is not None
            return attachment_view(row)

    async def _heartbeat(self) -> None:
        timeout = activity.info().heartbeat_timeout
        interval = timeout.total_seconds() / 3 if timeout else _HEARTBEAT_S
        while True:
            activity.heartbeat()
            await asyncio.sleep(interval)
