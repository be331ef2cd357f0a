"""NodeHealthProbeWorkflow `node-health-probe-{node_id}-{request}`: the agent half of the health
proof that `activate` and `reactivate` need (activities/node_admin.py). A recorded contact or a
poller Temporal still remembers says what the agent did in the past; this asks it now: one
read-only `node.validate_clean` on the node's own queue, one attempt, a short wait for pickup.
The agent answered (with its clean/residue checks) or it did not (no poller picked the task up,
or it failed); either is the result, never an exception.

Deliberately tiny: one activity, no retries, no signals."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from contracts.host_tasks import (
        NODE_VALIDATE_CLEAN,
        NodeMaintenanceInput,
        ValidateCleanResult,
    )
    from contracts.node_health_probe import (
        WORKFLOW_NAME,
        HealthProbeInput,
        HealthProbeResult,
    )
    from core.task_queues import node_task_queue


@workflow.defn(name=WORKFLOW_NAME)
class NodeHealthProbeWorkflow:
    @workflow.run
    async def run(self, input: HealthProbeInput) -> HealthProbeResult:
        try:
            result: ValidateCleanResult = await workflow.execute_activity(
                NODE_VALIDATE_CLEAN,
                NodeMaintenanceInput(
                    task_id=input.task_id, node_id=input.node_id, reason="health proof"
                ),
                result_type=ValidateCleanResult,
                task_queue=node_task_queue(input.node_id),
                schedule_to_start_timeout=timedelta(seconds=input.pickup_seconds),
                start_to_close_timeout=timedelta(seconds=input.run_seconds),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, TimeoutError):
                kind = cause.type.name.lower() if cause.type is not None else "timeout"
                why = f"no agent picked up the check ({kind})"
            elif isinstance(cause, ApplicationError):
                why = f"the agent's check failed: {cause.type or ''} {cause.message}".strip()
            else:
                why = f"the check failed: {cause}"
            return HealthProbeResult(answered=False, error=why)
        return HealthProbeResult(
            answered=True,
            clean=result.clean,
            answered_at=workflow.now().isoformat(),
            failed_checks=[c.name for c in result.checks if not c.passed],
        )
