"""NodeDrainWorkflow `node-drain-{node_id}`: the drain lifecycle of a node retired without being
removed (contracts/node_drain.py). It owns the node's `draining` state: it looks at the node's
allocations every poll interval until none lives on it, then moves the node draining → retired.
Being a workflow, it resumes where it was after a worker restart; its history stays bounded by
continuing as new every POLLS_PER_RUN looks."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.node_drain import (
        CHECK_ACTIVITY,
        FINISH_ACTIVITY,
        POLLS_PER_RUN,
        WORKFLOW_NAME,
        DrainCheck,
        DrainStatus,
        NodeDrainInput,
        NodeDrainResult,
    )

_TIMEOUT = timedelta(seconds=30)
# A database that is away for a while only delays the drain: retried without a bound.
_RETRY = RetryPolicy(maximum_interval=timedelta(seconds=30))


@workflow.defn(name=WORKFLOW_NAME)
class NodeDrainWorkflow:
    @workflow.run
    async def run(self, input: NodeDrainInput) -> NodeDrainResult:
        polls = 0
        while True:
            check: DrainCheck = await workflow.execute_activity(
                CHECK_ACTIVITY,
                input,
                result_type=DrainCheck,
                start_to_close_timeout=_TIMEOUT,
                retry_policy=_RETRY,
            )
            if not check.draining:
                return NodeDrainResult(input.node_id, DrainStatus.STOPPED.value, None)
            if check.live_allocations == 0:
                result: NodeDrainResult = await workflow.execute_activity(
                    FINISH_ACTIVITY,
                    input,
                    result_type=NodeDrainResult,
                    start_to_close_timeout=_TIMEOUT,
                    retry_policy=_RETRY,
                )
                if result.status != DrainStatus.RUNNING:
                    return result
            polls += 1
            if polls >= POLLS_PER_RUN:
                workflow.continue_as_new(input)
            await workflow.sleep(timedelta(seconds=input.poll_seconds))
