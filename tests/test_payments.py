"""Stripe payment sessions (docs/lifecycles/payment-session.md) against real Temporal, PostgreSQL,
the Vault simulator and stripe-mock: checkout idempotency, signed webhooks, reconciliation, TTL
expiry, and that every paid session is credited exactly once."""

from __future__ import annotations

import datetime as dt
import random
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio.client import Client

from activities.billing.accounts import balance_minor
from activities.payments.schedule import ensure_stripe_reconciliation_schedule
from contracts.admin_operation import STRIPE_WEBHOOK_EVENT
from contracts.payment_session import payment_session_workflow_id
from contracts.stripe_reconciliation import (
    WORKFLOW_NAME as RECONCILIATION,
)
from contracts.stripe_reconciliation import (
    ReconciliationInput,
    ReconciliationResult,
)
from schema.models import LedgerEntry, PaymentSession, PaymentSessionEvent, StripeWebhookEvent
from tests.admin_operation_support import nth_run, record
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.stripe_fixtures import PAID_AMOUNT, PaymentsFactory, PaymentsPlane, checkout_event

Sessions = async_sessionmaker[AsyncSession]


async def _row(db: Sessions, payment_session_id: str) -> PaymentSession | None:
    async with db() as session:
        return await session.get(PaymentSession, uuid.UUID(payment_session_id))


async def _status_is(db: Sessions, payment_session_id: str, status: str) -> PaymentSession:
    async def check() -> PaymentSession | None:
        row = await _row(db, payment_session_id)
        return row if row is not None and row.status == status else None

    found: PaymentSession = await eventually(check)
    return found


async def _credits(db: Sessions, project_id: uuid.UUID) -> list[LedgerEntry]:
    async with db() as session:
        query = select(LedgerEntry).where(LedgerEntry.project_id == project_id)
        return list((await session.scalars(query)).all())


async def _balance(db: Sessions, project_id: uuid.UUID) -> int:
    async with db() as session:
        return await balance_minor(session, project_id)


async def _events(db: Sessions, payment_session_id: str) -> list[tuple[str, Any, Any]]:
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


async def _workflow_done(client: Client, payment_session_id: str) -> Any:
    handle = client.get_workflow_handle(payment_session_workflow_id(payment_session_id))
    return await handle.result()


async def _reconcile(plane: PaymentsPlane) -> ReconciliationResult:
    result: ReconciliationResult = await plane.temporal.execute_workflow(
        RECONCILIATION,
        ReconciliationInput(grace_seconds=0),
        id=f"stripe-reconciliation-test-{uuid.uuid4()}",
        task_queue=plane.settings.control_plane_task_queue,
        result_type=ReconciliationResult,
    )
    return result


async def test_checkout_is_idempotent_per_key(
    payments: PaymentsFactory, db_sessions: Sessions
) -> None:
    plane = await payments()
    first = await plane.checkout(2500, key="topup-1")
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["status"] == "initiated"
    assert body["checkout_url"].startswith("https://")
    assert body["stripe_checkout_session_id"].startswith("cs_")

    again = await plane.checkout(2500, key="topup-1")
    assert again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["checkout_url"] == body["checkout_url"]
    assert again.json()["payment_session_id"] == body["payment_session_id"]
    assert plane.stripe.calls["checkout.sessions.create"] == 1

    reused = await plane.checkout(9999, key="topup-1")
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"

    missing = await plane.client.post(
        "/api/v1/payments/checkout-session", json={"amount_minor": 100}
    )
    assert missing.status_code == 400
    assert plane.stripe.calls["checkout.sessions.create"] == 1

    row = await _row(db_sessions, body["payment_session_id"])
    assert row is not None
    assert row.requested_amount_minor == 2500
    assert row.workflow_id == payment_session_workflow_id(body["payment_session_id"])


