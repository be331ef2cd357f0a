"""The StripeReconciliationWorkflow contract: run by the Temporal Schedule `stripe-reconciliation`,
it finds paid Checkout Sessions whose webhook never arrived, abandoned ones past their TTL, and
late successes: sessions that expired unpaid and that Stripe reports paid later, even after the
late-success window, when their own workflow has closed (issue 37)."""

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
    # Expired, never-credited sessions are asked about for this long after they expired (delayed
    # payment methods settle days later; Stripe's list of completed sessions covers them all,
    # a lookup each covers the newest `max_late_checks` the list did not).
    late_horizon_seconds: float = 60 * 86400.0
    max_late_checks: int = 100


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
    # Paid, its workflow gone, and settling it here failed too (left for the next run).
    unreachable: list[str] = field(default_factory=list)
    # Paid, its workflow closed (the late-success window passed, or it was terminated): settled
    # by this run itself and credited, exactly once (ledger key payment:{id}), a late one
    # flagged late_success. (One settled as failed_reconcile is in amount_mismatches or the
    # admin list of stuck sessions.)
    credited_directly: list[str] = field(default_factory=list)
    listed: int = 0
    checked: int = 0
