"""TerminalSessionWorkflow `terminal-{id}` (docs/lifecycles/terminal-session.md): opening → active →
closing → closed, with opening → error and active → error.

1. The gateway starts it with update-with-start (`open`): the first local activity creates the
   session row (or refuses: allocation not found / not active, or a live session already).
2. `claim`: the tenant's WebSocket presented the single-use open token before it expired. The
   workflow then schedules `terminal.open` on the allocation's node with where to dial and the
   agent's secret (both inside the codec-encrypted payload). No claim in time: error
   `open_token_expired`.
3. `stream_attached` (the agent's signal): active, and the max-TTL timer
   (`terminal.session_max_ttl_seconds`) runs.
4. The end. The stream ends on its own (tenant left, shell exited: closing → closed; stream
   dropped or the agent's heartbeats stopped: error `node_stream_dropped`), or a close is asked
   (`close` update: admin force-close, the tenant's close, the allocation's release): closing,
   the `terminal.close` host task carries the reason to the agent, and the workflow waits for
   the stream to end (the ack) or the close timeout, then closed. The max TTL is a policy
   timeout: the same close to the agent, then active → error `session_ttl_expired`.

A reopen is a new session (new token, new open task, new id): nothing here resumes.
"""

from __future__ import annotations

import contextlib
import hmac
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    TimeoutType,
)
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from contracts.states import NodeTaskStatus
    from contracts.terminal_session import (
        ACTOR_ADMIN,
        ACTOR_SYSTEM,
        ACTOR_USER,
        APPLY_CHANGE,
        CLAIM_UPDATE,
        CLOSE_REASONS,
        CLOSE_UPDATE,
        CREATE_SESSION,
        OPEN_REFUSALS,
        OPEN_TOKEN_INVALID,
        OPEN_UPDATE,
        REJECTED,
        SESSION_NOT_LIVE,
        STATUS_QUERY,
        STREAM_ATTACHED_SIGNAL,
        TERMINAL_CLOSE,
        TERMINAL_OPEN,
        WORKFLOW_NAME,
        ClaimAccepted,
        ClaimRequest,
        CloseReason,
        CloseRequest,
        CloseResult,
        CreateSessionInput,
        SessionPlan,
        TaskRecord,
        TerminalChange,
        TerminalCloseInput,
        TerminalCloseResult,
        TerminalOpenInput,
        TerminalOpenResult,
        TerminalSessionInput,
        TerminalSessionOpened,
        TerminalSessionResult,
        TerminalSessionStatus,
        TerminalSessionView,
    )
    from contracts.workflow_input import check_text, invalid_input
    from core.task_queues import node_task_queue

_LOCAL = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=20)
# A stream is never retried: a reopen is a new session.
_ONCE = RetryPolicy(maximum_attempts=1)

Status = TerminalSessionStatus
# workflow.patched ids: histories recorded before a change replay the old path.
TTL_ENDS_IN_ERROR = "terminal-ttl-ends-in-error"


