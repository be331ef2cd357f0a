"""Payment settings, read from the environment once at start-up (defaults suit the dev stack).
Secrets are not settings: the Stripe API key and webhook secret are read from the secret store at
call time, so rotation needs no restart."""

from __future__ import annotations

import os
from dataclasses import dataclass

STRIPE_API_KEY_PATH = "kv/stripe/api-key"  # {"key": "sk_…"}
STRIPE_WEBHOOK_SECRET_PATH = "kv/stripe/webhook-secret"  # noqa: S105 - a path; {"secret": "whsec_…"}


@dataclass(frozen=True)
class PaymentSettings:
    stripe_api_base: str = "https://api.stripe.com"
    # How long a Checkout Session waits for payment before the payment session expires.
    session_ttl_seconds: float = 24 * 3600.0
    success_url: str = "http://localhost:8000/payments/success"
    cancel_url: str = "http://localhost:8000/payments/cancel"
    stripe_timeout_seconds: float = 20.0
    # Stripe-Signature timestamps older than this are refused (Stripe's default tolerance).
    webhook_tolerance_seconds: int = 300
    reconciliation_interval_seconds: float = 300.0
    # The admin list shows initiated sessions older than this as stuck.
    stuck_after_seconds: float = 3600.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PaymentSettings:
        e = os.environ if env is None else env
        d = cls()
        return cls(
            stripe_api_base=e.get("GPUCLOUD_STRIPE_API_BASE", d.stripe_api_base).rstrip("/"),
            session_ttl_seconds=float(
                e.get("GPUCLOUD_PAYMENT_SESSION_TTL_S", str(d.session_ttl_seconds))
            ),
            success_url=e.get("GPUCLOUD_PAYMENT_SUCCESS_URL", d.success_url),
            cancel_url=e.get("GPUCLOUD_PAYMENT_CANCEL_URL", d.cancel_url),
            stripe_timeout_seconds=float(
                e.get("GPUCLOUD_STRIPE_TIMEOUT_S", str(d.stripe_timeout_seconds))
            ),
            webhook_tolerance_seconds=int(
                e.get("GPUCLOUD_STRIPE_WEBHOOK_TOLERANCE_S", str(d.webhook_tolerance_seconds))
            ),
            reconciliation_interval_seconds=float(
                e.get(
                    "GPUCLOUD_STRIPE_RECONCILE_INTERVAL_S", str(d.reconciliation_interval_seconds)
                )
            ),
            stuck_after_seconds=float(
                e.get("GPUCLOUD_PAYMENT_STUCK_AFTER_S", str(d.stuck_after_seconds))
            ),
        )
