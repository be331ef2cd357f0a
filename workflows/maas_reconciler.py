"""MaasSiteReconcilerWorkflow (seed 003 §6.3): one run reconciles one MAAS site, started every few
minutes by the Temporal Schedule `maas-reconciler-{site_id}` (overlapping runs skipped). The whole
pass is one local activity (activities/maas_reconcile.py), so each run's history stays a handful
of events and never grows."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.maas_reconciler import WORKFLOW_NAME, ReconcileInput, ReconcileResult

ACTIVITY_NAME = "maas.reconcile_site"


@workflow.defn(name=WORKFLOW_NAME)
class MaasSiteReconcilerWorkflow:
    @workflow.run
    async def run(self, input: ReconcileInput) -> ReconcileResult:
        result: ReconcileResult = await workflow.execute_local_activity(
            ACTIVITY_NAME,
            input,
            result_type=ReconcileResult,
            # A large site's single list call plus batched writes: seconds, not minutes.
            start_to_close_timeout=timedelta(minutes=3),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=2),
                maximum_interval=timedelta(seconds=30),
                maximum_attempts=4,
            ),
        )
        return result
