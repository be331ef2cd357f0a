"""Billing accounts: the balance state of docs/lifecycles/balance.md and the notices it sends.

The balance is the ledger's running total (billing_accounts.balance_minor, moved by every
posting in its transaction, activities/billing/ledger.py); the state (healthy / low_balance /
depleted) is derived from it and stored, so that placement can check it in the statement that
reserves capacity (activities/placement_sql.py). It is recomputed in the transaction of every credit
(activities/billing/ledger.py post_entry) and by every metering run after its debits, always with
the account row locked FOR UPDATE: a placement holding it FOR SHARE either commits before the
state changes (and the meter then sees its allocation) or sees the new state.

An episode starts when the balance leaves `healthy`; within one, each kind of notice
(low_balance, depleted) is written to the outbox at most once (a unique key on
(project, kind, episode)), and delivered to the project's webhook when it has one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sqlalchemy import exists, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.billing_meter import BalanceState, NotificationKind
from schema.models import (
    BillingAccount,
    BillingEvent,
    Notification,
    NotificationWebhook,
)

CLOCK = func.clock_timestamp()
_NOTICE_OF = {
    BalanceState.LOW_BALANCE: NotificationKind.LOW_BALANCE,
    BalanceState.DEPLETED: NotificationKind.DEPLETED,
}


async def ensure_account(session: AsyncSession, project_id: uuid.UUID) -> None:
    """Open the account if it is not open yet: with nothing credited, it is depleted."""
    await session.execute(
        pg_insert(BillingAccount)
        .values(project_id=project_id, state=BalanceState.DEPLETED.value)
        .on_conflict_do_nothing(index_elements=[BillingAccount.project_id])
    )


# An account's currency when it is opened (billing_accounts.currency's server default).
DEFAULT_ACCOUNT_CURRENCY = "usd"


async def account_currency(session: AsyncSession, project_id: uuid.UUID) -> str:
    """The currency of the project's account (every entry of its ledger is in it); an account
    not opened yet will be opened in the default one."""
    currency = await session.scalar(
        select(BillingAccount.currency).where(BillingAccount.project_id == project_id)
    )
    return (currency or DEFAULT_ACCOUNT_CURRENCY).lower()


async def balance_minor(session: AsyncSession, project_id: uuid.UUID) -> int:
    """The account's running total (activities/billing/ledger.py moves it with every posting,
    in the posting's transaction); 0 for an account not opened yet."""
    total = await session.scalar(
        select(BillingAccount.balance_minor).where(BillingAccount.project_id == project_id)
    )
    return int(total or 0)


def classify(balance: int, account: BillingAccount) -> BalanceState:
    if balance <= account.depleted_threshold_minor:
        return BalanceState.DEPLETED
    if balance <= account.low_balance_threshold_minor:
        return BalanceState.LOW_BALANCE
    return BalanceState.HEALTHY


@dataclass
class AccountState:
    project_id: uuid.UUID
    state: BalanceState
    previous: str
    balance_minor: int
    notices: list[str] = field(default_factory=list)  # kinds written to the outbox now

    @property
    def changed(self) -> bool:
        return self.state != self.previous


async def refresh_state(session: AsyncSession, project_id: uuid.UUID) -> AccountState | None:
    """Recompute the account's state from the ledger, in the caller's transaction, with the
    account row locked; record a change (billing event, notices). None: no account."""
    account = await session.scalar(
        select(BillingAccount)
        .where(BillingAccount.project_id == project_id)
        .with_for_update()
        # The running total moves by UPDATE statements: never a stale copy from the session.
        .execution_options(populate_existing=True)
    )
    if account is None:
        return None
    # Read with the lock: every posting before it has committed its move of the total.
    balance = account.balance_minor
    state = classify(balance, account)
    result = AccountState(project_id, state, account.state, balance)
    if result.changed:
        if account.state == BalanceState.HEALTHY:
            account.episode += 1
        session.add(
            BillingEvent(
                project_id=project_id,
                event=f"balance_{state.value}",
                details={"from": account.state, "balance_minor": balance},
            )
        )
        account.state = state.value
        account.state_changed_at = CLOCK
        kind = _NOTICE_OF.get(state)
        if kind is not None and await _write_notice(session, account, kind, balance):
            result.notices.append(kind.value)
    if state == BalanceState.HEALTHY:
        account.low_balance_notified_at = None  # the next episode gets its own notice
    elif result.changed and account.low_balance_notified_at is None:
        # The episode's first step down (to low, or straight to depleted), recorded once
        # however often we run; an account never credited has no episode and no notice.
        session.add(
            BillingEvent(
                project_id=project_id,
                event="low_balance_notified",
                details={"balance_minor": balance, "state": state.value},
            )
        )
        account.low_balance_notified_at = CLOCK
    await session.flush()
    return result


async def _write_notice(
    session: AsyncSession, account: BillingAccount, kind: NotificationKind, balance: int
) -> bool:
    """The outbox row, once per (kind, episode); pending delivery when the project has a
    webhook now. True when this call wrote it."""
    threshold = (
        account.depleted_threshold_minor
        if kind == NotificationKind.DEPLETED
        else account.low_balance_threshold_minor
    )
    has_webhook = bool(
        await session.scalar(
            select(exists().where(NotificationWebhook.project_id == account.project_id))
        )
    )
    written = await session.scalar(
        pg_insert(Notification)
        .values(
            id=uuid.uuid4(),
            project_id=account.project_id,
            kind=kind.value,
            episode=account.episode,
            details={
                "balance_minor": balance,
                "currency": account.currency,
                "state": kind.value,
                "threshold_minor": threshold,
            },
            delivery_status="pending" if has_webhook else "none",
            next_attempt_at=CLOCK if has_webhook else None,
        )
        .on_conflict_do_nothing(constraint="notifications_once_per_episode")
        .returning(Notification.id)
    )
    return written is not None
