"""Payments (docs/lifecycles/payment-session.md): Stripe Checkout Sessions for tenants, Stripe's
webhook, and the admin list of stuck sessions.

Creation is update-with-start on PaymentSessionWorkflow `payment-session-{id}` (id = uuid5 of
project and X-Idempotency-Key): its first activity creates the Checkout Session and records the
row. The webhook route verifies Stripe-Signature and hands the event to the worker, which
records its id (a redelivery is a no-op) and signals the owning workflow; the gateway writes
neither events nor payment state.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from typing import Annotated, Any

import msgspec
import stripe
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import WithStartWorkflowOperation, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError

from contracts.admin_operation import STRIPE_WEBHOOK_EVENT
from contracts.payment_session import (
    AMOUNT_ABOVE_MAXIMUM,
    AMOUNT_BELOW_MINIMUM,
    CHECKOUT_COMPLETED,
    CHECKOUT_UPDATE,
    CURRENCY_MISMATCH,
    CURRENCY_NOT_SUPPORTED,
    FAILED_RECONCILE,
    IDEMPOTENCY_KEY_REUSED,
    INITIATED,
    STRIPE_ERROR,
    WORKFLOW_NAME,
    CheckoutCreated,
    PaymentSessionInput,
    SettleResult,
    WebhookEventInput,
    WebhookEventResult,
    payment_session_workflow_id,
)
from core.payment_settings import (
    CHECKOUT_AMOUNT_LIMITS,
    STRIPE_WEBHOOK_SECRET_PATH,
    PaymentSettings,
)
from core.secrets import SecretStore
from core.timestamps import parse_iso
from gateway.admin_operations import run_admin_operation
from gateway.allocations import IDEMPOTENCY_HEADER, validate_idempotency_key
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.errors import (
    ApiError,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    Unprocessable,
)
from gateway.openapi import errors
from gateway.pagination import newest_first_page
from gateway.runtime import Runtime
from gateway.temporal import TemporalOps
from schema.models import BillingAccount, PaymentSession, PaymentSessionEvent

# billing_accounts.currency's server default: an account not opened yet will be in it.
DEFAULT_ACCOUNT_CURRENCY = "usd"

# Fixed forever: payment session ids derived from idempotency keys must not change.
PAYMENT_SESSION_ID_NAMESPACE = uuid.UUID("0d3e2a57-9b4c-4f1e-8a2d-7c6b5e4f3a21")
# A bound on the number itself; what a checkout may be is per currency (CHECKOUT_AMOUNT_LIMITS).
MAX_AMOUNT_MINOR = 10**12
SIGNATURE_HEADER = "Stripe-Signature"
# A correctly signed webhook body that is not a Stripe event of the shape we read.
MALFORMED_EVENT = "malformed_event"

Currency = Annotated[str, msgspec.Meta(pattern=r"^[a-z]{3}$")]


class CheckoutSessionCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    amount_minor: Annotated[int, msgspec.Meta(gt=0, le=MAX_AMOUNT_MINOR)]
    currency: Currency = "usd"


def check_amount(body: CheckoutSessionCreate) -> None:
    """422 unless the currency is one we accept and the amount within its limits (Stripe refuses
    card payments below its per-currency minimum), naming the limit in the details."""
    limits = CHECKOUT_AMOUNT_LIMITS.get(body.currency)
    if limits is None:
        raise Unprocessable(
            f"payments in {body.currency!r} are not accepted",
            code=CURRENCY_NOT_SUPPORTED,
            details={"currency": body.currency, "supported": sorted(CHECKOUT_AMOUNT_LIMITS)},
        )
    minimum, maximum = limits
    if body.amount_minor < minimum:
        raise Unprocessable(
            f"the smallest checkout in {body.currency} is {minimum} (minor units)",
            code=AMOUNT_BELOW_MINIMUM,
            details={"currency": body.currency, "minimum_amount_minor": minimum},
        )
    if body.amount_minor > maximum:
        raise Unprocessable(
            f"the largest checkout in {body.currency} is {maximum} (minor units)",
            code=AMOUNT_ABOVE_MAXIMUM,
            details={"currency": body.currency, "maximum_amount_minor": maximum},
        )


class CheckoutSessionCreated(msgspec.Struct, kw_only=True):
    payment_session_id: uuid.UUID
    checkout_url: str
    stripe_checkout_session_id: str
    status: str
    expires_at: dt.datetime | None


class WebhookAck(msgspec.Struct, kw_only=True):
    received: bool
    duplicate: bool = False


class PaymentSessionSummary(msgspec.Struct, kw_only=True):
    payment_session_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    requested_amount_minor: int
    credited_amount_minor: int | None
    currency: str
    stripe_checkout_session_id: str | None
    workflow_id: str
    failure_reason: str | None
    review_reason: str | None
    created_at: dt.datetime
    completed_at: dt.datetime | None
    expires_at: dt.datetime | None
    flagged_for_review_at: dt.datetime | None


class PaymentSessionList(msgspec.Struct, kw_only=True):
    items: list[PaymentSessionSummary]


class PaymentSessionPage(msgspec.Struct, kw_only=True):
    """A tenant's own payment sessions, newest first."""

    items: list[PaymentSessionSummary]
    # Pass back as ?cursor= for the next page; null on the last page.
    next_cursor: str | None = None


