"""Kill the control-plane worker (SIGKILL, a real process) in the middle of a metering run with a
large backlog; a fresh worker finishes the run and every window is charged exactly once."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import uuid
from typing import Any

from sqlalchemy import func, insert, select

from activities.billing.metering import cumulative_charge
from contracts.billing_meter import MeterInput
from contracts.states import AllocationStatus, SkuShape
from schema.models import Allocation, LedgerEntry, UsageRecord
from tests.factories import REGION, SLICE_SKU, create_node, create_project, create_sku
from tests.lifecycle_support import eventually
from tests.test_allocation_crash import start_worker_process
from workflows.billing_meter import BillingMeterWorkflow

RECORDS = 40
BACKLOG = dt.timedelta(hours=6)  # 360 windows per record: 14,400 debits in one run
# The second worker's whole run, on a CI VM in a phase of heavy hypervisor steal (at 20-70 %
# steal the run took over two minutes); a hang guard, not a performance assertion.
RUN_TIMEOUT_S = 300
PRICE = 250


async def test_metering_survives_a_worker_crash_without_charging_twice(
    settings: Any, db_sessions: Any, temporal_client: Any
) -> None:
    await create_sku(db_sessions)
    node = await create_node(db_sessions)
    project_id = await create_project(db_sessions, credit_minor=0)  # only the debits below
    now = dt.datetime.now(dt.UTC)
    started = now - BACKLOG
    async with db_sessions() as session, session.begin():
        for _ in range(RECORDS):
            allocation_id = uuid.uuid4()
            await session.execute(
                insert(Allocation).values(
                    id=allocation_id, project_id=project_id, sku=SLICE_SKU, region=REGION,
                    shape=SkuShape.GPU_SLICE, gpu_count=1, node_id=node.id,
                    status=AllocationStatus.ACTIVE, workflow_id=f"allocation-{allocation_id}",
                )
            )  # fmt: skip
            await session.execute(
                insert(UsageRecord).values(
                    id=uuid.uuid4(), allocation_id=allocation_id, project_id=project_id,
                    sku=SLICE_SKU, gpu_count=1, price_per_gpu_hour_minor=PRICE,
                    started_at=started, billed_until=started,
                )
            )  # fmt: skip

    async def debits() -> int:
        async with db_sessions() as session:
            return int(await session.scalar(select(func.count()).select_from(LedgerEntry)) or 0)

    first = start_worker_process(settings)
    handle = await temporal_client.start_workflow(
        BillingMeterWorkflow.run,
        MeterInput(until=now.isoformat()),
        id=f"billing-meter-crash-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )

    async def well_under_way() -> bool:
        return await debits() >= 1000

    await eventually(well_under_way, timeout=60)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    partial = await debits()

    second = start_worker_process(settings)
    try:
        await asyncio.wait_for(handle.result(), timeout=RUN_TIMEOUT_S)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=20)

    async with db_sessions() as session:
        total = -int(
            await session.scalar(select(func.coalesce(func.sum(LedgerEntry.amount_minor), 0))) or 0
        )
    windows = int(BACKLOG / dt.timedelta(minutes=1))
    assert partial < RECORDS * windows, "the worker was killed before it finished"
    assert await debits() == RECORDS * windows
    assert total == RECORDS * cumulative_charge(PRICE, 1, BACKLOG)
