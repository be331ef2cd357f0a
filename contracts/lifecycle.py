"""The vocabulary every node lifecycle job shares (onboarding, decommission;
docs/lifecycles/onboarding.md#job-states, docs/lifecycles/decommission.md#job-states: "the same
job-state model"): job states, stage event statuses, the operator-action update's name, payloads and
admission rule, and the fields of the progress query's answer and of a read-model write. Each job's
own contract re-exports what it uses."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from temporalio.exceptions import ApplicationError

OPERATOR_ACTION_UPDATE = "operator_action"
PROGRESS_QUERY = "progress"
# The operator actions every job kind has (docs/lifecycles/decommission.md#actions), by name; each
# kind's OperatorAction enum spells them with these values, and adds its own.
CANCEL_ACTION = "cancel"
FREEZE_ACTION = "mark_manual_intervention_required"
ADOPT_ACTION = "adopt_observed_state"
RETRY_STAGE_ACTION = "retry_stage"
RESUME_ACTION = "resume"
# A decommission's record of where a vanished machine's disks went (issue 35), then its adopt.
RECORD_DISK_DISPOSITION_ACTION = "record_disk_disposition"
# A lifecycle job's cancel or freeze can reach the workflow in the same workflow task as the
# running stage's result: the update handler runs first and cancels the stage, but the result is
# already there and wins the await. Jobs check for it before each stage; jobs that ran before that
# check replay without it.
STOP_BEFORE_NEXT_STAGE_PATCH = "operator-interrupt-stops-before-the-next-stage"


class JobStatus(StrEnum):
    """docs/lifecycles/onboarding.md#job-states, docs/lifecycles/decommission.md#job-states: the
    workflow's job state (not the coarse node state)."""

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
    # What an action needs beyond its reason (record_disk_disposition: the disposition and a
    # reference); empty for the others.
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActionResult:
    action: str
    accepted: bool
    prior_status: str
    prior_stage: str
    expected_status: str
    message: str = ""


@dataclass(kw_only=True)
class JobStageResult:
    """A stage activity's answer. Each job kind's `StageResult` adds the run state the stage
    answers updated, and the site its load_site_config loaded."""

    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False


@dataclass(kw_only=True)
class JobProgress:
    """Where a job stands: the progress query's answer. Each job kind's `Progress` adds its id
    and what is its own (fields by keyword: the kind's fields come after these)."""

    status: str
    stage: str
    attempt: int
    failure_class: str | None = None
    error_code: str | None = None
    recommended_action: str | None = None


@dataclass(kw_only=True)
class JobProgressRecord(JobProgress):
    """One read-model write: the job row's new values and, optionally, one stage event. Each job
    kind's `ProgressRecord` adds its id and its run state."""

    event_status: str | None = None
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    clear_error: bool = False
    workflow_run_id: str | None = None
    domain_event: str | None = None  # node.<kind>.started|completed|failed|...


def expected_job_status(action: str) -> JobStatus:
    """Where an accepted action leads the job when all goes well (the update's answer, and what
    the console shows before it is sent)."""
    if action == CANCEL_ACTION:
        return JobStatus.CANCELLED
    if action == FREEZE_ACTION:
        return JobStatus.FAILED_MANUAL_INTERVENTION
    if action in (ADOPT_ACTION, RECORD_DISK_DISPOSITION_ACTION):
        return JobStatus.RECONCILED
    return JobStatus.COMPLETED


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
