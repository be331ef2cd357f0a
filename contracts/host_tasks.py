"""The contract between control-plane workflows and node agents: activity names (which are also
the `node_tasks.kind` shown on the timeline), typed inputs and results, progress phases, and the
error types a host reports. Workflows import this module; agents implement it."""

# Annotations here are evaluated on purpose: see contracts/allocation.py.

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from temporalio.exceptions import ActivityError, ApplicationError

from contracts.terminal_session import TERMINAL_TASK_SUMMARIES

# Allocation shapes as host tasks carry them (`shape`); the SKU catalog's shapes (schema) use the
# same strings.
SHAPE_BAREMETAL = "baremetal"
SHAPE_GPU_SLICE = "gpu_slice"

# Activity names on the node's queue.
SLICE_VM_PROVISION = "slice.vm_provision"
SLICE_VM_RELEASE = "slice.vm_release"
BAREMETAL_PROVISION_USER = "allocation.provision_user"
BAREMETAL_DEPROVISION_USER = "allocation.deprovision_user"
BAREMETAL_REVOKE_USER = "allocation.revoke_user"
# Node maintenance for decommission (docs/lifecycles/decommission.md#node-tasks,
# docs/lifecycles/node.md node.drain / node.uninstall).
NODE_GPU_SCRUB = "node.gpu_scrub"
NODE_STORAGE_CLEANUP = "node.storage_cleanup"
NODE_VALIDATE_CLEAN = "node.validate_clean"
NODE_DRAIN = "node.drain"
NODE_UNDRAIN = "node.undrain"
NODE_UNINSTALL = "node.uninstall"
NODE_HW_SYNC_RESEED = "node.hw_sync_reseed"
# Storage attachments (docs/lifecycles/storage-attachment.md; their inputs and results are in
# contracts/storage.py).
STORAGE_MOUNT = "storage.mount"
STORAGE_UNMOUNT = "storage.unmount"

# Progress of a running host task (docs/lifecycles/allocation.md#task-timeline:
# node_task_dispatched, running with live phases): the agent signals the workflow that scheduled the
# task when an attempt starts and when its phases change; the workflow records it with the local
# activity RECORD_TASK_PROGRESS.
HOST_TASK_PROGRESS_SIGNAL = "host_task_progress"
RECORD_TASK_PROGRESS = "node_task.record_progress"

TASK_SUMMARIES = {
    SLICE_VM_PROVISION: "Creating GPU slice VM",
    SLICE_VM_RELEASE: "Releasing GPU slice VM",
    BAREMETAL_PROVISION_USER: "Granting bare-metal access",
    BAREMETAL_DEPROVISION_USER: "Revoking bare-metal access and cleaning the node",
    BAREMETAL_REVOKE_USER: "Revoking bare-metal access (account and data kept)",
    NODE_GPU_SCRUB: "Scrubbing GPU memory",
    NODE_STORAGE_CLEANUP: "Cleaning node storage",
    NODE_VALIDATE_CLEAN: "Checking the node for tenant residue",
    NODE_DRAIN: "Draining the node",
    NODE_UNDRAIN: "Returning the node to service",
    NODE_UNINSTALL: "Removing the node agent",
    NODE_HW_SYNC_RESEED: "Re-seeding MAAS hardware sync",
    # Terminal sessions (contracts/terminal_session.py).
    **TERMINAL_TASK_SUMMARIES,
    STORAGE_MOUNT: "Mounting a storage namespace",
    STORAGE_UNMOUNT: "Unmounting a storage namespace",
}


