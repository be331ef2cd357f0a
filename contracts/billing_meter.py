"""BillingMeterWorkflow's run and its activities' inputs and results; the balance states of seed
001 §4 and the tenant notification channel (the outbox the meter writes, the webhook it
delivers to, and how a delivery is signed)."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from dataclasses import dataclass, field
from enum import StrEnum

from contracts.admin_operation import Actor


class BalanceState(StrEnum):
    """docs/lifecycles/balance.md: depleted at a balance ≤ the depleted threshold (0), low at ≤ the
    low threshold, healthy above. An account starts depleted."""

    HEALTHY = "healthy"
    LOW_BALANCE = "low_balance"
    DEPLETED = "depleted"


class NotificationKind(StrEnum):
    LOW_BALANCE = "low_balance"
    DEPLETED = "depleted"


# A project's notification webhook: each delivery is a POST of the notice as JSON, with
#   Gpucloud-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>
#   Gpucloud-Notification-Id: <the notice's id> (the same on every retry: dedupe on it)
SIGNATURE_HEADER = "Gpucloud-Signature"
NOTIFICATION_ID_HEADER = "Gpucloud-Notification-Id"


def notification_webhook_secret_path(project_id: uuid.UUID | str) -> str:
    """Where the webhook's signing secret lives in the secret store: {"secret": "whsec_…"}."""
    return f"kv/projects/{project_id}/notification-webhook"


@dataclass
class WebhookSetInput:
    """AdminOperationWorkflow operation NOTIFICATION_WEBHOOK_SET: the secret is written to the
    secret store and the row (URL, secret path) with its audit row, or neither."""

    actor: Actor
    project_id: str
    url: str
    signing_secret: str = field(repr=False)


@dataclass
class WebhookDeleteInput:
    actor: Actor
    project_id: str


@dataclass
class WebhookState:
    url: str
    created_at: str  # ISO 8601
    updated_at: str  # ISO 8601


def sign_notification(secret: str, timestamp: int, body: bytes) -> str:
    """The Gpucloud-Signature header value for `body` sent at `timestamp`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


@dataclass
class MeterInput:
    # Bill windows that ended by this instant (ISO-8601); None: now, by the database's clock.
    until: str | None = None


@dataclass
class MeterResult:
    debits_posted: int = 0
    charged_minor: int = 0
    records_billed: int = 0
    state_changes: list[str] = field(default_factory=list)
    allocations_to_release: list[str] = field(default_factory=list)
    # Notices waiting for their webhook delivery (new ones, and retries that are due).
    notifications_due: int = 0
    # Storage (issue 37): the part of debits_posted / charged_minor that is storage, and the
    # attachments of accounts depleted beyond their grace, to be detached (data kept).
    storage_debits_posted: int = 0
    storage_charged_minor: int = 0
    attachments_to_detach: list[str] = field(default_factory=list)


# The storage activities the meter runs (activities/storage.py, on the control-plane queue).
STORAGE_DETACH_FOR_BILLING = "storage.detach_for_billing"
STORAGE_MEASURE_USAGE = "storage.measure_usage"
# A namespace whose provider has no price in its account's currency (storage_prices): refused.
STORAGE_NOT_PRICED = "storage_not_priced"


@dataclass
class StorageDetachForBillingInput:
    attachment_ids: list[str]
    reason: str = "billing account depleted beyond its storage grace period"


@dataclass
class StorageDetachForBillingResult:
    requested: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


@dataclass
class StorageMeasureInput:
    # Stop measuring after this long (the rest waits for the next run), oldest measure first.
    max_seconds: float = 20.0


@dataclass
class StorageMeasureResult:
    measured: int = 0
    unavailable: int = 0  # the provider could not measure them here (e.g. export not mounted)


@dataclass
class BillingForceReleaseInput:
    allocation_ids: list[str]
    reason: str = "billing account depleted"


@dataclass
class BillingForceReleaseResult:
    requested: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


@dataclass
class DeliverNotificationsInput:
    max_notifications: int = 50


@dataclass
class DeliverNotificationsResult:
    delivered: list[str] = field(default_factory=list)
    retrying: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # attempts spent: no more tries
