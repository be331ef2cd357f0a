"""The vocabulary every node lifecycle job shares (onboarding, decommission; seed 004 §4.1,
§5.1: "the same job-state model"): job states, stage event statuses, and the operator-action
update's name and payloads. Each job's own contract re-exports what it uses."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

OPERATOR_ACTION_UPDATE = "operator_action"
PROGRESS_QUERY = "progress"


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
