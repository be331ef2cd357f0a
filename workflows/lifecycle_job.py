"""What the node lifecycle jobs' workflows (onboarding, decommission) do the same way, so the two
cannot drift apart: how a stage's activity failure becomes the job's failure, what an operator's
freeze records, how the job state is written to the read model, the progress query, and the
operator-action update (OperatorControlledJob, the base of both workflows). The vocabulary (job
states, payloads, the admission rule) is in contracts/lifecycle.py; this is workflow-side
behaviour, imported through the sandbox like a contract (it holds no per-run state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from contracts.lifecycle import (
    CANCEL_ACTION,
    FAILED_JOB_STATUSES,
    FREEZE_ACTION,
    OPERATOR_ACTION_UPDATE,
    PROGRESS_QUERY,
    ActionResult,
    EventStatus,
    JobProgress,
    JobProgressRecord,
    JobStatus,
    OperatorRequest,
    check_operator_action,
    expected_job_status,
)
from contracts.workflow_input import check_text
from core import search_attributes as sa
from core.failures import FailureClass

StageT = TypeVar("StageT", bound=StrEnum)
ActionT = TypeVar("ActionT", bound=StrEnum)
ResultT = TypeVar("ResultT")

# A job still running (or about to) when an operator acts: cancel and freeze stop its stage.
RUNNING_JOB_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING)


class StageFailure(Exception, Generic[StageT]):
    """A stage that failed beyond its retry policy, classified
    (docs/lifecycles/onboarding.md#job-states)."""

    def __init__(
        self,
        stage: StageT,
        failure_class: str,
        error_code: str,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.failure_class = failure_class
        self.error_code = error_code
        self.message = message
        self.details = dict(details or {})


class StoppedBeforeNextStep(Exception):
    """An operator's cancel or freeze came in the same workflow task as the running stage's (or
    host task's) result: the update handler ran first and cancelled the stage, but the result
    was already there and won the await, so the stop is carried out here, before the next stage
    or host task (STOP_BEFORE_NEXT_STAGE_PATCH)."""


def stage_failure_from(stage: StageT, err: ActivityError) -> StageFailure[StageT]:
    """An activity's failure as the job's: an ApplicationError carries its class (its type) and
    error code and details (its first detail); a timeout or anything else is transient."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        info: dict[str, Any] = {}
        if cause.details and isinstance(cause.details[0], dict):
            info = cause.details[0]
        return StageFailure(
            stage,
            cause.type or FailureClass.UPSTREAM_TRANSIENT.value,
            str(info.get("error_code") or cause.type or "unknown"),
            cause.message,
            dict(info.get("details") or {}),
        )
    if isinstance(cause, TimeoutError):
        return StageFailure(
            stage,
            FailureClass.UPSTREAM_TRANSIENT.value,
            "activity_timeout",
            f"{stage.value} timed out ({cause.type.name if cause.type else 'timeout'})",
        )
    return StageFailure(stage, FailureClass.UPSTREAM_TRANSIENT.value, "activity_failed", str(err))


def operator_freeze(stage: StageT, prior: StageFailure[StageT] | None) -> StageFailure[StageT]:
    """What a job frozen by mark_manual_intervention_required records: the stage it stopped at,
    keeping the class of the failure it had (if any) for the operator's context."""
    return StageFailure(
        stage,
        prior.failure_class if prior else "",
        "manual_intervention_requested",
        "an operator froze automation",
    )


def is_standing_action(action: StrEnum, status: JobStatus) -> bool:
    """An action already in effect: cancel of a cancelled job, freeze of a frozen one."""
    return (action == CANCEL_ACTION and status == JobStatus.CANCELLED) or (
        action == FREEZE_ACTION and status == JobStatus.FAILED_MANUAL_INTERVENTION
    )


class FailureOutcome(Protocol):
    """What a job kind's failure policy answers for a classified failure."""

    @property
    def job_status(self) -> JobStatus: ...

    @property
    def recommended_action(self) -> StrEnum: ...

    @property
    def hint(self) -> str: ...


@dataclass(frozen=True)
class JobKind(Generic[ActionT]):
    """What one job kind brings to what the kinds share: its name (the refusal's "the onboarding
    is ...", its `<name>.record_progress` local activity, its `node.<name>.failed` and
    `node.<name>.manual_intervention_required` domain events), its operator actions and the job
    states each is allowed from, and its failure policy."""

    name: str
    actions: type[ActionT]
    allowed: Mapping[ActionT, Collection[JobStatus]]
    outcome_for: Callable[[str | None, str | None], FailureOutcome]


class OperatorControlledJob(Generic[StageT, ActionT, ResultT]):
    """A lifecycle job's workflow as the kinds share it: the job state and its read-model writes,
    how a failure is recorded, the progress query, and the operator-action update.

    The update takes an admitted action: a no-op answers at once; while the job runs, cancel
    and freeze (the only actions admitted then) become its interrupt and cancel the running
    stage; otherwise the action waits for the job's operator loop (`_next_action`). The run
    loop stops before its next step while an interrupt is pending, and then carries it out:
    cancel compensates and closes the job, freeze fails it for manual intervention. Each job
    kind supplies its `JobKind`, how it cancels, its own search attributes, and its own fields
    of the progress answer and of a read-model write."""

    _kind: JobKind[ActionT]

    def __init__(self, first_stage: StageT) -> None:
        self._status = JobStatus.PENDING
        self._stage = first_stage
        self._entries: dict[StageT, int] = {}  # how often each stage was entered
        self._failure: StageFailure[StageT] | None = None
        self._pending: OperatorRequest | None = None  # an accepted action for the operator loop
        self._interrupt: ActionT | None = None  # cancel or freeze, while the job runs
        self._stage_task: asyncio.Task[None] | None = None
        self._adopted = False  # an operator's adopt took the job over: it ends reconciled
        self._request: OperatorRequest | None = None  # the action _next_action last answered

    # ------------------------------------------------------------------ the kind's part

    async def _cancel(self) -> ResultT:
        raise NotImplementedError

    def _search_attributes(self) -> list[SearchAttributeUpdate[Any]]:
        """The kind's search attributes, after the job state and stage every job has."""
        raise NotImplementedError

    def _progress(self, **fields: Any) -> JobProgress:
        """The kind's Progress: its own fields with these."""
        raise NotImplementedError

    def _progress_record(self, **fields: Any) -> JobProgressRecord:
        """The kind's ProgressRecord: its id and run state with these."""
        raise NotImplementedError

    def _record_details(self) -> dict[str, Any]:
        """What every stage event of the job carries in its details."""
        raise NotImplementedError

    # ------------------------------------------------------------------ job state

    def _enter(self, stage: StageT) -> None:
        self._stage = stage
        self._entries[stage] = self._entries.get(stage, 0) + 1
        self._upsert_search_attributes()

    def _upsert_search_attributes(self) -> None:
        workflow.upsert_search_attributes(
            [
                sa.LIFECYCLE_STATUS.value_set(self._status.value),
                sa.CURRENT_STAGE.value_set(self._stage.value),
                *self._search_attributes(),
            ]
        )

    def _standing_failure(self) -> StageFailure[StageT] | None:
        """The failure the job stands failed with (None unless it is failed now)."""
        return self._failure if self._status in FAILED_JOB_STATUSES else None

    async def _set_status(
        self,
        status: JobStatus,
        *,
        stage: StageT | None = None,
        failure: StageFailure[StageT] | None = None,
        recommended_action: str | None = None,
        details: dict[str, Any] | None = None,
        event_status: EventStatus | None = None,
        message: str = "",
        domain_event: str | None = None,
        clear_error: bool = False,
        workflow_run_id: str | None = None,
    ) -> None:
        """Move the job to `status` (at `stage`, if given) and write it to the read model, with
        a stage event when `event_status` is given."""
        self._status = status
        if stage is not None:
            self._stage = stage
        self._upsert_search_attributes()
        record = self._progress_record(
            status=status.value,
            stage=self._stage.value,
            attempt=self._entries.get(self._stage, 0),
            event_status=event_status.value if event_status else None,
            message=failure.message if failure else message,
            details={**(details or {}), **self._record_details()},
            failure_class=failure.failure_class if failure else None,
            error_code=failure.error_code if failure else None,
            recommended_action=recommended_action,
            clear_error=clear_error,
            workflow_run_id=workflow_run_id,
            domain_event=domain_event,
        )
        await workflow.execute_local_activity(
            f"{self._kind.name}.record_progress",
            record,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        )

    async def _fail(
        self, failure: StageFailure[StageT], *, forced: JobStatus | None = None
    ) -> None:
        """Fail the job at the failure's stage, as its kind's policy classifies the failure
        (`forced`: this job state whatever the class)."""
        self._failure = failure
        outcome = self._kind.outcome_for(failure.failure_class, failure.error_code)
        status = forced or outcome.job_status
        self._stage = failure.stage
        frozen = status == JobStatus.FAILED_MANUAL_INTERVENTION
        await self._set_status(
            status,
            failure=failure,
            recommended_action=outcome.recommended_action.value,
            details={**failure.details, "hint": outcome.hint},
            event_status=EventStatus.FAILED,
            domain_event=f"node.{self._kind.name}."
            + ("manual_intervention_required" if frozen else "failed"),
        )

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> JobProgress:
        failure = self._standing_failure()
        return self._progress(
            status=self._status.value,
            stage=self._stage.value,
            attempt=self._entries.get(self._stage, 0),
            failure_class=failure.failure_class if failure else None,
            error_code=failure.error_code if failure else None,
        )

    # ------------------------------------------------------------------ operator surface

    @workflow.update(name=OPERATOR_ACTION_UPDATE)
    async def operator_action(self, request: OperatorRequest) -> ActionResult:
        action = self._kind.actions(request.action)
        noop = self._is_noop(action)
        prior_status, prior_stage = self._status, self._stage
        if noop:
            message = self._noop_message(action) or f"{action.value}: already in effect"
        elif self._status in RUNNING_JOB_STATUSES:
            self._interrupt = action
            if self._stage_task is not None:
                self._stage_task.cancel()
            message = f"{action.value}: stopping {self._stage.value}"
        else:
            self._pending = request
            message = f"{action.value} accepted"
        return ActionResult(
            action=action.value,
            accepted=not noop,
            prior_status=prior_status.value,
            prior_stage=prior_stage.value,
            # A no-op leaves the job as it is.
            expected_status=(prior_status if noop else expected_job_status(action)).value,
            message=message,
        )

    @operator_action.validator
    def _validate_action(self, request: OperatorRequest) -> None:
        # What the job records of the request (its actor and reason) must be storable text.
        check_text("actor", request.actor, max_chars=200)
        check_text("reason", request.reason)
        check_operator_action(
            request,
            self._kind.actions,
            job=self._kind.name,
            status=self._status,
            busy=self._pending is not None or self._interrupt is not None,
            is_noop=self._is_noop,
            allowed=self._kind.allowed,
        )
        self._check_request(request)

    def _check_request(self, request: OperatorRequest) -> None:
        """The kind's own admission rule for an admitted action (raises ApplicationError of type
        ACTION_NOT_ALLOWED): what the job state table cannot say (the standing failure, the
        action's details). Validator side: reads the job, changes nothing."""

    def _is_noop(self, action: ActionT) -> bool:
        """An action the job answers "already in effect" to, without acting."""
        return is_standing_action(action, self._status)

    def _noop_message(self, action: ActionT) -> str:
        """What a no-op answers, where the kind says more than "already in effect"."""
        return ""

    async def _next_action(self, first_stage: StageT) -> tuple[ActionT, StageT]:
        """The operator loop's next action, once one is accepted, with the stage the job failed
        at (`first_stage` if none): a freeze is recorded here and the wait goes on; any action
        but cancel sets the job running again before it is answered."""
        while True:
            await workflow.wait_condition(lambda: self._pending is not None)
            request, self._pending = self._pending, None
            assert request is not None
            self._request = request
            action = self._kind.actions(request.action)
            failed_stage = self._failure.stage if self._failure else first_stage
            if action == FREEZE_ACTION:
                await self._set_status(JobStatus.FAILED_MANUAL_INTERVENTION, stage=failed_stage)
                continue
            if action != CANCEL_ACTION:
                await self._set_status(JobStatus.RUNNING, clear_error=True)
            return action, failed_stage

    def _stop_if_interrupted(self, patch_id: str) -> None:
        """Before the next step: an interrupt that came with the last step's result (see
        StoppedBeforeNextStep) stops the job here; runs from before `patch_id` went on."""
        if self._interrupt is not None and workflow.patched(patch_id):
            raise StoppedBeforeNextStep()

    async def _interrupted(self) -> ResultT | None:
        """Carry out the pending interrupt: cancel → compensate and close (the result);
        mark_manual_intervention_required → freeze (None: the job waits for an operator)."""
        interrupt, self._interrupt = self._interrupt, None
        if interrupt == CANCEL_ACTION:
            return await self._cancel()
        await self._fail(
            operator_freeze(self._stage, self._failure),
            forced=JobStatus.FAILED_MANUAL_INTERVENTION,
        )
        return None
