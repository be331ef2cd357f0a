"""MaasSiteReconcilerWorkflow (docs/lifecycles/node.md#detection): one run reconciles one MAAS site,
started every few minutes by the Temporal Schedule `maas-reconciler-{site_id}` (overlapping runs
skipped). The whole pass is one local activity (activities/maas_reconcile.py), so each run's history
stays a handful of events and never grows.

Nodes whose hardware-sync drift is new come back from the pass (`ReconcileResult.reseeds`, at
most a bounded number per run, each drift event once): the run re-seeds each one's sync through
its agent (§9.1, `node.hw_sync_reseed` on `node-{id}`), all at once, and records every outcome on
its drift event. A node whose agent does not pick the task up in time is recorded as unreachable;
a failed task is recorded, never retried by a later run (the drift event stays claimed); neither
holds up the reconcile, whose result is already written."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from contracts.host_task_errors import (
        AGENT_CAPABILITY_MISSING,
        agent_capability_missing,
        host_task_non_retryable,
    )
    from contracts.host_tasks import (
        NODE_HW_SYNC_RESEED,
        NON_RETRYABLE_MAINTENANCE_ERRORS,
        HwSyncReseedInput,
        HwSyncReseedResult,
    )
    from contracts.maas_reconciler import (
        RECORD_RESEEDS_ACTIVITY,
        WORKFLOW_NAME,
        ReconcileInput,
        ReconcileResult,
        ReseedOutcome,
        ReseedOutcomes,
        ReseedRequest,
        ReseedStatus,
    )
    from core.task_queues import node_task_queue

ACTIVITY_NAME = "maas.reconcile_site"
# Runs recorded before the reconciler re-seeded stale sync replay without the re-seed step.
RESEED_PATCH = "reconciler-reseeds-stale-sync"
RESEED_ATTEMPTS = 2  # one retry for a transient host error; a failure then stays recorded
RECORD_TIMEOUT = timedelta(seconds=30)


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
        if result.reseeds and workflow.patched(RESEED_PATCH):
            outcomes = await asyncio.gather(*(_reseed(input, r) for r in result.reseeds))
            await workflow.execute_local_activity(
                RECORD_RESEEDS_ACTIVITY,
                ReseedOutcomes(site_id=input.site_id, outcomes=list(outcomes)),
                start_to_close_timeout=RECORD_TIMEOUT,
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            )
            result.actions += [f"reseed_{o.status}:{o.node_id}" for o in outcomes]
        return result


async def _reseed(input: ReconcileInput, request: ReseedRequest) -> ReseedOutcome:
    """`node.hw_sync_reseed` on the node's own queue; its outcome, never an exception."""
    outcome = ReseedOutcome(
        node_id=request.node_id,
        drift_event_id=request.drift_event_id,
        task_id=request.task_id,
        status=ReseedStatus.SUCCEEDED,
    )
    try:
        done: HwSyncReseedResult = await workflow.execute_activity(
            NODE_HW_SYNC_RESEED,
            HwSyncReseedInput(
                task_id=request.task_id,
                node_id=request.node_id,
                interval_minutes=request.interval_minutes,
            ),
            result_type=HwSyncReseedResult,
            task_queue=node_task_queue(request.node_id),
            schedule_to_start_timeout=timedelta(seconds=input.reseed_schedule_to_start_seconds),
            start_to_close_timeout=timedelta(seconds=input.reseed_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=1),
                maximum_attempts=RESEED_ATTEMPTS,
                non_retryable_error_types=host_task_non_retryable(
                    e.value for e in NON_RETRYABLE_MAINTENANCE_ERRORS
                ),
            ),
        )
    except ActivityError as err:
        cause = err.cause
        if isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START:
            outcome.status = ReseedStatus.AGENT_UNREACHABLE
            outcome.message = f"the node agent did not pick up {NODE_HW_SYNC_RESEED} in time"
            return outcome
        outcome.status = ReseedStatus.FAILED
        missing = agent_capability_missing(err, NODE_HW_SYNC_RESEED)
        if missing is not None:
            outcome.error_type, outcome.message = AGENT_CAPABILITY_MISSING, missing
        elif isinstance(cause, ApplicationError):
            outcome.error_type, outcome.message = cause.type, cause.message
        else:
            outcome.message = str(cause or err)
        return outcome
    outcome.units_written = len(done.units_written)
    outcome.credentials_present = done.credentials_present
    outcome.restarted = done.restarted
    if not done.restarted:
        # The units are in place but nothing made the timer run again: the sync stays stale.
        outcome.status = ReseedStatus.FAILED
        outcome.error_type = "not_restarted"
        outcome.message = "the hardware-sync timer was not restarted: " + (
            "no unit manager on the node" if done.credentials_present else "no MAAS credentials"
        )
    return outcome