class HostErrorType(StrEnum):
    """`ApplicationError.type` values raised by host activities
    (docs/lifecycles/allocation.md#failures-and-recommended-actions failure table)."""

    IMAGE_ERROR = "image_error"  # download failed or sha256 mismatch: non-retryable
    VFIO_ERROR = "vfio_error"  # VFIO bind required but host wrong: non-retryable
    READINESS_TIMEOUT = "readiness_timeout"  # SSH / guest readiness marker never appeared
    LEASE_CONFLICT = "lease_conflict"  # another lease holds the resource: retried, then failed
    RELEASE_ERROR = "release_error"  # cleanup step failed: retried, then release_failed
    INVALID_SPEC = "invalid_spec"
    NODE_DRAINING = "node_draining"  # node.drain ran: no new tenant work on this node
    UNSUPPORTED = "unsupported"  # the node cannot do this yet (e.g. Weka cleanup): non-retryable
    UNSAFE_PATH = "unsafe_path"  # a path leaves its configured root or is a symlink: non-retryable
    MAINTENANCE_ERROR = "maintenance_error"  # a maintenance step failed: retried, then failed
    STORAGE_ERROR = "storage_error"  # a mount or unmount step failed: retried, then failed


NON_RETRYABLE_HOST_ERRORS = frozenset(
    {
        HostErrorType.IMAGE_ERROR,
        HostErrorType.VFIO_ERROR,
        HostErrorType.READINESS_TIMEOUT,
        HostErrorType.INVALID_SPEC,
        HostErrorType.NODE_DRAINING,
    }
)

# Maintenance activities add their own non-retryable types to the host ones.
NON_RETRYABLE_MAINTENANCE_ERRORS = NON_RETRYABLE_HOST_ERRORS | frozenset(
    {HostErrorType.UNSUPPORTED, HostErrorType.UNSAFE_PATH}
)


@dataclass
class GpuAssignment:
    pci_address: str
    numa_node: int
    gpu_index: int


@dataclass
class HostPhase:
    """One progress step; heartbeats carry the list so far, results carry the whole list."""

    phase: str
    status: str  # "started" | "succeeded" | "failed"
    at: str  # ISO-8601 UTC
    message: str = ""
    # The Temporal attempt of the host activity that went through this phase (0: not reported,
    # as in results recorded before attempts were).
    attempt: int = 0

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "HostPhase":
        """From a phase decoded without its type (an activity failure's details)."""
        return cls(
            phase=str(value.get("phase", "")),
            status=str(value.get("status", "")),
            at=str(value.get("at", "")),
            message=str(value.get("message") or ""),
            attempt=int(value.get("attempt") or 0),
        )


@dataclass
class HostTaskProgress:
    """HOST_TASK_PROGRESS_SIGNAL's payload: one attempt of a host task so far."""

    task_id: str
    attempt: int
    started_at: str  # ISO-8601 UTC: when this attempt started on the node
    phases: list[HostPhase] = field(default_factory=list)


def phases_of_failure(error: BaseException) -> list[HostPhase]:
    """The phases a failed host activity went through: the agent raises its ApplicationError
    with the phase list as the first detail (agent/host_activities.py); empty for any other
    failure (a timeout, an agent that never ran the task). Pure: safe in workflow code."""
    cause = error.cause if isinstance(error, ActivityError) else error
    if not isinstance(cause, ApplicationError) or not cause.details:
        return []
    first = cause.details[0]
    if not isinstance(first, list):
        return []
    return [
        p if isinstance(p, HostPhase) else HostPhase.from_json(p)
        for p in first
        if isinstance(p, HostPhase | dict)
    ]


@dataclass
class HostProvisionInput:
    task_id: str
    allocation_id: str
    node_id: str
    shape: str  # "baremetal" | "gpu_slice"
    username: str
    ssh_public_keys: list[str]  # secret-ish: only ever inside encrypted payloads
    gpus: list[GpuAssignment] = field(default_factory=list)
    vcpus: int = 0
    memory_mb: int = 0
    image: str = ""
    image_sha256: str = ""
    # The allocation's tenant VLAN on the node's uplink; None: an isolated per-allocation bridge.
    vlan_id: int | None = None


@dataclass
class HostProvisionResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    # What the tenant connects to (host/IP); sanitised, never credentials.
    connect_host: str = ""
    adopted_existing: bool = False