async def test_signed_webhook_credits_exactly_once(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any
) -> None:
    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(4200, key="k")).json()
    session_id = created["payment_session_id"]
    event = checkout_event(created["stripe_checkout_session_id"], 4200)

    delivered = await plane.deliver(event)
    assert delivered.status_code == 200, delivered.text
    assert delivered.json() == {"received": True, "duplicate": False}
    row = await _status_is(db_sessions, session_id, "credited")
    assert row.credited_amount_minor == 4200
    assert row.ledger_entry_id is not None
    assert row.completed_at is not None
    assert row.credited_at is not None

    # Redelivery of the same event, and a second event for the same session: no effect.
    duplicate = await plane.deliver(event)
    assert duplicate.json() == {"received": True, "duplicate": True}
    for n, name in ((0, "stripe_webhook_event"), (1, "stripe_webhook_event_duplicate")):
        await record(await nth_run(plane.temporal, plane.settings, STRIPE_WEBHOOK_EVENT, n), name)
    other = await plane.deliver(checkout_event(created["stripe_checkout_session_id"], 4200))
    assert other.status_code == 200
    await _workflow_done(plane.temporal, session_id)

    entries = await _credits(db_sessions, project.id)
    assert [(e.amount_minor, e.kind, e.idempotency_key) for e in entries] == [
        (4200, "payment_credit", f"payment:{session_id}")
    ]
    assert await _balance(db_sessions, project.id) == 4200
    handle = plane.temporal.get_workflow_handle(payment_session_workflow_id(session_id))
    await record_history(handle, "payment_session", "credited_via_webhook")
    # Each transition in the append-only event log, checkout_completed as its own step.
    assert await _events(db_sessions, session_id) == [
        ("initiated", None, "initiated"),
        ("checkout_completed", "initiated", "checkout_completed"),
        ("credited", "checkout_completed", "credited"),
    ]


async def test_out_of_order_deliveries(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any
) -> None:
    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(1500, key="ooo")).json()
    cs_id = created["stripe_checkout_session_id"]
    # An event for a session we do not know, an unpaid completion (async payment pending),
    # then the async success before the (older) completed event, then a late expiry notice.
    assert (await plane.deliver(checkout_event("cs_test_unknown", 10))).status_code == 200
    unpaid = checkout_event(cs_id, 1500, payment_status="unpaid")
    assert (await plane.deliver(unpaid)).status_code == 200
    assert (await _row(db_sessions, created["payment_session_id"])).status == "initiated"  # type: ignore[union-attr]
    succeeded = checkout_event(cs_id, 1500, event_type="checkout.session.async_payment_succeeded")
    assert (await plane.deliver(succeeded)).status_code == 200
    completed = checkout_event(cs_id, 1500)
    completed["created"] -= 60
    assert (await plane.deliver(completed)).status_code == 200
    expired = checkout_event(cs_id, 1500, event_type="checkout.session.expired",
                             payment_status="unpaid")  # fmt: skip
    assert (await plane.deliver(expired)).status_code == 200

    await _status_is(db_sessions, created["payment_session_id"], "credited")
    await _workflow_done(plane.temporal, created["payment_session_id"])
    assert (await _row(db_sessions, created["payment_session_id"])).status == "credited"  # type: ignore[union-attr]
    assert await _balance(db_sessions, project.id) == 1500
    assert len(await _credits(db_sessions, project.id)) == 1


@pytest.mark.parametrize("kind", ["forged", "stale", "missing", "tampered"])
async def test_bad_signatures_are_refused_and_nothing_is_recorded(
    payments: PaymentsFactory, db_sessions: Sessions, kind: str
) -> None:
    import json

    from tests.stripe_fixtures import sign

    plane = await payments()
    created = (await plane.checkout(700, key="sig")).json()
    event = checkout_event(created["stripe_checkout_session_id"], 700)
    if kind == "forged":
        response = await plane.deliver(event, secret="whsec_not_the_real_one")
    elif kind == "stale":
        response = await plane.deliver(event, timestamp=int(time.time()) - 3600)
    else:
        payload = json.dumps(event).encode()
        headers = {"Content-Type": "application/json"}
        if kind == "tampered":
            headers["Stripe-Signature"] = sign(payload, plane.webhook_secret)
            payload = payload.replace(b'"amount_total": 700', b'"amount_total": 70000')
        response = await plane.client.post(
            "/api/v1/webhooks/stripe", content=payload, headers=headers
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_signature"
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(StripeWebhookEvent)) == 0
        assert await session.scalar(select(func.count()).select_from(LedgerEntry)) == 0
    assert (await _row(db_sessions, created["payment_session_id"])).status == "initiated"  # type: ignore[union-attr]


