"""`SimulatedHost`: a node's host in memory, behind the same HostBackend seam a libvirt backend
uses. It keeps what a real host keeps between tasks (defined domains, GPU leases, tenant users),
so the control plane meets the real host's behaviour: a provision re-run after a crash adopts what
the first attempt built, a release of something already gone succeeds, two allocations cannot
lease the same GPU. Phases take configurable time, and faults can be armed (sim.faults).

Thread-safe: the agent runs each task on its own thread.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict, Unpack

from agent.backend import (
    HARD_STOP_PHASE,
    HostCancelled,
    HostError,
    PhaseStatus,
    Progress,
    ProvisionOutcome,
    ReleaseOutcome,
    RevokeOutcome,
)
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    BAREMETAL_REVOKE_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
    HostProvisionInput,
    HostReleaseInput,
    UnhealthyGpu,
)
from sim.config import SimHostConfig
from sim.faults import GRACEFUL_SHUTDOWN_FAILS, HANG, FaultInjector

_ERROR_KINDS = frozenset({*(e.value for e in HostErrorType), HANG})
_SHUTDOWN_KINDS = frozenset({GRACEFUL_SHUTDOWN_FAILS})


def connect_host_for(key: str) -> str:
    """A stable private address "10.x.y.z" for an allocation id (slice) or a hostname (bare
    metal); z avoids .0 and .255."""
    digest = hashlib.sha256(key.encode()).digest()
    return f"10.{digest[0]}.{digest[1]}.{1 + digest[2] % 254}"


def key_fingerprint(public_key: str) -> str:
    """What the simulator remembers of a key: a fingerprint, never the key itself."""
    return "SHA256:" + hashlib.sha256(public_key.strip().encode()).hexdigest()[:43]


@dataclass(frozen=True)
class SimDomain:
    allocation_id: str
    name: str
    pci_addresses: tuple[str, ...]
    state: str  # "defined" | "running" | "shutoff"
    connect_host: str
    guest_ready: bool = False
    # virtiofs filesystems given to the guest (agent/storage_mounts.py): tag -> host directory.
    filesystems: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SimUser:
    allocation_id: str
    username: str
    key_fingerprints: tuple[str, ...] = ()
    sessions: int = 0
    access_verified: bool = False


class _DomainChanges(TypedDict, total=False):
    """The SimDomain fields a provisioning phase updates in place."""

    guest_ready: bool


class _UserChanges(TypedDict, total=False):
    """The SimUser fields a provisioning phase updates in place."""

    key_fingerprints: tuple[str, ...]
    access_verified: bool


@dataclass(frozen=True)
class CancelledPhase:
    activity: str
    allocation_id: str
    phase: str


class SimulatedHost:
    def __init__(
        self,
        node_id: str,
        *,
        hostname: str | None = None,
        config: SimHostConfig | None = None,
        seed: int | None = None,
    ) -> None:
        self.node_id = str(node_id)
        self.hostname = hostname or f"sim-{self.node_id[:8]}"
        self.config = config or SimHostConfig()
        self.faults = FaultInjector()
        for spec in self.config.faults:
            self.faults.add(spec)
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._domains: dict[str, SimDomain] = {}
        self._unhealthy_after_release: dict[str, str] = {}
        self._users: dict[str, SimUser] = {}
        self._gpu_leases: dict[str, str] = {}  # pci address -> allocation id
        self._node_lease: str | None = None  # bare metal: the allocation holding the node
        self._images: set[str] = set()
        self._attempts: dict[tuple[str, str], int] = {}
        self._cancelled: list[CancelledPhase] = []

    # ------------------------------------------------------------------ inspection (tests, demo)

    def domain(self, allocation_id: str) -> SimDomain | None:
        with self._lock:
            return self._domains.get(allocation_id)

    def user(self, allocation_id: str) -> SimUser | None:
        with self._lock:
            return self._users.get(allocation_id)

    @property
    def domains(self) -> dict[str, SimDomain]:
        with self._lock:
            return dict(self._domains)

    @property
    def users(self) -> dict[str, SimUser]:
        with self._lock:
            return dict(self._users)

    @property
    def gpu_leases(self) -> dict[str, str]:
        with self._lock:
            return dict(self._gpu_leases)

    @property
    def cancelled_phases(self) -> list[CancelledPhase]:
        with self._lock:
            return list(self._cancelled)

    def attempts(self, activity: str, allocation_id: str | None = None) -> int:
        """How many times a task of this kind (for this allocation) started on this host."""
        with self._lock:
            return sum(
                n
                for (act, alloc), n in self._attempts.items()
                if act == activity and allocation_id in (None, alloc)
            )

    # ------------------------------------------------------------------ HostBackend

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Progress) -> ProvisionOutcome:
        run = _Task(self, SLICE_VM_PROVISION, spec.allocation_id, progress)
        connect_host = connect_host_for(spec.allocation_id)
        pci = tuple(gpu.pci_address.lower() for gpu in spec.gpus)
        adopted = False

        def prepare_image() -> str:
            with self._lock:
                cached = spec.image in self._images
                self._images.add(spec.image)
            return f"image {spec.image or 'default'} {'reused' if cached else 'downloaded'}"

        def define_domain() -> str:
            nonlocal adopted
            with self._lock:
                if spec.allocation_id in self._domains:
                    adopted = True
                    return "adopted the domain an earlier attempt defined"
                holders = {self._gpu_leases[a] for a in pci if a in self._gpu_leases}
                holders.discard(spec.allocation_id)
                if holders:
                    raise HostError(
                        HostErrorType.LEASE_CONFLICT,
                        "a requested GPU is leased by another allocation",
                    )
                for address in pci:
                    self._gpu_leases[address] = spec.allocation_id
                self._domains[spec.allocation_id] = SimDomain(
                    spec.allocation_id, f"alloc-{spec.allocation_id}", pci, "defined", connect_host
                )
            return f"domain defined with {len(pci)} GPU(s) passed through"

        def start_vm() -> str:
            return (
                "already running"
                if self._set_domain_state(spec.allocation_id, "running")
                else "started"
            )

        def reach_guest() -> str:
            self._update_domain(spec.allocation_id, guest_ready=True)
            return f"ssh reachable at {connect_host}"

        run.phase("image_prepared", prepare_image)
        run.phase(
            "cloud_init_seed_generated",
            lambda: f"seed with {len(spec.ssh_public_keys)} authorized key(s)",
        )
        run.phase("domain_defined", define_domain)
        run.phase("vm_started", start_vm)
        run.phase("guest_reachable", reach_guest)
        run.phase("driver_ready", lambda: f"driver sees {len(pci)} GPU(s)")
        return ProvisionOutcome(connect_host=connect_host, adopted_existing=adopted)

    def release_slice_vm(self, spec: HostReleaseInput, progress: Progress) -> ReleaseOutcome:
        run = _Task(self, SLICE_VM_RELEASE, spec.allocation_id, progress)
        hard_stopped = False
        domain = self.domain(spec.allocation_id)  # its GPUs are checked once it is gone
        released_gpus = domain.pci_addresses if domain is not None else ()

        def hard_stop() -> str:
            nonlocal hard_stopped
            hard_stopped = True
            return (
                "destroyed"
                if self._set_domain_state(spec.allocation_id, "shutoff") is not None
                else "no domain"
            )

        if spec.force:
            run.phase(HARD_STOP_PHASE, hard_stop)
        else:
            shutdown_ok = run.phase("graceful_shutdown", lambda: self._graceful_shutdown(run))
            if not shutdown_ok:
                run.phase(HARD_STOP_PHASE, hard_stop)
        unhealthy: list[UnhealthyGpu] = []

        def check_gpus() -> str:
            with self._lock:
                for address in released_gpus:
                    reason = self._unhealthy_after_release.pop(address, None)
                    if reason is not None:
                        unhealthy.append(UnhealthyGpu(address, reason))
            return f"{len(released_gpus) - len(unhealthy)} healthy, {len(unhealthy)} quarantined"

        run.phase("domain_destroyed", lambda: self._destroy(spec.allocation_id))
        run.phase("domain_undefined", lambda: self._undefine(spec.allocation_id))
        run.phase("leases_wiped", lambda: self._wipe_leases(spec.allocation_id))
        run.phase("gpus_health_checked", check_gpus)
        return ReleaseOutcome(
            released=True,
            hard_stopped=hard_stopped,
            wiped=True,
            leases_released=True,
            unhealthy_gpus=tuple(unhealthy),
        )

    def fail_gpu_health_after_release(
        self, pci_address: str, reason: str = "PCI config space reads all-ones"
    ) -> None:
        """The next release of a VM holding this GPU finds it unhealthy (e.g. a failed FLR)."""
        with self._lock:
            self._unhealthy_after_release[pci_address] = reason

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome:
        run = _Task(self, BAREMETAL_PROVISION_USER, spec.allocation_id, progress)
        adopted = False

        def create_user() -> str:
            nonlocal adopted
            with self._lock:
                if spec.allocation_id in self._users:
                    adopted = True
                    return "adopted the user an earlier attempt created"
                if self._node_lease not in (None, spec.allocation_id):
                    raise HostError(
                        HostErrorType.LEASE_CONFLICT, "the node is leased by another allocation"
                    )
                self._node_lease = spec.allocation_id
                self._users[spec.allocation_id] = SimUser(spec.allocation_id, spec.username)
            return f"user {spec.username} created"

        def install_keys() -> str:
            fingerprints = tuple(key_fingerprint(k) for k in spec.ssh_public_keys)
            self._update_user(spec.allocation_id, key_fingerprints=fingerprints)
            return f"{len(fingerprints)} authorized key(s) installed"

        def verify_access() -> str:
            self._update_user(spec.allocation_id, access_verified=True)
            return f"login verified on {self.hostname}"

        run.phase("user_created", create_user)
        run.phase("ssh_keys_installed", install_keys)
        run.phase("access_verified", verify_access)
        return ProvisionOutcome(
            connect_host=connect_host_for(self.hostname), adopted_existing=adopted
        )

    def deprovision_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> ReleaseOutcome:
        run = _Task(self, BAREMETAL_DEPROVISION_USER, spec.allocation_id, progress)

        def terminate_sessions() -> str:
            with self._lock:
                user = self._users.get(spec.allocation_id)
                if user is None:
                    return "no user (already removed)"
                self._users[spec.allocation_id] = replace(user, sessions=0)
                return f"{user.sessions} session(s) terminated"

        def remove_user() -> str:
            with self._lock:
                gone = self._users.pop(spec.allocation_id, None) is None
            return "already removed" if gone else f"user {spec.username} removed"

        def scrub_gpus() -> str:
            with self._lock:
                if self._node_lease == spec.allocation_id:
                    self._node_lease = None
            return "GPU memory scrubbed, node lease released"

        run.phase("sessions_terminated", terminate_sessions)
        run.phase("user_removed", remove_user)
        run.phase("home_wiped", lambda: "home directory wiped")
        run.phase("gpu_memory_scrubbed", scrub_gpus)
        return ReleaseOutcome(released=True, hard_stopped=False, wiped=True, leases_released=True)

    def revoke_baremetal_user(self, spec: HostReleaseInput, progress: Progress) -> RevokeOutcome:
        run = _Task(self, BAREMETAL_REVOKE_USER, spec.allocation_id, progress)
        existed = self.user(spec.allocation_id) is not None
        sessions = 0

        def disable_login() -> str:
            with self._lock:
                user = self._users.get(spec.allocation_id)
                if user is None:
                    return "no user"
                self._users[spec.allocation_id] = replace(user, key_fingerprints=())
            return "login disabled, authorized keys removed"

        def terminate_sessions() -> str:
            nonlocal sessions
            with self._lock:
                user = self._users.get(spec.allocation_id)
                if user is None:
                    return "no sessions"
                sessions = user.sessions
                self._users[spec.allocation_id] = replace(user, sessions=0)
            return f"{sessions} session(s) terminated"

        run.phase("login_disabled", disable_login)
        run.phase("sessions_terminated", terminate_sessions)
        return RevokeOutcome(revoked=existed, sessions_terminated=sessions)

    # ------------------------------------------------------------------ state helpers

    def _graceful_shutdown(self, run: _Task) -> str:
        if run.take_fault(_SHUTDOWN_KINDS, "graceful_shutdown") is not None:
            raise _GracefulShutdownFailed("guest ignored the shutdown request")
        state = self._set_domain_state(run.allocation_id, "shutoff")
        return "no domain (already released)" if state is None else "guest shut down"

    # ------------------------------------------------------------------ guest filesystems

    def attach_filesystem(
        self, allocation_id: str, source_dir: Path, tag: str, *, read_only: bool
    ) -> str:
        """What LibvirtSliceBackend.attach_filesystem does, on the simulated domain."""
        with self._lock:
            domain = self._domains.get(allocation_id)
            if domain is None:
                raise HostError(
                    HostErrorType.INVALID_SPEC, f"allocation {allocation_id} has no VM on this node"
                )
            if tag in dict(domain.filesystems):
                return f"virtiofs {tag} already attached"
            self._domains[allocation_id] = replace(
                domain, filesystems=(*domain.filesystems, (tag, str(source_dir)))
            )
        return f"virtiofs {tag} attached (simulated VM{', read-only' if read_only else ''})"

    def detach_filesystem(self, allocation_id: str, tag: str) -> str:
        with self._lock:
            domain = self._domains.get(allocation_id)
            if domain is None:
                return "no VM: nothing attached"
            if tag not in dict(domain.filesystems):
                return f"virtiofs {tag} was not attached"
            self._domains[allocation_id] = replace(
                domain, filesystems=tuple(f for f in domain.filesystems if f[0] != tag)
            )
        return f"virtiofs {tag} detached (simulated VM)"

    def _set_domain_state(self, allocation_id: str, state: str) -> bool | None:
        """Set a domain's state; answers whether it already was in it (None: no such domain)."""
        with self._lock:
            domain = self._domains.get(allocation_id)
            if domain is None:
                return None
            self._domains[allocation_id] = replace(domain, state=state)
            return domain.state == state

    def _update_domain(self, allocation_id: str, **changes: Unpack[_DomainChanges]) -> None:
        with self._lock:
            domain = self._domains.get(allocation_id)
            if domain is not None:
                self._domains[allocation_id] = replace(domain, **changes)

    def _update_user(self, allocation_id: str, **changes: Unpack[_UserChanges]) -> None:
        with self._lock:
            user = self._users.get(allocation_id)
            if user is not None:
                self._users[allocation_id] = replace(user, **changes)

    def _destroy(self, allocation_id: str) -> str:
        state = self._set_domain_state(allocation_id, "shutoff")
        return "no domain (already released)" if state is None else "domain destroyed"

    def _undefine(self, allocation_id: str) -> str:
        with self._lock:
            gone = self._domains.pop(allocation_id, None) is None
        return "already undefined" if gone else "domain undefined"

    def _wipe_leases(self, allocation_id: str) -> str:
        with self._lock:
            held = [a for a, owner in self._gpu_leases.items() if owner == allocation_id]
            for address in held:
                del self._gpu_leases[address]
        return f"{len(held)} GPU lease(s) released, scratch disks wiped"

    def _count_attempt(self, activity: str, allocation_id: str) -> None:
        with self._lock:
            key = (activity, allocation_id)
            self._attempts[key] = self._attempts.get(key, 0) + 1

    def _record_cancel(self, cancelled: CancelledPhase) -> None:
        with self._lock:
            self._cancelled.append(cancelled)

    def _delay(self, phase: str) -> float:
        with self._lock:
            return self.config.delay_for(phase, self._rng)


