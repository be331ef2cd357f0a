"""The AdminOperationWorkflow contract: a mutation the gateway used to write itself (a manual
credit, a slot returned to service, a drift resolved, a MAAS site's credentials, RoCE
assignments, BMC credential overrides; and, outside the admin API, an onboarding or decommission
submission's job rows, an agent's enrollment, a Stripe webhook event and a project's
notification webhook) runs in the worker as one workflow running one single-purpose activity,
named by the operation, that does the write and its audit row in one database transaction. Kept
apart from the workflow so the gateway and the activities import no workflow code.

Workflow ids say what the operation is about, so that Temporal deduplicates a retried request
(id conflict policy USE_EXISTING: a request that arrives while the first runs gets the first's
answer; id reuse ALLOW_DUPLICATE: once it closed, a new request runs again and the activity
answers from the database, e.g. an existing ledger entry): `admin-op-{operation}-{discriminator}`
where the discriminator is the client's idempotency key (credits), the target (state changes and
deletes), or the request's own id when its body carries secrets (credentials, overrides), so
that a request is never answered with another request's result for different secrets.

Secrets (the MAAS API key, BMC and deploy passwords) travel only inside the encrypted workflow
and activity payloads (core.temporal.data_converter); ids, search attributes and error messages
never carry them, and their fields are left out of reprs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

WORKFLOW_NAME = "AdminOperationWorkflow"
WORKFLOW_ID_PREFIX = "admin-op-"

# Operations: each is the name of the activity that performs it.
BILLING_CREDIT = "admin.billing_credit"
GPU_SLOT_RETURN = "admin.gpu_slot_return_to_service"
DRIFT_RESOLVE = "admin.drift_resolve"
SITE_CREDENTIALS_WRITE = "admin.site_credentials_write"
SITE_PROBE = "admin.site_probe"
ROCE_UPSERT = "admin.roce_upsert"
ROCE_DELETE = "admin.roce_delete"
POWER_OVERRIDE_CREATE = "admin.power_override_create"
POWER_OVERRIDE_UPDATE = "admin.power_override_update"
POWER_OVERRIDE_DELETE = "admin.power_override_delete"
# Node lifecycle actions of docs/lifecycles/node.md#who-moves-it (activities/node_admin.py).
NODE_ACTIVATE = "admin.node_activate"  # quarantined → active, after a health proof
NODE_RETIRE = "admin.node_retire"  # → draining, with its NodeDrainWorkflow; → retired
NODE_REACTIVATE = "admin.node_reactivate"  # retired → active, after a health proof
# Mutations of other requests the gateway answers, run the same way (their types live beside
# their lifecycle: contracts.enrollment, .lifecycle_submissions, .payment_session).
ENROLLMENT_ISSUE_TOKEN = "enrollment.issue_token"  # noqa: S105 - an operation name
ENROLLMENT_REDEEM_TOKEN = "enrollment.redeem_token"  # noqa: S105 - an operation name
ONBOARDING_SUBMIT = "onboarding.submit"
DECOMMISSION_SUBMIT = "decommission.submit"
STRIPE_WEBHOOK_EVENT = "payments.stripe_webhook_event"
NOTIFICATION_WEBHOOK_SET = "notifications.webhook_set"
NOTIFICATION_WEBHOOK_DELETE = "notifications.webhook_delete"
# Storage namespaces (contracts.storage: their inputs and results; activities/storage.py).
STORAGE_NAMESPACE_CREATE = "storage.namespace_create"
STORAGE_NAMESPACE_DELETE = "storage.namespace_delete"
OPERATIONS = (
    BILLING_CREDIT,
    GPU_SLOT_RETURN,
    DRIFT_RESOLVE,
    SITE_CREDENTIALS_WRITE,
    SITE_PROBE,
    ROCE_UPSERT,
    ROCE_DELETE,
    POWER_OVERRIDE_CREATE,
    POWER_OVERRIDE_UPDATE,
    POWER_OVERRIDE_DELETE,
    NODE_ACTIVATE,
    NODE_RETIRE,
    NODE_REACTIVATE,
    ENROLLMENT_ISSUE_TOKEN,
    ENROLLMENT_REDEEM_TOKEN,
    ONBOARDING_SUBMIT,
    DECOMMISSION_SUBMIT,
    STRIPE_WEBHOOK_EVENT,
    NOTIFICATION_WEBHOOK_SET,
    NOTIFICATION_WEBHOOK_DELETE,
    STORAGE_NAMESPACE_CREATE,
    STORAGE_NAMESPACE_DELETE,
)

# Error types (the ApplicationError type, also the API's error code the gateway answers with).
NOT_FOUND = "not_found"
SLOT_NOT_QUARANTINED = "slot_not_quarantined"
NO_DRIFT = "no_drift"
OVERRIDE_EXISTS = "override_exists"
MAAS_API_KEY_MALFORMED = "maas_api_key_malformed"
MAAS_TOKEN_REJECTED = "maas_token_rejected"  # noqa: S105 - an error code
MAAS_TOKEN_NOT_ADMIN = "maas_token_not_admin"  # noqa: S105 - an error code
MAAS_UNREACHABLE = "maas_unreachable"
CREDENTIALS_MISSING = "credentials_missing"
CREDENTIALS_INVALID = "credentials_invalid"
SECRET_STORE_UNAVAILABLE = "secret_store_unavailable"  # noqa: S105 - an error code
DATABASE_UNAVAILABLE = "database_unavailable"
UNKNOWN_OPERATION = "unknown_operation"
NODE_STATUS_CONFLICT = "node_status_conflict"  # the node is not where the action moves from
NODE_NOT_PROVEN_HEALTHY = "node_not_proven_healthy"
NODE_LIFECYCLE_IN_PROGRESS = "node_lifecycle_in_progress"  # an onboarding/decommission owns it
# Retried by the workflow (bounded); every other type above is a final answer.
RETRYABLE_ERRORS = (DATABASE_UNAVAILABLE,)

# Fixed forever: credit workflow ids derived from idempotency keys must not change.
_CREDIT_ID_NAMESPACE = uuid.UUID("5f0c8e1a-2b7d-4c39-9a64-3e1d0b7f2c58")


def admin_operation_workflow_id(operation: str, discriminator: str) -> str:
    return f"{WORKFLOW_ID_PREFIX}{operation.removeprefix('admin.')}-{discriminator}"


def ledger_idempotency_key(project_id: str, idempotency_key: str) -> str:
    """The one ledger entry a manual credit with this key may ever post
    (activities.billing.ledger)."""
    return f"admin:{project_id}:{idempotency_key}"


def credit_key(project_id: str, idempotency_key: str) -> str:
    """A credit's workflow key. Idempotency keys are free text: the workflow id carries a uuid5
    of the ledger key, not the key itself."""
    return str(
        uuid.uuid5(_CREDIT_ID_NAMESPACE, ledger_idempotency_key(project_id, idempotency_key))
    )


@dataclass
class Actor:
    """Who asked, for the audit row."""

    name: str
    token_id: str | None
    role: str
    reason: str | None = None


@dataclass
class AdminOperationInput:
    """`request` is the operation's own input (one of the *Input classes below), which the
    activity decodes by its own type."""

    operation: str
    request: Any


# --- billing ------------------------------------------------------------------------------------


@dataclass
class CreditInput:
    actor: Actor
    project_id: str
    amount_minor: int
    idempotency_key: str  # the client's; the ledger's is ledger_idempotency_key(...)


@dataclass
class CreditResult:
    entry_id: str
    created: bool
    balance_minor: int


# --- GPU slots ----------------------------------------------------------------------------------


@dataclass
class GpuSlotReturnInput:
    actor: Actor
    node_id: str
    slot_id: str


@dataclass
class GpuSlotState:
    id: str
    gpu_index: int
    numa_node: int
    pci_address: str
    status: str
    allocation_id: str | None = None
    quarantine_reason: str | None = None
    quarantined_at: str | None = None  # ISO 8601


# --- reconciliation -----------------------------------------------------------------------------


@dataclass
class DriftResolveInput:
    actor: Actor
    node_id: str


@dataclass
class DriftState:
    node_id: str
    hostname: str
    node_status: str
    site_id: str
    maas_system_id: str
    rule: str | None = None
    details: dict[str, Any] | None = None
    last_maas_status: str | None = None
    last_reconciled_at: str | None = None  # ISO 8601


# --- MAAS site credentials and probe ------------------------------------------------------------


@dataclass
class PowerSecret:
    user: str
    password: str = field(repr=False)


@dataclass
class SiteCredentialsInput:
    actor: Actor
    site_id: str
    maas_api_key: str = field(repr=False)
    power: PowerSecret | None = None
    deploy_password: str | None = field(default=None, repr=False)


@dataclass
class SiteCredentialsResult:
    site_id: str
    maas_version: str
    written_paths: list[str]


@dataclass
class SiteProbeInput:
    site_id: str


@dataclass
class RackController:
    system_id: str
    hostname: str
    version: str | None = None


@dataclass
class SiteProbeResult:
    site_id: str
    maas_version: str
    subversion: str
    capabilities: list[str]
    rack_controllers: list[RackController]


# --- RoCE assignments ---------------------------------------------------------------------------


@dataclass
class RoceItem:
    hostname: str
    interface: str
    ipv4_cidr: str  # validated and normalised by the gateway


@dataclass
class RoceUpsertInput:
    actor: Actor
    site_id: str
    items: list[RoceItem]


@dataclass
class RoceUpsertResult:
    created: int
    updated: int
    unchanged: int


@dataclass
class RoceDeleteInput:
    actor: Actor
    site_id: str
    assignment_id: str


# --- BMC power credential overrides -------------------------------------------------------------


@dataclass
class PowerOverrideCreateInput:
    actor: Actor
    site_id: str
    override_id: str
    selector_type: str
    selector_value: str  # normalised by the gateway
    user: str
    password: str = field(repr=False)


@dataclass
class PowerOverrideUpdateInput:
    actor: Actor
    site_id: str
    override_id: str
    status: str | None = None
    # Both or neither (the gateway checks): a rotation of the override's secret.
    user: str | None = None
    password: str | None = field(default=None, repr=False)


@dataclass
class PowerOverrideDeleteInput:
    actor: Actor
    site_id: str
    override_id: str


@dataclass
class PowerOverrideState:
    id: str
    site_id: str
    selector_type: str
    selector_value: str
    vault_path: str
    status: str
    created_at: str  # ISO 8601
    updated_at: str  # ISO 8601


# --- node lifecycle actions ---------------------------------------------------------------------


@dataclass
class NodeActionInput:
    actor: Actor  # reason required: every node lifecycle action is audited with it
    node_id: str


@dataclass
class HealthCheck:
    """One check of a node's health proof (activities/node_admin.py)."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class NodeActionResult:
    node_id: str
    prior_status: str
    status: str
    health: list[HealthCheck] = field(default_factory=list)
    drain_id: str | None = None  # retire: the drain lifecycle that owns `draining`