def _malformed_bodies(checkout_session_id: str) -> dict[str, bytes]:
    import json

    good = checkout_event(checkout_session_id, 700)
    no_data = {k: v for k, v in good.items() if k != "data"}
    listed_object = {**good, "data": {"object": [checkout_session_id]}}
    text_amount = {**good, "data": {"object": {**good["data"]["object"], "amount_total": "7e2"}}}
    numeric_id = {**good, "id": 12345}
    return {
        "array": b"[]",
        "not_json": b"{'id': 'evt_1'}",
        "no_data": json.dumps(no_data).encode(),
        "object_is_a_list": json.dumps(listed_object).encode(),
        "amount_is_text": json.dumps(text_amount).encode(),
        "event_id_is_a_number": json.dumps(numeric_id).encode(),
    }


@pytest.mark.parametrize(
    "shape",
    ["array", "not_json", "no_data", "object_is_a_list", "amount_is_text", "event_id_is_a_number"],
)
async def test_a_signed_body_of_the_wrong_shape_is_400_malformed_event(
    payments: PaymentsFactory, db_sessions: Sessions, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    """Correctly signed (Stripe's scheme, the real secret) but not a Stripe event of the shape
    we read: 400 malformed_event (it was a 500 with a traceback), one log line, nothing
    recorded, the session untouched."""
    import logging

    from tests.stripe_fixtures import sign

    plane = await payments()
    created = (await plane.checkout(700, key="shape")).json()
    payload = _malformed_bodies(created["stripe_checkout_session_id"])[shape]
    caplog.set_level(logging.INFO, logger="gateway.errors")
    response = await plane.client.post(
        "/api/v1/webhooks/stripe",
        content=payload,
        headers={
            "Content-Type": "application/json",
            "Stripe-Signature": sign(payload, plane.webhook_secret),
        },
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "malformed_event"
    assert created["stripe_checkout_session_id"] not in response.text
    logged = [r for r in caplog.records if r.name == "gateway.errors"]
    assert [r.getMessage() for r in logged] == [
        "POST /api/v1/webhooks/stripe -> 400 malformed_event"
    ]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in logged)
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(StripeWebhookEvent)) == 0
        assert await session.scalar(select(func.count()).select_from(LedgerEntry)) == 0
    assert (await _row(db_sessions, created["payment_session_id"])).status == "initiated"  # type: ignore[union-attr]

    # The same event in its real shape, signed the same way, still lands.
    good = await plane.deliver(checkout_event(created["stripe_checkout_session_id"], 700))
    assert good.status_code == 200, good.text
    await _status_is(db_sessions, created["payment_session_id"], "credited")


async def test_amount_mismatch_is_failed_reconcile_without_credit(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any, make_token: Any, api: Any
) -> None:
    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(3000, key="mm")).json()
    await plane.deliver(checkout_event(created["stripe_checkout_session_id"], 2999))
    row = await _status_is(db_sessions, created["payment_session_id"], "failed_reconcile")
    assert row.failure_reason == "amount_mismatch"
    assert row.credited_amount_minor == 2999
    assert row.ledger_entry_id is None
    assert await _credits(db_sessions, project.id) == []
    handle = plane.temporal.get_workflow_handle(
        payment_session_workflow_id(created["payment_session_id"])
    )
    await handle.result()
    await record_history(handle, "payment_session", "amount_mismatch")

    # The admin list shows it, and an initiated session older than an hour, nothing else.
    stuck = (await plane.checkout(100, key="stuck")).json()
    fresh = (await plane.checkout(200, key="fresh")).json()
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(PaymentSession)
            .where(PaymentSession.id == uuid.UUID(stuck["payment_session_id"]))
            .values(created_at=func.now() - dt.timedelta(hours=2))
        )
    admin = await api(token=await make_token("admin"), settings=plane.settings)
    listed = await admin.get("/api/v1/admin/payments/sessions")
    assert listed.status_code == 200, listed.text
    ids = {item["payment_session_id"]: item["status"] for item in listed.json()["items"]}
    assert ids == {
        created["payment_session_id"]: "failed_reconcile",
        stuck["payment_session_id"]: "initiated",
    }
    assert fresh["payment_session_id"] not in ids
    assert (await plane.client.get("/api/v1/admin/payments/sessions")).status_code == 403


