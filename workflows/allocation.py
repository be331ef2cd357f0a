"""AllocationWorkflow `allocation-{id}`: requested → provisioning → active → releasing → released,
with failed and release_failed side states (docs/lifecycles/allocation.md,
docs/lifecycles/allocation.md).

The gateway starts it with update-with-start: the first (local) activity places and reserves in one
transaction and the `reserve` update hands that outcome back to the HTTP call. Host work runs on the
node's own task queue. Every transition is applied by an activity as compare-and-set together with
an append-only event row; the workflow only decides what happens next.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    TimeoutError,
    TimeoutType,
)

with workflow.unsafe.imports_passed_through():
    from contracts.allocation import (
        AGENT_CAPABILITY_MISSING,
        DETACH_UPDATE,
        DETACHED,
        HOST_TIMEOUT,
        IDEMPOTENCY_KEY_REUSED,
        NODE_UNREACHABLE,
        NOT_DETACHABLE,
        NOT_RELEASABLE,
        PROVISIONING_ERROR,
        REJECTED,
        REJECTION_TYPES,
        RELEASE_UPDATE,
        RESERVE_UPDATE,
        STATUS_AT_START,
        STATUS_QUERY,
        WORKFLOW_NAME,
        AllocationInput,
        AllocationResult,
        AllocationView,
        DetachRequest,
        DetachResult,
        ReleaseAccepted,
        ReleaseRequest,
    )
    from contracts.allocation_activities import (
        ActivateInput,
        BeginProvisioningInput,
        BeginReleaseInput,
        DetachInput,
        FailProvisioningInput,
        FinishReleaseInput,
        PlaceInput,
        Placement,
        ProvisioningStart,
        ProvisionPlan,
        ReleasePlan,
        Reservation,
    )
    from contracts.allocation_group import (
        MEMBER_STATUS_PATCH,
        MEMBER_STATUS_SIGNAL,
        MemberStatus,
        allocation_group_workflow_id,
    )
    from contracts.host_task_errors import agent_capability_missing, host_task_non_retryable
    from contracts.host_tasks import (
        HOST_TASK_PROGRESS_SIGNAL,
        NON_RETRYABLE_HOST_ERRORS,
        RECORD_TASK_PROGRESS,
        HostErrorType,
        HostProvisionResult,
        HostReleaseInput,
        HostReleaseResult,
        HostTaskProgress,
        UnhealthyGpu,
        phases_of_failure,
    )
    from contracts.states import AllocationStatus, ReleaseActor
    from contracts.storage import (
        DETACH_FOR_RELEASE,
        RELEASE_DETACHES_STORAGE_PATCH,
        STORAGE_DETACH_FAILED,
        DetachForReleaseInput,
    )
    from contracts.terminal_session import (
        CLOSE_FOR_ALLOCATION,
        RELEASE_CLOSES_TERMINAL_SESSIONS,
        CloseForAllocationInput,
        CloseForAllocationResult,
    )
    from contracts.workflow_input import (
        MAX_ID_CHARS,
        check_text,
        text_problem,
        uuid_problem,
    )
    from core import search_attributes as sa
    from core.task_queues import node_task_queue

# Issue 37: a release with storage attached fences the tenant (host release) before it detaches
# the storage; histories recorded before it detached first.
RELEASE_FENCES_FIRST_PATCH = "release-fences-first"
# A host-task progress report that is malformed, or that cannot be recorded, is dropped with a
# warning instead of failing the workflow (issue 38).
PROGRESS_TOLERATED_PATCH = "host-task-progress-tolerated"

_LOCAL = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=20)
# Closing an allocation's terminal sessions: each waits at most its close timeout for the agent.
_TERMINAL_CLOSE_BUDGET = timedelta(minutes=2)


# Not sandboxed: every allocation's first workflow task is on the POST path, and the sandbox
# costs about a tenth of the worker's CPU there (the SDK re-enters it through `exec` for every
# payload it encodes). What the sandbox would catch (wall-clock time, randomness, I/O in workflow
# code) this module does not do: it calls only `workflow.*` and pure contract types, and its
# recorded histories are replayed in CI. The other workflows, off the hot path, stay sandboxed.
@workflow.defn(name=WORKFLOW_NAME, sandboxed=False)
class AllocationWorkflow:
    @workflow.init
    def __init__(self, input: AllocationInput) -> None:
        self._input = input
        self._status: str | None = None  # None until placement has answered
        self._reservation: Reservation | None = None
        self._rejection: ApplicationError | None = None
        self._failure_reason: str | None = None
        self._release_attempts = 0
        self._pending_release: ReleaseRequest | None = None
        self._release_running = False
        # An admin detach of a release_failed allocation: accepted, then done
        # (docs/lifecycles/allocation.md).
        self._detach: DetachRequest | None = None
        self._detached: DetachResult | None = None
        # A group member's status reports to its group, awaited before the workflow ends.
        self._group_reports: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ handlers

    @workflow.update(name=RESERVE_UPDATE)
    async def reserve(self, request_fingerprint: str) -> Reservation:
        if request_fingerprint != self._input.request_fingerprint:
            raise ApplicationError(
                "this idempotency key was already used with a different request body",
                type=IDEMPOTENCY_KEY_REUSED,
                non_retryable=True,
            )
        await workflow.wait_condition(
            lambda: self._reservation is not None or self._rejection is not None
        )
        if self._rejection is not None:
            raise self._rejection
        assert self._reservation is not None
        return self._reservation

    @reserve.validator
    def _validate_reserve(self, request_fingerprint: str) -> None:
        # Refused before it enters history; the handler checks again (histories from before).
        if request_fingerprint != self._input.request_fingerprint:
            raise ApplicationError(
                "this idempotency key was already used with a different request body",
                type=IDEMPOTENCY_KEY_REUSED,
                non_retryable=True,
            )

    @workflow.update(name=RELEASE_UPDATE)
    async def request_release(self, request: ReleaseRequest) -> ReleaseAccepted:
        prior = self._status or AllocationStatus.REQUESTED
        if self._detach is not None:
            # A detach is ending it (released): there is no release left to run.
            return ReleaseAccepted(
                self._input.allocation_id, prior, AllocationStatus.RELEASED, False
            )
        if prior == AllocationStatus.RELEASING and request.force:
            # docs/lifecycles/allocation.md: an admin force-release is a new attempt. One that
            # arrives while a release runs waits for it: if that one ends release_failed, this one
            # runs next.
            self._pending_release = request
            return ReleaseAccepted(self._input.allocation_id, prior, prior, True)
        if prior in (AllocationStatus.RELEASING, AllocationStatus.RELEASED):
            return ReleaseAccepted(self._input.allocation_id, prior, prior, False)
        if prior in (AllocationStatus.REQUESTED, AllocationStatus.PROVISIONING):
            # Released as soon as provisioning settles: a tenant may cancel early.
            self._pending_release = request
            return ReleaseAccepted(self._input.allocation_id, prior, prior, True)
        self._pending_release = request
        return ReleaseAccepted(self._input.allocation_id, prior, AllocationStatus.RELEASING, False)

    @request_release.validator
    def _validate_release(self, request: ReleaseRequest) -> None:
        if request.actor not in {a.value for a in ReleaseActor}:
            raise ApplicationError(f"unknown release actor {request.actor!r}", type="invalid_actor")
        check_text("reason", request.reason)
        if self._rejection is not None or self._status == AllocationStatus.FAILED:
            raise ApplicationError(
                f"allocation is {self._status or 'rejected'}; there is nothing to release",
                type=NOT_RELEASABLE,
            )

    @workflow.update(name=DETACH_UPDATE)
    async def detach(self, request: DetachRequest) -> DetachResult:
        """docs/lifecycles/allocation.md's "admin removes the assignment" for a release_failed
        allocation whose node cannot clean up: the lifecycle loop ends it `released` by quarantining
        what it held. A repeated detach answers the first one's result."""
        if self._detach is None:
            self._detach = request
        await workflow.wait_condition(lambda: self._detached is not None)
        assert self._detached is not None
        return self._detached

    @detach.validator
    def _validate_detach(self, request: DetachRequest) -> None:
        if request.actor not in {a.value for a in ReleaseActor}:
            raise ApplicationError(f"unknown detach actor {request.actor!r}", type="invalid_actor")
        check_text("reason", request.reason)
        if self._detach is not None:
            return  # accepted before: answered with its result
        idle = self._pending_release is None and not self._release_running
        if self._status != AllocationStatus.RELEASE_FAILED or not idle:
            status = self._status or "rejected"
            if self._status == AllocationStatus.RELEASE_FAILED:
                status = AllocationStatus.RELEASING  # a retry is queued or running
            raise ApplicationError(
                f"allocation is {status}; only a release_failed allocation can be detached",
                type=NOT_DETACHABLE,
            )

    @workflow.signal(name=HOST_TASK_PROGRESS_SIGNAL)
    async def host_task_progress(self, report: HostTaskProgress) -> None:
        """The node's agent started an attempt of one of this workflow's host tasks, or its
        phases moved on: recorded for the timeline (docs/lifecycles/allocation.md#task-timeline),
        nothing decided on it. A report that is malformed, or that still cannot be recorded after
        the retries, is dropped with a warning: a signal can never fail this workflow (issue 38)."""
        problem = _progress_problem(report)
        if problem is not None and workflow.patched(PROGRESS_TOLERATED_PATCH):
            workflow.logger.warning("host task progress dropped: %s", problem)
            return
        try:
            await workflow.execute_local_activity(
                RECORD_TASK_PROGRESS, report, start_to_close_timeout=_LOCAL, retry_policy=_DB_RETRY
            )
        except ActivityError as err:
            if not workflow.patched(PROGRESS_TOLERATED_PATCH):
                raise
            workflow.logger.warning("host task progress not recorded: %s", err)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> AllocationView:
        return AllocationView(
            allocation_id=self._input.allocation_id,
            status=self._status or "placing",
            node_id=self._reservation.node_id if self._reservation else None,
            failure_reason=self._failure_reason,
            release_attempts=self._release_attempts,
            release_pending=self._pending_release is not None,
        )

    # ------------------------------------------------------------------ lifecycle

    @workflow.run
    async def run(self, input: AllocationInput) -> AllocationResult:
        result = await self._lifecycle(input)
        await asyncio.gather(*self._group_reports)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return result

    async def _lifecycle(self, input: AllocationInput) -> AllocationResult:
        placement = await self._place(input)
        if placement is None:
            assert self._rejection is not None
            self._mark_rejected()
            return AllocationResult(input.allocation_id, REJECTED, self._rejection.type)
        reservation = self._reservation = placement.reservation
        self._set_status(AllocationStatus.REQUESTED)
        # A placement recorded by an older build created the allocation already `provisioning`
        # (its history then goes on with the host task). Not workflow.patched(): its marker
        # upserts a search attribute, a visibility write per allocation.
        requested = placement.allocation_status == AllocationStatus.REQUESTED
        if requested and not await self._begin_provisioning(input, placement.plan):
            return AllocationResult(
                input.allocation_id, AllocationStatus.FAILED, self._failure_reason
            )

        if not await self._provision(input, reservation, placement.plan):
            return AllocationResult(
                input.allocation_id, AllocationStatus.FAILED, self._failure_reason
            )

        while True:
            await workflow.wait_condition(
                lambda: self._pending_release is not None or self._detach is not None
            )
            if self._detach is not None:
                await self._detach_after_release_failed(input, self._detach)
                return AllocationResult(input.allocation_id, AllocationStatus.RELEASED, DETACHED)
            request, self._pending_release = self._pending_release, None
            assert request is not None
            self._release_running = True
            released = await self._release(input, reservation, request)
            self._release_running = False
            if released:
                return AllocationResult(input.allocation_id, AllocationStatus.RELEASED)

    async def _place(self, input: AllocationInput) -> Placement | None:
        try:
            placement: Placement = await workflow.execute_local_activity(
                "allocation.place",
                PlaceInput(
                    allocation_id=input.allocation_id,
                    project_id=input.project_id,
                    sku=input.sku,
                    gpus=input.gpus,
                    region=input.region,
                    ssh_key_ids=input.ssh_key_ids,
                    idempotency_key=input.idempotency_key,
                    workflow_id=workflow.info().workflow_id,
                    provision_task_id=str(workflow.uuid4()),
                    allocation_group_id=input.allocation_group_id,
                    same_node_forbidden=input.same_node_forbidden,
                ),
                result_type=Placement,
                start_to_close_timeout=_LOCAL,
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=200),
                    maximum_attempts=10,
                    non_retryable_error_types=list(REJECTION_TYPES),
                ),
            )
            return placement
        except (ActivityError, ApplicationError) as err:
            # A local activity's non-retryable ApplicationError reaches the workflow unwrapped.
            cause = err.cause if isinstance(err, ActivityError) else err
            if isinstance(cause, ApplicationError) and cause.type in REJECTION_TYPES:
                self._rejection = ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                )
                return None
            raise

    async def _begin_provisioning(self, input: AllocationInput, plan: ProvisionPlan) -> bool:
        """requested → provisioning, or → failed when the reserved node left service meanwhile.
        A regular activity, not a local one: the POST's workflow task answers with the
        reservation without waiting for it."""
        start: ProvisioningStart = await workflow.execute_activity(
            "allocation.begin_provisioning",
            BeginProvisioningInput(input.allocation_id, plan.task_id),
            result_type=ProvisioningStart,
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )
        if not start.started:
            self._failure_reason = start.reason
            self._set_status(AllocationStatus.FAILED)
        return start.started

    async def _provision(
        self, input: AllocationInput, reservation: Reservation, plan: ProvisionPlan
    ) -> bool:
        self._set_status(AllocationStatus.PROVISIONING)
        policy = input.policy
        try:
            result: HostProvisionResult = await workflow.execute_activity(
                plan.task_kind,
                plan.spec,
                result_type=HostProvisionResult,
                task_queue=node_task_queue(reservation.node_id),
                schedule_to_start_timeout=timedelta(seconds=policy.node_schedule_to_start_seconds),
                start_to_close_timeout=timedelta(seconds=policy.host_provision_timeout_seconds),
                heartbeat_timeout=timedelta(seconds=policy.host_heartbeat_timeout_seconds),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=1),
                    maximum_attempts=max(1, policy.lease_conflict_max_attempts),
                    non_retryable_error_types=host_task_non_retryable(
                        e.value for e in NON_RETRYABLE_HOST_ERRORS
                    ),
                ),
            )
        except ActivityError as err:
            reason, message = _classify_provisioning_failure(err, plan.task_kind)
            self._failure_reason = reason
            # The claims are freed only when the host proves the cleanup; an unreachable node
            # cannot run it, so what the allocation held is quarantined instead.
            cleanup = _Cleanup(proven=False, error=f"{NODE_UNREACHABLE}: cleanup could not run")
            if reason != NODE_UNREACHABLE:
                cleanup = await self._cleanup_after_failed_provision(input, reservation, plan)
            await workflow.execute_local_activity(
                "allocation.fail_provisioning",
                FailProvisioningInput(
                    input.allocation_id,
                    plan.task_id,
                    reason,
                    message,
                    cleanup_proven=cleanup.proven,
                    cleanup_error=cleanup.error,
                    unhealthy_gpus=cleanup.unhealthy_gpus,
                    phases=phases_of_failure(err),
                ),
                start_to_close_timeout=_LOCAL,
                retry_policy=_DB_RETRY,
            )
            self._set_status(AllocationStatus.FAILED)
            return False
        await workflow.execute_local_activity(
            "allocation.activate",
            ActivateInput(input.allocation_id, plan.task_id, result),
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )
        self._set_status(AllocationStatus.ACTIVE)
        return True

    async def _cleanup_after_failed_provision(
        self, input: AllocationInput, reservation: Reservation, plan: ProvisionPlan
    ) -> _Cleanup:
        """A host release, retried as a release is, so a half-built VM or user does not outlive
        its claim; whether the host proved it decides whether the claims are freed or
        quarantined (an operator then finishes the cleanup)."""
        release = await self._begin_release_task(input, ReleaseRequest(ReleaseActor.ADMIN), False)
        try:
            result = await self._host_release(
                input, reservation, release, attempts=input.policy.release_max_attempts
            )
        except ActivityError as err:
            workflow.logger.warning("cleanup after failed provisioning did not finish: %s", err)
            await self._finish_release(input, release, None, err, final=False)
            return _Cleanup(proven=False, error=": ".join(_describe_error(err, release.task_kind)))
        if not result.cleanup_proven:
            unproven = ApplicationError(
                "host reported release without proof of cleanup", type=HostErrorType.RELEASE_ERROR
            )
            await self._finish_release(input, release, result, unproven, final=False)
            return _Cleanup(proven=False, error=": ".join(_describe_error(unproven)))
        await self._finish_release(input, release, result, None, final=False)
        return _Cleanup(proven=True, unhealthy_gpus=list(result.unhealthy_gpus))

    async def _release(
        self, input: AllocationInput, reservation: Reservation, request: ReleaseRequest
    ) -> bool:
        plan = await self._begin_release_task(input, request, True)
        self._set_status(AllocationStatus.RELEASING)
        self._release_attempts += 1
        # docs/lifecycles/terminal-session.md: a live terminal session is closed first
        # (allocation_released, its ack or the close timeout), then the release goes on. The
        # allocation is `releasing` by now, so no new session opens behind this.
        if _release_step_needed(plan.live_terminal_sessions, RELEASE_CLOSES_TERMINAL_SESSIONS):
            await self._close_terminal_sessions(input)
        # Issue 37: with storage attached, the tenant is fenced first (its VM stopped, or its
        # user locked and its processes ended) and the storage detached after; asked only when
        # the plan counted attachments, so a release without storage writes no patch marker.
        if plan.storage_attachments and workflow.patched(RELEASE_FENCES_FIRST_PATCH):
            return await self._fence_then_detach(input, reservation, request, plan)
        try:
            # Histories recorded before issue 37 (and plans from older builds, with no count):
            # the storage attachments were detached first; one that did not detach failed the
            # release before the host release ran.
            if _release_step_needed(plan.storage_attachments, RELEASE_DETACHES_STORAGE_PATCH):
                await self._detach_storage(input, request)
            result = await self._host_release(
                input,
                reservation,
                plan,
                attempts=input.policy.release_max_attempts,
                force=request.force,
            )
        except ActivityError as err:
            await self._finish_release(input, plan, None, err, final=True)
            self._set_status(AllocationStatus.RELEASE_FAILED)
            return False
        if not result.cleanup_proven:
            unproven = ApplicationError(
                "host reported release without proof of cleanup", type=HostErrorType.RELEASE_ERROR
            )
            await self._finish_release(input, plan, result, unproven, final=True)
            self._set_status(AllocationStatus.RELEASE_FAILED)
            return False
        await self._finish_release(input, plan, result, None, final=True)
        self._set_status(AllocationStatus.RELEASED)
        return True

    async def _fence_then_detach(
        self,
        input: AllocationInput,
        reservation: Reservation,
        request: ReleaseRequest,
        plan: ReleasePlan,
    ) -> bool:
        """Fence first, then clean (issue 37): the host release ends the tenant's access to the
        compute before the storage is detached, so a mount the tenant keeps busy cannot keep its
        VM or user running. Billing stops once the host release succeeded (the tenant is
        fenced). A detach that fails then ends the release `release_failed` with the tenant
        fenced and the host task recorded succeeded; the failure reason says the storage step
        failed. A host release that fails still detaches what it can, then fails the release."""
        try:
            result = await self._host_release(
                input,
                reservation,
                plan,
                attempts=input.policy.release_max_attempts,
                force=request.force,
            )
        except ActivityError as err:
            await self._detach_storage_after_unfenced_release(input, request)
            await self._finish_release(input, plan, None, err, final=True)
            self._set_status(AllocationStatus.RELEASE_FAILED)
            return False
        if not result.cleanup_proven:
            unproven = ApplicationError(
                "host reported release without proof of cleanup", type=HostErrorType.RELEASE_ERROR
            )
            await self._detach_storage_after_unfenced_release(input, request)
            await self._finish_release(input, plan, result, unproven, final=True)
            self._set_status(AllocationStatus.RELEASE_FAILED)
            return False
        await self._finish_release(input, plan, result, None, final=False, fenced=True)
        try:
            await self._detach_storage(input, request)
        except ActivityError as err:
            await self._finish_release(input, plan, result, err, final=True, task_recorded=True)
            self._set_status(AllocationStatus.RELEASE_FAILED)
            return False
        await self._finish_release(input, plan, result, None, final=True, task_recorded=True)
        self._set_status(AllocationStatus.RELEASED)
        return True

    async def _detach_storage_after_unfenced_release(
        self, input: AllocationInput, request: ReleaseRequest
    ) -> None:
        """The host release failed: the storage is still detached (a failed detach is on the
        attachment's own record, for the admin's retry); the release fails on the host error."""
        try:
            await self._detach_storage(input, request)
        except ActivityError as err:
            workflow.logger.warning("storage not detached after a failed host release: %s", err)

    async def _close_terminal_sessions(self, input: AllocationInput) -> None:
        """Each session's workflow bounds its own wait for the agent (its close timeout); a
        close that still fails does not hold the release up: the host release ends the
        tenant's processes anyway."""
        try:
            await workflow.execute_activity(
                CLOSE_FOR_ALLOCATION,
                CloseForAllocationInput(input.allocation_id),
                result_type=CloseForAllocationResult,
                start_to_close_timeout=_TERMINAL_CLOSE_BUDGET,
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:
            workflow.logger.warning("terminal sessions not closed before release: %s", err)

    async def _detach_storage(self, input: AllocationInput, request: ReleaseRequest) -> None:
        """Every storage attachment of the allocation detached, each by its own workflow
        (activities/storage.py); raises when one ends detach_failed."""
        policy = input.policy
        await workflow.execute_activity(
            DETACH_FOR_RELEASE,
            DetachForReleaseInput(input.allocation_id, request.reason),
            start_to_close_timeout=timedelta(
                seconds=policy.node_schedule_to_start_seconds
                + policy.host_provision_timeout_seconds
            ),
            heartbeat_timeout=timedelta(seconds=policy.host_heartbeat_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=policy.release_retry_initial_seconds),
                maximum_attempts=max(1, policy.release_max_attempts),
                non_retryable_error_types=[STORAGE_DETACH_FAILED],
            ),
        )

    async def _detach_after_release_failed(
        self, input: AllocationInput, request: DetachRequest
    ) -> None:
        """release_failed → released without a cleanup the host proved: the activity
        quarantines the node (bare metal) or the GPU slots (slice) and only then frees the
        claims; billing stays closed (it stopped at release_failed)."""
        self._detached = await workflow.execute_local_activity(
            "allocation.detach",
            DetachInput(input.allocation_id, request.actor, request.reason),
            result_type=DetachResult,
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )
        self._set_status(AllocationStatus.RELEASED)

    async def _begin_release_task(
        self, input: AllocationInput, request: ReleaseRequest, transition: bool
    ) -> ReleasePlan:
        plan: ReleasePlan = await workflow.execute_local_activity(
            "allocation.begin_release",
            BeginReleaseInput(
                allocation_id=input.allocation_id,
                workflow_id=workflow.info().workflow_id,
                actor=request.actor,
                reason=request.reason,
                task_id=str(workflow.uuid4()),
                transition=transition,
            ),
            result_type=ReleasePlan,
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )
        return plan

    async def _host_release(
        self,
        input: AllocationInput,
        reservation: Reservation,
        plan: ReleasePlan,
        *,
        attempts: int,
        force: bool = False,
    ) -> HostReleaseResult:
        policy = input.policy
        spec = HostReleaseInput(
            task_id=plan.task_id,
            allocation_id=input.allocation_id,
            node_id=reservation.node_id,
            shape=reservation.shape,
            username=plan.username,
            force=force,
        )
        result: HostReleaseResult = await workflow.execute_activity(
            plan.task_kind,
            spec,
            result_type=HostReleaseResult,
            task_queue=node_task_queue(reservation.node_id),
            schedule_to_start_timeout=timedelta(seconds=policy.node_schedule_to_start_seconds),
            start_to_close_timeout=timedelta(seconds=policy.host_provision_timeout_seconds),
            heartbeat_timeout=timedelta(seconds=policy.host_heartbeat_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=policy.release_retry_initial_seconds),
                backoff_coefficient=2.0,
                maximum_attempts=max(1, attempts),
                non_retryable_error_types=host_task_non_retryable(
                    [HostErrorType.INVALID_SPEC.value]
                ),
            ),
        )
        return result

    async def _finish_release(
        self,
        input: AllocationInput,
        plan: ReleasePlan,
        result: HostReleaseResult | None,
        error: BaseException | None,
        *,
        final: bool,
        fenced: bool = False,
        task_recorded: bool = False,
    ) -> None:
        error_type, message = (
            (None, None) if error is None else _describe_error(error, plan.task_kind)
        )
        await workflow.execute_local_activity(
            "allocation.finish_release",
            FinishReleaseInput(
                allocation_id=input.allocation_id,
                task_id=plan.task_id,
                result=result,
                error_type=error_type,
                error_message=message,
                transition=final,
                phases=[] if error is None else phases_of_failure(error),
                fenced=fenced,
                task_recorded=task_recorded,
            ),
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )

    # Search attributes mirror the allocation in Temporal Web. A workflow is started with the
    # status it heads for once placed (STATUS_AT_START: `provisioning`, which follows
    # `requested` at once), so nothing is upserted while the POST waits or when provisioning
    # begins: an upsert is a second visibility write per allocation. NodeId is
    # therefore upserted with the next status (active, failed, releasing); until then the node
    # is the task queue (`node-{id}`) of the pending host activity, and the read model has it.
    # Workflows an older gateway started as `requested` upsert `provisioning` with NodeId as
    # they always did: the rules below compare with the attributes in the workflow's own
    # history, so replay of those histories issues the same commands.
    def _set_status(self, status: AllocationStatus) -> None:
        self._status = status
        self._report_to_group(status)
        if status == AllocationStatus.REQUESTED:
            return  # placement answered; the attribute already reads `provisioning`, next
        current = workflow.info().typed_search_attributes
        if current.get(sa.ALLOCATION_STATUS) == status.value:
            return
        updates = [sa.ALLOCATION_STATUS.value_set(status.value)]
        if self._reservation is not None and current.get(sa.NODE_ID) is None:
            updates.append(sa.NODE_ID.value_set(self._reservation.node_id))
        workflow.upsert_search_attributes(updates)

    def _report_to_group(self, status: AllocationStatus) -> None:
        """A group member tells its AllocationGroupWorkflow each status it reaches
        (docs/lifecycles/allocation-group.md: the group's status is derived from its members').
        Allocations outside a group, and every history recorded before groups, issue nothing
        here."""
        group_id = self._input.allocation_group_id
        if group_id is None or not workflow.patched(MEMBER_STATUS_PATCH):
            return
        report = MemberStatus(self._input.allocation_id, status.value, self._failure_reason)
        self._group_reports.append(asyncio.create_task(self._signal_group(group_id, report)))

    async def _signal_group(self, group_id: str, report: MemberStatus) -> None:
        group = workflow.get_external_workflow_handle(allocation_group_workflow_id(group_id))
        try:
            await group.signal(MEMBER_STATUS_SIGNAL, report)
        except ApplicationError as err:  # the group has ended: nothing is waiting for this
            workflow.logger.warning("group %s not told of %s: %s", group_id, report.status, err)

    def _mark_rejected(self) -> None:
        """A refused placement created nothing; its workflow must not read `provisioning`."""
        current = workflow.info().typed_search_attributes
        if current.get(sa.ALLOCATION_STATUS) == STATUS_AT_START:
            workflow.upsert_search_attributes([sa.ALLOCATION_STATUS.value_set(REJECTED)])


