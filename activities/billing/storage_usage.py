"""Storage usage windows (issue 37 item 3): a namespace is billed for its provisioned capacity,
its quota, per GB-hour, from the transaction that creates it to the one that deletes it.

Provisioned rather than measured: the quota is what the project holds (its storage limits count
quotas, not bytes written), it is known exactly at every instant, so a window's charge is exact
and the same on every retry of the meter, and nothing can be written between two measurements
unbilled. The record keeps the price and currency of its account at creation, like a compute
usage record keeps its SKU's price. Charges are computed by the meter
(activities/billing/metering.py), never accrued in place."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.billing.accounts import account_currency, ensure_account
from schema.models import StoragePrice, StorageUsageRecord

# Decimal gigabytes, as storage is sold.
BYTES_PER_GB = 10**9
# Prices are in millionths of a minor unit per GB-hour.
MICRO = 10**6
_US_PER_HOUR = 3_600_000_000
# The policy's price where the storage catalog (storage_prices) has no row for a provider and
# currency: 0.10 USD per GB-month (730 h). No default in other currencies: an account in one
# gets storage only once the catalog prices it there (never a usd price read as another).
DEFAULT_STORAGE_PRICES_MICRO_MINOR = {"usd": 13_699}


class StorageNotPriced(LookupError):
    """The storage catalog has no price for this provider in the account's currency."""

    def __init__(self, provider: str, currency: str) -> None:
        super().__init__(f"storage on {provider} has no price in {currency}")
        self.provider = provider
        self.currency = currency


def storage_cumulative_charge(
    price_per_gb_hour_micro_minor: int, quota_bytes: int, elapsed: dt.timedelta
) -> int:
    """What `quota_bytes` held for `elapsed` costs, in whole minor units (rounded down): the
    meter debits window k as cum(end) - cum(start), so the windows add up to this exactly."""
    elapsed_us = max(0, elapsed // dt.timedelta(microseconds=1))
    return (
        price_per_gb_hour_micro_minor
        * quota_bytes
        * elapsed_us
        // (BYTES_PER_GB * _US_PER_HOUR * MICRO)
    )


async def storage_price(session: AsyncSession, provider: str, currency: str) -> int:
    """The catalog's price (µ-minor per GB-hour), else the policy's default in this currency;
    raises StorageNotPriced when there is neither."""
    currency = currency.lower()
    price = await session.scalar(
        select(StoragePrice.price_per_gb_hour_micro_minor).where(
            StoragePrice.provider == provider, StoragePrice.currency == currency
        )
    )
    if price is None:
        price = DEFAULT_STORAGE_PRICES_MICRO_MINOR.get(currency)
    if price is None:
        raise StorageNotPriced(provider, currency)
    return int(price)


async def open_storage_usage(
    session: AsyncSession,
    *,
    namespace_id: uuid.UUID,
    project_id: uuid.UUID,
    provider: str,
    quota_bytes: int,
) -> None:
    """In the transaction that creates the namespace. Idempotent: a retried create opens
    nothing twice. Raises StorageNotPriced (the caller refuses the namespace)."""
    await ensure_account(session, project_id)
    currency = await account_currency(session, project_id)
    price = await storage_price(session, provider, currency)
    now = func.clock_timestamp()
    await session.execute(
        pg_insert(StorageUsageRecord)
        .values(
            id=uuid.uuid4(),
            namespace_id=namespace_id,
            project_id=project_id,
            quota_bytes=quota_bytes,
            price_per_gb_hour_micro_minor=price,
            currency=currency,
            started_at=now,
            billed_until=now,
        )
        .on_conflict_do_nothing(index_elements=[StorageUsageRecord.namespace_id])
    )


async def close_storage_usage(session: AsyncSession, namespace_id: uuid.UUID) -> None:
    """In the transaction that marks the namespace deleted. Idempotent: the first close wins."""
    await session.execute(
        update(StorageUsageRecord)
        .where(
            StorageUsageRecord.namespace_id == namespace_id, StorageUsageRecord.ended_at.is_(None)
        )
        .values(ended_at=func.clock_timestamp())
    )