async def test_a_completion_for_another_checkout_session_is_not_credited(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any
) -> None:
    """The credit step's session-mismatch branch (REVIEW.md: untested). The webhook route and
    reconciliation signal a session's workflow with its own checkout id; a completion naming
    another (a confused or hostile Temporal client, an older build) is told to the workflow as
    a signal and must credit nothing, even at the right amount and currency."""
    from contracts.payment_session import COMPLETED_SIGNAL, CheckoutCompletion

    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(3000, key="sm")).json()
    other = (await plane.checkout(3000, key="sm-other")).json()
    handle = plane.temporal.get_workflow_handle(
        payment_session_workflow_id(created["payment_session_id"])
    )
    await handle.signal(
        COMPLETED_SIGNAL,
        CheckoutCompletion(
            stripe_checkout_session_id=other["stripe_checkout_session_id"],
            amount_total=3000,
            currency="usd",
            source="webhook",
        ),
    )
    row = await _status_is(db_sessions, created["payment_session_id"], "failed_reconcile")
    assert row.failure_reason == "stripe_session_mismatch"
    assert row.ledger_entry_id is None
    assert await _credits(db_sessions, project.id) == []
    await handle.result()
    assert (await _row(db_sessions, other["payment_session_id"])).status == "initiated"  # type: ignore[union-attr]


async def test_reconciliation_recovers_a_missed_webhook(
    payments: PaymentsFactory,
    db_sessions: Sessions,
    make_project: Any,
    stripe_mock_paid: Any,
) -> None:
    """Stripe (the 'paid' stripe-mock) reports every session paid for PAID_AMOUNT; no webhook
    ever arrives. Reconciliation credits the matching one and flags the other."""
    project = await make_project(credit_minor=0)
    plane = await payments(project=project, mock=stripe_mock_paid)
    paid = (await plane.checkout(PAID_AMOUNT, key="paid")).json()
    short = (await plane.checkout(PAID_AMOUNT - 1, key="short")).json()

    result = await _reconcile(plane)
    assert sorted(result.signalled) == sorted(
        [paid["payment_session_id"], short["payment_session_id"]]
    )
    assert result.amount_mismatches == [short["payment_session_id"]]
    await _status_is(db_sessions, paid["payment_session_id"], "credited")
    flagged = await _status_is(db_sessions, short["payment_session_id"], "failed_reconcile")
    assert flagged.failure_reason == "amount_mismatch"

    # A second run finds nothing to do; a late webhook changes nothing either.
    await _workflow_done(plane.temporal, paid["payment_session_id"])
    again = await _reconcile(plane)
    assert again.signalled == []
    assert again.expired == []
    await plane.deliver(checkout_event(paid["stripe_checkout_session_id"], PAID_AMOUNT))
    assert await _balance(db_sessions, project.id) == PAID_AMOUNT
    assert len(await _credits(db_sessions, project.id)) == 1
    handle = plane.temporal.get_workflow_handle(
        payment_session_workflow_id(paid["payment_session_id"])
    )
    await record_history(handle, "payment_session", "credited_via_reconciliation")


