"""Late successes (issue 37 item 4): a payment Stripe reports paid after the session's
late-success window, when its PaymentSessionWorkflow has closed, was dropped silently. The
`stripe-reconciliation` run now asks Stripe about every session that expired unpaid (its list of
completed sessions, then a lookup each) and settles a paid one itself: credited exactly once
(ledger key `payment:{id}`, whatever later webhooks or runs say), flagged `late_success` for
review, in the account's currency.

Against real Temporal, PostgreSQL, the Vault simulator and stripe-mock, through the HTTP API.
stripe-mock answers from fixed fixtures: its list of sessions is one fixture that is none of
ours, so "Stripe reports it paid" is the 'paid' stripe-mock's lookup of our own session (every
Checkout Session it is asked about is complete/paid for PAID_AMOUNT usd). The window passes the
way the payment tests let it: a 1 s TTL and a 1 s late-success window in the worker's settings.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from contracts.payment_session import payment_session_workflow_id
from contracts.stripe_reconciliation import WORKFLOW_NAME as RECONCILIATION
from contracts.stripe_reconciliation import ReconciliationInput, ReconciliationResult
from schema.models import LedgerEntry, PaymentSession, PaymentSessionEvent
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.stripe_fixtures import PAID_AMOUNT, PaymentsFactory, PaymentsPlane, checkout_event

Sessions = async_sessionmaker[AsyncSession]


async def _reconcile(plane: PaymentsPlane, run_id: str | None = None) -> ReconciliationResult:
    result: ReconciliationResult = await plane.temporal.execute_workflow(
        RECONCILIATION,
        ReconciliationInput(grace_seconds=0),
        id=run_id or f"stripe-reconciliation-test-{uuid.uuid4()}",
        task_queue=plane.settings.control_plane_task_queue,
        result_type=ReconciliationResult,
    )
    return result


async def _row(db: Sessions, payment_session_id: str) -> PaymentSession:
    async with db() as session:
        row = await session.get(PaymentSession, uuid.UUID(payment_session_id))
    assert row is not None
    return row


async def _ledger(db: Sessions, project_id: uuid.UUID) -> list[tuple[int, str, str, str]]:
    async with db() as session:
        rows = await session.scalars(
            select(LedgerEntry)
            .where(LedgerEntry.project_id == project_id)
            .order_by(LedgerEntry.created_at)
        )
        return [(e.amount_minor, e.currency, e.kind, e.idempotency_key) for e in rows]


async def _events(db: Sessions, payment_session_id: str) -> list[tuple[Any, ...]]:
    async with db() as session:
        rows = await session.execute(
            select(
                PaymentSessionEvent.event,
                PaymentSessionEvent.from_status,
                PaymentSessionEvent.to_status,
            )
            .where(PaymentSessionEvent.payment_session_id == uuid.UUID(payment_session_id))
            .order_by(PaymentSessionEvent.id)
        )
        return [tuple(r) for r in rows.all()]


async def _closed_expired(plane: PaymentsPlane, payment_session_id: str) -> None:
    """Wait until the session's workflow has closed, expired, its late-success window over."""
    handle = plane.temporal.get_workflow_handle(payment_session_workflow_id(payment_session_id))
    result = await asyncio.wait_for(handle.result(), timeout=60)
    assert result["status"] == "expired", result


