"""The ledger: every movement of money is one append-only row with a unique idempotency key, so a
retried or replayed posting lands at most once; amounts are in minor units, never floats.
A credit recomputes the account's state in its own transaction (a top-up lifts `depleted` at
once, not at the next metering run). An account has one currency (issue 37): an entry in any
other is refused (`CurrencyMismatch`), so a balance is never a sum over currencies.

The balance is the account's running total (billing_accounts.balance_minor), moved in the
transaction that inserts each entry, and only by an entry this call created (a repeated key
moves nothing); a usage debit moves its usage record's charged_minor the same way. So a balance
read, a credit or a meter run never sums the ledger, and the total is always the ledger's sum:
`check_running_totals` recomputes both (and repairs, when asked; `python -m
activities.billing.ledger [--repair]`). Postings lock the account row (the UPDATE), so concurrent
postings to one account serialize; a batch moves its accounts in project order (no deadlock
between two batches)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.billing.accounts import (
    DEFAULT_ACCOUNT_CURRENCY,
    ensure_account,
    refresh_state,
)
from contracts.payment_session import CURRENCY_MISMATCH
from schema.models import BillingAccount, LedgerEntry, StorageUsageRecord, UsageRecord


class CurrencyMismatch(ValueError):
    """An entry in another currency than its account's: refused, nothing posted."""

    code = CURRENCY_MISMATCH

    def __init__(self, project_id: uuid.UUID, currency: str, account: str) -> None:
        super().__init__(
            f"project {project_id}'s account is in {account}; an entry in {currency} is refused"
        )
        self.currency = currency
        self.account_currency = account


# Rows per INSERT statement: 9 parameters each, under asyncpg's 32,767.
INSERT_CHUNK = 1000


class EntryKind(StrEnum):
    USAGE_DEBIT = "usage_debit"
    STORAGE_DEBIT = "storage_debit"  # a storage namespace's provisioned GB-hours
    PAYMENT_CREDIT = "payment_credit"
    ADMIN_CREDIT = "admin_credit"


@dataclass(frozen=True)
class Posting:
    """One entry to post (post_entries); see post_entry for the rules."""

    project_id: uuid.UUID
    amount_minor: int
    kind: EntryKind
    idempotency_key: str
    currency: str = "usd"
    usage_record_id: uuid.UUID | None = None
    description: str | None = None
    storage_usage_record_id: uuid.UUID | None = None


@dataclass(frozen=True)
class Posted:
    entry_id: uuid.UUID
    created: bool  # False: an earlier posting with the same key stands


DEBITS = (EntryKind.USAGE_DEBIT, EntryKind.STORAGE_DEBIT)


def _validate(p: Posting) -> None:
    if p.amount_minor == 0:
        raise ValueError("a ledger entry moves money: amount_minor must not be 0")
    if (p.kind in DEBITS) != (p.amount_minor < 0):
        raise ValueError("debits are negative and credits positive")