@dataclass
class HostReleaseInput:
    task_id: str
    allocation_id: str
    node_id: str
    shape: str
    username: str
    force: bool = False  # admin force-release: skip the graceful shutdown wait


@dataclass
class UnhealthyGpu:
    """A GPU that failed its health check after release: its slot is quarantined, not freed."""

    pci_address: str
    reason: str


@dataclass
class HostReleaseResult:
    """docs/lifecycles/allocation.md: result {released, hard_stopped, wiped, leases_released}."""

    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    released: bool
    hard_stopped: bool
    wiped: bool
    leases_released: bool
    # Released GPUs whose health check failed (slices only); empty when all are healthy.
    unhealthy_gpus: list[UnhealthyGpu] = field(default_factory=list)

    @property
    def cleanup_proven(self) -> bool:
        return self.released and self.wiped and self.leases_released


# --------------------------------------------------------------------------- node maintenance
# Every string in these results is sanitised by the agent (agent/maintenance.py): no secrets,
# paths only inside the configured roots (as seen from the node's "/"), messages truncated.

STORAGE_SCOPE_LOCAL_SCRATCH = "local_scratch"
STORAGE_SCOPE_WEKA = "weka"


@dataclass
class NodeMaintenanceInput:
    """Input of node.gpu_scrub, node.validate_clean, node.drain and node.uninstall."""

    task_id: str
    node_id: str
    reason: str = ""  # free text for logs of the control plane; never acted on by the agent


@dataclass
class StorageCleanupInput:
    task_id: str
    node_id: str
    scope: str = STORAGE_SCOPE_LOCAL_SCRATCH  # "local_scratch" | "weka"
    # Configured scratch roots to clean (each must be one of them); empty: all of them.
    roots: list[str] = field(default_factory=list)


@dataclass
class HwSyncReseedInput:
    task_id: str
    node_id: str
    interval_minutes: int = 15  # the hardware-sync timer's period (1..1440)


@dataclass
class GpuScrubOutcome:
    gpu: str  # "0", "1", ... or "all" when the scrubber works on the whole node
    scrubbed: bool
    message: str = ""


@dataclass
class GpuScrubResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    gpus: list[GpuScrubOutcome] = field(default_factory=list)

    @property
    def all_scrubbed(self) -> bool:
        return bool(self.gpus) and all(g.scrubbed for g in self.gpus)


@dataclass
class ScratchRootOutcome:
    root: str  # the configured root, as a path on the node ("/scratch")
    present: bool
    entries_removed: int = 0
    entries_kept: int = 0  # not tenant-owned in a root cleaned only of tenant files


@dataclass
class StorageCleanupResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    scope: str
    roots: list[ScratchRootOutcome] = field(default_factory=list)


@dataclass
class CleanCheck:
    name: str  # "tenant_users" | "tenant_processes" | "tenant_mounts" | "gpu_memory"
    passed: bool
    reason: str = ""


@dataclass
class ValidateCleanResult:
    """A failed check is a result, not an error: the decommission workflow decides (quarantine)."""

    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    clean: bool
    checks: list[CleanCheck] = field(default_factory=list)


@dataclass
class DrainResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    draining: bool
    already_draining: bool = False
    running_tasks: int = 0


@dataclass
class UninstallResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    removed: list[str] = field(default_factory=list)  # agent-owned paths that were removed
    absent: list[str] = field(default_factory=list)  # agent-owned paths already gone


@dataclass
class HwSyncReseedResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    units_written: list[str] = field(default_factory=list)  # changed unit files
    units_unchanged: list[str] = field(default_factory=list)
    credentials_present: bool = False
    restarted: bool = False


@dataclass
class HostRevokeResult:
    """allocation.revoke_user: login disabled and keys removed; the account and home stay."""

    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    revoked: bool  # False: there was no such user (nothing to revoke)
    sessions_terminated: int = 0