async def test_a_payment_that_succeeds_after_the_window_is_credited_once_by_reconciliation(
    payments: PaymentsFactory,
    db_sessions: Sessions,
    make_project: Any,
    stripe_mock_paid: Any,
    api: Any,
    make_token: Any,
) -> None:
    project = await make_project(credit_minor=0)
    plane = await payments(
        project=project, mock=stripe_mock_paid, ttl_seconds=1.0, late_window_seconds=1.0
    )
    created = await plane.checkout(PAID_AMOUNT, key="paid-after-the-window")
    assert created.status_code == 201, created.text
    session_id = created.json()["payment_session_id"]
    checkout_id = created.json()["stripe_checkout_session_id"]
    await _closed_expired(plane, session_id)
    # The workflow is gone: a webhook now reaches nobody and credits nothing (as before).
    assert (await plane.deliver(checkout_event(checkout_id, PAID_AMOUNT))).status_code == 200
    assert await _ledger(db_sessions, project.id) == []
    assert (await _row(db_sessions, session_id)).status == "expired"

    run_id = f"stripe-reconciliation-test-{uuid.uuid4()}"
    result = await _reconcile(plane, run_id)
    assert result.credited_directly == [session_id]
    assert (result.signalled, result.unreachable, result.amount_mismatches) == ([], [], [])
    assert plane.stripe.calls["checkout.sessions.retrieve"] >= 1  # asked Stripe about it

    row = await _row(db_sessions, session_id)
    assert (row.status, row.review_reason, row.failure_reason) == (
        "credited",
        "late_success",
        None,
    )
    assert row.flagged_for_review_at is not None
    account = (await plane.client.get("/api/v1/billing/balance")).json()
    assert (account["balance_minor"], account["currency"]) == (PAID_AMOUNT, "usd")
    expected_ledger = [(PAID_AMOUNT, "usd", "payment_credit", f"payment:{session_id}")]
    assert await _ledger(db_sessions, project.id) == expected_ledger
    assert await _events(db_sessions, session_id) == [
        ("initiated", None, "initiated"),
        ("expired", "initiated", "expired"),
        ("checkout_completed", "expired", "checkout_completed"),
        ("credited", "checkout_completed", "credited"),
    ]
    await record_history(
        plane.temporal.get_workflow_handle(run_id),
        "stripe_reconciliation",
        "credits_a_late_success_after_the_window",
    )

    # A second run and a late webhook (a new event, and the same one again) credit nothing more.
    again = await _reconcile(plane)
    assert (again.credited_directly, again.signalled, again.unreachable) == ([], [], [])
    succeeded = "checkout.session.async_payment_succeeded"
    late = checkout_event(checkout_id, PAID_AMOUNT, event_type=succeeded)
    for event in (late, late, checkout_event(checkout_id, PAID_AMOUNT)):
        assert (await plane.deliver(event)).status_code == 200
    assert await _ledger(db_sessions, project.id) == expected_ledger
    tenant = (await plane.client.get("/api/v1/payments/sessions")).json()["items"]
    assert [(s["status"], s["review_reason"]) for s in tenant] == [("credited", "late_success")]
    admin = await api(token=await make_token("admin"), settings=plane.settings)
    listed = (await admin.get("/api/v1/admin/payments/sessions")).json()["items"]
    assert [(i["payment_session_id"], i["review_reason"]) for i in listed] == [
        (session_id, "late_success")
    ]


async def test_concurrent_runs_credit_a_late_success_once_and_a_wrong_amount_never(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any, stripe_mock_paid: Any
) -> None:
    """Adversary: three reconciliation runs at once over two closed sessions Stripe reports
    paid, one for less than it asked (PAID_AMOUNT for a PAID_AMOUNT + 100 checkout)."""
    project = await make_project(credit_minor=0)
    plane = await payments(
        project=project, mock=stripe_mock_paid, ttl_seconds=1.0, late_window_seconds=1.0
    )
    paid = (await plane.checkout(PAID_AMOUNT, key="late-paid")).json()["payment_session_id"]
    short = (await plane.checkout(PAID_AMOUNT + 100, key="late-short")).json()["payment_session_id"]
    await _closed_expired(plane, paid)
    await _closed_expired(plane, short)

    runs = await asyncio.gather(*(_reconcile(plane) for _ in range(3)))
    assert {s for r in runs for s in r.credited_directly} == {paid}
    assert any(short in r.amount_mismatches for r in runs)
    assert not [r.unreachable for r in runs if r.unreachable]
    assert await _ledger(db_sessions, project.id) == [
        (PAID_AMOUNT, "usd", "payment_credit", f"payment:{paid}")
    ]
    credited = [e for e in await _events(db_sessions, paid) if e[0] == "credited"]
    assert len(credited) == 1
    refused = await _row(db_sessions, short)
    assert (refused.status, refused.failure_reason, refused.ledger_entry_id) == (
        "failed_reconcile",
        "amount_mismatch",
        None,
    )
    assert refused.review_reason == "late_success"
    # Settled either way: later runs leave both alone.
    again = await _reconcile(plane)
    assert (again.credited_directly, again.unreachable, again.amount_mismatches) == ([], [], [])


async def test_a_late_success_within_the_window_is_signalled_to_its_running_workflow(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any, stripe_mock_paid: Any
) -> None:
    """Expired, its workflow still waiting out the late-success window, no webhook ever: the
    run signals the workflow, which credits it (flagged late_success); nothing is settled
    around the workflow."""
    project = await make_project(credit_minor=0)
    plane = await payments(
        project=project, mock=stripe_mock_paid, ttl_seconds=1.0, late_window_seconds=3600.0
    )
    session_id = (await plane.checkout(PAID_AMOUNT, key="late-in-window")).json()[
        "payment_session_id"
    ]

    async def expired() -> bool:
        return (await _row(db_sessions, session_id)).status == "expired"

    await eventually(expired)
    result = await _reconcile(plane)
    assert (result.signalled, result.credited_directly) == ([session_id], [])
    handle = plane.temporal.get_workflow_handle(payment_session_workflow_id(session_id))
    outcome = await asyncio.wait_for(handle.result(), timeout=60)
    assert (outcome["status"], outcome["review_reason"]) == ("credited", "late_success")
    assert await _ledger(db_sessions, project.id) == [
        (PAID_AMOUNT, "usd", "payment_credit", f"payment:{session_id}")
    ]