async def post_entries(session: AsyncSession, postings: Sequence[Posting]) -> list[Posted]:
    """Post a batch once each, in the caller's transaction: one INSERT for all of them, then the
    running totals of the accounts (and usage records) that the created entries move, in project
    order. Answers in the order asked. A credit recomputes its account's state before this
    returns. Raises CurrencyMismatch, posting nothing, when any entry is in a currency other than
    its account's; ValueError for a zero amount or a debit/credit of the wrong sign."""
    if not postings:
        return []
    for p in postings:
        _validate(p)
    if len({p.idempotency_key for p in postings}) != len(postings):
        raise ValueError("a batch posts each idempotency key once")
    projects = sorted({p.project_id for p in postings})
    for project_id in projects:
        await ensure_account(session, project_id)
    currencies = dict(
        (
            await session.execute(
                select(BillingAccount.project_id, BillingAccount.currency).where(
                    BillingAccount.project_id.in_(projects)
                )
            )
        ).all()
    )
    for p in postings:
        account = (currencies.get(p.project_id) or DEFAULT_ACCOUNT_CURRENCY).lower()
        if p.currency.lower() != account:
            raise CurrencyMismatch(p.project_id, p.currency.lower(), account)
    created_rows: list[tuple[str, uuid.UUID]] = []
    for i in range(0, len(postings), INSERT_CHUNK):  # within the driver's 32,767 parameters
        created_rows.extend(
            (key, entry_id)
            for key, entry_id in (
                await session.execute(
                    pg_insert(LedgerEntry)
                    .values(
                        [
                            {
                                "id": uuid.uuid4(),
                                "project_id": p.project_id,
                                "amount_minor": p.amount_minor,
                                "currency": p.currency,
                                "kind": p.kind,
                                "idempotency_key": p.idempotency_key,
                                "usage_record_id": p.usage_record_id,
                                "storage_usage_record_id": p.storage_usage_record_id,
                                "description": p.description,
                            }
                            for p in postings[i : i + INSERT_CHUNK]
                        ]
                    )
                    .on_conflict_do_nothing(index_elements=[LedgerEntry.idempotency_key])
                    .returning(LedgerEntry.idempotency_key, LedgerEntry.id)
                )
            ).all()
        )
    created = {key: entry_id for key, entry_id in created_rows}
    by_project: dict[uuid.UUID, int] = defaultdict(int)
    by_record: dict[uuid.UUID, int] = defaultdict(int)
    by_storage_record: dict[uuid.UUID, int] = defaultdict(int)
    credited: set[uuid.UUID] = set()
    for p in postings:
        if p.idempotency_key not in created:
            continue
        by_project[p.project_id] += p.amount_minor
        if p.usage_record_id is not None:
            by_record[p.usage_record_id] -= p.amount_minor
        if p.storage_usage_record_id is not None:
            by_storage_record[p.storage_usage_record_id] -= p.amount_minor
        if p.amount_minor > 0:
            credited.add(p.project_id)
    for project_id in sorted(by_project):
        if by_project[project_id]:
            await session.execute(
                update(BillingAccount)
                .where(BillingAccount.project_id == project_id)
                .values(balance_minor=BillingAccount.balance_minor + by_project[project_id])
            )
    for model, moved in ((UsageRecord, by_record), (StorageUsageRecord, by_storage_record)):
        if not moved:
            continue
        records = model.__table__
        assert isinstance(records, Table)
        connection = await session.connection()
        await connection.execute(
            update(records)
            .where(records.c.id == bindparam("b_id"))
            .values(charged_minor=records.c.charged_minor + bindparam("b_charged")),
            [{"b_id": r, "b_charged": c} for r, c in sorted(moved.items())],
        )
    for project_id in sorted(credited):  # a repeated posting changed nothing: nothing to redo
        await refresh_state(session, project_id)
    missing = [p.idempotency_key for p in postings if p.idempotency_key not in created]
    if missing:
        created.update(
            (
                await session.execute(
                    select(LedgerEntry.idempotency_key, LedgerEntry.id).where(
                        LedgerEntry.idempotency_key.in_(missing)
                    )
                )
            ).all()
        )
    new = {key for key, _ in created_rows}
    return [Posted(created[p.idempotency_key], p.idempotency_key in new) for p in postings]


async def post_entry(
    session: AsyncSession,
    *,
    project_id: uuid.UUID,
    amount_minor: int,
    kind: EntryKind,
    idempotency_key: str,
    currency: str = "usd",
    usage_record_id: uuid.UUID | None = None,
    description: str | None = None,
) -> tuple[uuid.UUID, bool]:
    """Post once, in the caller's transaction, moving the account's running total with it.
    Returns the entry id and whether this call created it (False: an earlier posting with the
    same key stands, whatever this call asked for). A credit recomputes the account's state
    before it returns (accounts.refresh_state). Raises CurrencyMismatch, posting nothing, for a
    currency other than the account's."""
    (posted,) = await post_entries(
        session,
        [
            Posting(
                project_id=project_id,
                amount_minor=amount_minor,
                kind=kind,
                idempotency_key=idempotency_key,
                currency=currency,
                usage_record_id=usage_record_id,
                description=description,
            )
        ],
    )
    return posted.entry_id, posted.created


@dataclass(frozen=True)
class TotalMismatch:
    """A running total that differs from the ledger's sum (found by check_running_totals)."""

    kind: str  # account | usage_record | storage_usage_record
    id: uuid.UUID
    running_minor: int
    ledger_minor: int


async def ledger_sum_minor(session: AsyncSession, project_id: uuid.UUID) -> int:
    """The balance the slow way: the sum of the project's entries (checks and repairs only)."""
    total = await session.scalar(
        select(func.coalesce(func.sum(LedgerEntry.amount_minor), 0)).where(
            LedgerEntry.project_id == project_id
        )
    )
    return int(total or 0)


