"""Metering and balance enforcement.

Each usage record is charged in fixed windows aligned to its start (window k covers
[started_at + k·W, started_at + (k+1)·W)); window k's debit is cum(end) - cum(start) with
cum(t) = ⌊price_per_gpu_hour · gpus · elapsed(t) / 1 h⌋ in minor units, so the sum of the windows
is exactly the charge for the whole usage, with no rounding drift, and each window is posted under
the idempotency key (usage_record, k): a retried or replayed meter run never charges twice.
Records are billed in batches, one transaction each (records locked in id order, every window's
entry in one INSERT, the running totals moved once per account: activities/billing/ledger.py
post_entries), so a run over thousands of open records is tens of transactions, not thousands.

Balances are then reclassified (healthy / low_balance / depleted, activities/billing/accounts.py):
a notice goes to the outbox once per kind and episode (delivered to the project's webhook by
billing.deliver_notifications, which the workflow runs when some are due), and a depleted
account's allocations are handed to their own workflows for release (billing force-release),
never released around them.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.billing.accounts import refresh_state
from activities.billing.ledger import EntryKind, Posting, post_entries
from contracts.allocation import (
    RELEASE_UPDATE,
    ReleaseAccepted,
    ReleaseRequest,
    allocation_workflow_id,
)
from contracts.billing_meter import (
    BalanceState,
    BillingForceReleaseInput,
    BillingForceReleaseResult,
    MeterInput,
    MeterResult,
)
from contracts.states import AllocationStatus, ReleaseActor
from schema.models import Allocation, BillingAccount, Notification, UsageRecord

WINDOW_SECONDS = 60
_US_PER_HOUR = 3_600_000_000
# A long outage of the meter is caught up over several runs rather than in one huge transaction.
MAX_WINDOWS_PER_RUN = 24 * 60
# One transaction bills a batch of records (issue 37): at most this many, and about this many
# windows (one ledger entry each) in all.
BATCH_RECORDS = 500
BATCH_WINDOWS = 5000
# Allocations that would keep consuming a depleted account.
_BILLABLE = (AllocationStatus.REQUESTED, AllocationStatus.PROVISIONING, AllocationStatus.ACTIVE)


def cumulative_charge(price_per_gpu_hour_minor: int, gpus: int, elapsed: dt.timedelta) -> int:
    elapsed_us = max(0, elapsed // dt.timedelta(microseconds=1))
    return price_per_gpu_hour_minor * gpus * elapsed_us // _US_PER_HOUR


class BillingActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        client: Client | None = None,
        *,
        window_seconds: int = WINDOW_SECONDS,
    ) -> None:
        self._sessions = sessions
        self._client = client
        self._window = dt.timedelta(seconds=window_seconds)

    @activity.defn(name="billing.meter")
    async def meter(self, input: MeterInput) -> MeterResult:
        result = MeterResult()
        async with self._sessions() as session:
            until = (
                dt.datetime.fromisoformat(input.until)
                if input.until
                else await session.scalar(select(func.clock_timestamp()))
            )
            assert until is not None
            due = (
                await session.execute(
                    select(
                        UsageRecord.id,
                        UsageRecord.billed_until,
                        UsageRecord.ended_at,
                    )
                    .where(UsageRecord.billed_until < func.coalesce(UsageRecord.ended_at, until))
                    .order_by(UsageRecord.id)
                )
            ).all()
        projects: set[uuid.UUID] = set()
        for batch in self._batches(due, until):
            projects.update(await self._bill_batch(batch, until, result))
        async with self._sessions() as session:
            # Accounts not healthy are looked at every run: a payment may have restored them.
            projects.update(
                (
                    await session.scalars(
                        select(BillingAccount.project_id).where(
                            BillingAccount.state != BalanceState.HEALTHY.value
                        )
                    )
                ).all()
            )
        for project_id in sorted(projects):
            await self._reclassify(project_id, result)
        result.notifications_due = await self._notifications_due()
        return result

    def _batches(self, due: Sequence[Any], until: dt.datetime) -> list[list[uuid.UUID]]:
        """The records due, in id order, cut into batches of at most BATCH_RECORDS records and
        about BATCH_WINDOWS windows (as read before the batch locks them; a record a concurrent
        run billed meanwhile only has fewer)."""
        batches: list[list[uuid.UUID]] = [[]]
        windows = 0
        for record_id, billed_until, ended_at in due:
            end = min(ended_at, until) if ended_at is not None else until
            mine = min(MAX_WINDOWS_PER_RUN, max(1, -(-(end - billed_until) // self._window)))
            if batches[-1] and (
                len(batches[-1]) >= BATCH_RECORDS or windows + mine > BATCH_WINDOWS
            ):
                batches.append([])
                windows = 0
            batches[-1].append(record_id)
            windows += mine
        return [b for b in batches if b]

    async def _bill_batch(
        self, record_ids: list[uuid.UUID], until: dt.datetime, result: MeterResult
    ) -> set[uuid.UUID]:
        """One transaction for the batch: its records locked (in id order), their due windows
        posted in one go (ledger.post_entries, idempotent per (record, window)), and each
        record's billed_until moved. The projects billed."""
        postings: list[Posting] = []
        projects: set[uuid.UUID] = set()
        async with self._sessions() as session, session.begin():
            records = (
                await session.scalars(
                    select(UsageRecord)
                    .where(UsageRecord.id.in_(record_ids))
                    .order_by(UsageRecord.id)
                    .with_for_update()
                )
            ).all()
            for record in records:
                end_of_usage = record.ended_at
                first = (record.billed_until - record.started_at) // self._window
                if end_of_usage is not None and end_of_usage <= until:
                    # Closed: bill through the end, its last window partial.
                    last = -(-(end_of_usage - record.started_at) // self._window)  # ceil
                    bill_to = end_of_usage
                else:
                    last = (until - record.started_at) // self._window  # whole windows only
                    bill_to = record.started_at + last * self._window
                last = min(last, first + MAX_WINDOWS_PER_RUN)
                bill_to = min(bill_to, record.started_at + last * self._window)
                if bill_to <= record.billed_until:
                    continue
                for k in range(first, last):
                    start = record.started_at + k * self._window
                    end = min(start + self._window, bill_to)
                    charge = cumulative_charge(
                        record.price_per_gpu_hour_minor, record.gpu_count, end - record.started_at
                    ) - cumulative_charge(
                        record.price_per_gpu_hour_minor,
                        record.gpu_count,
                        start - record.started_at,
                    )
                    if charge <= 0:
                        continue
                    postings.append(
                        Posting(
                            project_id=record.project_id,
                            amount_minor=-charge,
                            kind=EntryKind.USAGE_DEBIT,
                            idempotency_key=f"usage:{record.id}:{k}",
                            currency=record.currency,
                            usage_record_id=record.id,
                            description=f"{record.gpu_count}x {record.sku}, window {k}",
                        )
                    )
                record.billed_until = bill_to
                result.records_billed += 1
                projects.add(record.project_id)
            posted = await post_entries(session, postings)
            # (The ORM's flush writes billed_until only: charged_minor is post_entries'.)
            for p, done in zip(postings, posted, strict=True):
                if done.created:
                    result.debits_posted += 1
                    result.charged_minor -= p.amount_minor
        return projects

    async def _reclassify(self, project_id: uuid.UUID, result: MeterResult) -> None:
        async with self._sessions() as session, session.begin():
            account = await refresh_state(session, project_id)
            if account is None:
                return
            if account.changed:
                result.state_changes.append(f"{project_id}:{account.previous}->{account.state}")
            if account.state == BalanceState.DEPLETED:
                ids = (
                    await session.scalars(
                        select(Allocation.id).where(
                            Allocation.project_id == project_id,
                            or_(*(Allocation.status == s for s in _BILLABLE)),
                            Allocation.release_requested_by.is_(None),
                        )
                    )
                ).all()
                result.allocations_to_release.extend(str(i) for i in ids)

    async def _notifications_due(self) -> int:
        async with self._sessions() as session:
            due = await session.scalar(
                select(func.count())
                .select_from(Notification)
                .where(
                    Notification.delivery_status == "pending",
                    Notification.next_attempt_at <= func.clock_timestamp(),
                )
            )
        return int(due or 0)

    @activity.defn(name="billing.force_release")
    async def force_release(self, input: BillingForceReleaseInput) -> BillingForceReleaseResult:
        """Ask each allocation's own workflow to release (actor billing)."""
        if self._client is None:
            raise RuntimeError("billing.force_release needs a Temporal client")
        result = BillingForceReleaseResult()
        for allocation_id in input.allocation_ids:
            handle = self._client.get_workflow_handle(allocation_workflow_id(allocation_id))
            try:
                await handle.execute_update(
                    RELEASE_UPDATE,
                    ReleaseRequest(actor=ReleaseActor.BILLING, reason=input.reason),
                    result_type=ReleaseAccepted,
                )
                result.requested.append(allocation_id)
            except (WorkflowUpdateFailedError, RPCError):
                # Not releasable any more (failed, or the workflow already finished): nothing to do.
                result.skipped.append(allocation_id)
            activity.heartbeat(len(result.requested) + len(result.skipped))
        return result
