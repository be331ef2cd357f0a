"""BillingMeterWorkflow: one metering run, started every minute by the Temporal Schedule
`billing-meter` (overlapping runs are skipped). A schedule rather than one meter per allocation:
one short run charges every open usage window and reclassifies balances in a single pass, and
its history never grows. Depleted accounts' allocations are released by their own workflows;
notices the run left due are then delivered to the projects' webhooks (a delivery that does not
land is retried by a later run, so the meter never waits on a tenant's endpoint for long).
Storage (issue 37): the attachments of accounts depleted beyond their grace period are detached
through their own workflows, and the namespaces' used bytes are measured by the provider off
any tenant's path (oldest measure first, for a bounded time per run)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from contracts.billing_meter import (
        STORAGE_DETACH_FOR_BILLING,
        STORAGE_MEASURE_USAGE,
        BillingForceReleaseInput,
        BillingForceReleaseResult,
        DeliverNotificationsInput,
        DeliverNotificationsResult,
        MeterInput,
        MeterResult,
        StorageDetachForBillingInput,
        StorageDetachForBillingResult,
        StorageMeasureInput,
        StorageMeasureResult,
    )

WORKFLOW_NAME = "BillingMeterWorkflow"
SCHEDULE_ID = "billing-meter"
# Runs recorded before notices were delivered issue no delivery command.
DELIVER_NOTIFICATIONS_PATCH = "billing-meter-deliver-notifications"
# Runs recorded before storage was billed detach and measure nothing.
STORAGE_GRACE_DETACH_PATCH = "billing-meter-storage-grace-detach"
STORAGE_MEASURE_PATCH = "billing-meter-storage-measure"


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
        if result.attachments_to_detach and workflow.patched(STORAGE_GRACE_DETACH_PATCH):
            await workflow.execute_activity(
                STORAGE_DETACH_FOR_BILLING,
                StorageDetachForBillingInput(sorted(set(result.attachments_to_detach))),
                result_type=StorageDetachForBillingResult,
                start_to_close_timeout=timedelta(minutes=2),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=5),
            )
        if workflow.patched(STORAGE_MEASURE_PATCH):
            measure = StorageMeasureInput()
            try:
                await workflow.execute_activity(
                    STORAGE_MEASURE_USAGE,
                    measure,
                    result_type=StorageMeasureResult,
                    start_to_close_timeout=timedelta(seconds=measure.max_seconds + 40),
                    heartbeat_timeout=timedelta(seconds=30),
                    retry_policy=RetryPolicy(maximum_attempts=1),
                )
            except ActivityError as err:
                # The measures are for display and the next run measures again.
                workflow.logger.warning("storage usage was not measured: %s", err)
        if result.notifications_due and workflow.patched(DELIVER_NOTIFICATIONS_PATCH):
            try:
                await workflow.execute_activity(
                    "billing.deliver_notifications",
                    DeliverNotificationsInput(),
                    result_type=DeliverNotificationsResult,
                    start_to_close_timeout=timedelta(minutes=5),
                    heartbeat_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(maximum_attempts=3),
                )
            except ActivityError as err:
                # The outbox keeps them due: the next run tries again.
                workflow.logger.warning("notification delivery did not run: %s", err)
        return result