async def check_running_totals(
    session: AsyncSession,
    *,
    project_id: uuid.UUID | None = None,
    repair: bool = False,
) -> list[TotalMismatch]:
    """Recompute every account's running total (and every usage record's and storage usage
    record's charged_minor) from
    the ledger, for one project or all: the mismatches found. With `repair`, each is set to the
    ledger's sum, its account row locked first (a posting racing the repair waits for it), in
    the caller's transaction. A maintenance check: it reads the whole ledger."""
    sums = (
        select(LedgerEntry.project_id, func.sum(LedgerEntry.amount_minor).label("total"))
        .group_by(LedgerEntry.project_id)
        .subquery()
    )
    accounts = select(
        BillingAccount.project_id, BillingAccount.balance_minor, func.coalesce(sums.c.total, 0)
    ).outerjoin(sums, sums.c.project_id == BillingAccount.project_id)
    charged = (
        select(LedgerEntry.usage_record_id, (-func.sum(LedgerEntry.amount_minor)).label("total"))
        .where(LedgerEntry.usage_record_id.is_not(None))
        .group_by(LedgerEntry.usage_record_id)
        .subquery()
    )
    records = select(
        UsageRecord.id, UsageRecord.charged_minor, func.coalesce(charged.c.total, 0)
    ).outerjoin(charged, charged.c.usage_record_id == UsageRecord.id)
    storage_charged = (
        select(
            LedgerEntry.storage_usage_record_id,
            (-func.sum(LedgerEntry.amount_minor)).label("total"),
        )
        .where(LedgerEntry.storage_usage_record_id.is_not(None))
        .group_by(LedgerEntry.storage_usage_record_id)
        .subquery()
    )
    storage_records = select(
        StorageUsageRecord.id,
        StorageUsageRecord.charged_minor,
        func.coalesce(storage_charged.c.total, 0),
    ).outerjoin(storage_charged, storage_charged.c.storage_usage_record_id == StorageUsageRecord.id)
    if project_id is not None:
        accounts = accounts.where(BillingAccount.project_id == project_id)
        records = records.where(UsageRecord.project_id == project_id)
        storage_records = storage_records.where(StorageUsageRecord.project_id == project_id)
    if repair:
        accounts = accounts.order_by(BillingAccount.project_id).with_for_update(of=BillingAccount)
    found = (
        [
            TotalMismatch("account", pid, int(running), int(total))
            for pid, running, total in (await session.execute(accounts)).all()
            if int(running) != int(total)
        ]
        + [
            TotalMismatch("usage_record", rid, int(running), int(total))
            for rid, running, total in (await session.execute(records)).all()
            if int(running) != int(total)
        ]
        + [
            TotalMismatch("storage_usage_record", rid, int(running), int(total))
            for rid, running, total in (await session.execute(storage_records)).all()
            if int(running) != int(total)
        ]
    )
    if repair:
        for m in found:
            if m.kind == "account":
                await session.execute(
                    update(BillingAccount)
                    .where(BillingAccount.project_id == m.id)
                    .values(balance_minor=await ledger_sum_minor(session, m.id))
                )
            else:
                model = UsageRecord if m.kind == "usage_record" else StorageUsageRecord
                await session.execute(
                    update(model).where(model.id == m.id).values(charged_minor=m.ledger_minor)
                )
    return found


def main() -> None:
    """Check (and with --repair, fix) the running totals against the ledger; exit 1 when any
    differed."""
    import argparse
    import asyncio

    from core.config import Settings
    from schema.db import create_engine, session_factory

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--project", type=uuid.UUID, default=None)
    parser.add_argument("--repair", action="store_true")
    args = parser.parse_args()

    async def go() -> int:
        engine = create_engine(Settings.from_env().database_url, pool_size=1, max_overflow=0)
        try:
            async with session_factory(engine)() as session, session.begin():
                found = await check_running_totals(
                    session, project_id=args.project, repair=args.repair
                )
        finally:
            await engine.dispose()
        for m in found:
            print(
                f"{m.kind} {m.id}: running {m.running_minor}, ledger {m.ledger_minor}"
                + (" (repaired)" if args.repair else "")
            )
        print(f"{len(found)} running totals differed from the ledger")
        return 1 if found else 0

    raise SystemExit(asyncio.run(go()))


if __name__ == "__main__":
    main()
