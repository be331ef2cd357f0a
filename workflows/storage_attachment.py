"""StorageAttachmentWorkflow `storage-attachment-{id}` (docs/lifecycles/storage-attachment.md): one
project-owned storage namespace bound to one allocation's node.

    requested → prechecking → grant_applying → grant_applied → mounting → mounted
    mounted → detaching → detached
    requested|prechecking → failed; grant_applying|grant_applied|mounting → failed
    mounted|detaching → detach_failed; failed|detach_failed → detaching → detached

The gateway starts it with update-with-start (`open`): the first activity puts the attachment on
record (or refuses: no such namespace, allocation not active) and the update hands that back to
the HTTP call. The provider measures the namespace (one that cannot be measured fails the
attachment while it is still `requested`), the precheck decides the write mode against that
quota posture and other writers, the provider grants the node access, and the node's agent
mounts it (a typed host task on `node-{id}`). Then the workflow waits for a detach (`detach`
update: the tenant, an admin retry of a stuck attachment, or the allocation's release), which
unmounts on the node and revokes the grant. A detach asked for before the mount began stops the
attach once the grant is applied (grant_applied → failed) and then detaches; one asked for
while the mount runs waits for it. A detach whose node is offline fails at once (mounted →
detach_failed: nothing can unmount there). A failed detach waits for the next one; the workflow
ends when the attachment is detached. Nothing here deletes the namespace's data.

An admin's `abandon` update (issue 35) is the way out of detach_failed on a node that never comes
back: the workflow observes the node now (its agent not heard from within the liveness window,
by recorded contact and its queue's pollers; or no node at all) and only then revokes the grant
without any unmount and ends the attachment detached, failure_reason `abandoned`, through
detaching as docs/lifecycles/storage-attachment.md has it. A node observed alive refuses
(`node_alive`: retry the detach), and nothing changes.

Every transition is applied by an activity as compare-and-set with an event row; the workflow
only decides what comes next.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.host_task_errors import host_task_non_retryable
    from contracts.host_tasks import (
        HOST_TASK_PROGRESS_SIGNAL,
        RECORD_TASK_PROGRESS,
        STORAGE_MOUNT,
        STORAGE_UNMOUNT,
        HostErrorType,
        HostTaskProgress,
        phases_of_failure,
    )
    from contracts.states import NodeStatus
    from contracts.storage import (
        ABANDON_PATCH,
        ABANDON_UPDATE,
        ATTACHMENT_ABANDONED,
        ATTACHMENT_DETACH_IN_PROGRESS,
        ATTACHMENT_NODE_OBSERVE,
        ATTACHMENT_NODE_STATUS,
        ATTACHMENT_NOT_DETACH_FAILED,
        ATTACHMENT_OPEN,
        ATTACHMENT_PRECHECK,
        ATTACHMENT_PRECHECK_WITH_USAGE,
        ATTACHMENT_TRANSITION,
        DETACH_BEFORE_MOUNT_CANCELS_PATCH,
        DETACH_UPDATE,
        DETACHED_ANSWERS_ALL_PATCH,
        DETACHED_BEFORE_MOUNT,
        GRANT_APPLY,
        GRANT_FAILED,
        GRANT_REVOKE,
        HOST_TASK_FINISH,
        HOST_TASK_QUEUE,
        MEASURE_BEFORE_PRECHECK_PATCH,
        MOUNT_FAILED,
        NAMESPACE_USAGE,
        NODE_OFFLINE,
        OFFLINE_NODE_FAILS_DETACH_PATCH,
        OPEN_REFUSALS,
        OPEN_UPDATE,
        PROVIDER_UNAVAILABLE,
        STATUS_QUERY,
        UNMOUNT_FAILED,
        WORKFLOW_NAME,
        AbandonRequest,
        AttachmentInput,
        AttachmentStatus,
        AttachmentView,
        DetachRequest,
        GrantInput,
        HostTaskFinishInput,
        HostTaskQueueInput,
        NodeObservation,
        NodeObserveInput,
        OpenInput,
        PrecheckInput,
        PrecheckResult,
        StorageMountInput,
        StorageMountResult,
        StorageUnmountInput,
        StorageUnmountResult,
        TransitionInput,
    )
    from core.task_queues import node_task_queue

_R = TypeVar("_R")
_DB = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=20)
# The provider's grant and revoke: a filesystem that is briefly away is retried, then it fails.
_PROVIDER_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=500), backoff_coefficient=2.0, maximum_attempts=5
)
_HOST_NON_RETRYABLE = host_task_non_retryable(
    e.value
    for e in (
        HostErrorType.INVALID_SPEC,
        HostErrorType.UNSAFE_PATH,
        HostErrorType.UNSUPPORTED,
        HostErrorType.NODE_DRAINING,
    )
)
# What a refused open answers the gateway with (it maps these to HTTP); "not_found" as well.
_OPEN_REFUSALS = frozenset({*OPEN_REFUSALS, "not_found"})


@workflow.defn(name=WORKFLOW_NAME)
class StorageAttachmentWorkflow:
    @workflow.init
    def __init__(self, input: AttachmentInput) -> None:
        self._input = input
        self._view: AttachmentView | None = None
        self._rejection: ApplicationError | None = None
        self._mount_attempted = False
        self._allocation_shape = ""  # the precheck's answer (SkuShape)
        # Detach requests accepted, and how many of them a finished detach run has answered.
        self._detach_requests = 0
        self._detaches_answered = 0
        self._next_detach: DetachRequest | None = None
        # The abandon being decided (one at a time) and its answer: the view or the refusal.
        self._abandon: AbandonRequest | None = None
        self._abandon_answer: AttachmentView | ApplicationError | None = None

    # ------------------------------------------------------------------ handlers

    @workflow.update(name=OPEN_UPDATE)
    async def open(self) -> AttachmentView:
        await workflow.wait_condition(lambda: self._view is not None or self._rejection is not None)
        if self._rejection is not None:
            raise self._rejection
        assert self._view is not None
        return self._view

    @workflow.update(name=DETACH_UPDATE)
    async def detach(self, request: DetachRequest) -> AttachmentView:
        assert self._view is not None
        if self._view.status == AttachmentStatus.DETACHED:
            return self._view
        self._detach_requests += 1
        ticket = self._detach_requests
        self._next_detach = request
        if request.wait:
            await workflow.wait_condition(lambda: self._detaches_answered >= ticket)
        return self._view

    @detach.validator
    def _validate_detach(self, request: DetachRequest) -> None:
        if self._view is None:
            raise ApplicationError(
                "the attachment was refused or is not on record yet", type="not_found"
            )

    @workflow.update(name=ABANDON_UPDATE)
    async def abandon(self, request: AbandonRequest) -> AttachmentView:
        """Decided by the run loop (so no detach runs beside it); answers the detached view or
        raises the refusal (NODE_ALIVE, NODE_LIVENESS_UNKNOWN, GRANT_FAILED)."""
        self._abandon = request
        self._abandon_answer = None
        await workflow.wait_condition(lambda: self._abandon_answer is not None)
        answer = self._abandon_answer
        self._abandon, self._abandon_answer = None, None
        if isinstance(answer, ApplicationError):
            raise answer
        assert answer is not None
        return answer

    @abandon.validator
    def _validate_abandon(self, request: AbandonRequest) -> None:
        """Refused before anything is written: only a detach_failed attachment with no detach
        or abandon in progress."""
        if self._view is None:
            raise ApplicationError(
                "the attachment was refused or is not on record yet", type="not_found"
            )
        if self._view.status != AttachmentStatus.DETACH_FAILED:
            raise ApplicationError(
                f"the attachment is {self._view.status}; only a detach_failed one is abandoned",
                {"status": self._view.status},
                type=ATTACHMENT_NOT_DETACH_FAILED,
            )
        if self._abandon is not None or self._detach_pending():
            raise ApplicationError(
                "a detach or an abandon of this attachment is in progress",
                {"status": self._view.status},
                type=ATTACHMENT_DETACH_IN_PROGRESS,
            )

    @workflow.signal(name=HOST_TASK_PROGRESS_SIGNAL)
    async def host_task_progress(self, report: HostTaskProgress) -> None:
        """The agent's report of a mount or unmount attempt, recorded for the timeline."""
        await workflow.execute_local_activity(
            RECORD_TASK_PROGRESS, report, start_to_close_timeout=_DB, retry_policy=_DB_RETRY
        )

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> AttachmentView | None:
        return self._view

    # ------------------------------------------------------------------ lifecycle

    @workflow.run
    async def run(self, input: AttachmentInput) -> AttachmentView:
        if not await self._open(input):
            assert self._rejection is not None
            return AttachmentView(
                input.attachment_id, "rejected", failure_reason=self._rejection.type
            )
        await self._attach(input)
        while True:
            await workflow.wait_condition(lambda: self._detach_pending() or self._abandon_pending())
            if self._abandon_pending():
                if await self._abandon_run(input):
                    # Detached: every detach request accepted meanwhile is answered by it.
                    self._detaches_answered = self._detach_requests
                    break
                continue
            answered = self._detach_requests
            request = self._next_detach
            assert request is not None
            detached = await self._detach(input, request)
            # Detached answers every request, also those accepted while this run went on (the
            # allocation's release may ask while the tenant's detach runs); a failed run leaves
            # those for the next run.
            late = self._detach_requests > answered
            if detached and late and workflow.patched(DETACHED_ANSWERS_ALL_PATCH):
                answered = self._detach_requests
            self._detaches_answered = answered
            if detached:
                break
        await workflow.wait_condition(workflow.all_handlers_finished)
        assert self._view is not None
        return self._view

    async def _open(self, input: AttachmentInput) -> bool:
        try:
            self._view = await workflow.execute_activity(
                ATTACHMENT_OPEN,
                OpenInput(
                    attachment_id=input.attachment_id,
                    project_id=input.project_id,
                    allocation_id=input.allocation_id,
                    namespace_id=input.namespace_id,
                    mode=input.mode,
                    workflow_id=workflow.info().workflow_id,
                    requested_by=input.requested_by,
                ),
                result_type=AttachmentView,
                start_to_close_timeout=_DB,
                retry_policy=_DB_RETRY,
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type in _OPEN_REFUSALS:
                self._rejection = ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                )
                return False
            raise
        return True

    async def _attach(self, input: AttachmentInput) -> None:
        if workflow.patched(MEASURE_BEFORE_PRECHECK_PATCH):
            try:
                usage: int = await workflow.execute_activity(
                    NAMESPACE_USAGE,
                    input.namespace_id,
                    result_type=int,
                    start_to_close_timeout=_DB,
                    retry_policy=_PROVIDER_RETRY,
                )
            except ActivityError as err:
                await self._fail(AttachmentStatus.FAILED, PROVIDER_UNAVAILABLE, err)
                return
            await self._transition(AttachmentStatus.PRECHECKING, actor=input.requested_by)
            check: PrecheckResult = await workflow.execute_activity(
                ATTACHMENT_PRECHECK_WITH_USAGE,
                PrecheckInput(input.attachment_id, usage),
                result_type=PrecheckResult,
                start_to_close_timeout=_DB,
                retry_policy=_DB_RETRY,
            )
        else:
            await self._transition(AttachmentStatus.PRECHECKING, actor=input.requested_by)
            check = await workflow.execute_activity(
                ATTACHMENT_PRECHECK,
                input.attachment_id,
                result_type=PrecheckResult,
                start_to_close_timeout=_DB,
                retry_policy=_DB_RETRY,
            )
        if check.refusal is not None:
            self._set(AttachmentStatus.FAILED, failure_reason=check.refusal, message=check.message)
            return
        self._allocation_shape = check.allocation_shape
        self._set(AttachmentStatus.GRANT_APPLYING)
        grant = GrantInput(input.attachment_id, check.namespace_key, check.node_id, input.mode)
        try:
            await workflow.execute_activity(
                GRANT_APPLY, grant, start_to_close_timeout=_DB, retry_policy=_PROVIDER_RETRY
            )
        except ActivityError as err:
            await self._fail(AttachmentStatus.FAILED, GRANT_FAILED, err)
            return
        await self._transition(AttachmentStatus.GRANT_APPLIED)
        if self._detach_pending() and workflow.patched(DETACH_BEFORE_MOUNT_CANCELS_PATCH):
            await self._transition(
                AttachmentStatus.FAILED,
                failure_reason=DETACHED_BEFORE_MOUNT,
                failure_message="a detach was asked for before the mount began",
            )
            return
        await self._transition(AttachmentStatus.MOUNTING)
        self._mount_attempted = True
        spec = StorageMountInput(
            task_id=str(workflow.uuid4()),
            attachment_id=input.attachment_id,
            allocation_id=input.allocation_id,
            node_id=check.node_id,
            provider=check.provider,
            namespace_key=check.namespace_key,
            mode=input.mode,
            allocation_shape=check.allocation_shape,
        )
        try:
            mounted: StorageMountResult = await self._host_task(
                STORAGE_MOUNT,
                spec,
                StorageMountResult,
                spec.node_id,
                input.policy.mount_max_attempts,
            )
        except ActivityError as err:
            await self._finish_task(HostTaskFinishInput(spec.task_id), err)
            await self._fail(AttachmentStatus.FAILED, MOUNT_FAILED, err)
            return
        await self._finish_task(HostTaskFinishInput(spec.task_id, mount=mounted))
        await self._transition(
            AttachmentStatus.MOUNTED,
            mount_path=mounted.mount_path,
            guest_mount_tag=mounted.guest_mount_tag,
        )

    async def _detach(self, input: AttachmentInput, request: DetachRequest) -> bool:
        """One detach run: unmount on the node (when a mount was ever attempted), revoke the
        grant; detached, or detach_failed to wait for the next request."""
        assert self._view is not None
        node_id = self._view.node_id
        unmount = self._mount_attempted and node_id is not None
        if unmount and workflow.patched(OFFLINE_NODE_FAILS_DETACH_PATCH):
            node_status: str = await workflow.execute_activity(
                ATTACHMENT_NODE_STATUS,
                input.attachment_id,
                result_type=str,
                start_to_close_timeout=_DB,
                retry_policy=_DB_RETRY,
            )
            if node_status == NodeStatus.OFFLINE:
                # Its agent is silent: the unmount would only wait out its schedule-to-start.
                # A mounted attachment says so at once; a failed one passes through detaching.
                if self._view.status != AttachmentStatus.MOUNTED:
                    await self._transition(
                        AttachmentStatus.DETACHING, actor=request.actor, reason=request.reason
                    )
                await self._transition(
                    AttachmentStatus.DETACH_FAILED,
                    actor=request.actor,
                    failure_reason=NODE_OFFLINE,
                    failure_message=f"node {node_id} is offline: its agent cannot unmount",
                )
                return False
        await self._transition(
            AttachmentStatus.DETACHING, actor=request.actor, reason=request.reason
        )
        if unmount:
            assert node_id is not None
            spec = StorageUnmountInput(
                task_id=str(workflow.uuid4()),
                attachment_id=input.attachment_id,
                allocation_id=input.allocation_id,
                node_id=node_id,
                allocation_shape=self._allocation_shape,
            )
            try:
                unmounted: StorageUnmountResult = await self._host_task(
                    STORAGE_UNMOUNT,
                    spec,
                    StorageUnmountResult,
                    node_id,
                    input.policy.unmount_max_attempts,
                )
            except ActivityError as err:
                await self._finish_task(HostTaskFinishInput(spec.task_id), err)
                await self._fail(AttachmentStatus.DETACH_FAILED, UNMOUNT_FAILED, err)
                return False
            await self._finish_task(HostTaskFinishInput(spec.task_id, unmount=unmounted))
        try:
            await workflow.execute_activity(
                GRANT_REVOKE,
                GrantInput(input.attachment_id, input.namespace_id, node_id or "", input.mode),
                start_to_close_timeout=_DB,
                retry_policy=_PROVIDER_RETRY,
            )
        except ActivityError as err:
            await self._fail(AttachmentStatus.DETACH_FAILED, GRANT_FAILED, err)
            return False
        await self._transition(AttachmentStatus.DETACHED, actor=request.actor)
        return True

    async def _abandon_run(self, input: AttachmentInput) -> bool:
        """One abandon: the node observed now; gone → detaching, the grant revoked (no unmount:
        nothing answers on that node), detached as `abandoned`. Answers the update."""
        request = self._abandon
        assert request is not None
        workflow.patched(ABANDON_PATCH)
        observed: NodeObservation = await workflow.execute_activity(
            ATTACHMENT_NODE_OBSERVE,
            NodeObserveInput(input.attachment_id, request.liveness_window_seconds),
            result_type=NodeObservation,
            start_to_close_timeout=_DB,
            retry_policy=_DB_RETRY,
        )
        if observed.refusal is not None:
            self._abandon_answer = ApplicationError(
                observed.message,
                {"node_id": observed.node_id, "node_status": observed.node_status,
                 "last_seen": observed.last_seen, "observed_at": observed.observed_at},
                type=observed.refusal,
                non_retryable=True,
            )  # fmt: skip
            return False
        await self._transition(
            AttachmentStatus.DETACHING, actor=request.actor, reason=f"abandon: {request.reason}"
        )
        try:
            await workflow.execute_activity(
                GRANT_REVOKE,
                GrantInput(input.attachment_id, input.namespace_id, observed.node_id, input.mode),
                start_to_close_timeout=_DB,
                retry_policy=_PROVIDER_RETRY,
            )
        except ActivityError as err:
            await self._fail(AttachmentStatus.DETACH_FAILED, GRANT_FAILED, err)
            error_type, message = _describe(err)
            self._abandon_answer = ApplicationError(
                f"the grant was not revoked: {error_type}: {message}",
                type=GRANT_FAILED,
                non_retryable=True,
            )
            return False
        await self._transition(
            AttachmentStatus.DETACHED,
            actor=request.actor,
            failure_reason=ATTACHMENT_ABANDONED,
            failure_message=f"abandoned on a node observed gone ({observed.message}): "
            f"{request.reason}",
        )
        self._abandon_answer = self._view
        return True

    # ------------------------------------------------------------------ steps

    async def _host_task(
        self,
        kind: str,
        spec: StorageMountInput | StorageUnmountInput,
        result_type: type[_R],
        node_id: str,
        attempts: int,
    ) -> _R:
        policy = self._input.policy
        await workflow.execute_activity(
            HOST_TASK_QUEUE,
            HostTaskQueueInput(
                self._input.attachment_id, spec.task_id, kind, workflow.info().workflow_id
            ),
            start_to_close_timeout=_DB,
            retry_policy=_DB_RETRY,
        )
        result: _R = await workflow.execute_activity(
            kind,
            spec,
            result_type=result_type,
            task_queue=node_task_queue(node_id),
            schedule_to_start_timeout=timedelta(seconds=policy.node_schedule_to_start_seconds),
            start_to_close_timeout=timedelta(seconds=policy.host_task_timeout_seconds),
            heartbeat_timeout=timedelta(seconds=policy.host_heartbeat_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=policy.retry_initial_seconds),
                backoff_coefficient=2.0,
                maximum_attempts=max(1, attempts),
                non_retryable_error_types=_HOST_NON_RETRYABLE,
            ),
        )
        return result

    async def _finish_task(
        self, finish: HostTaskFinishInput, error: ActivityError | None = None
    ) -> None:
        if error is not None:
            finish.error_type, finish.error_message = _describe(error)
            finish.phases = phases_of_failure(error)
        await workflow.execute_activity(
            HOST_TASK_FINISH, finish, start_to_close_timeout=_DB, retry_policy=_DB_RETRY
        )

    def _detach_pending(self) -> bool:
        return self._detach_requests > self._detaches_answered

    def _abandon_pending(self) -> bool:
        return self._abandon is not None and self._abandon_answer is None

    async def _fail(self, status: AttachmentStatus, reason: str, error: ActivityError) -> None:
        error_type, message = _describe(error)
        await self._transition(
            status, failure_reason=reason, failure_message=f"{error_type}: {message}"
        )

    async def _transition(
        self,
        status: AttachmentStatus,
        *,
        actor: str = "workflow",
        reason: str | None = None,
        failure_reason: str | None = None,
        failure_message: str | None = None,
        mount_path: str | None = None,
        guest_mount_tag: str | None = None,
    ) -> None:
        self._view = await workflow.execute_activity(
            ATTACHMENT_TRANSITION,
            TransitionInput(
                attachment_id=self._input.attachment_id,
                to_status=status.value,
                actor=actor,
                reason=reason,
                failure_reason=failure_reason,
                failure_message=failure_message,
                mount_path=mount_path,
                guest_mount_tag=guest_mount_tag,
            ),
            result_type=AttachmentView,
            start_to_close_timeout=_DB,
            retry_policy=_DB_RETRY,
        )

    def _set(
        self, status: AttachmentStatus, *, failure_reason: str | None = None, message: str = ""
    ) -> None:
        """A transition an activity already applied (the precheck's), mirrored here."""
        assert self._view is not None
        self._view.status = status.value
        if failure_reason is not None:
            self._view.failure_reason = failure_reason
            self._view.failure_message = message or None


def _describe(error: ActivityError) -> tuple[str, str]:
    cause = error.cause if error.cause is not None else error
    if isinstance(cause, ApplicationError):
        return cause.type or "application_error", cause.message
    return type(cause).__name__, str(cause)
