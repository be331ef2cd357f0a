"""The ledger's running total (issue 37 item 5): every posting moves billing_accounts.balance_minor
in its own transaction, so the balance is never a sum over the ledger, and it always equals that
sum. Driven through the production posting functions (activities/billing/ledger.py post_entry,
post_entries) in random sequences, with repeated keys, refused currencies, rolled-back
transactions and concurrent postings; then checked against the ledger by check_running_totals,
the maintenance check, which also repairs a total that drifted."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from activities.billing.accounts import balance_minor, refresh_state
from activities.billing.ledger import (
    CurrencyMismatch,
    EntryKind,
    Posting,
    TotalMismatch,
    check_running_totals,
    ledger_sum_minor,
    post_entries,
    post_entry,
)
from schema.models import BillingAccount, LedgerEntry, Project

Sessions = Any

# One operation: (kind, amount, key index, currency, roll back?). Few keys, so keys repeat.
_OPERATION = st.tuples(
    st.sampled_from(["credit", "debit", "batch", "concurrent"]),
    st.integers(min_value=1, max_value=10**7),
    st.integers(min_value=0, max_value=7),
    st.sampled_from(["usd", "usd", "usd", "eur"]),
    st.booleans(),
)


async def _new_project(db: Sessions) -> uuid.UUID:
    project_id = uuid.uuid4()
    async with db() as session, session.begin():
        session.add(Project(id=project_id, name=f"ledger-{project_id.hex[:8]}"))
    return project_id


def _posting(project_id: uuid.UUID, kind: str, amount: int, key: str, currency: str) -> Posting:
    debit = kind == "debit" or (kind == "batch" and amount % 2 == 0)
    return Posting(
        project_id=project_id,
        amount_minor=-amount if debit else amount,
        kind=EntryKind.USAGE_DEBIT if debit else EntryKind.ADMIN_CREDIT,
        idempotency_key=key,
        currency=currency,
    )


async def _apply(db: Sessions, project_id: uuid.UUID, step: int, op: tuple[Any, ...]) -> None:
    kind, amount, key_index, currency, roll_back = op
    key = f"{project_id}:{key_index}"
    try:
        if kind == "concurrent":
            # Four transactions at once on one account, each its own key (and one repeated).
            async def one(i: int) -> None:
                async with db() as session, session.begin():
                    await post_entry(
                        session,
                        project_id=project_id,
                        amount_minor=amount + i,
                        kind=EntryKind.ADMIN_CREDIT,
                        idempotency_key=f"{key}:c{min(i, 2)}:{step}",
                    )

            await asyncio.gather(*(one(i) for i in range(4)))
            return
        async with db() as session, session.begin():
            if kind == "batch":
                postings = [
                    _posting(project_id, kind, amount + i, f"{key}:b{i}", "usd") for i in range(3)
                ]
                await post_entries(session, postings)
            else:
                posting = _posting(project_id, kind, amount, key, currency)
                await post_entry(
                    session,
                    project_id=posting.project_id,
                    amount_minor=posting.amount_minor,
                    kind=posting.kind,
                    idempotency_key=posting.idempotency_key,
                    currency=posting.currency,
                )
            if roll_back:
                raise _RolledBack
    except (_RolledBack, CurrencyMismatch):
        pass


class _RolledBack(Exception):
    pass


async def _ledger_sum(db: Sessions, project_id: uuid.UUID) -> int:
    async with db() as session:
        return await ledger_sum_minor(session, project_id)


async def _running(db: Sessions, project_id: uuid.UUID) -> int:
    async with db() as session:
        return await balance_minor(session, project_id)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(operations=st.lists(_OPERATION, min_size=1, max_size=12))
async def test_the_running_total_equals_the_ledgers_sum_after_any_postings(
    db_sessions: Sessions, operations: list[tuple[Any, ...]]
) -> None:
    project_id = await _new_project(db_sessions)
    for step, op in enumerate(operations):
        await _apply(db_sessions, project_id, step, op)
        assert await _running(db_sessions, project_id) == await _ledger_sum(db_sessions, project_id)
    async with db_sessions() as session:
        assert await check_running_totals(session, project_id=project_id) == []
    # The state the account is in is the one its running total gives.
    async with db_sessions() as session, session.begin():
        state = await refresh_state(session, project_id)
    if state is not None:
        assert state.balance_minor == await _ledger_sum(db_sessions, project_id)


async def test_a_repeated_key_moves_nothing_and_another_currency_nothing_at_all(
    db_sessions: Sessions,
) -> None:
    project_id = await _new_project(db_sessions)
    async with db_sessions() as session, session.begin():
        first = await post_entry(
            session,
            project_id=project_id,
            amount_minor=500,
            kind=EntryKind.ADMIN_CREDIT,
            idempotency_key="k",
        )
        again = await post_entry(
            session,
            project_id=project_id,
            amount_minor=9000,
            kind=EntryKind.ADMIN_CREDIT,
            idempotency_key="k",
        )
    assert first[1]
    assert not again[1]
    assert first[0] == again[0]
    assert await _running(db_sessions, project_id) == 500
    with pytest.raises(CurrencyMismatch):
        async with db_sessions() as session, session.begin():
            await post_entries(
                session,
                [
                    Posting(project_id, 100, EntryKind.ADMIN_CREDIT, "k2"),
                    Posting(project_id, 100, EntryKind.ADMIN_CREDIT, "k3", currency="jpy"),
                ],
            )
    with pytest.raises(ValueError, match="once"):
        async with db_sessions() as session, session.begin():
            await post_entries(
                session,
                [
                    Posting(project_id, 100, EntryKind.ADMIN_CREDIT, "k4"),
                    Posting(project_id, 100, EntryKind.ADMIN_CREDIT, "k4"),
                ],
            )
    assert await _running(db_sessions, project_id) == 500
    async with db_sessions() as session:
        entries = await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(LedgerEntry.project_id == project_id)
        )
    assert entries == 1


async def test_the_check_finds_a_drifted_total_and_repairs_it(db_sessions: Sessions) -> None:
    """The maintenance check (python -m activities.billing.ledger [--repair]) recomputes from
    the ledger. The drift is made by hand here: nothing in production writes the total but a
    posting, which is what the check is for."""
    project_id, other = await _new_project(db_sessions), await _new_project(db_sessions)
    for p in (project_id, other):
        async with db_sessions() as session, session.begin():
            await post_entry(
                session,
                project_id=p,
                amount_minor=1234,
                kind=EntryKind.ADMIN_CREDIT,
                idempotency_key=f"{p}:credit",
            )
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(BillingAccount)
            .where(BillingAccount.project_id == project_id)
            .values(balance_minor=99)
        )
    async with db_sessions() as session:
        assert await check_running_totals(session) == [
            TotalMismatch("account", project_id, 99, 1234)
        ]
    async with db_sessions() as session, session.begin():
        repaired = await check_running_totals(session, repair=True)
    assert [m.id for m in repaired] == [project_id]
    async with db_sessions() as session:
        assert await check_running_totals(session) == []
    assert await _running(db_sessions, project_id) == 1234
