"""The AllocationWorkflow contract: its id scheme, message names, inputs, outputs and the error
types its clients map to HTTP. Kept apart from the workflow so the gateway imports no workflow
code and the worker's sandbox passes these definitions through instead of re-creating them for
every workflow run."""

# Annotations here are evaluated (no `from __future__ import annotations`): Temporal's payload
# converter resolves a dataclass's type hints on every conversion, and string annotations made
# that a visible share of the CPU of every POST /allocations.

from dataclasses import dataclass, field

from contracts.host_task_errors import AGENT_CAPABILITY_MISSING as AGENT_CAPABILITY_MISSING
from contracts.states import AllocationStatus

WORKFLOW_NAME = "AllocationWorkflow"
RESERVE_UPDATE = "reserve"
RELEASE_UPDATE = "request_release"
DETACH_UPDATE = "detach"
STATUS_QUERY = "status"

# Error types the gateway maps to HTTP (see gateway/errors.py).
SKU_UNAVAILABLE = "sku_unavailable"
SSH_KEY_NOT_FOUND = "ssh_key_not_found"
BALANCE_DEPLETED = "balance_depleted"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
NOT_RELEASABLE = "allocation_not_releasable"
# Detach is for a release_failed allocation only (nor while a release retry is queued or runs).
NOT_DETACHABLE = "allocation_not_detachable"
# The region's slice VLAN pool has no vid left for a project that holds none.
NETWORK_POOL_EXHAUSTED = "network_pool_exhausted"
REJECTION_TYPES = (SKU_UNAVAILABLE, SSH_KEY_NOT_FOUND, BALANCE_DEPLETED, NETWORK_POOL_EXHAUSTED)

# Provisioning failure reasons beyond the host's own error types.
NODE_UNREACHABLE = "node_unreachable"
# The reserved node left service (offline, quarantined, draining, …) after the reservation and
# before provisioning started: requested → failed, nothing ran on the host, the claims are freed.
NODE_UNAVAILABLE = "node_unavailable"
HOST_TIMEOUT = "host_timeout"
PROVISIONING_ERROR = "provisioning_error"
# AGENT_CAPABILITY_MISSING (imported above, defined with the other host-task failures in
# contracts/host_task_errors.py): the node's agent does not offer the host task.

# The quarantine reason of the GPU slots (slices) or the node (bare metal) a failed provision
# held when the host did not prove its cleanup: they are not placed again until an operator
# finishes the cleanup and returns them to service.
PROVISION_CLEANUP_UNCONFIRMED = "provision_cleanup_unconfirmed"
# The same for a release_failed allocation an admin detached (docs/lifecycles/allocation.md,
# "removes the assignment"): the release never proved its cleanup, so the assignment ends by
# quarantining what it held, never by claiming the node was cleaned.
RELEASE_CLEANUP_UNCONFIRMED = "release_cleanup_unconfirmed"
# An AllocationResult's reason when the allocation ended `released` by an admin detach.
DETACHED = "detached"


def allocation_workflow_id(allocation_id: str) -> str:
    return f"allocation-{allocation_id}"


def allocation_id_from_workflow_id(workflow_id: str) -> str:
    prefix = "allocation-"
    if not workflow_id.startswith(prefix):
        raise ValueError(f"not an allocation workflow id: {workflow_id}")
    return workflow_id[len(prefix) :]


@dataclass
class AllocationPolicy:
    """Timeouts and retry bounds, fixed at start so the workflow stays deterministic."""

    node_schedule_to_start_seconds: float = 60.0
    host_provision_timeout_seconds: float = 900.0
    host_heartbeat_timeout_seconds: float = 30.0
    release_max_attempts: int = 3
    release_retry_initial_seconds: float = 1.0
    lease_conflict_max_attempts: int = 3


@dataclass
class AllocationInput:
    allocation_id: str
    project_id: str
    sku: str
    gpus: int
    region: str
    ssh_key_ids: list[str]
    idempotency_key: str | None
    # sha256 of the canonical request body: the same idempotency key with another body is refused.
    request_fingerprint: str
    policy: AllocationPolicy = field(default_factory=AllocationPolicy)
    # Set for a member of an allocation group (docs/lifecycles/allocation-group.md): it reports each
    # status to the group's workflow, and placement applies the group's anti-affinity.
    allocation_group_id: str | None = None
    same_node_forbidden: bool = False


@dataclass
class ReleaseRequest:
    actor: str  # ReleaseActor value
    reason: str = ""
    force: bool = False


@dataclass
class ReleaseAccepted:
    allocation_id: str
    prior_status: str
    # The status the allocation is heading to: "releasing", or the current one when the release
    # waits for provisioning to finish, or "released" when there is nothing left to do.
    expected_status: str
    release_pending: bool


@dataclass
class DetachRequest:
    """An admin ends a release_failed allocation whose node cannot clean up (the `detach`
    update); the reason is required and audited."""

    reason: str
    actor: str = "admin"  # ReleaseActor value


@dataclass
class DetachResult:
    allocation_id: str
    status: str  # released
    detached_at: str  # ISO 8601, the database's clock


@dataclass
class AllocationView:
    allocation_id: str
    status: str
    node_id: str | None
    failure_reason: str | None
    release_attempts: int
    release_pending: bool


# The outcome of a workflow whose placement was refused (no allocation row exists): its result's
# status, and its AllocationStatus search attribute.
REJECTED = "rejected"
# The AllocationStatus the gateway starts the workflow with. Placement creates the allocation
# `requested` and the workflow moves it to `provisioning` right after, off the POST's path; the
# attribute names the state the workflow is heading for, so that neither the POST's workflow task
# nor the next one upserts (a visibility write per allocation). Temporal Web shows `provisioning`
# for the moment a placed allocation is `requested`; the API shows the row.
STATUS_AT_START = AllocationStatus.PROVISIONING.value


@dataclass
class AllocationResult:
    allocation_id: str
    status: str  # released | failed | rejected
    reason: str | None = None  # a failure or rejection type; DETACHED for a detach
