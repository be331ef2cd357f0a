"""What a failed host task on `node-{id}` says about the node's agent, for every workflow that
schedules host tasks (allocation, decommission).

A node's agent that polls its queue but does not register the task's activity type (an agent
older than the control plane) fails each attempt with the Python SDK worker's own
`ApplicationError(type="NotFoundError")` ("Activity function … is not registered on this
worker"). That is not transient: the next attempt reaches the same agent. So host tasks list it
as non-retryable (`host_task_non_retryable`) and classify it `agent_capability_missing`
(`agent_capability_missing`), never as a generic or connectivity failure: the operator upgrades
the agent.

Pure functions over Temporal's exception types: safe to call from workflow code.
"""

from __future__ import annotations

from collections.abc import Iterable

from temporalio.exceptions import ActivityError, ApplicationError

# The failure reason / error code of a host task the node's agent does not offer.
AGENT_CAPABILITY_MISSING = "agent_capability_missing"
# The ApplicationError type the SDK worker fails an unregistered activity type with
# (temporalio.worker._activity, 1.35).
ACTIVITY_NOT_REGISTERED = "NotFoundError"


def host_task_non_retryable(types: Iterable[str]) -> list[str]:
    """`RetryPolicy.non_retryable_error_types` for a host task: `types` (the host error types
    that must not be retried) plus the SDK's NotFoundError, sorted so the command is the same on
    every worker (a frozenset's order is not)."""
    return sorted({*types, ACTIVITY_NOT_REGISTERED})


def agent_capability_missing(err: BaseException, kind: str) -> str | None:
    """When `err` (an ActivityError, or its cause) says the node's agent does not offer host task
    `kind`, a message saying so; None for any other failure. The SDK's own message lists every
    activity the agent registers; it is not repeated here."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, ApplicationError) and cause.type == ACTIVITY_NOT_REGISTERED:
        return (
            f"the node's agent does not offer {kind} (an agent older than the control plane): "
            "upgrade the agent"
        )
    return None
