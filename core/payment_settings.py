"""Payment and notification settings, read from the environment once at start-up (defaults suit
the dev stack). Secrets are not settings: the Stripe API key and webhook secret, and projects'
notification webhook secrets, are read from the secret store at call time, so rotation needs no
restart."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from core.config import env

STRIPE_API_KEY_PATH = "kv/stripe/api-key"  # {"key": "sk_…"}
STRIPE_WEBHOOK_SECRET_PATH = "kv/stripe/webhook-secret"  # noqa: S105 - a path; {"secret": "whsec_…"}


@dataclass(frozen=True)
class PaymentSettings:
    # Each field's variable and meaning: core.config.env (docs/gen_configuration.py).
    stripe_api_base: str = field(
        default="https://api.stripe.com",
        metadata=env(
            "GPUCLOUD_STRIPE_API_BASE",
            "worker, gateway",
            "the Stripe API (stripe-mock under `bin/stack` and in tests); its key and webhook "
            "secret come from Vault (`kv/stripe/api-key`, `kv/stripe/webhook-secret`), never the "
            "environment",
        ),
    )
    session_ttl_seconds: float = field(
        default=24 * 3600.0,
        metadata=env(
            "GPUCLOUD_PAYMENT_SESSION_TTL_S",
            "worker",
            "how long a Checkout Session waits for payment before the payment session expires",
        ),
    )
    # Delayed payment methods settle days later: such a success is credited and flagged for
    # review instead of being dropped.
    late_success_window_seconds: float = field(
        default=14 * 86400.0,
        metadata=env(
            "GPUCLOUD_PAYMENT_LATE_SUCCESS_WINDOW_S",
            "worker",
            "how long an expired payment session still credits a late success (flagged "
            "`late_success`)",
        ),
    )
    success_url: str = field(
        default="http://localhost:8000/payments/success",
        metadata=env(
            "GPUCLOUD_PAYMENT_SUCCESS_URL",
            "worker",
            "where Stripe's checkout page sends the tenant back after paying",
        ),
    )
    cancel_url: str = field(
        default="http://localhost:8000/payments/cancel",
        metadata=env(
            "GPUCLOUD_PAYMENT_CANCEL_URL",
            "worker",
            "where Stripe's checkout page sends the tenant back after cancelling",
        ),
    )
    stripe_timeout_seconds: float = field(
        default=20.0,
        metadata=env("GPUCLOUD_STRIPE_TIMEOUT_S", "worker", "bound on each Stripe call"),
    )
    webhook_tolerance_seconds: int = field(
        default=300,
        metadata=env(
            "GPUCLOUD_STRIPE_WEBHOOK_TOLERANCE_S",
            "gateway",
            "how old a signed webhook may be before it is refused (replay protection; Stripe's "
            "default tolerance)",
        ),
    )
    reconciliation_interval_seconds: float = field(
        default=300.0,
        metadata=env(
            "GPUCLOUD_STRIPE_RECONCILE_INTERVAL_S",
            "worker",
            "how often open payment sessions are checked against Stripe",
        ),
    )
    stuck_after_seconds: float = field(
        default=3600.0,
        metadata=env(
            "GPUCLOUD_PAYMENT_STUCK_AFTER_S",
            "gateway",
            "age after which an open session is listed as stuck "
            "(`GET /api/v1/admin/payments/sessions`)",
        ),
    )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PaymentSettings:
        e = os.environ if env is None else env
        d = cls()
        return cls(
            stripe_api_base=e.get("GPUCLOUD_STRIPE_API_BASE", d.stripe_api_base).rstrip("/"),
            session_ttl_seconds=float(
                e.get("GPUCLOUD_PAYMENT_SESSION_TTL_S", str(d.session_ttl_seconds))
            ),
            late_success_window_seconds=float(
                e.get("GPUCLOUD_PAYMENT_LATE_SUCCESS_WINDOW_S", str(d.late_success_window_seconds))
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


# Per-currency bounds of one Checkout Session, in minor units (the currencies we accept). The
# minimum is Stripe's own (it refuses card payments below about 0.50 USD, converted per
# currency); the maximum is Stripe's 8-digit amount limit.
# https://docs.stripe.com/currencies#minimum-and-maximum-charge-amounts
CHECKOUT_AMOUNT_LIMITS: dict[str, tuple[int, int]] = {
    "usd": (50, 99_999_999),
    "eur": (50, 99_999_999),
    "gbp": (30, 99_999_999),
    "chf": (50, 99_999_999),
    "cad": (50, 99_999_999),
    "aud": (50, 99_999_999),
    "jpy": (50, 99_999_999),  # zero-decimal: ¥50
}


@dataclass(frozen=True)
class NotificationSettings:
    """How the worker delivers tenant notifications to project webhooks."""

    timeout_seconds: float = field(
        default=5.0,
        metadata=env(
            "GPUCLOUD_NOTIFICATION_WEBHOOK_TIMEOUT_S",
            "worker",
            "bound on one delivery of a balance notice to a project's webhook",
        ),
    )
    max_attempts: int = field(
        default=8,
        metadata=env(
            "GPUCLOUD_NOTIFICATION_WEBHOOK_MAX_ATTEMPTS",
            "worker",
            "deliveries of one notice before it is given up",
        ),
    )
    initial_backoff_seconds: float = field(
        default=30.0,
        metadata=env(
            "GPUCLOUD_NOTIFICATION_WEBHOOK_RETRY_INITIAL_S",
            "worker",
            "first retry of a failed delivery, doubling up to an hour",
        ),
    )
    max_backoff_seconds: float = 3600.0
    # Webhooks on loopback, private, link-local or otherwise reserved addresses are refused
    # (the worker must not be a way into the control plane's network), and plain http with
    # them; the dev stack and the tests turn this on.
    allow_private_targets: bool = field(
        default=False,
        metadata=env(
            "GPUCLOUD_NOTIFICATION_WEBHOOK_ALLOW_PRIVATE",
            "gateway, worker",
            "`1` lets a webhook resolve to a private or loopback address (tests, the embedded "
            "stack)",
        ),
    )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NotificationSettings:
        e = os.environ if env is None else env
        d = cls()
        return cls(
            timeout_seconds=float(
                e.get("GPUCLOUD_NOTIFICATION_WEBHOOK_TIMEOUT_S", str(d.timeout_seconds))
            ),
            max_attempts=int(
                e.get("GPUCLOUD_NOTIFICATION_WEBHOOK_MAX_ATTEMPTS", str(d.max_attempts))
            ),
            initial_backoff_seconds=float(
                e.get(
                    "GPUCLOUD_NOTIFICATION_WEBHOOK_RETRY_INITIAL_S", str(d.initial_backoff_seconds)
                )
            ),
            allow_private_targets=e.get("GPUCLOUD_NOTIFICATION_WEBHOOK_ALLOW_PRIVATE", "")
            in ("1", "true", "yes"),
        )
