"""The StripeReconciliationWorkflow contract: run by the Temporal Schedule `stripe-reconciliation`,
it finds paid Checkout Sessions whose webhook never arrived and abandoned ones past their TTL."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKFLOW_NAME = "StripeReconciliationWorkflow"
SCHEDULE_ID = "stripe-reconciliation"


@dataclass
class ReconciliationInput:
    # Initiated sessions are looked up one by one in Stripe once older than this (a webhook
    # normally arrives within seconds); the list call covers the rest.
    grace_seconds: float = 60.0
    max_sessions: int = 200


@dataclass
class PaidSession:
    payment_session_id: str
    stripe_checkout_session_id: str
    amount_total: int
    currency: str
    requested_amount_minor: int


@dataclass
class ReconciliationScan:
    paid: list[PaidSession] = field(default_factory=list)
    overdue: list[str] = field(default_factory=list)  # payment session ids initiated past TTL
    listed: int = 0
    checked: int = 0


@dataclass
class ReconciliationResult:
    signalled: list[str] = field(default_factory=list)
    amount_mismatches: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # paid, but its workflow is gone
    listed: int = 0
    checked: int = 0