async def test_ttl_expiry_and_reconciliation_expires_abandoned_sessions(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any
) -> None:
    project = await make_project(credit_minor=0)
    plane = await payments(project=project, ttl_seconds=1.0, late_window_seconds=1.0)
    created = (await plane.checkout(900, key="ttl")).json()
    row = await _status_is(db_sessions, created["payment_session_id"], "expired")
    assert row.ledger_entry_id is None
    handle = plane.temporal.get_workflow_handle(
        payment_session_workflow_id(created["payment_session_id"])
    )
    assert (await handle.result())["status"] == "expired"  # the late-success window passed
    await record_history(handle, "payment_session", "expired_after_late_window")
    assert await _events(db_sessions, created["payment_session_id"]) == [
        ("initiated", None, "initiated"),
        ("expired", "initiated", "expired"),
    ]
    # A completion after the late-success window finds the workflow closed: acknowledged,
    # nothing credited.
    late = await plane.deliver(checkout_event(created["stripe_checkout_session_id"], 900))
    assert late.status_code == 200
    assert await _credits(db_sessions, project.id) == []

    # A session whose workflow is gone (terminated) is expired by reconciliation.
    orphan = (await plane.checkout(800, key="orphan")).json()
    await plane.temporal.get_workflow_handle(
        payment_session_workflow_id(orphan["payment_session_id"])
    ).terminate("test: the workflow is gone")
    await eventually(lambda: _expired_past(db_sessions, orphan["payment_session_id"]), timeout=10)
    result = await _reconcile(plane)
    assert result.expired == [orphan["payment_session_id"]]
    assert (await _row(db_sessions, orphan["payment_session_id"])).status == "expired"  # type: ignore[union-attr]
    reconciliation = plane.temporal.get_workflow_handle(await _last_reconciliation_id(plane))
    await record_history(reconciliation, "stripe_reconciliation", "expires_abandoned")


async def _expired_past(db: Sessions, payment_session_id: str) -> bool:
    async with db() as session:
        row = await session.get(PaymentSession, uuid.UUID(payment_session_id))
        now = await session.scalar(select(func.clock_timestamp()))
        return bool(row and row.expires_at and now and row.expires_at < now)


async def _last_reconciliation_id(plane: PaymentsPlane) -> str:
    query = (
        f"WorkflowType = '{RECONCILIATION}' AND TaskQueue = "
        f"'{plane.settings.control_plane_task_queue}'"
    )

    async def find() -> str | None:
        async for wf in plane.temporal.list_workflows(query):
            return wf.id
        return None

    found: str = await eventually(find)
    return found


async def test_every_paid_session_is_credited_exactly_once_under_interleavings(
    payments: PaymentsFactory,
    db_sessions: Sessions,
    make_project: Any,
    stripe_mock_paid: Any,
) -> None:
    """Seeded random interleavings of duplicate webhooks (same and new event ids), checkout
    retries and reconciliation runs: each paid session is credited exactly once."""
    rng = random.Random(20261121)
    project = await make_project(credit_minor=0)
    plane = await payments(project=project, mock=stripe_mock_paid)
    sessions = [(await plane.checkout(PAID_AMOUNT, key=f"p-{i}")).json() for i in range(4)]
    events = {s["payment_session_id"]: checkout_event(s["stripe_checkout_session_id"],
                                                      PAID_AMOUNT) for s in sessions}  # fmt: skip
    reconciliation_runs = 0
    for _ in range(24):
        target = rng.choice(sessions)
        action = rng.choice(["same_event", "new_event", "reconcile", "retry_checkout"])
        if action == "same_event":
            assert (await plane.deliver(events[target["payment_session_id"]])).status_code == 200
        elif action == "new_event":
            fresh = checkout_event(target["stripe_checkout_session_id"], PAID_AMOUNT)
            assert (await plane.deliver(fresh)).status_code == 200
        elif action == "reconcile" and reconciliation_runs < 3:
            reconciliation_runs += 1
            await _reconcile(plane)
        else:
            retried = await plane.checkout(PAID_AMOUNT, key=f"p-{sessions.index(target)}")
            assert retried.json()["checkout_url"] == target["checkout_url"]
    await _reconcile(plane)  # whatever the dice left unpaid is recovered here
    for s in sessions:
        await _status_is(db_sessions, s["payment_session_id"], "credited")
        await _workflow_done(plane.temporal, s["payment_session_id"])
    entries = await _credits(db_sessions, project.id)
    assert sorted(e.idempotency_key for e in entries) == sorted(
        f"payment:{s['payment_session_id']}" for s in sessions
    )
    assert await _balance(db_sessions, project.id) == PAID_AMOUNT * len(sessions)
    assert plane.stripe.calls["checkout.sessions.create"] == len(sessions)
    last = plane.temporal.get_workflow_handle(await _last_reconciliation_id(plane))
    await record_history(last, "stripe_reconciliation", "interleaved_runs")


