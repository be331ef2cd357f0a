"""BillingMeterWorkflow: one metering run, started every minute by the Temporal Schedule
`billing-meter` (overlapping runs are skipped). A schedule rather than one meter per allocation:
one short run charges every open usage window and reclassifies balances in a single pass, and
its history never grows. Depleted accounts' allocations are released by their own workflows."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.billing_meter import (
        BillingForceReleaseInput,
        BillingForceReleaseResult,
        MeterInput,
        MeterResult,
    )

WORKFLOW_NAME = "BillingMeterWorkflow"
SCHEDULE_ID = "billing-meter"


@workflow.defn(name=WORKFLOW_NAME)
class BillingMeterWorkflow:
    @workflow.run
    async def run(self, input: MeterInput) -> MeterResult:
        result: MeterResult = await workflow.execute_local_activity(
            "billing.meter",
            input,
            result_type=MeterResult,
            start_to_close_timeout=timedelta(seconds=50),
            retry_policy=RetryPolicy(maximum_attempts=5),
        )
        if result.allocations_to_release:
            await workflow.execute_activity(
                "billing.force_release",
                BillingForceReleaseInput(sorted(set(result.allocations_to_release))),
                result_type=BillingForceReleaseResult,
                start_to_close_timeout=timedelta(minutes=2),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=5),
            )
        return result
