"""Payment activities: each is one short transaction (never open across a Stripe call) and
idempotent, since local activities run again after a crash between commit and record. Every
transition writes its row of the append-only payment_session_events in the same transaction.

A completion is first recorded on its own (initiated → checkout_completed, `complete`); the
credit then moves checkout_completed → credited and posts the ledger entry with key
`payment:{id}` in ONE transaction, so a session credits at most once, whatever retries, duplicate
webhooks or reconciliation runs do. A completion of a session that already expired (a delayed
payment method that settled late) is credited the same way and flagged `late_success` for review.
(Workflows recorded before `complete` existed credit straight from initiated, as they did.)
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid

import stripe
from sqlalchemy import Select, func, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.billing.accounts import account_currency
from activities.billing.ledger import EntryKind, post_entry
from activities.payments.stripe_api import StripeApi, StripeCheckoutSession, StripeNotConfigured
from contracts.payment_session import (
    AMOUNT_MISMATCH,
    CHECKOUT_COMPLETED,
    CREDITED,
    CURRENCY_MISMATCH,
    EXPIRED,
    FAILED_RECONCILE,
    INITIATED,
    LATE_SUCCESS,
    STRIPE_ERROR,
    CheckoutCompletion,
    CheckoutCreated,
    CompleteInput,
    CreateCheckoutInput,
    CreditInput,
    ExpireInput,
    FailInput,
    SettleResult,
    ledger_idempotency_key,
    stripe_idempotency_key,
)
from contracts.stripe_reconciliation import (
    PaidSession,
    ReconciliationInput,
    ReconciliationScan,
)
from core.payment_settings import PaymentSettings
from schema.models import PaymentSession, PaymentSessionEvent

log = logging.getLogger(__name__)
CLOCK = func.clock_timestamp()
SESSION_MISMATCH = "stripe_session_mismatch"
# payment_sessions.failure_reason of a session whose TTL elapsed unpaid.
TTL_ELAPSED = "ttl_elapsed"
# Stripe accepts a Checkout Session expires_at between 30 minutes and 24 hours from now.
_STRIPE_MIN_TTL, _STRIPE_MAX_TTL = 1800.0, 86400.0


def _stripe_failure(err: Exception) -> ApplicationError:
    """Connection trouble and 5xx/429 are retried; everything else is a non-retryable refusal.
    Only the error's class is kept: Stripe messages can echo request data."""
    retryable = isinstance(err, stripe.APIConnectionError | stripe.RateLimitError) or (
        isinstance(err, stripe.APIError) and not isinstance(err, stripe.InvalidRequestError)
    )
    return ApplicationError(
        f"Stripe call failed ({type(err).__name__})", type=STRIPE_ERROR, non_retryable=not retryable
    )


def _event(
    session: AsyncSession,
    payment_session_id: uuid.UUID,
    event: str,
    from_status: str | None,
    to_status: str | None,
    **details: object,
) -> None:
    session.add(
        PaymentSessionEvent(
            payment_session_id=payment_session_id,
            event=event,
            from_status=from_status,
            to_status=to_status,
            details={k: v for k, v in details.items() if v is not None},
        )
    )


def _completion_details(completion: CheckoutCompletion) -> dict[str, object]:
    return {
        "source": completion.source,
        "stripe_event_id": completion.stripe_event_id,
        "amount_total": completion.amount_total,
        "currency": completion.currency.lower(),
    }


def _settled(row: PaymentSession) -> SettleResult:
    entry = str(row.ledger_entry_id) if row.ledger_entry_id else None
    return SettleResult(str(row.id), row.status, entry, row.failure_reason, row.review_reason)


class PaymentActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        stripe_api: StripeApi,
        settings: PaymentSettings,
    ) -> None:
        self._sessions = sessions
        self._stripe = stripe_api
        self._settings = settings

    # ------------------------------------------------------------------ create

    @activity.defn(name="payments.create_checkout")
    async def create_checkout(self, input: CreateCheckoutInput) -> CheckoutCreated:
        """Load (already created? answer from the row) → create the Checkout Session at Stripe
        (with an idempotency key, so a retry is the same session) → record the row."""
        ttl = self._settings.session_ttl_seconds
        session_id = uuid.UUID(input.payment_session_id)
        existing = await self._load(session_id)
        if existing is not None:
            return self._created(existing, ttl)
        expires_at: int | None = None
        if ttl >= _STRIPE_MIN_TTL:
            # Stripe refuses more than 24 h; a minute of margin for clock skew.
            expires_at = int(dt.datetime.now(dt.UTC).timestamp() + min(ttl, _STRIPE_MAX_TTL - 60))
        try:
            checkout = await self._stripe.create_checkout_session(
                payment_session_id=input.payment_session_id,
                amount_minor=input.amount_minor,
                currency=input.currency,
                idempotency_key=stripe_idempotency_key(input.payment_session_id),
                expires_at=expires_at,
            )
        except StripeNotConfigured as err:
            raise ApplicationError(str(err), type=STRIPE_ERROR, non_retryable=True) from None
        except stripe.StripeError as err:
            raise _stripe_failure(err) from None
        async with self._sessions() as session, session.begin():
            inserted = await session.scalar(
                pg_insert(PaymentSession)
                .values(
                    id=session_id,
                    project_id=uuid.UUID(input.project_id),
                    stripe_checkout_session_id=checkout.id,
                    idempotency_key=input.idempotency_key,
                    requested_amount_minor=input.amount_minor,
                    currency=input.currency,
                    status=INITIATED,
                    checkout_url=checkout.url,
                    workflow_id=input.workflow_id,
                    expires_at=CLOCK + dt.timedelta(seconds=ttl),
                )
                .on_conflict_do_nothing(index_elements=[PaymentSession.id])
                .returning(PaymentSession.id)
            )
            if inserted is not None:
                _event(
                    session,
                    session_id,
                    "initiated",
                    None,
                    INITIATED,
                    stripe_checkout_session_id=checkout.id,
                    amount_minor=input.amount_minor,
                    currency=input.currency,
                )
        row = await self._load(session_id)
        assert row is not None
        return self._created(row, ttl)

    async def _load(self, session_id: uuid.UUID) -> PaymentSession | None:
        async with self._sessions() as session:
            return await session.get(PaymentSession, session_id)

    def _created(self, row: PaymentSession, ttl: float) -> CheckoutCreated:
        return CheckoutCreated(
            payment_session_id=str(row.id),
            stripe_checkout_session_id=row.stripe_checkout_session_id or "",
            checkout_url=row.checkout_url or "",
            status=row.status,
            expires_at=row.expires_at.isoformat() if row.expires_at else "",
            ttl_seconds=ttl,
            late_success_window_seconds=self._settings.late_success_window_seconds,
        )

    # ------------------------------------------------------------------ settle

    @activity.defn(name="payments.complete")
    async def complete(self, input: CompleteInput) -> SettleResult:
        """initiated → checkout_completed, committed before any credit is tried: Stripe said it
        was paid. From expired (the payment settled after the session's TTL) the same, flagged
        `late_success` for review. Any other status: already past this step, answered as is."""
        completion = input.completion
        async with self._sessions() as session, session.begin():
            row = await self._locked(session, input.payment_session_id)
            if row.status not in (INITIATED, EXPIRED):
                return _settled(row)
            prior = row.status
            row.status = CHECKOUT_COMPLETED
            row.completed_at = CLOCK
            row.credited_amount_minor = completion.amount_total
            if prior == EXPIRED:
                row.review_reason = LATE_SUCCESS
                row.flagged_for_review_at = CLOCK
                row.failure_reason = None
                log.warning(
                    "payment session %s was paid after it expired: crediting it, flagged for "
                    "review",
                    row.id,
                )
            _event(
                session,
                row.id,
                "checkout_completed",
                prior,
                CHECKOUT_COMPLETED,
                late=prior == EXPIRED or None,
                **_completion_details(completion),
            )
            await session.flush()
            return SettleResult(str(row.id), CHECKOUT_COMPLETED, None, None, row.review_reason)

    @activity.defn(name="payments.credit")
    async def credit(self, input: CreditInput) -> SettleResult:
        completion = input.completion
        async with self._sessions() as session, session.begin():
            row = await self._locked(session, input.payment_session_id)
            if row.status in (CREDITED, FAILED_RECONCILE, EXPIRED):
                return _settled(row)
            if row.status == INITIATED:
                # A workflow from before `payments.complete`: both steps in this transaction.
                row.status = CHECKOUT_COMPLETED
                row.completed_at = CLOCK
                row.credited_amount_minor = completion.amount_total
                _event(
                    session,
                    row.id,
                    "checkout_completed",
                    INITIATED,
                    CHECKOUT_COMPLETED,
                    **_completion_details(completion),
                )
                await session.flush()
            reason: str | None = None
            if completion.stripe_checkout_session_id != row.stripe_checkout_session_id:
                reason = SESSION_MISMATCH
            elif completion.currency.lower() != row.currency or row.currency != (
                await account_currency(session, row.project_id)
            ):
                # Paid in another currency than asked, or asked (by an older build) in one other
                # than the account's: nothing is credited (the ledger would refuse it).
                reason = CURRENCY_MISMATCH
            elif completion.amount_total != row.requested_amount_minor:
                reason = AMOUNT_MISMATCH
            if reason is not None:
                row.status = FAILED_RECONCILE
                row.failure_reason = reason
                _event(
                    session,
                    row.id,
                    "failed_reconcile",
                    CHECKOUT_COMPLETED,
                    FAILED_RECONCILE,
                    reason=reason,
                    amount_total=completion.amount_total,
                    currency=completion.currency.lower(),
                )
                return SettleResult(str(row.id), FAILED_RECONCILE, None, reason, row.review_reason)
            entry_id, _ = await post_entry(
                session,
                project_id=row.project_id,
                amount_minor=row.requested_amount_minor,
                kind=EntryKind.PAYMENT_CREDIT,
                idempotency_key=ledger_idempotency_key(str(row.id)),
                currency=row.currency,
                description=f"Stripe Checkout Session {row.stripe_checkout_session_id}",
            )
            row.status = CREDITED
            row.ledger_entry_id = entry_id
            row.credited_at = CLOCK
            _event(
                session,
                row.id,
                "credited",
                CHECKOUT_COMPLETED,
                CREDITED,
                ledger_entry_id=str(entry_id),
                amount_minor=row.requested_amount_minor,
                review_reason=row.review_reason,
            )
            return SettleResult(str(row.id), CREDITED, str(entry_id), None, row.review_reason)

    @activity.defn(name="payments.fail")
    async def fail(self, input: FailInput) -> SettleResult:
        async with self._sessions() as session, session.begin():
            row = await self._locked(session, input.payment_session_id)
            if row.status not in (INITIATED, CHECKOUT_COMPLETED):
                return _settled(row)
            prior = row.status
            row.status = FAILED_RECONCILE
            row.failure_reason = input.reason
            if input.credited_amount_minor is not None:
                row.credited_amount_minor = input.credited_amount_minor
            if row.completed_at is None:
                row.completed_at = CLOCK
            _event(
                session, row.id, "failed_reconcile", prior, FAILED_RECONCILE, reason=input.reason
            )
            await session.flush()
            return _settled(row)

    @activity.defn(name="payments.expire")
    async def expire(self, input: ExpireInput) -> SettleResult:
        async with self._sessions() as session, session.begin():
            row = await self._locked(session, input.payment_session_id)
            if row.status != INITIATED:
                return _settled(row)
            row.status = EXPIRED
            row.failure_reason = TTL_ELAPSED
            _event(session, row.id, "expired", INITIATED, EXPIRED, reason=TTL_ELAPSED)
            await session.flush()
            return _settled(row)

    @staticmethod
    async def _locked(session: AsyncSession, payment_session_id: str) -> PaymentSession:
        row = await session.get(PaymentSession, uuid.UUID(payment_session_id), with_for_update=True)
        if row is None:
            raise ApplicationError("no such payment session", type="not_found", non_retryable=True)
        return row

    # ------------------------------------------------------------------ reconciliation

    @activity.defn(name="payments.reconciliation_scan")
    async def reconciliation_scan(self, input: ReconciliationInput) -> ReconciliationScan:
        """Load our unsettled sessions → ask Stripe → report the paid ones and those initiated
        past their TTL. Writes nothing: the workflow signals the owning workflows (or, where
        one has closed, settles the session itself), which apply the outcome.

        Unsettled: initiated, or expired unpaid (`ttl_elapsed`, nothing credited) no longer than
        `late_horizon_seconds` ago: a delayed payment method may still settle, also after the
        late-success window (issue 37). Stripe is asked with its list of completed sessions
        (paged; whatever it lists that we hold unsettled counts, however many we hold) and,
        for each loaded session the list did not settle, a lookup: initiated ones past the
        grace, expired ones the newest `max_late_checks` first."""
        async with self._sessions() as session:
            now = await session.scalar(select(CLOCK))
            assert now is not None
            late_since = now - dt.timedelta(seconds=input.late_horizon_seconds)
            initiated = list(
                (
                    await session.scalars(
                        select(PaymentSession)
                        .where(
                            PaymentSession.status == INITIATED,
                            PaymentSession.stripe_checkout_session_id.is_not(None),
                        )
                        .order_by(PaymentSession.created_at)
                        .limit(input.max_sessions)
                    )
                ).all()
            )
            expired = list(
                (
                    await session.scalars(
                        _unsettled_expired(late_since)
                        .order_by(PaymentSession.expires_at.desc())
                        .limit(input.max_late_checks)
                    )
                ).all()
            )
        ours: dict[str | None, PaymentSession] = {
            r.stripe_checkout_session_id: r for r in [*initiated, *expired]
        }
        scan = ReconciliationScan()
        found: dict[str, StripeCheckoutSession] = {}
        horizon = late_since - dt.timedelta(seconds=self._settings.session_ttl_seconds + 3600)
        try:
            listed = await self._stripe.list_checkout_sessions(
                created_after=int(horizon.timestamp()),
                status="complete",
                max_pages=_LIST_PAGES,
            )
            scan.listed = len(listed)
            found.update({s.id: s for s in listed if s.payment_status == "paid"})
            await self._add_listed(ours, [i for i in found if i not in ours], late_since)
            found = {i: s for i, s in found.items() if i in ours}
            grace = dt.timedelta(seconds=input.grace_seconds)
            for stripe_id, row in ours.items():
                if stripe_id is None or stripe_id in found:
                    continue
                if row.status == INITIATED and row.created_at > now - grace:
                    continue
                activity.heartbeat(stripe_id)
                try:
                    found[stripe_id] = await self._stripe.retrieve_checkout_session(stripe_id)
                    scan.checked += 1
                except stripe.InvalidRequestError:
                    log.warning("Stripe does not know checkout session %s", stripe_id)
        except StripeNotConfigured as err:
            raise ApplicationError(str(err), type=STRIPE_ERROR, non_retryable=True) from None
        except stripe.StripeError as err:
            raise _stripe_failure(err) from None
        for stripe_id, row in ours.items():
            checkout = found.get(stripe_id or "")
            if checkout is not None and checkout.payment_status == "paid":
                scan.paid.append(
                    PaidSession(
                        payment_session_id=str(row.id),
                        stripe_checkout_session_id=checkout.id,
                        amount_total=checkout.amount_total or 0,
                        currency=(checkout.currency or row.currency).lower(),
                        requested_amount_minor=row.requested_amount_minor,
                    )
                )
            elif row.status == INITIATED and row.expires_at is not None and row.expires_at < now:
                scan.overdue.append(str(row.id))
        return scan

    async def _add_listed(
        self,
        ours: dict[str | None, PaymentSession],
        stripe_ids: list[str],
        late_since: dt.datetime,
    ) -> None:
        """Add to `ours` the sessions Stripe listed as paid that we hold unsettled but did not
        load (beyond the bounds of the loads)."""
        if not stripe_ids:
            return
        async with self._sessions() as session:
            rows = await session.scalars(
                select(PaymentSession).where(
                    PaymentSession.stripe_checkout_session_id.in_(stripe_ids),
                    or_(
                        PaymentSession.status == INITIATED,
                        PaymentSession.id.in_(
                            _unsettled_expired(late_since).with_only_columns(PaymentSession.id)
                        ),
                    ),
                )
            )
            ours.update({r.stripe_checkout_session_id: r for r in rows})


# Pages of Stripe's list of completed sessions one scan reads (100 sessions a page).
_LIST_PAGES = 20


def _unsettled_expired(late_since: dt.datetime) -> Select[PaymentSession]:
    """Sessions that expired unpaid (the TTL elapsed, nothing was ever completed or credited)
    since `late_since`: a late success may still arrive for them."""
    return select(PaymentSession).where(
        PaymentSession.status == EXPIRED,
        PaymentSession.failure_reason == TTL_ELAPSED,
        PaymentSession.ledger_entry_id.is_(None),
        PaymentSession.stripe_checkout_session_id.is_not(None),
        PaymentSession.expires_at > late_since,
    )
