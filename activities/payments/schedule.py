"""The Temporal Schedule `stripe-reconciliation`, created idempotently by the worker."""

from __future__ import annotations

from datetime import timedelta

from temporalio.client import Client

from contracts.stripe_reconciliation import (
    SCHEDULE_ID,
    WORKFLOW_NAME,
    ReconciliationInput,
)
from core.schedules import ensure_schedule, periodic_schedule


async def ensure_stripe_reconciliation_schedule(
    client: Client, *, task_queue: str, every_seconds: float, schedule_id: str = SCHEDULE_ID
) -> None:
    """Create the schedule unless it exists (a second create is a no-op)."""
    await ensure_schedule(
        client,
        schedule_id,
        periodic_schedule(
            schedule_id,
            WORKFLOW_NAME,
            ReconciliationInput(),
            every=timedelta(seconds=every_seconds),
            task_queue=task_queue,
        ),
    )
