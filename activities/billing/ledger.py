"""The ledger: every movement of money is one append-only row with a unique idempotency key, so a
retried or replayed posting lands at most once; balances are sums, in minor units, never floats.
A credit recomputes the account's state in its own transaction (a top-up lifts `depleted` at
once, not at the next metering run). An account has one currency (issue 37): an entry in any
other is refused (`CurrencyMismatch`), so a balance is never a sum over currencies."""

from __future__ import annotations

import uuid
from enum import StrEnum

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from activities.billing.accounts import account_currency, ensure_account, refresh_state
from contracts.payment_session import CURRENCY_MISMATCH
from schema.models import LedgerEntry


class CurrencyMismatch(ValueError):
    """An entry in another currency than its account's: refused, nothing posted."""

    code = CURRENCY_MISMATCH

    def __init__(self, project_id: uuid.UUID, currency: str, account: str) -> None:
        super().__init__(
            f"project {project_id}'s account is in {account}; an entry in {currency} is refused"
        )
        self.currency = currency
        self.account_currency = account


class EntryKind(StrEnum):
    USAGE_DEBIT = "usage_debit"
    PAYMENT_CREDIT = "payment_credit"
    ADMIN_CREDIT = "admin_credit"


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
    """Post once, in the caller's transaction. Returns the entry id and whether this call created
    it (False: an earlier posting with the same key stands, whatever this call asked for). A
    credit recomputes the account's state before it returns (accounts.refresh_state). Raises
    CurrencyMismatch, posting nothing, for a currency other than the account's."""
    if amount_minor == 0:
        raise ValueError("a ledger entry moves money: amount_minor must not be 0")
    if (kind == EntryKind.USAGE_DEBIT) != (amount_minor < 0):
        raise ValueError("usage debits are negative and credits positive")
    await ensure_account(session, project_id)
    account = await account_currency(session, project_id)
    if currency.lower() != account:
        raise CurrencyMismatch(project_id, currency.lower(), account)
    entry_id = await session.scalar(
        pg_insert(LedgerEntry)
        .values(
            id=uuid.uuid4(),
            project_id=project_id,
            amount_minor=amount_minor,
            currency=currency,
            kind=kind,
            idempotency_key=idempotency_key,
            usage_record_id=usage_record_id,
            description=description,
        )
        .on_conflict_do_nothing(index_elements=[LedgerEntry.idempotency_key])
        .returning(LedgerEntry.id)
    )
    if entry_id is not None:
        if amount_minor > 0:  # a repeated posting changed nothing: no state to recompute
            await refresh_state(session, project_id)
        return entry_id, True
    existing = await session.scalar(
        select(LedgerEntry.id).where(LedgerEntry.idempotency_key == idempotency_key)
    )
    assert existing is not None
    return existing, False