class PaymentSessionEventView(msgspec.Struct, kw_only=True):
    event: str
    from_status: str | None
    to_status: str | None
    details: dict[str, Any]
    occurred_at: dt.datetime


class PaymentSessionEventList(msgspec.Struct, kw_only=True):
    items: list[PaymentSessionEventView]


def payment_session_id_for(project_id: uuid.UUID, idempotency_key: str) -> uuid.UUID:
    return uuid.uuid5(PAYMENT_SESSION_ID_NAMESPACE, f"{project_id}:{idempotency_key}")


def request_fingerprint(body: CheckoutSessionCreate) -> str:
    canonical = {"amount_minor": body.amount_minor, "currency": body.currency}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def _reused() -> ApiError:
    return Unprocessable(
        "this X-Idempotency-Key was already used with a different request body",
        code=IDEMPOTENCY_KEY_REUSED,
    )


async def create_checkout_session(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    *,
    project_id: uuid.UUID,
    body: CheckoutSessionCreate,
    idempotency_key: str | None,
) -> tuple[CheckoutSessionCreated, bool]:
    if idempotency_key is None:
        raise InvalidRequest(
            f"{IDEMPOTENCY_HEADER} is required", details={"header": IDEMPOTENCY_HEADER}
        )
    key = validate_idempotency_key(idempotency_key)
    assert key is not None
    check_amount(body)
    # Issue 37: one currency per account. A checkout in another is refused before anything is
    # created (no Stripe call, no row): its credit could only be counted 1:1 in the wrong unit.
    account = (
        await db.scalar(
            select(BillingAccount.currency).where(BillingAccount.project_id == project_id)
        )
        or DEFAULT_ACCOUNT_CURRENCY
    ).lower()
    if body.currency != account:
        raise Unprocessable(
            f"this project's account is in {account}; a checkout in {body.currency} is refused",
            code=CURRENCY_MISMATCH,
            details={"currency": body.currency, "account_currency": account},
        )
    payment_session_id = payment_session_id_for(project_id, key)
    existing = await db.scalar(
        select(PaymentSession).where(
            PaymentSession.project_id == project_id, PaymentSession.idempotency_key == key
        )
    )
    if existing is not None:
        if (existing.requested_amount_minor, existing.currency) != (
            body.amount_minor,
            body.currency,
        ):
            raise _reused()
        return (
            CheckoutSessionCreated(
                payment_session_id=existing.id,
                checkout_url=existing.checkout_url or "",
                stripe_checkout_session_id=existing.stripe_checkout_session_id or "",
                status=existing.status,
                expires_at=existing.expires_at,
            ),
            True,
        )
    await db.close()  # never hold a connection across a Temporal call

    fingerprint = request_fingerprint(body)
    workflow_input = PaymentSessionInput(
        payment_session_id=str(payment_session_id),
        project_id=str(project_id),
        amount_minor=body.amount_minor,
        currency=body.currency,
        idempotency_key=key,
        request_fingerprint=fingerprint,
    )
    try:
        created = await temporal.update_with_start(
            lambda: WithStartWorkflowOperation(
                WORKFLOW_NAME,
                workflow_input,
                id=payment_session_workflow_id(str(payment_session_id)),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                task_queue=task_queue,
                result_type=SettleResult,
            ),
            CHECKOUT_UPDATE,
            fingerprint,
            result_type=CheckoutCreated,
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.type == IDEMPOTENCY_KEY_REUSED:
            raise _reused() from None
        raise ApiError(
            "the payment provider did not create a checkout session; retry later",
            code=STRIPE_ERROR,
            status_code=502,
        ) from None
    return (
        CheckoutSessionCreated(
            payment_session_id=uuid.UUID(created.payment_session_id),
            checkout_url=created.checkout_url,
            stripe_checkout_session_id=created.stripe_checkout_session_id,
            status=created.status,
            expires_at=parse_iso(created.expires_at),
        ),
        False,
    )


async def _webhook_secret(secrets: SecretStore) -> str:
    data = await secrets.read(STRIPE_WEBHOOK_SECRET_PATH)
    secret = (data or {}).get("secret")
    if not secret:
        raise ServiceUnavailable(
            "the Stripe webhook secret is not configured", code="webhook_not_configured"
        )
    return secret


class _StripeEventData(msgspec.Struct, kw_only=True):
    object: dict[str, Any]


class _StripeEvent(msgspec.Struct, kw_only=True):
    """What every Stripe event has (other fields are ignored)."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    type: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    data: _StripeEventData


class _CheckoutSessionObject(msgspec.Struct, kw_only=True):
    """A Checkout Session as a checkout.session.* event carries it (what its handling reads)."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    payment_status: str | None = None
    amount_total: Annotated[int, msgspec.Meta(ge=0, le=MAX_AMOUNT_MINOR)] | None = None
    currency: Annotated[str, msgspec.Meta(max_length=16)] | None = None


def _malformed(reason: str) -> ApiError:
    """A correctly signed body that is not a Stripe event of the shape we read: 400, one log
    line (gateway.errors), nothing recorded. Stripe retries a non-2xx delivery, so a real event
    we misread is not lost; the reason names the problem, never the payload."""
    return InvalidRequest(
        "the webhook payload is not a Stripe event of the expected shape",
        code=MALFORMED_EVENT,
        details={"reason": reason[:200]},
    )


def parse_event(payload: bytes) -> WebhookEventInput:
    """The verified payload as the worker's input, or 400 malformed_event."""
    try:
        event = msgspec.json.decode(payload, type=_StripeEvent)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise _malformed(str(err)) from None
    if not event.type.startswith("checkout.session."):
        return WebhookEventInput(event_id=event.id, event_type=event.type)
    try:
        obj = msgspec.convert(event.data.object, _CheckoutSessionObject)
    except msgspec.ValidationError as err:
        raise _malformed(f"data.object: {err}") from None
    return WebhookEventInput(
        event_id=event.id,
        event_type=event.type,
        stripe_checkout_session_id=obj.id,
        paid=obj.payment_status == "paid",
        amount_total=obj.amount_total or 0,
        currency=obj.currency or None,
    )


async def handle_webhook(
    temporal: TemporalOps,
    secrets: SecretStore,
    task_queue: str,
    *,
    payload: bytes,
    signature: str | None,
    tolerance: int,
) -> WebhookAck:
    """Verify the signature here (nothing unsigned reaches the worker), then the event's shape
    (a signed body of another shape is 400 malformed_event, not a 500); the worker records the
    event and does what it says (activities/payments/webhook_events.py)."""
    secret = await _webhook_secret(secrets)
    try:
        stripe.WebhookSignature.verify_header(payload, signature or "", secret, tolerance)
    except (stripe.SignatureVerificationError, UnicodeDecodeError):
        # Stripe signs text: a body that is not UTF-8 cannot carry its signature.
        raise ApiError(
            "the Stripe-Signature header does not verify", code="invalid_signature"
        ) from None
    event = parse_event(payload)
    result = await run_admin_operation(
        temporal,
        task_queue,
        STRIPE_WEBHOOK_EVENT,
        event,
        key=hashlib.sha256(event.event_id.encode()).hexdigest()[:32],  # free text from Stripe
        result_type=WebhookEventResult,
    )
    return WebhookAck(received=True, duplicate=result.duplicate)


def _summary(row: PaymentSession) -> PaymentSessionSummary:
    return PaymentSessionSummary(
        payment_session_id=row.id,
        project_id=row.project_id,
        status=row.status,
        requested_amount_minor=row.requested_amount_minor,
        credited_amount_minor=row.credited_amount_minor,
        currency=row.currency,
        stripe_checkout_session_id=row.stripe_checkout_session_id,
        workflow_id=row.workflow_id,
        failure_reason=row.failure_reason,
        review_reason=row.review_reason,
        created_at=row.created_at,
        completed_at=row.completed_at,
        expires_at=row.expires_at,
        flagged_for_review_at=row.flagged_for_review_at,
    )


class PaymentsController(Controller):
    path = "/api/v1/payments"
    guards = [tenant_guard]
    tags = ["payments"]

    @post(
        "/checkout-session",
        status_code=201,
        summary="Start a Stripe Checkout Session to add credit",
        description=(
            "X-Idempotency-Key is required: the same key answers the same session (header "
            "Idempotent-Replayed: true) without a second Stripe call; the same key with another "
            "body is 422 idempotency_key_reused. The amount must lie within the currency's "
            "limits (422 amount_below_minimum / amount_above_maximum with the limit in the "
            "details; 422 currency_not_supported for a currency we do not accept; 422 "
            "currency_mismatch for a currency other than the project's account's)."
        ),
        responses=errors(400, 403, 422, 502),
    )
    async def create(
        self,
        data: JSONBody[CheckoutSessionCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        # Required: without it the route answers 400 (create_checkout_session).
        idempotency_key: Annotated[str, HeaderParameter(name=IDEMPOTENCY_HEADER, required=True)],
    ) -> Response[CheckoutSessionCreated]:
        created, replayed = await create_checkout_session(
            db,
            temporal,
            runtime.settings.control_plane_task_queue,
            project_id=principal.project,
            body=data,
            idempotency_key=idempotency_key,
        )
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return Response(created, status_code=201, headers=headers)

    @get(
        "/sessions",
        summary="The project's payment sessions, newest first",
        description=(
            "Every checkout this project started, whatever became of it (initiated, credited, "
            "expired, failed_reconcile ...), newest first; pass next_cursor back as ?cursor= "
            "for the next page. Another project's sessions are never listed."
        ),
        responses=errors(400, 403),
    )
    async def list_sessions(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> PaymentSessionPage:
        rows, next_cursor = await newest_first_page(
            db,
            select(PaymentSession).where(PaymentSession.project_id == principal.project),
            created=PaymentSession.created_at,
            row_id=PaymentSession.id,
            limit=limit,
            cursor=cursor,
        )
        return PaymentSessionPage(items=[_summary(r) for r in rows], next_cursor=next_cursor)


class StripeWebhookController(Controller):
    path = "/api/v1/webhooks/stripe"
    tags = ["payments"]

    @post(
        "/",
        status_code=200,
        summary="Stripe webhook endpoint (authenticated by Stripe-Signature)",
        security=[],
        responses=errors(400, 413),
    )
    async def receive(
        self,
        request: Request[Any, Any, Any],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        secrets: NamedDependency[SecretStore],
    ) -> WebhookAck:
        return await handle_webhook(
            temporal,
            secrets,
            runtime.settings.control_plane_task_queue,
            payload=await request.body(),
            signature=request.headers.get(SIGNATURE_HEADER),
            tolerance=PaymentSettings.from_env().webhook_tolerance_seconds,
        )


class AdminPaymentsController(Controller):
    path = "/api/v1/admin/payments"
    guards = [admin_guard]
    tags = ["admin", "payments"]

    @get(
        "/sessions",
        summary=(
            "Payment sessions that need a person: initiated or checkout_completed for over an "
            "hour, failed_reconcile, or flagged for review (paid after they expired)"
        ),
        responses=errors(400, 403),
    )
    async def stuck_sessions(
        self,
        db: NamedDependency[AsyncSession],
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> PaymentSessionList:
        stuck_after = dt.timedelta(seconds=PaymentSettings.from_env().stuck_after_seconds)
        rows = (
            await db.scalars(
                select(PaymentSession)
                .where(
                    or_(
                        PaymentSession.status == FAILED_RECONCILE,
                        PaymentSession.review_reason.is_not(None),
                        PaymentSession.status.in_([INITIATED, CHECKOUT_COMPLETED])
                        & (PaymentSession.created_at < func.now() - stuck_after),
                    )
                )
                .order_by(PaymentSession.created_at)
                .limit(limit)
            )
        ).all()
        return PaymentSessionList(items=[_summary(r) for r in rows])

    @get(
        "/sessions/{payment_session_id:uuid}/events",
        summary="A payment session's transitions, oldest first (append-only)",
        responses=errors(403, 404),
    )
    async def session_events(
        self, db: NamedDependency[AsyncSession], payment_session_id: FromPath[uuid.UUID]
    ) -> PaymentSessionEventList:
        if await db.get(PaymentSession, payment_session_id) is None:
            raise NotFound("payment session not found")
        rows = await db.scalars(
            select(PaymentSessionEvent)
            .where(PaymentSessionEvent.payment_session_id == payment_session_id)
            .order_by(PaymentSessionEvent.id)
        )
        return PaymentSessionEventList(
            items=[
                PaymentSessionEventView(
                    event=r.event,
                    from_status=r.from_status,
                    to_status=r.to_status,
                    details=r.details,
                    occurred_at=r.occurred_at,
                )
                for r in rows
            ]
        )