class _GracefulShutdownFailed(Exception):
    """The guest did not shut down; the release continues with a hard stop."""


class _Task:
    """One host task on the simulated host: runs its phases with delays, faults and progress."""

    def __init__(
        self, host: SimulatedHost, activity: str, allocation_id: str, progress: Progress
    ) -> None:
        self.host = host
        self.activity = activity
        self.allocation_id = allocation_id
        self.progress = progress
        host._count_attempt(activity, allocation_id)

    def take_fault(self, kinds: frozenset[str], phase: str) -> object | None:
        return self.host.faults.take(self.activity, phase, self.allocation_id, kinds)

    def phase(self, name: str, work: Callable[[], str]) -> bool:
        """Run one phase; False when a graceful shutdown failed (the caller hard-stops)."""
        self.progress(name, PhaseStatus.STARTED)
        try:
            delay = self.host._delay(name)
            if delay > 0:
                self.progress.wait(delay)
            self._strike(name)
            message = work()
        except _GracefulShutdownFailed as err:
            self.progress(name, PhaseStatus.FAILED, str(err))
            return False
        except HostCancelled:
            self.host._record_cancel(CancelledPhase(self.activity, self.allocation_id, name))
            raise
        self.progress(name, PhaseStatus.SUCCEEDED, message)
        return True

    def _strike(self, phase: str) -> None:
        fault = self.host.faults.take(self.activity, phase, self.allocation_id, _ERROR_KINDS)
        if fault is None:
            return
        if fault.spec.kind == HANG:
            if not fault.spec.heartbeats:
                self.progress.suspend_heartbeats()
            self.progress.wait(None)  # until cancelled: raises HostCancelled
            raise HostCancelled(f"{phase} hung until cancelled")
        raise HostError(HostErrorType(fault.spec.kind), fault.message)
