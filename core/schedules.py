"""Temporal Schedules that start one workflow run at a fixed interval with overlapping runs
skipped: the billing meter, node liveness, Stripe reconciliation, each MAAS site's reconciler."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
)


def periodic_schedule(
    schedule_id: str,
    workflow: Any,
    arg: Any,
    *,
    every: timedelta,
    task_queue: str,
    paused: bool = False,
    note: str = "",
) -> Schedule:
    """`workflow` is a run method or a workflow type name; runs get the id `{schedule_id}-run`."""
    return Schedule(
        action=ScheduleActionStartWorkflow(
            workflow, arg, id=f"{schedule_id}-run", task_queue=task_queue
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
        state=ScheduleState(paused=paused, note=note),
    )


async def ensure_schedule(client: Client, schedule_id: str, schedule: Schedule) -> None:
    """Create it once; creating it again is a no-op (an existing schedule is left as it is)."""
    with contextlib.suppress(ScheduleAlreadyRunningError):
        await client.create_schedule(schedule_id, schedule)


async def put_schedule(client: Client, schedule_id: str, schedule: Schedule) -> None:
    """Create it, or make an existing one exactly `schedule` (interval, paused state)."""
    try:
        await client.create_schedule(schedule_id, schedule)
    except ScheduleAlreadyRunningError:
        await client.get_schedule_handle(schedule_id).update(
            lambda _: ScheduleUpdate(schedule=schedule)
        )