@workflow.defn(name=WORKFLOW_NAME)
class TerminalSessionWorkflow:
    @workflow.init
    def __init__(self, input: TerminalSessionInput) -> None:
        self._input = input
        self._plan: SessionPlan | None = None
        self._rejection: ApplicationError | None = None
        self._status: Status | None = None
        self._token_deadline = workflow.now()
        self._claim: ClaimRequest | None = None
        self._attached = False
        self._close: CloseRequest | None = None
        self._result: CloseResult | None = None

    # ------------------------------------------------------------------ handlers

    @workflow.update(name=OPEN_UPDATE)
    async def open(self) -> TerminalSessionOpened:
        await workflow.wait_condition(lambda: self._plan is not None or self._rejection is not None)
        if self._rejection is not None:
            raise self._rejection
        assert self._plan is not None
        return TerminalSessionOpened(
            session_id=self._input.session_id,
            allocation_id=self._input.allocation_id,
            node_id=self._plan.node_id,
            status=Status.OPENING.value,
            open_token_expires_at=self._plan.open_token_expires_at,
        )

    @workflow.update(name=CLAIM_UPDATE)
    def claim(self, request: ClaimRequest) -> ClaimAccepted:
        # Checked again in the handler: two claims in one workflow task would both pass the
        # validator before either handler ran. The first one wins; the token is spent.
        if not self._claim_usable(request) or self._plan is None:
            raise _token_invalid()
        self._claim = request
        return ClaimAccepted(session_id=self._input.session_id, node_id=self._plan.node_id)

    @claim.validator
    def _validate_claim(self, request: ClaimRequest) -> None:
        # A rejected update writes nothing to history (issue 36): a wrong, used or expired token
        # costs the worker a workflow task, never an event. Validators do not run on replay.
        if not self._claim_usable(request) or self._plan is None:
            raise _token_invalid()

    def _claim_usable(self, request: ClaimRequest) -> bool:
        return (
            self._status == Status.OPENING
            and self._claim is None
            and self._close is None
            and hmac.compare_digest(request.open_token_sha256, self._input.open_token_sha256)
            and workflow.now() < self._token_deadline
        )

    @workflow.signal(name=STREAM_ATTACHED_SIGNAL)
    def stream_attached(self) -> None:
        self._attached = True

    @workflow.update(name=CLOSE_UPDATE)
    async def close(self, request: CloseRequest) -> CloseResult:
        """Close now with a reason; answers once the session has ended. A close while one is
        under way waits for that one."""
        if self._close is None:
            self._close = request
        await workflow.wait_condition(lambda: self._result is not None)
        assert self._result is not None
        return self._result

    @close.validator
    def _validate_close(self, request: CloseRequest) -> None:
        if self._rejection is not None or self._result is not None:
            raise ApplicationError("the terminal session has ended", type=SESSION_NOT_LIVE)
        if request.reason not in CLOSE_REASONS:
            raise ApplicationError(
                f"unknown close reason {request.reason!r}", type="invalid_reason"
            )
        # Recorded with the session's end: a known actor, an admin's note as storable text.
        if request.actor not in (ACTOR_USER, ACTOR_ADMIN, ACTOR_SYSTEM):
            raise invalid_input("actor", "not user, admin or system")
        check_text("note", request.note)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> TerminalSessionView:
        return TerminalSessionView(
            session_id=self._input.session_id,
            allocation_id=self._input.allocation_id,
            status=self._status.value if self._status else "placing",
            close_reason=self._result.close_reason if self._result else None,
        )

    # ------------------------------------------------------------------ lifecycle

    @workflow.run
    async def run(self, input: TerminalSessionInput) -> TerminalSessionResult:
        result = await self._lifecycle(input)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return result

    async def _lifecycle(self, input: TerminalSessionInput) -> TerminalSessionResult:
        policy = input.policy
        plan = await self._create(input)
        if plan is None:
            assert self._rejection is not None
            return TerminalSessionResult(input.session_id, REJECTED, self._rejection.type)
        self._plan = plan
        self._status = Status.OPENING
        token_ttl = timedelta(seconds=policy.open_token_ttl_seconds)
        self._token_deadline = workflow.now() + token_ttl
        try:
            await workflow.wait_condition(
                lambda: self._claim is not None or self._close is not None, timeout=token_ttl
            )
        except TimeoutError:
            return await self._end(Status.ERROR, CloseReason.OPEN_TOKEN_EXPIRED.value)
        if self._claim is None:
            assert self._close is not None
            return await self._end(Status.ERROR, self._close.reason, self._close.actor)

        open_task = str(workflow.uuid4())
        await self._apply(
            TerminalChange(input.session_id, tasks=[TaskRecord(open_task, TERMINAL_OPEN)])
        )
        stream = workflow.start_activity(
            TERMINAL_OPEN,
            TerminalOpenInput(
                task_id=open_task,
                session_id=input.session_id,
                allocation_id=input.allocation_id,
                node_id=plan.node_id,
                shape=plan.shape,
                username=plan.username,
                stream_url=self._claim.node_stream_url,
                agent_secret=self._claim.agent_secret,
            ),
            result_type=TerminalOpenResult,
            task_queue=node_task_queue(plan.node_id),
            schedule_to_start_timeout=timedelta(seconds=policy.node_schedule_to_start_seconds),
            start_to_close_timeout=timedelta(
                seconds=policy.attach_timeout_seconds
                + policy.max_ttl_seconds
                + 2 * policy.close_timeout_seconds
            ),
            heartbeat_timeout=timedelta(seconds=policy.heartbeat_timeout_seconds),
            retry_policy=_ONCE,
        )
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._attached or stream.done() or self._close is not None,
                timeout=timedelta(
                    seconds=policy.node_schedule_to_start_seconds + policy.attach_timeout_seconds
                ),
            )
        if not self._attached:
            return await self._fail_open(open_task, stream)

        await self._apply(
            TerminalChange(
                input.session_id,
                to_status=Status.ACTIVE.value,
                tasks=[TaskRecord(open_task, TERMINAL_OPEN, NodeTaskStatus.DISPATCHED.value)],
            )
        )
        self._status = Status.ACTIVE
        try:
            await workflow.wait_condition(
                lambda: stream.done() or self._close is not None,
                timeout=timedelta(seconds=policy.max_ttl_seconds),
            )
        except TimeoutError:
            if self._close is None:
                self._close = CloseRequest(CloseReason.SESSION_TTL_EXPIRED.value, ACTOR_SYSTEM)
                # docs/lifecycles/terminal-session.md: a policy timeout is active → error (it was
                # active → closed).
                if workflow.patched(TTL_ENDS_IN_ERROR):
                    return await self._close_active(
                        open_task, stream, self._close, end_status=Status.ERROR
                    )
        if self._close is None:
            return await self._stream_ended(open_task, stream)
        return await self._close_active(open_task, stream, self._close)

    async def _create(self, input: TerminalSessionInput) -> SessionPlan | None:
        try:
            plan: SessionPlan = await workflow.execute_local_activity(
                CREATE_SESSION,
                CreateSessionInput(
                    session_id=input.session_id,
                    allocation_id=input.allocation_id,
                    project_id=input.project_id,
                    workflow_id=workflow.info().workflow_id,
                    open_token_sha256=input.open_token_sha256,
                    open_token_ttl_seconds=input.policy.open_token_ttl_seconds,
                ),
                result_type=SessionPlan,
                start_to_close_timeout=_LOCAL,
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=200),
                    maximum_attempts=10,
                    non_retryable_error_types=list(OPEN_REFUSALS),
                ),
            )
            return plan
        except (ActivityError, ApplicationError) as err:
            # A local activity's non-retryable ApplicationError reaches the workflow unwrapped.
            cause = err.cause if isinstance(err, ActivityError) else err
            if isinstance(cause, ApplicationError) and cause.type in OPEN_REFUSALS:
                self._rejection = ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                )
                return None
            raise

    async def _fail_open(
        self, open_task: str, stream: workflow.ActivityHandle[TerminalOpenResult]
    ) -> TerminalSessionResult:
        """opening → error: the node never attached the stream (unreachable, the shell could
        not start, the gateway refused it), or a close came first."""
        actor = ACTOR_SYSTEM
        if self._close is not None:
            reason, actor = self._close.reason, self._close.actor
        else:
            reason = CloseReason.NODE_UNREACHABLE.value
        error_type, message = "cancelled", "the session closed before the stream attached"
        if not stream.done():
            stream.cancel()
        try:
            await stream
            if self._close is None:
                reason = CloseReason.OPEN_FAILED.value
        except ActivityError as err:
            error_type, message = _describe(err)
            cause = err.cause
            scheduled = isinstance(cause, ActivityTimeout) and (
                cause.type == TimeoutType.SCHEDULE_TO_START
            )
            if self._close is None and not scheduled and not isinstance(cause, CancelledError):
                reason = CloseReason.OPEN_FAILED.value
        task = TaskRecord(
            open_task, TERMINAL_OPEN, NodeTaskStatus.FAILED.value, error_type, message
        )
        return await self._end(Status.ERROR, reason, actor, tasks=[task])

    async def _stream_ended(
        self, open_task: str, stream: workflow.ActivityHandle[TerminalOpenResult]
    ) -> TerminalSessionResult:
        """The stream ended by itself: the tenant left or the shell exited (closed), or the
        stream dropped or the agent stopped heartbeating (error, node_stream_dropped)."""
        try:
            outcome = await stream
        except ActivityError as err:
            error_type, message = _describe(err)
            task = TaskRecord(
                open_task, TERMINAL_OPEN, NodeTaskStatus.FAILED.value, error_type, message
            )
            reason = CloseReason.NODE_STREAM_DROPPED.value
            return await self._end(Status.ERROR, reason, tasks=[task])
        done = TaskRecord(open_task, TERMINAL_OPEN, NodeTaskStatus.COMPLETED.value)
        if outcome.ended_by == CloseReason.NODE_STREAM_DROPPED:
            return await self._end(Status.ERROR, outcome.ended_by, tasks=[done])
        await self._apply(
            TerminalChange(
                self._input.session_id,
                to_status=Status.CLOSING.value,
                close_reason=outcome.ended_by,
                actor=ACTOR_SYSTEM,
            )
        )
        self._status = Status.CLOSING
        return await self._end(Status.CLOSED, outcome.ended_by, tasks=[done])

    async def _close_active(
        self,
        open_task: str,
        stream: workflow.ActivityHandle[TerminalOpenResult],
        request: CloseRequest,
        *,
        end_status: Status = Status.CLOSED,
    ) -> TerminalSessionResult:
        """active → closing → closed: the reason goes to the agent (`terminal.close`), which ends
        the shell and the stream; the stream's end is the ack, awaited up to the close timeout.
        With `end_status` error (the TTL, a policy timeout) the same close runs but the session
        goes active → error directly: closing leads only to closed."""
        session_id = self._input.session_id
        policy = self._input.policy
        close_task = str(workflow.uuid4())
        closing = end_status == Status.CLOSED
        await self._apply(
            TerminalChange(
                session_id,
                to_status=Status.CLOSING.value if closing else "",
                close_reason=request.reason if closing else None,
                actor=request.actor,
                tasks=[TaskRecord(close_task, TERMINAL_CLOSE)],
            )
        )
        if closing:
            self._status = Status.CLOSING
        assert self._plan is not None
        close_timeout = timedelta(seconds=policy.close_timeout_seconds)
        closer = workflow.start_activity(
            TERMINAL_CLOSE,
            TerminalCloseInput(close_task, session_id, request.reason),
            result_type=TerminalCloseResult,
            task_queue=node_task_queue(self._plan.node_id),
            schedule_to_start_timeout=close_timeout,
            start_to_close_timeout=close_timeout,
            retry_policy=_ONCE,
        )
        acknowledged = True
        try:
            await workflow.wait_condition(stream.done, timeout=close_timeout)
        except TimeoutError:
            acknowledged = False
            stream.cancel()
        tasks = [await _task_outcome(close_task, TERMINAL_CLOSE, closer)]
        tasks.append(await _task_outcome(open_task, TERMINAL_OPEN, stream))
        return await self._end(
            end_status, request.reason, request.actor, tasks=tasks, acknowledged=acknowledged
        )

    async def _end(
        self,
        status: Status,
        reason: str,
        actor: str = ACTOR_SYSTEM,
        *,
        tasks: list[TaskRecord] | None = None,
        acknowledged: bool = True,
    ) -> TerminalSessionResult:
        await self._apply(
            TerminalChange(
                self._input.session_id,
                to_status=status.value,
                close_reason=reason,
                actor=actor,
                tasks=tasks or [],
            )
        )
        self._status = status
        self._result = CloseResult(self._input.session_id, status.value, reason, acknowledged)
        return TerminalSessionResult(self._input.session_id, status.value, reason)

    async def _apply(self, change: TerminalChange) -> None:
        await workflow.execute_local_activity(
            APPLY_CHANGE, change, start_to_close_timeout=_LOCAL, retry_policy=_DB_RETRY
        )


def _token_invalid() -> ApplicationError:
    return ApplicationError(
        "the open token is unknown, used or expired; open a new session",
        type=OPEN_TOKEN_INVALID,
        non_retryable=True,
    )


async def _task_outcome(
    task_id: str, kind: str, handle: workflow.ActivityHandle[object]
) -> TaskRecord:
    try:
        await handle
    except ActivityError as err:
        error_type, message = _describe(err)
        return TaskRecord(task_id, kind, NodeTaskStatus.FAILED.value, error_type, message)
    return TaskRecord(task_id, kind, NodeTaskStatus.COMPLETED.value)


def _describe(err: ActivityError) -> tuple[str, str]:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return cause.type or "application_error", cause.message
    if isinstance(cause, ActivityTimeout):
        kind = cause.type.name.lower() if cause.type else "timeout"
        return f"timeout_{kind}", "the node agent did not answer in time"
    if isinstance(cause, CancelledError):
        return "cancelled", "the task was cancelled"
    return type(cause).__name__, str(cause)
