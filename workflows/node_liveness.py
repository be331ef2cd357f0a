"""NodeLivenessWorkflow: one liveness sweep, started every 30 s by the Temporal Schedule
`node-liveness` (overlapping runs skipped)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.node_liveness import LivenessInput, LivenessResult

WORKFLOW_NAME = "NodeLivenessWorkflow"
SCHEDULE_ID = "node-liveness"


@workflow.defn(name=WORKFLOW_NAME)
class NodeLivenessWorkflow:
    @workflow.run
    async def run(self, input: LivenessInput) -> LivenessResult:
        result: LivenessResult = await workflow.execute_local_activity(
            "node.check_liveness",
            input,
            result_type=LivenessResult,
            start_to_close_timeout=timedelta(seconds=20),
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        return result
