"""Metering and balance enforcement.

Each usage record is charged in fixed windows aligned to its start (window k covers
[started_at + k·W, started_at + (k+1)·W)); window k's debit is cum(end) - cum(start) with
cum(t) = ⌊price_per_gpu_hour · gpus · elapsed(t) / 1 h⌋ in minor units, so the sum of the windows
is exactly the charge for the whole usage, with no rounding drift, and each window is posted under
the idempotency key (usage_record, k): a retried or replayed meter run never charges twice.
Records are billed in batches, one transaction each (records locked in id order, every window's
entry in one INSERT, the running totals moved once per account: activities/billing/ledger.py
post_entries), so a run over thousands of open records is tens of transactions, not thousands.

Storage is billed the same way (issue 37 item 3): each namespace's storage usage record
(activities/billing/storage_usage.py: its provisioned quota at its price per GB-hour) is charged
per window aligned to its start, under the idempotency key (storage record, k), in batches after
the compute records, as `storage_debit` entries in the account's currency.

Balances are then reclassified (healthy / low_balance / depleted, activities/billing/accounts.py):
a notice goes to the outbox once per kind and episode (delivered to the project's webhook by
billing.deliver_notifications, which the workflow runs when some are due), and a depleted
account's allocations are handed to their own workflows for release (billing force-release),
never released around them. Once an account has been depleted longer than its storage grace
period (billing_accounts.storage_grace_seconds, measured against the run's `until`), its storage
attachments still attached are handed to their own workflows for detach (actor billing; the
data is kept), and one that failed to detach (a busy mount) is asked again every
GRACE_DETACH_RETRY_SECONDS.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.billing.accounts import refresh_state
from activities.billing.ledger import EntryKind, Posting, post_entries
from activities.billing.storage_usage import storage_cumulative_charge
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
from contracts.storage import AttachmentStatus
from schema.models import (
    Allocation,
    BillingAccount,
    BillingEvent,
    Notification,
    StorageAttachment,
    StorageUsageRecord,
    UsageRecord,
)

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
# How often a detach that failed after a depleted account's grace is asked for again.
GRACE_DETACH_RETRY_SECONDS = 15 * 60
# Attachments a depleted account's grace ends: attached or on their way to it (a detach asked
# for before the mount stops the attach). `detaching` is already on its way out; `failed` and
# `detached` hold no mount; `detach_failed` is asked again, no more often than the retry setting.
_DETACHABLE = (
    AttachmentStatus.REQUESTED,
    AttachmentStatus.PRECHECKING,
    AttachmentStatus.GRANT_APPLYING,
    AttachmentStatus.GRANT_APPLIED,
    AttachmentStatus.MOUNTING,
    AttachmentStatus.MOUNTED,
)


def due_windows(
    started_at: dt.datetime,
    billed_until: dt.datetime,
    ended_at: dt.datetime | None,
    until: dt.datetime,
    window: dt.timedelta,
) -> tuple[int, int, dt.datetime] | None:
    """The windows [first, last) of a record to bill now and the instant billed through after
    them; None when nothing is due. A closed record is billed through its end (its last window
    partial); an open one through its last whole window before `until`; at most
    MAX_WINDOWS_PER_RUN at once."""
    first = (billed_until - started_at) // window
    if ended_at is not None and ended_at <= until:
        last = -(-(ended_at - started_at) // window)  # ceil
        bill_to = ended_at
    else:
        last = (until - started_at) // window  # whole windows only
        bill_to = started_at + last * window
    last = min(last, first + MAX_WINDOWS_PER_RUN)
    bill_to = min(bill_to, started_at + last * window)
    if bill_to <= billed_until:
        return None
    return first, last, bill_to


def window_charges(
    started_at: dt.datetime,
    billed_until: dt.datetime,
    ended_at: dt.datetime | None,
    until: dt.datetime,
    window: dt.timedelta,
    cumulative: Callable[[dt.timedelta], int],
) -> tuple[list[tuple[int, int]], dt.datetime] | None:
    """Each due window k with its charge, and the instant billed through after them (None:
    nothing due). A window's charge is cumulative(its end) - cumulative(its start), both since
    the record started, so the windows add up exactly to the whole usage rounded down once; a
    window worth less than a minor unit is left out and the next carries it."""
    windows = due_windows(started_at, billed_until, ended_at, until, window)
    if windows is None:
        return None
    first, last, bill_to = windows
    charges: list[tuple[int, int]] = []
    for k in range(first, last):
        start = started_at + k * window
        end = min(start + window, bill_to)
        charge = cumulative(end - started_at) - cumulative(start - started_at)
        if charge > 0:
            charges.append((k, charge))
    return charges, bill_to


def cumulative_charge(price_per_gpu_hour_minor: int, gpus: int, elapsed: dt.timedelta) -> int:
    elapsed_us = max(0, elapsed // dt.timedelta(microseconds=1))
    return price_per_gpu_hour_minor * gpus * elapsed_us // _US_PER_HOUR


async def _post_counted(
    session: AsyncSession, postings: list[Posting], result: MeterResult
) -> list[Posting]:
    """Post the batch's debits (idempotent per key) and count those this run created into the
    run's result; returns them (a concurrent or earlier run's are not counted again)."""
    posted = await post_entries(session, postings)
    created = [p for p, done in zip(postings, posted, strict=True) if done.created]
    result.debits_posted += len(created)
    result.charged_minor += sum(-p.amount_minor for p in created)
    return created


class BillingActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        client: Client | None = None,
        *,
        window_seconds: int = WINDOW_SECONDS,
        grace_detach_retry_seconds: int = GRACE_DETACH_RETRY_SECONDS,
    ) -> None:
        self._sessions = sessions
        self._client = client
        self._window = dt.timedelta(seconds=window_seconds)
        self._grace_detach_retry = dt.timedelta(seconds=grace_detach_retry_seconds)

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
            storage_due = (
                await session.execute(
                    select(
                        StorageUsageRecord.id,
                        StorageUsageRecord.billed_until,
                        StorageUsageRecord.ended_at,
                    )
                    .where(
                        StorageUsageRecord.billed_until
                        < func.coalesce(StorageUsageRecord.ended_at, until)
                    )
                    .order_by(StorageUsageRecord.id)
                )
            ).all()
        projects: set[uuid.UUID] = set()
        for batch in self._batches(due, until):
            projects.update(await self._bill_batch(batch, until, result))
        for batch in self._batches(storage_due, until):
            projects.update(await self._bill_storage_batch(batch, until, result))
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
            await self._reclassify(project_id, until, result)
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
                due = window_charges(
                    record.started_at,
                    record.billed_until,
                    record.ended_at,
                    until,
                    self._window,
                    partial(cumulative_charge, record.price_per_gpu_hour_minor, record.gpu_count),
                )
                if due is None:
                    continue
                charges, record.billed_until = due
                postings += [
                    Posting(
                        project_id=record.project_id,
                        amount_minor=-charge,
                        kind=EntryKind.USAGE_DEBIT,
                        idempotency_key=f"usage:{record.id}:{k}",
                        currency=record.currency,
                        usage_record_id=record.id,
                        description=f"{record.gpu_count}x {record.sku}, window {k}",
                    )
                    for k, charge in charges
                ]
                result.records_billed += 1
                projects.add(record.project_id)
            # (The ORM's flush writes billed_until only: charged_minor is post_entries'.)
            await _post_counted(session, postings, result)
        return projects

    async def _bill_storage_batch(
        self, record_ids: list[uuid.UUID], until: dt.datetime, result: MeterResult
    ) -> set[uuid.UUID]:
        """_bill_batch for storage usage records: the quota held in each window at the record's
        price per GB-hour, idempotent per (storage record, window)."""
        postings: list[Posting] = []
        projects: set[uuid.UUID] = set()
        async with self._sessions() as session, session.begin():
            records = (
                await session.scalars(
                    select(StorageUsageRecord)
                    .where(StorageUsageRecord.id.in_(record_ids))
                    .order_by(StorageUsageRecord.id)
                    .with_for_update()
                )
            ).all()
            for record in records:
                quota = record.quota_bytes
                due = window_charges(
                    record.started_at,
                    record.billed_until,
                    record.ended_at,
                    until,
                    self._window,
                    partial(storage_cumulative_charge, record.price_per_gb_hour_micro_minor, quota),
                )
                if due is None:
                    continue
                charges, record.billed_until = due
                postings += [
                    Posting(
                        project_id=record.project_id,
                        amount_minor=-charge,
                        kind=EntryKind.STORAGE_DEBIT,
                        idempotency_key=f"storage:{record.id}:{k}",
                        currency=record.currency,
                        storage_usage_record_id=record.id,
                        description=f"storage {record.namespace_id}, {quota} bytes, window {k}",
                    )
                    for k, charge in charges
                ]
                result.records_billed += 1
                projects.add(record.project_id)
            posted = await _post_counted(session, postings, result)
            result.storage_debits_posted += len(posted)
            result.storage_charged_minor += sum(-p.amount_minor for p in posted)
        return projects

    async def _reclassify(
        self, project_id: uuid.UUID, until: dt.datetime, result: MeterResult
    ) -> None:
        async with self._sessions() as session, session.begin():
            account = await refresh_state(session, project_id)
            if account is None:
                return
            if account.changed:
                result.state_changes.append(f"{project_id}:{account.previous}->{account.state}")
            if account.state == BalanceState.DEPLETED:
                await self._storage_grace(session, project_id, until, result)
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

    async def _storage_grace(
        self, session: AsyncSession, project_id: uuid.UUID, until: dt.datetime, result: MeterResult
    ) -> None:
        """A depleted account keeps its storage attached for its grace period (counted from when
        it became depleted, to the run's `until`); after it, its attachments are detached by
        their own workflows (billing.detach_storage in the workflow), recorded as a billing
        event. The namespaces and their data stay, and are still billed."""
        depleted_since, grace_seconds = (
            await session.execute(
                select(BillingAccount.state_changed_at, BillingAccount.storage_grace_seconds).where(
                    BillingAccount.project_id == project_id
                )
            )
        ).one()
        grace_ends = depleted_since + dt.timedelta(seconds=grace_seconds)
        if until < grace_ends:
            return
        # Like the grace, the retry interval counts to the run's `until` (now, in production).
        retry_before = until - self._grace_detach_retry
        ids = (
            await session.scalars(
                select(StorageAttachment.id)
                .where(
                    StorageAttachment.project_id == project_id,
                    or_(
                        StorageAttachment.status.in_([s.value for s in _DETACHABLE]),
                        and_(
                            StorageAttachment.status == AttachmentStatus.DETACH_FAILED.value,
                            StorageAttachment.updated_at <= retry_before,
                        ),
                    ),
                )
                .order_by(StorageAttachment.id)
            )
        ).all()
        if not ids:
            return
        session.add(
            BillingEvent(
                project_id=project_id,
                event="storage_grace_detach",
                details={
                    "attachment_ids": [str(i) for i in ids],
                    "depleted_since": depleted_since.isoformat(),
                    "grace_seconds": grace_seconds,
                },
            )
        )
        result.attachments_to_detach.extend(str(i) for i in ids)

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
