"""Fault injection for the simulated host: arm a fault, and the next matching host task fails (or
hangs) at the chosen phase. Thread-safe: host tasks run on a thread pool.

    host.faults.inject(SLICE_VM_PROVISION, HostErrorType.IMAGE_ERROR)          # sha mismatch
    host.faults.inject(SLICE_VM_PROVISION, HostErrorType.LEASE_CONFLICT, times=2)  # then success
    host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
    host.faults.fail_graceful_shutdown()          # release succeeds with hard_stopped=True
    host.faults.hang(SLICE_VM_PROVISION)          # phase blocks until cancelled, heartbeats stop

The same faults can be given as JSON (FaultSpec.from_dict), e.g. in GPUCLOUD_SIM_FAULTS:
    [{"activity": "slice.vm_provision", "kind": "vfio_error", "times": 1}]
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from typing import Any

from agent.backend import (
    BAREMETAL_DEPROVISION_PHASES,
    BAREMETAL_PROVISION_PHASES,
    HARD_STOP_PHASE,
    SLICE_PROVISION_PHASES,
    SLICE_RELEASE_PHASES,
)
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
)

# Fault kinds beyond the HostErrorType values.
HANG = "hang"  # the phase blocks until the task is cancelled
GRACEFUL_SHUTDOWN_FAILS = "graceful_shutdown_fails"  # release falls back to a hard stop
FAULT_KINDS = frozenset({*(e.value for e in HostErrorType), HANG, GRACEFUL_SHUTDOWN_FAILS})

PHASES_BY_ACTIVITY: dict[str, tuple[str, ...]] = {
    SLICE_VM_PROVISION: SLICE_PROVISION_PHASES,
    SLICE_VM_RELEASE: (*SLICE_RELEASE_PHASES, HARD_STOP_PHASE),
    BAREMETAL_PROVISION_USER: BAREMETAL_PROVISION_PHASES,
    BAREMETAL_DEPROVISION_USER: BAREMETAL_DEPROVISION_PHASES,
}

# Where each failure happens on a real host, when the fault does not name a phase.
_DEFAULT_PHASE: dict[tuple[str, str], str] = {
    (SLICE_VM_PROVISION, HostErrorType.IMAGE_ERROR): "image_prepared",
    (SLICE_VM_PROVISION, HostErrorType.LEASE_CONFLICT): "domain_defined",
    (SLICE_VM_PROVISION, HostErrorType.VFIO_ERROR): "vm_started",  # managed hostdev binds on start
    (SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT): "guest_reachable",
    (SLICE_VM_PROVISION, HANG): "guest_reachable",
    (SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR): "domain_destroyed",
    (BAREMETAL_PROVISION_USER, HostErrorType.READINESS_TIMEOUT): "access_verified",
    (BAREMETAL_DEPROVISION_USER, HostErrorType.RELEASE_ERROR): "user_removed",
}

DEFAULT_MESSAGES: dict[str, str] = {
    HostErrorType.IMAGE_ERROR: "image sha256 does not match the catalog",
    HostErrorType.VFIO_ERROR: "a GPU could not be bound to vfio-pci (IOMMU off or device busy)",
    HostErrorType.READINESS_TIMEOUT: "guest did not become reachable in time",
    HostErrorType.LEASE_CONFLICT: "a GPU lease is held by another allocation",
    HostErrorType.RELEASE_ERROR: "cleanup step failed",
    HostErrorType.INVALID_SPEC: "host rejected the spec",
}


@dataclass
class FaultSpec:
    activity: str
    kind: str  # a HostErrorType value, HANG or GRACEFUL_SHUTDOWN_FAILS
    times: int | None = 1  # None: every matching task, forever
    phase: str | None = None  # None: where this failure happens on a real host
    allocation_id: str | None = None  # None: any allocation
    node_id: str | None = None  # None: every node (used when one config serves a fleet)
    message: str | None = None
    heartbeats: bool = False  # HANG only: keep heartbeating (a hung phase, not a lost agent)

    def __post_init__(self) -> None:
        if self.activity not in PHASES_BY_ACTIVITY:
            raise ValueError(f"unknown activity {self.activity!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.kind == GRACEFUL_SHUTDOWN_FAILS and self.activity != SLICE_VM_RELEASE:
            raise ValueError("graceful_shutdown_fails applies to slice.vm_release only")
        phases = PHASES_BY_ACTIVITY[self.activity]
        if self.phase is None:
            self.phase = _DEFAULT_PHASE.get((self.activity, self.kind), phases[0])
        if self.phase not in phases:
            raise ValueError(f"{self.activity} has no phase {self.phase!r}")
        if self.times is not None and self.times < 1:
            raise ValueError("times must be at least 1 (or null for always)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultSpec:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(sorted(unknown))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Fault:
    """An armed fault; `fired` counts how often it has struck."""

    spec: FaultSpec
    fired: int = 0

    @property
    def remaining(self) -> int | None:
        return None if self.spec.times is None else max(0, self.spec.times - self.fired)

    @property
    def message(self) -> str:
        return self.spec.message or DEFAULT_MESSAGES.get(self.spec.kind, self.spec.kind)


class FaultInjector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[Fault] = []

    def add(self, spec: FaultSpec) -> Fault:
        fault = Fault(spec)
        with self._lock:
            self._armed.append(fault)
        return fault

    def inject(
        self,
        activity: str,
        error_type: HostErrorType,
        *,
        times: int | None = 1,
        phase: str | None = None,
        allocation_id: str | None = None,
        message: str | None = None,
    ) -> Fault:
        """The next `times` matching tasks raise HostError(error_type) at `phase`."""
        return self.add(
            FaultSpec(
                activity,
                HostErrorType(error_type).value,
                times,
                phase,
                allocation_id,
                message=message,
            )
        )

    def hang(
        self,
        activity: str,
        *,
        phase: str | None = None,
        times: int | None = 1,
        allocation_id: str | None = None,
        heartbeats: bool = False,
    ) -> Fault:
        """The phase blocks until the task is cancelled. Without `heartbeats` the agent also
        stops heartbeating, so the control plane's heartbeat timeout fires."""
        return self.add(
            FaultSpec(activity, HANG, times, phase, allocation_id, heartbeats=heartbeats)
        )

    def fail_graceful_shutdown(
        self, *, times: int | None = 1, allocation_id: str | None = None
    ) -> Fault:
        """The guest ignores the shutdown request; release hard-destroys it (hard_stopped)."""
        return self.add(
            FaultSpec(
                SLICE_VM_RELEASE, GRACEFUL_SHUTDOWN_FAILS, times, "graceful_shutdown", allocation_id
            )
        )

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    @property
    def armed(self) -> list[Fault]:
        with self._lock:
            return [f for f in self._armed if f.remaining != 0]

    def take(
        self, activity: str, phase: str, allocation_id: str, kinds: frozenset[str]
    ) -> Fault | None:
        """Consume one strike of the first armed fault matching this task and phase."""
        with self._lock:
            for fault in self._armed:
                spec = fault.spec
                if (
                    spec.activity == activity
                    and spec.phase == phase
                    and spec.kind in kinds
                    and spec.allocation_id in (None, allocation_id)
                    and fault.remaining != 0
                ):
                    fault.fired += 1
                    return fault
        return None
