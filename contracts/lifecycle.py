"""The vocabulary every node lifecycle job shares (onboarding, decommission; seed 004 §4.1,
§5.1: "the same job-state model"): job states, stage event statuses, and the operator-action
update's name, payloads and admission rule. Each job's own contract re-exports what it uses."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from temporalio.exceptions import ApplicationError

OPERATOR_ACTION_UPDATE = "operator_action"
PROGRESS_QUERY = "progress"
# The operator actions every job kind has (seed 004 §8), by name; each kind's OperatorAction
# enum spells them with these values, and adds its own.
CANCEL_ACTION = "cancel"
FREEZE_ACTION = "mark_manual_intervention_required"
ADOPT_ACTION = "adopt_observed_state"
RETRY_STAGE_ACTION = "retry_stage"
RESUME_ACTION = "resume"
# A lifecycle job's cancel or freeze can reach the workflow in the same workflow task as the
# running stage's result: the update handler runs first and cancels the stage, but the result is
# already there and wins the await. Jobs check for it before each stage; jobs that ran before that
# check replay without it.
STOP_BEFORE_NEXT_STAGE_PATCH = "operator-interrupt-stops-before-the-next-stage"


class JobStatus(StrEnum):
    """Seed 004 §4.1 / §5.1: the workflow's job state (not the coarse node state)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED_RETRYABLE = "failed_retryable"
    FAILED_MANUAL_INTERVENTION = "failed_manual_intervention"
    CANCELLED = "cancelled"
    COMPENSATING = "compensating"
    RECONCILED = "reconciled"


TERMINAL_JOB_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.CANCELLED, JobStatus.RECONCILED})
FAILED_JOB_STATUSES = frozenset({JobStatus.FAILED_RETRYABLE, JobStatus.FAILED_MANUAL_INTERVENTION})
# A job in one of these states still owns its node (partial unique indexes enforce one per node
# or per site and hostname).
LIVE_JOB_STATUSES = frozenset(
    {
        JobStatus.PENDING,
        JobStatus.RUNNING,
        JobStatus.COMPENSATING,
        JobStatus.FAILED_RETRYABLE,
        JobStatus.FAILED_MANUAL_INTERVENTION,
    }
)


class EventStatus(StrEnum):
    """A stage event in a job's event table."""

    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATED = "compensated"
    SKIPPED = "skipped"


@dataclass
class OperatorRequest:
    action: str  # an OperatorAction value of the job kind
    actor: str = ""
    reason: str = ""


@dataclass
class ActionResult:
    action: str
    accepted: bool
    prior_status: str
    prior_stage: str
    expected_status: str
    message: str = ""


# The error type of every refused operator action (the gateway answers it 409).
ACTION_NOT_ALLOWED = "action_not_allowed"
Action = TypeVar("Action", bound=StrEnum)


def check_operator_action(
    request: OperatorRequest,
    actions: type[Action],
    *,
    job: str,
    status: JobStatus,
    busy: bool,
    is_noop: Callable[[Action], bool],
    allowed: Mapping[Action, Collection[JobStatus]],
) -> None:
    """The operator-action update's validator, the same for every job kind: a known action;
    a no-op is always admitted (it answers "already in effect"); otherwise one action at a time
    (`busy`: another is being applied), and only from the job states the kind allows."""
    try:
        action = actions(request.action)
    except ValueError:
        raise ApplicationError(
            f"unknown action {request.action!r}", type=ACTION_NOT_ALLOWED
        ) from None
    if is_noop(action):
        return
    if busy:
        raise ApplicationError("another operator action is being applied", type=ACTION_NOT_ALLOWED)
    if status not in allowed[action]:
        raise ApplicationError(
            f"{action.value} is not allowed while the {job} is {status.value}",
            type=ACTION_NOT_ALLOWED,
        )
