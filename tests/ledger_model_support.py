"""The ledger model (tests/test_ledger_properties.py): what one tenant did, as the test saw it
from outside (when it asked, when it saw the answer), and the invariants the ledger must keep
against it. Reads only: the ledger, the usage records and the account, through the ORM.

Times are this machine's clock, as the stack's own timestamps are; CLOCK_SLACK absorbs the
microseconds between a timestamp taken in the test and one taken in a transaction."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from activities.billing.ledger import EntryKind, check_running_totals, ledger_sum_minor
from activities.billing.metering import cumulative_charge
from activities.billing.storage_usage import storage_cumulative_charge
from schema.models import BillingAccount, LedgerEntry, StorageUsageRecord, UsageRecord

CLOCK_SLACK = dt.timedelta(milliseconds=50)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class AllocationSeen:
    id: str
    shape: str  # "slice" or "baremetal"
    gpus: int
    posted_at: dt.datetime  # taken before the POST: usage cannot start earlier
    active_at: dt.datetime  # first seen active: usage must have started by then
    release_asked_at: dt.datetime | None = None  # billing must run at least until then
    released_by: str | None = None  # user, admin or billing
    ended_seen_at: dt.datetime | None = None  # first seen released/release_failed: fenced
    status: str = "active"


@dataclass
class NamespaceSeen:
    id: str
    quota_bytes: int
    posted_at: dt.datetime
    created_at: dt.datetime  # the 201 came back
    delete_asked_at: dt.datetime | None = None
    deleted_at: dt.datetime | None = None


@dataclass
class LedgerModel:
    """One example's tenant: its starting credit, what it allocated, stored and paid, and the
    meter runs made for it."""

    project_id: uuid.UUID
    currency: str
    price_per_gpu_hour_minor: int
    window: dt.timedelta
    starting_credit_minor: int
    allocations: dict[str, AllocationSeen] = field(default_factory=dict)
    namespaces: dict[str, NamespaceSeen] = field(default_factory=dict)
    credits: dict[str, int] = field(default_factory=dict)  # payment session id -> paid
    metered_until: dt.datetime | None = None  # the latest `until` a meter run was given
    log: list[str] = field(default_factory=list)

    def live(self) -> list[AllocationSeen]:
        """Allocations that still hold their resources (release_failed holds them too)."""
        return [a for a in self.allocations.values() if a.status != "released"]

    def namespaces_live(self) -> list[NamespaceSeen]:
        return [n for n in self.namespaces.values() if n.deleted_at is None]


@dataclass
class Ledger:
    account: BillingAccount
    entries: list[LedgerEntry]
    usage: list[UsageRecord]
    storage: list[StorageUsageRecord]
    total_mismatches: list[Any]
    ledger_sum: int


async def read_ledger(sessions: async_sessionmaker[AsyncSession], project_id: uuid.UUID) -> Ledger:
    async with sessions() as session:
        account = await session.get(BillingAccount, project_id)
        assert account is not None, f"project {project_id} has no billing account"
        entries = list(
            await session.scalars(
                select(LedgerEntry)
                .where(LedgerEntry.project_id == project_id)
                .order_by(LedgerEntry.created_at)
            )
        )
        usage = list(
            await session.scalars(select(UsageRecord).where(UsageRecord.project_id == project_id))
        )
        storage = list(
            await session.scalars(
                select(StorageUsageRecord).where(StorageUsageRecord.project_id == project_id)
            )
        )
        mismatches = await check_running_totals(session, project_id=project_id)
        total = await ledger_sum_minor(session, project_id)
    return Ledger(account, entries, usage, storage, mismatches, total)


def check_ledger(model: LedgerModel, ledger: Ledger, balance: dict[str, Any]) -> None:
    """Every invariant, for the model's project, on one read of its ledger; `balance` is the
    tenant's GET /billing/balance read just after."""
    # The running balance is the ledger's sum (and each record's charged_minor its debits').
    assert ledger.total_mismatches == [], ledger.total_mismatches
    assert ledger.account.balance_minor == ledger.ledger_sum
    assert balance["balance_minor"] == ledger.ledger_sum, (balance, ledger.ledger_sum)
    assert balance["currency"] == model.currency
    assert (balance["state"] == "depleted") == (ledger.ledger_sum <= 0), balance

    # One currency: every entry in the account's.
    assert {e.currency for e in ledger.entries} <= {model.currency}, [
        (e.kind, e.currency) for e in ledger.entries
    ]
    assert len({e.idempotency_key for e in ledger.entries}) == len(ledger.entries)

    # Credits: the starting credit, and each payment once, for what was paid.
    by_kind: dict[str, list[LedgerEntry]] = {}
    for entry in ledger.entries:
        by_kind.setdefault(entry.kind, []).append(entry)
    admin = by_kind.get(EntryKind.ADMIN_CREDIT, [])
    assert sum(e.amount_minor for e in admin) == model.starting_credit_minor
    payments = {
        e.idempotency_key: e.amount_minor for e in by_kind.get(EntryKind.PAYMENT_CREDIT, [])
    }
    assert payments == {f"payment:{sid}": paid for sid, paid in model.credits.items()}
    unknown = set(by_kind) - {k.value for k in EntryKind}
    assert not unknown, unknown

    debits = by_kind.get(EntryKind.USAGE_DEBIT, []) + by_kind.get(EntryKind.STORAGE_DEBIT, [])
    assert all(e.amount_minor <= 0 for e in debits)
    assert ledger.ledger_sum == (
        model.starting_credit_minor
        + sum(model.credits.values())
        + sum(e.amount_minor for e in debits)
    )
    _check_compute(model, ledger)
    _check_storage(model, ledger)


