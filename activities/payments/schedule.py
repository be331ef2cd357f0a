"""The Temporal Schedule `stripe-reconciliation`, created idempotently by the worker."""

from __future__ import annotations

import contextlib
from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
)

from workflows.stripe_reconciliation_contract import (
    SCHEDULE_ID,
    WORKFLOW_NAME,
    ReconciliationInput,
)


async def ensure_stripe_reconciliation_schedule(
    client: Client, *, task_queue: str, every_seconds: float, schedule_id: str = SCHEDULE_ID
) -> None:
    """Create the schedule unless it exists (a second create is a no-op)."""
    with contextlib.suppress(ScheduleAlreadyRunningError):
        await client.create_schedule(
            schedule_id,
            Schedule(
                action=ScheduleActionStartWorkflow(
                    WORKFLOW_NAME,
                    ReconciliationInput(),
                    id=f"{schedule_id}-run",
                    task_queue=task_queue,
                ),
                spec=ScheduleSpec(
                    intervals=[ScheduleIntervalSpec(every=timedelta(seconds=every_seconds))]
                ),
                policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
            ),
        )
