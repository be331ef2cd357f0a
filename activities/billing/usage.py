"""Usage windows: opened in the same transaction that makes an allocation active, closed in the
one that makes it released or release_failed. Charges are computed from these windows by the
meter (activities/billing/metering.py), never accrued in place."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.billing.accounts import ensure_account
from schema.models import Allocation, Sku, UsageRecord


async def open_usage(session: AsyncSession, allocation_id: uuid.UUID) -> None:
    """Idempotent: a retried activation opens nothing twice."""
    row = (
        await session.execute(
            select(
                Allocation.project_id,
                Allocation.sku,
                Allocation.gpu_count,
                Sku.price_per_gpu_hour_minor,
            )
            .join(Sku, (Sku.name == Allocation.sku) & (Sku.region == Allocation.region))
            .where(Allocation.id == allocation_id)
        )
    ).first()
    if row is None:
        return
    project_id, sku, gpus, price = row
    await ensure_account(session, project_id)
    now = func.clock_timestamp()
    await session.execute(
        pg_insert(UsageRecord)
        .values(
            id=uuid.uuid4(),
            allocation_id=allocation_id,
            project_id=project_id,
            sku=sku,
            gpu_count=gpus,
            price_per_gpu_hour_minor=price,
            started_at=now,
            billed_until=now,
        )
        .on_conflict_do_nothing(index_elements=[UsageRecord.allocation_id])
    )


async def close_usage(session: AsyncSession, allocation_id: uuid.UUID) -> None:
    """Idempotent: the first close wins (a release retried after release_failed reopens
    nothing, so the time spent failing to release is never charged)."""
    await session.execute(
        update(UsageRecord)
        .where(UsageRecord.allocation_id == allocation_id, UsageRecord.ended_at.is_(None))
        .values(ended_at=func.clock_timestamp())
    )
