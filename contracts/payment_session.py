"""The PaymentSessionWorkflow contract (docs/lifecycles/payment-session.md): id scheme, message
names, payloads, the statuses a session goes through and the error types the gateway maps to HTTP.
Kept apart from the workflow so the gateway and the activities import no workflow code."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKFLOW_NAME = "PaymentSessionWorkflow"
CHECKOUT_UPDATE = "checkout"
COMPLETED_SIGNAL = "checkout_completed"
STATUS_QUERY = "status"

# Statuses (payment_sessions.status): initiated → checkout_completed → credited, with
# failed_reconcile and expired beside them; an expired session whose payment still succeeds
# within the late-success window goes on to checkout_completed and credited, flagged for review.
INITIATED = "initiated"
CHECKOUT_COMPLETED = "checkout_completed"
CREDITED = "credited"
FAILED_RECONCILE = "failed_reconcile"
EXPIRED = "expired"

# Error types the gateway maps to HTTP.
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
STRIPE_ERROR = "payment_provider_error"
# 422s of POST /api/v1/payments/checkout-session (core.payment_settings.CHECKOUT_AMOUNT_LIMITS).
CURRENCY_NOT_SUPPORTED = "currency_not_supported"
AMOUNT_BELOW_MINIMUM = "amount_below_minimum"
AMOUNT_ABOVE_MAXIMUM = "amount_above_maximum"

# Failure reasons stored in payment_sessions.failure_reason.
AMOUNT_MISMATCH = "amount_mismatch"
CURRENCY_MISMATCH = "currency_mismatch"
CREDIT_FAILED = "credit_failed"

# Review reasons stored in payment_sessions.review_reason.
LATE_SUCCESS = "late_success"  # paid after the session expired: credited, for a person to check

WORKFLOW_ID_PREFIX = "payment-session-"


def payment_session_workflow_id(payment_session_id: str) -> str:
    return f"{WORKFLOW_ID_PREFIX}{payment_session_id}"


def payment_session_id_from_workflow_id(workflow_id: str) -> str:
    if not workflow_id.startswith(WORKFLOW_ID_PREFIX):
        raise ValueError(f"not a payment session workflow id: {workflow_id}")
    return workflow_id[len(WORKFLOW_ID_PREFIX) :]


def ledger_idempotency_key(payment_session_id: str) -> str:
    """The one credit a payment session may ever post (activities.billing.ledger)."""
    return f"payment:{payment_session_id}"


def stripe_idempotency_key(payment_session_id: str) -> str:
    """Sent to Stripe with the Checkout Session create call: a retried create is the same one."""
    return f"checkout-session:{payment_session_id}"


@dataclass
class PaymentSessionPolicy:
    credit_max_attempts: int = 5
    create_max_attempts: int = 5


@dataclass
class PaymentSessionInput:
    payment_session_id: str
    project_id: str
    amount_minor: int
    currency: str
    idempotency_key: str
    # sha256 of the canonical request body: the same key with another body is refused.
    request_fingerprint: str
    policy: PaymentSessionPolicy = field(default_factory=PaymentSessionPolicy)


@dataclass
class CreateCheckoutInput:
    payment_session_id: str
    project_id: str
    amount_minor: int
    currency: str
    idempotency_key: str
    workflow_id: str


@dataclass
class CheckoutCreated:
    payment_session_id: str
    stripe_checkout_session_id: str
    checkout_url: str
    status: str
    expires_at: str  # ISO 8601
    # How long the workflow waits for payment (from the worker's settings, fixed in history).
    ttl_seconds: float = 86400.0
    # After expiry, how long a payment that still succeeds is credited (flagged for review).
    late_success_window_seconds: float = 14 * 86400.0


@dataclass
class CheckoutCompletion:
    """Signalled by the webhook route or by Stripe reconciliation: Stripe says it was paid."""

    stripe_checkout_session_id: str
    amount_total: int
    currency: str
    source: str  # webhook | reconciliation
    stripe_event_id: str | None = None


@dataclass
class CompleteInput:
    """Record the completion (status checkout_completed) before the credit is attempted."""

    payment_session_id: str
    completion: CheckoutCompletion


@dataclass
class CreditInput:
    payment_session_id: str
    completion: CheckoutCompletion


@dataclass
class SettleResult:
    payment_session_id: str
    status: str  # credited | failed_reconcile | expired (checkout_completed: not yet settled)
    ledger_entry_id: str | None = None
    failure_reason: str | None = None
    review_reason: str | None = None


@dataclass
class FailInput:
    payment_session_id: str
    reason: str
    credited_amount_minor: int | None = None


@dataclass
class ExpireInput:
    payment_session_id: str


@dataclass
class PaymentSessionView:
    payment_session_id: str
    status: str
    stripe_checkout_session_id: str | None
    failure_reason: str | None


@dataclass
class WebhookEventInput:
    """A Stripe event whose signature the gateway verified, as much of it as its handling needs
    (AdminOperationWorkflow operation STRIPE_WEBHOOK_EVENT, keyed by the event id)."""

    event_id: str
    event_type: str
    stripe_checkout_session_id: str | None = None
    paid: bool = False
    amount_total: int = 0
    currency: str | None = None


@dataclass
class WebhookEventResult:
    duplicate: bool  # already processed: this delivery changed nothing
