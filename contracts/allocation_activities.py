"""Inputs and results of the allocation activities (control-plane side, PostgreSQL)."""

# Annotations here are evaluated on purpose: see contracts/allocation.py.

from dataclasses import dataclass, field

from contracts.host_tasks import (
    GpuAssignment,
    HostPhase,
    HostProvisionInput,
    HostProvisionResult,
    HostReleaseResult,
    UnhealthyGpu,
)


@dataclass
class PlaceInput:
    allocation_id: str
    project_id: str
    sku: str
    gpus: int
    region: str
    ssh_key_ids: list[str]
    idempotency_key: str | None
    workflow_id: str
    # The provisioning node task's id, from workflow.uuid4(): a rerun records the same task once.
    provision_task_id: str = ""
    # A member of an allocation group (docs/lifecycles/allocation-group.md), and whether its group
    # forbids two live members on one node (placement skips those nodes; a unique index holds it
    # under races).
    allocation_group_id: str | None = None
    same_node_forbidden: bool = False


@dataclass
class Reservation:
    """What POST /allocations answers with: the allocation is `requested` and holds capacity."""

    allocation_id: str
    status: str
    node_id: str
    shape: str
    sku: str
    region: str
    gpu_count: int
    gpus: list[GpuAssignment] = field(default_factory=list)
    created_at: str = ""


@dataclass
class ProvisionPlan:
    task_id: str
    task_kind: str
    spec: HostProvisionInput


@dataclass
class Placement:
    """What the first activity did, in one transaction: reserved capacity (`reservation`, what
    the POST answers with: the allocation is `requested`) and queued the host task described by
    `plan`, which the workflow dispatches once it has moved the allocation on to `provisioning`
    (allocation.begin_provisioning)."""

    reservation: Reservation
    plan: ProvisionPlan
    # The allocation's status when placement answered: `requested` (then the workflow moves it
    # on), or `provisioning`, the default, for a placement recorded by a build that created the
    # allocation already provisioning (the workflow's history says which path it took).
    allocation_status: str = "provisioning"


@dataclass
class BeginProvisioningInput:
    allocation_id: str
    # The provisioning host task the placement queued: failed with the allocation when
    # provisioning cannot start.
    task_id: str


@dataclass
class ProvisioningStart:
    """`requested` → `provisioning` (started), or `requested` → `failed` with the reason."""

    started: bool
    reason: str | None = None
    message: str | None = None


@dataclass
class ActivateInput:
    allocation_id: str
    task_id: str
    result: HostProvisionResult


@dataclass
class FailProvisioningInput:
    allocation_id: str
    task_id: str
    reason: str
    message: str
    # Whether the host proved the cleanup after the failed provision (the cleanup host task
    # succeeded with proof). Only then are the claims freed; otherwise the slots (slice) or the
    # node (bare metal) are quarantined as `provision_cleanup_unconfirmed`. Defaults to the
    # safe side.
    cleanup_proven: bool = False
    # Why the cleanup is not proven (error type and message), for the quarantine's records.
    cleanup_error: str = ""
    # GPUs the proven cleanup found unhealthy: their slots are quarantined, the rest freed.
    unhealthy_gpus: list[UnhealthyGpu] = field(default_factory=list)
    # The phases the failed host task went through, the failed one last
    # (docs/lifecycles/allocation.md#task-timeline).
    phases: list[HostPhase] = field(default_factory=list)


@dataclass
class BeginReleaseInput:
    allocation_id: str
    workflow_id: str
    actor: str
    reason: str
    task_id: str
    # False: only record a host cleanup task (after a failed provision), no state change.
    transition: bool = True


@dataclass
class ReleasePlan:
    task_id: str
    task_kind: str
    username: str
    # What the release ends before its host task: live terminal sessions
    # (docs/lifecycles/terminal-session.md) and storage attachments not yet detached (§7), counted
    # in the transaction that made the allocation `releasing` (both opens hold its row and need it
    # `active`, so none opens after). None: a plan from an older build (in recorded histories),
    # whose release ran both steps.
    live_terminal_sessions: int | None = None
    storage_attachments: int | None = None


@dataclass
class FinishReleaseInput:
    allocation_id: str
    task_id: str
    result: HostReleaseResult | None
    error_type: str | None
    error_message: str | None
    transition: bool = True
    # Without a result: the phases the failed host task went through
    # (docs/lifecycles/allocation.md#task-timeline).
    phases: list[HostPhase] = field(default_factory=list)
    # Issue 37, fence first: `fenced` records the host release that fenced the tenant (its task
    # outcome) and stops billing, without a transition (storage is detached next);
    # `task_recorded` is the transition that follows, whose host task is recorded already.
    fenced: bool = False
    task_recorded: bool = False


@dataclass
class DetachInput:
    allocation_id: str
    actor: str
    reason: str