def _check_compute(model: LedgerModel, ledger: Ledger) -> None:
    records = {str(r.allocation_id): r for r in ledger.usage}
    assert set(records) == set(model.allocations), (
        "a usage record for each allocation the tenant got, and none other",
        sorted(records),
        sorted(model.allocations),
    )
    debited: dict[uuid.UUID, int] = {}
    for entry in ledger.entries:
        if entry.kind == EntryKind.USAGE_DEBIT:
            assert entry.usage_record_id is not None
            debited[entry.usage_record_id] = (
                debited.get(entry.usage_record_id, 0) - entry.amount_minor
            )
    for allocation_id, seen in model.allocations.items():
        r = records[allocation_id]
        where = f"allocation {allocation_id} ({seen.shape}, {seen.gpus} GPUs, {seen.status})"
        assert (r.gpu_count, r.price_per_gpu_hour_minor, r.currency) == (
            seen.gpus,
            model.price_per_gpu_hour_minor,
            model.currency,
        ), where
        # Usage starts between the request and the first sight of the allocation active.
        assert seen.posted_at - CLOCK_SLACK <= r.started_at <= seen.active_at + CLOCK_SLACK, (
            where,
            seen.posted_at,
            r.started_at,
            seen.active_at,
        )
        if seen.ended_seen_at is not None:
            # Fenced by the time it was seen released/release_failed: billing closed by then,
            # and not before the release was asked for.
            assert r.ended_at is not None, f"{where}: seen ended, usage still open"
            assert r.ended_at <= seen.ended_seen_at + CLOCK_SLACK, (where, r.ended_at)
            assert seen.release_asked_at is not None
            assert r.ended_at >= seen.release_asked_at - CLOCK_SLACK, (
                f"{where}: billing stopped before the release was asked for",
                r.ended_at,
                seen.release_asked_at,
            )
        elif seen.release_asked_at is None:
            assert r.ended_at is None, f"{where}: usage closed while the tenant still had it"
        # No debit for time after the usage ended; debits equal usage x price, rounded down
        # once over the whole billed span.
        assert r.billed_until >= r.started_at
        if r.ended_at is not None:
            assert r.billed_until <= r.ended_at, (where, r.billed_until, r.ended_at)
        billed = r.billed_until - r.started_at
        expected = cumulative_charge(r.price_per_gpu_hour_minor, r.gpu_count, billed)
        assert debited.get(r.id, 0) == r.charged_minor == expected, (
            where,
            debited.get(r.id, 0),
            r.charged_minor,
            expected,
        )
        # Nothing the meter should have billed is left unbilled (whole windows while running;
        # through the end once closed).
        if model.metered_until is not None:
            end = (
                model.metered_until if r.ended_at is None else min(r.ended_at, model.metered_until)
            )
            owed = end - r.started_at
            if owed > dt.timedelta(0):
                assert billed >= owed - model.window, (where, billed, owed)
            exact = (
                r.price_per_gpu_hour_minor
                * r.gpu_count
                * max(owed, dt.timedelta(0))
                / dt.timedelta(hours=1)
            )
            assert r.charged_minor <= exact + 1e-9, (where, r.charged_minor, exact)


def _check_storage(model: LedgerModel, ledger: Ledger) -> None:
    records = {str(r.namespace_id): r for r in ledger.storage}
    assert set(records) == set(model.namespaces), (sorted(records), sorted(model.namespaces))
    debited: dict[uuid.UUID, int] = {}
    for entry in ledger.entries:
        if entry.kind == EntryKind.STORAGE_DEBIT:
            assert entry.storage_usage_record_id is not None
            key = entry.storage_usage_record_id
            debited[key] = debited.get(key, 0) - entry.amount_minor
    for namespace_id, seen in model.namespaces.items():
        r = records[namespace_id]
        where = f"namespace {namespace_id} ({seen.quota_bytes} B)"
        assert (r.quota_bytes, r.currency) == (seen.quota_bytes, model.currency), where
        assert seen.posted_at - CLOCK_SLACK <= r.started_at <= seen.created_at + CLOCK_SLACK, where
        if seen.deleted_at is not None:
            assert r.ended_at is not None, f"{where}: deleted, still billed"
            assert seen.delete_asked_at is not None
            assert seen.delete_asked_at - CLOCK_SLACK <= r.ended_at <= seen.deleted_at + CLOCK_SLACK
        else:
            assert r.ended_at is None, f"{where}: billing stopped while the namespace exists"
        assert r.started_at <= r.billed_until
        if r.ended_at is not None:
            assert r.billed_until <= r.ended_at, where
        expected = storage_cumulative_charge(
            r.price_per_gb_hour_micro_minor, r.quota_bytes, r.billed_until - r.started_at
        )
        assert debited.get(r.id, 0) == r.charged_minor == expected, (
            where,
            debited.get(r.id, 0),
            r.charged_minor,
            expected,
        )
        if model.metered_until is not None:
            end = (
                model.metered_until if r.ended_at is None else min(r.ended_at, model.metered_until)
            )
            owed = end - r.started_at
            if owed > dt.timedelta(0):
                assert r.billed_until - r.started_at >= owed - model.window, where
