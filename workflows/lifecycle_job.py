"""What the node lifecycle jobs' workflows (onboarding, decommission) do the same way, so the two
cannot drift apart: how a stage's activity failure becomes the job's failure, what an operator's
freeze records, and how the operator-action update takes an action. The vocabulary (job states,
payloads, the admission rule) is in contracts/lifecycle.py; this is workflow-side
behaviour, imported through the sandbox like a contract (it holds no per-run state)."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import Any, Generic, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from contracts.lifecycle import (
    ADOPT_ACTION,
    CANCEL_ACTION,
    FREEZE_ACTION,
    ActionResult,
    JobStatus,
    OperatorRequest,
)
from core.failures import FailureClass

StageT = TypeVar("StageT", bound=StrEnum)
ActionT = TypeVar("ActionT", bound=StrEnum)
ResultT = TypeVar("ResultT")

# A job still running (or about to) when an operator acts: cancel and freeze stop its stage.
RUNNING_JOB_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING)


class StageFailure(Exception, Generic[StageT]):
    """A stage that failed beyond its retry policy, classified (seed 004 §4.8)."""

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


def expected_job_status(action: StrEnum) -> JobStatus:
    """Where an accepted action leads the job when all goes well."""
    if action == CANCEL_ACTION:
        return JobStatus.CANCELLED
    if action == FREEZE_ACTION:
        return JobStatus.FAILED_MANUAL_INTERVENTION
    if action == ADOPT_ACTION:
        return JobStatus.RECONCILED
    return JobStatus.COMPLETED


class OperatorControlledJob(Generic[StageT, ActionT, ResultT]):
    """How a job's operator-action update and its run loop share an operator's interrupt.

    The update takes an admitted action: a no-op answers at once; while the job runs, cancel
    and freeze (the only actions admitted then) become its interrupt and cancel the running
    stage; otherwise the action waits for the job's operator loop. The run loop stops before
    its next step while an interrupt is pending, and then carries it out: cancel compensates
    and closes the job, freeze fails it for manual intervention. Each job kind supplies how it
    cancels and how it records a failure."""

    _status: JobStatus
    _stage: StageT
    _failure: StageFailure[StageT] | None
    _pending: OperatorRequest | None
    _interrupt: ActionT | None
    _stage_task: asyncio.Task[None] | None

    async def _cancel(self) -> ResultT:
        raise NotImplementedError

    async def _fail(
        self, failure: StageFailure[StageT], *, forced: JobStatus | None = None
    ) -> None:
        raise NotImplementedError

    def _take_operator_action(
        self, request: OperatorRequest, action: ActionT, *, noop: bool, noop_message: str = ""
    ) -> ActionResult:
        prior_status, prior_stage = self._status, self._stage
        if noop:
            message = noop_message or f"{action.value}: already in effect"
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