async def test_reconciliation_schedule_is_created_idempotently(
    temporal_client: Client, settings: Any
) -> None:
    schedule_id = f"stripe-reconciliation-test-{uuid.uuid4()}"
    for _ in range(2):
        await ensure_stripe_reconciliation_schedule(
            temporal_client,
            task_queue=settings.control_plane_task_queue,
            every_seconds=3600,
            schedule_id=schedule_id,
        )
    handle = temporal_client.get_schedule_handle(schedule_id)
    try:
        described = await handle.describe()
        assert described.schedule.spec.intervals[0].every == dt.timedelta(hours=1)
    finally:
        await handle.delete()


async def test_checkout_amounts_are_bounded_per_currency(
    payments: PaymentsFactory, db_sessions: Sessions
) -> None:
    """Stripe refuses card payments under its per-currency minimum (0.50 USD): such a session
    is refused here, 422 with the limit, before anything is created."""
    plane = await payments()
    refusals = [
        (1, "usd", "amount_below_minimum", {"currency": "usd", "minimum_amount_minor": 50}),
        (29, "gbp", "amount_below_minimum", {"currency": "gbp", "minimum_amount_minor": 30}),
        (
            100_000_000,
            "usd",
            "amount_above_maximum",
            {"currency": "usd", "maximum_amount_minor": 99_999_999},
        ),
    ]
    for amount, currency, code, details in refusals:
        refused = await plane.checkout(amount, key=f"k-{amount}-{currency}", currency=currency)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["code"] == code
        assert refused.json()["error"]["details"] == details
    unknown = await plane.checkout(5000, key="xyz", currency="xyz")
    assert unknown.status_code == 422
    assert unknown.json()["error"]["code"] == "currency_not_supported"
    assert "usd" in unknown.json()["error"]["details"]["supported"]
    assert plane.stripe.calls["checkout.sessions.create"] == 0
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(PaymentSession)) == 0

    # The project's account is in usd (issue 37): a supported currency other than it is refused.
    mismatch = await plane.checkout(30, key="ok-gbp", currency="gbp")
    assert mismatch.status_code == 422, mismatch.text
    assert mismatch.json()["error"]["code"] == "currency_mismatch"
    for amount in (50, 99_999_999):
        accepted = await plane.checkout(amount, key=f"ok-usd-{amount}", currency="usd")
        assert accepted.status_code == 201, accepted.text
    assert plane.stripe.calls["checkout.sessions.create"] == 2


