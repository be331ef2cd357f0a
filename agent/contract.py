"""The contract between control-plane workflows and node agents: activity names (which are also
the `node_tasks.kind` shown on the timeline), typed inputs and results, progress phases, and the
error types a host reports. Workflows import this module; agents implement it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# Activity names on the node's queue.
SLICE_VM_PROVISION = "slice.vm_provision"
SLICE_VM_RELEASE = "slice.vm_release"
BAREMETAL_PROVISION_USER = "allocation.provision_user"
BAREMETAL_DEPROVISION_USER = "allocation.deprovision_user"

TASK_SUMMARIES = {
    SLICE_VM_PROVISION: "Creating GPU slice VM",
    SLICE_VM_RELEASE: "Releasing GPU slice VM",
    BAREMETAL_PROVISION_USER: "Granting bare-metal access",
    BAREMETAL_DEPROVISION_USER: "Revoking bare-metal access and cleaning the node",
}


class HostErrorType(StrEnum):
    """`ApplicationError.type` values raised by host activities (seed 000 failure table)."""

    IMAGE_ERROR = "image_error"  # download failed or sha256 mismatch: non-retryable
    VFIO_ERROR = "vfio_error"  # VFIO bind required but host wrong: non-retryable
    READINESS_TIMEOUT = "readiness_timeout"  # SSH / guest readiness marker never appeared
    LEASE_CONFLICT = "lease_conflict"  # another lease holds the resource: retried, then failed
    RELEASE_ERROR = "release_error"  # cleanup step failed: retried, then release_failed
    INVALID_SPEC = "invalid_spec"


NON_RETRYABLE_HOST_ERRORS = frozenset(
    {
        HostErrorType.IMAGE_ERROR,
        HostErrorType.VFIO_ERROR,
        HostErrorType.READINESS_TIMEOUT,
        HostErrorType.INVALID_SPEC,
    }
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
class HostReleaseResult:
    """seed 000: result {released, hard_stopped, wiped, leases_released}."""

    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    released: bool
    hard_stopped: bool
    wiped: bool
    leases_released: bool

    @property
    def cleanup_proven(self) -> bool:
        return self.released and self.wiped and self.leases_released
