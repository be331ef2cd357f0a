"""The seam between the agent's Temporal activities and the machine they change.

A `HostBackend` does the host work (libvirt domains, VFIO, users, GPU scrubbing) and reports each
step through a `Progress`. Real backends (libvirt, pyroute2, useradd) and the simulator
(`sim.host.SimulatedHost`) implement the same protocol, so `HostActivities` never knows which one
it drives. Backends are plain blocking functions: the activities run them on a thread pool
(STYLE habit 6) and keep heartbeating from the event loop while they block.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput, UnhealthyGpu

# Phase names, in the order each activity runs them (docs/lifecycles/allocation.md#task-timeline
# timeline).
SLICE_PROVISION_PHASES = (
    "image_prepared",
    "cloud_init_seed_generated",
    "domain_defined",
    "vm_started",
    "guest_reachable",
    "driver_ready",
)
# "hard_stop" replaces (or follows a failed) "graceful_shutdown".
SLICE_RELEASE_PHASES = (
    "graceful_shutdown",
    "domain_destroyed",
    "domain_undefined",
    "leases_wiped",
    "gpus_health_checked",
)
HARD_STOP_PHASE = "hard_stop"
BAREMETAL_PROVISION_PHASES = ("user_created", "ssh_keys_installed", "access_verified")
BAREMETAL_REVOKE_PHASES = ("login_disabled", "sessions_terminated")
BAREMETAL_DEPROVISION_PHASES = (
    "sessions_terminated",
    "user_removed",
    "home_wiped",
    "gpu_memory_scrubbed",
)


class PhaseStatus(StrEnum):
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class HostError(Exception):
    """A classified host failure; the activity turns it into an ApplicationError of this type.

    The message ends up in Temporal (encrypted) and in the read models: never put SSH keys,
    cloud-init content or credentials in it.
    """

    def __init__(self, error_type: HostErrorType, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message


class HostCancelled(Exception):
    """Raised inside a backend when the activity was cancelled; it stops at a phase boundary."""


class Progress(Protocol):
    """What a backend gets to report progress and to notice cancellation.

    Call it as `progress(phase, PhaseStatus.STARTED)` before a step and with SUCCEEDED (or
    FAILED) after it. Starting a phase after the activity was cancelled raises HostCancelled, so a
    backend that only reports phases still stops at the next boundary.
    """

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None: ...

    @property
    def cancelled(self) -> bool: ...

    def wait(self, seconds: float | None) -> None:
        """Block for `seconds` (None: until cancelled); raises HostCancelled once cancelled."""
        ...

    def suspend_heartbeats(self) -> None:
        """Stop heartbeating this task: the control plane's heartbeat timeout then fires as if
        the agent had lost contact. Used by the simulator's hang fault."""
        ...


@dataclass(frozen=True)
class ProvisionOutcome:
    # Host or IP the tenant connects to; never a credential.
    connect_host: str
    # The VM or user already existed (a retried or re-run provision) and was taken over.
    adopted_existing: bool = False


@dataclass(frozen=True)
class ReleaseOutcome:
    released: bool
    hard_stopped: bool
    wiped: bool
    leases_released: bool
    unhealthy_gpus: tuple[UnhealthyGpu, ...] = ()


@dataclass(frozen=True)
class RevokeOutcome:
    revoked: bool
    sessions_terminated: int = 0


class HostBackend(Protocol):
    """Host work for one node. Methods block; they raise HostError for classified failures and
    HostCancelled when `progress` says the task was cancelled. Every method must be idempotent:
    a provision re-run adopts what an earlier attempt built, a release of what is already gone
    succeeds."""

    def provision_slice_vm(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome: ...

    def release_slice_vm(self, spec: HostReleaseInput, progress: Progress) -> ReleaseOutcome: ...

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome: ...

    def deprovision_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> ReleaseOutcome: ...

    def revoke_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> RevokeOutcome: ...