@dataclass
class _Cleanup:
    """How the host cleanup after a failed provision went."""

    proven: bool
    error: str = ""  # why it is not proven: "error_type: message"
    unhealthy_gpus: list[UnhealthyGpu] = field(default_factory=list)


def _release_step_needed(counted: int | None, legacy_patch: str) -> bool:
    """Whether a release closes terminal sessions or detaches storage before its host task: when
    begin_release counted any (a release with neither runs no activity and writes no patch
    marker, whose TemporalChangeVersion upsert is a visibility write). None: a plan recorded by an
    older build, whose release decided by this patch marker (kept so its histories replay)."""
    return workflow.patched(legacy_patch) if counted is None else counted > 0


def _describe_error(error: BaseException, kind: str = "") -> tuple[str, str]:
    missing = agent_capability_missing(error, kind)
    if missing is not None:
        return AGENT_CAPABILITY_MISSING, missing
    cause = error.cause if isinstance(error, ActivityError) and error.cause else error
    if isinstance(cause, ApplicationError):
        return cause.type or "application_error", cause.message
    if isinstance(cause, TimeoutError):
        timeout = cause.type.name.lower() if cause.type else "timeout"
        return f"timeout_{timeout}", str(cause)
    return type(cause).__name__, str(cause)


def _classify_provisioning_failure(err: ActivityError, kind: str) -> tuple[str, str]:
    """Map a failed host provision to
    docs/lifecycles/allocation.md#failures-and-recommended-actions's failure reasons: the host's own
    error type (vfio_error, image_error, …), agent_capability_missing, node_unreachable,
    host_timeout, or provisioning_error for anything else."""
    cause = err.cause
    if isinstance(cause, TimeoutError):
        if cause.type == TimeoutType.SCHEDULE_TO_START:
            return NODE_UNREACHABLE, "the node agent did not pick up the task in time"
        return (
            HOST_TIMEOUT,
            f"host task timed out ({cause.type.name.lower() if cause.type else ''})",
        )
    missing = agent_capability_missing(err, kind)
    if missing is not None:
        return AGENT_CAPABILITY_MISSING, missing
    if isinstance(cause, ApplicationError) and cause.type in {e.value for e in HostErrorType}:
        return cause.type, cause.message
    error_type, message = _describe_error(err, kind)
    return PROVISIONING_ERROR, f"{error_type}: {message}"


def _progress_problem(report: HostTaskProgress) -> str | None:
    """Why the agent's progress report cannot be recorded as it is, or None (messages are
    redacted, control characters dropped, when recorded)."""
    if (problem := uuid_problem(report.task_id)) is not None:
        return f"task_id: {problem}"
    if not isinstance(report.attempt, int) or not 0 <= report.attempt < 2**31:
        return "attempt: not a small non-negative integer"
    if (problem := text_problem(report.started_at, max_chars=64)) is not None:
        return f"started_at: {problem}"
    for phase in report.phases:
        for name, value, limit in (
            ("phase", phase.phase, MAX_ID_CHARS),
            ("status", phase.status, MAX_ID_CHARS),
            ("at", phase.at, 64),
        ):
            if (problem := text_problem(value, max_chars=limit)) is not None:
                return f"phases.{name}: {problem}"
        if not isinstance(phase.attempt, int) or not 0 <= phase.attempt < 2**31:
            return "phases.attempt: not a small non-negative integer"
    return None