async def test_a_credit_that_keeps_failing_lands_in_failed_reconcile(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any, api: Any,
    make_token: Any,
) -> None:  # fmt: skip
    """The completion is persisted (checkout_completed) before the credit is tried; when the
    credit still fails after its retries (here the database refuses every payment credit), the
    session is failed_reconcile with nothing credited, for ops to resolve."""
    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(2000, key="cf")).json()
    session_id = created["payment_session_id"]
    async with db_sessions() as session, session.begin():
        await session.execute(text(_REFUSE_PAYMENT_CREDITS))
        await session.execute(
            text(
                "CREATE TRIGGER test_refuse_payment_credit BEFORE INSERT ON ledger_entries "
                "FOR EACH ROW WHEN (NEW.kind = 'payment_credit') "
                "EXECUTE FUNCTION test_refuse_payment_credit()"
            )
        )
    try:
        delivered = await plane.deliver(checkout_event(created["stripe_checkout_session_id"], 2000))
        assert delivered.status_code == 200
        # Recorded on its own while the credit is being retried.
        await _status_is(db_sessions, session_id, "checkout_completed")
        row = await _status_is(db_sessions, session_id, "failed_reconcile")
        assert row.failure_reason == "credit_failed"
        assert row.ledger_entry_id is None
        assert row.credited_amount_minor == 2000
        assert row.completed_at is not None
        result = await _workflow_done(plane.temporal, session_id)
        assert (result["status"], result["failure_reason"]) == ("failed_reconcile", "credit_failed")
    finally:
        async with db_sessions() as session, session.begin():
            await session.execute(
                text("DROP TRIGGER IF EXISTS test_refuse_payment_credit ON ledger_entries")
            )
            await session.execute(text("DROP FUNCTION IF EXISTS test_refuse_payment_credit()"))
    handle = plane.temporal.get_workflow_handle(payment_session_workflow_id(session_id))
    await record_history(handle, "payment_session", "credit_failed")
    assert await _events(db_sessions, session_id) == [
        ("initiated", None, "initiated"),
        ("checkout_completed", "initiated", "checkout_completed"),
        ("failed_reconcile", "checkout_completed", "failed_reconcile"),
    ]
    assert await _credits(db_sessions, project.id) == []
    admin = await api(token=await make_token("admin"), settings=plane.settings)
    listed = (await admin.get("/api/v1/admin/payments/sessions")).json()["items"]
    assert [(i["payment_session_id"], i["failure_reason"]) for i in listed] == [
        (session_id, "credit_failed")
    ]
    events = await admin.get(f"/api/v1/admin/payments/sessions/{session_id}/events")
    assert [e["to_status"] for e in events.json()["items"]] == [
        "initiated",
        "checkout_completed",
        "failed_reconcile",
    ]


_REFUSE_PAYMENT_CREDITS = """
CREATE FUNCTION test_refuse_payment_credit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'test: the ledger refuses payment credits';
END $$
"""


async def test_a_payment_that_succeeds_after_expiry_is_credited_once_and_flagged(
    payments: PaymentsFactory, db_sessions: Sessions, make_project: Any, api: Any,
    make_token: Any,
) -> None:  # fmt: skip
    """A delayed payment method that settles after the session's TTL: credited (exactly once,
    however often Stripe tells us) and flagged late_success for review, not dropped."""
    project = await make_project(credit_minor=0)
    plane = await payments(project=project, ttl_seconds=1.0)
    created = (await plane.checkout(1500, key="late")).json()
    session_id, cs_id = created["payment_session_id"], created["stripe_checkout_session_id"]
    await _status_is(db_sessions, session_id, "expired")

    succeeded = checkout_event(cs_id, 1500, event_type="checkout.session.async_payment_succeeded")
    assert (await plane.deliver(succeeded)).status_code == 200
    row = await _status_is(db_sessions, session_id, "credited")
    assert row.review_reason == "late_success"
    assert row.flagged_for_review_at is not None
    assert row.failure_reason is None
    result = await _workflow_done(plane.temporal, session_id)
    assert (result["status"], result["review_reason"]) == ("credited", "late_success")
    handle = plane.temporal.get_workflow_handle(payment_session_workflow_id(session_id))
    await record_history(handle, "payment_session", "late_success_credited")

    # Redelivered, or told again by another event: no second credit.
    assert (await plane.deliver(succeeded)).json()["duplicate"] is True
    assert (await plane.deliver(checkout_event(cs_id, 1500))).status_code == 200
    entries = await _credits(db_sessions, project.id)
    assert [(e.amount_minor, e.idempotency_key) for e in entries] == [
        (1500, f"payment:{session_id}")
    ]
    assert await _events(db_sessions, session_id) == [
        ("initiated", None, "initiated"),
        ("expired", "initiated", "expired"),
        ("checkout_completed", "expired", "checkout_completed"),
        ("credited", "checkout_completed", "credited"),
    ]
    # The credit lifted the account at once (1500 > the 1000 low-balance threshold).
    balance = (await plane.client.get("/api/v1/billing/balance")).json()
    assert (balance["balance_minor"], balance["state"]) == (1500, "healthy")
    admin = await api(token=await make_token("admin"), settings=plane.settings)
    listed = (await admin.get("/api/v1/admin/payments/sessions")).json()["items"]
    assert [(i["payment_session_id"], i["status"], i["review_reason"]) for i in listed] == [
        (session_id, "credited", "late_success")
    ]
