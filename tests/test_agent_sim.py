"""The simulated host on its own (no Temporal): configuration, faults, determinism, threads."""

from __future__ import annotations

import json
import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.backend import HostCancelled, HostError, PhaseStatus
from contracts.host_tasks import (
    BAREMETAL_PROVISION_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    GpuAssignment,
    HostErrorType,
    HostProvisionInput,
    HostReleaseInput,
)
from sim.config import SimHostConfig
from sim.faults import HANG, FaultSpec
from sim.host import SimulatedHost, connect_host_for


class RecordingProgress:
    """A Progress for calling the backend directly; cancellable from another thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.heartbeats_suspended = False
        self._cancel = threading.Event()

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        if status == PhaseStatus.STARTED and self._cancel.is_set():
            raise HostCancelled(phase)
        self.events.append((phase, str(status)))

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, seconds: float | None) -> None:
        if self._cancel.wait(seconds):
            raise HostCancelled("cancelled")

    def suspend_heartbeats(self) -> None:
        self.heartbeats_suspended = True

    def cancel(self) -> None:
        self._cancel.set()


def slice_input(node_id: str, allocation_id: str, pci: list[str]) -> HostProvisionInput:
    return HostProvisionInput(
        task_id=str(uuid.uuid4()),
        allocation_id=allocation_id,
        node_id=node_id,
        shape="gpu_slice",
        username="ubuntu",
        ssh_public_keys=["ssh-ed25519 AAAAC3Nza tenant"],
        gpus=[GpuAssignment(address, 0, i) for i, address in enumerate(pci)],
    )


def slice_release(node_id: str, allocation_id: str) -> HostReleaseInput:
    return HostReleaseInput(str(uuid.uuid4()), allocation_id, node_id, "gpu_slice", "ubuntu")


def test_connect_host_is_deterministic_and_private() -> None:
    allocation = str(uuid.uuid4())
    address = connect_host_for(allocation)
    assert address == connect_host_for(allocation)
    octets = [int(o) for o in address.split(".")]
    assert octets[0] == 10
    assert all(0 <= o <= 255 for o in octets)
    assert 1 <= octets[3] <= 254


def test_config_from_env_reads_delays_jitter_and_faults() -> None:
    node = str(uuid.uuid4())
    other = str(uuid.uuid4())
    env = {
        "GPUCLOUD_SIM_PHASE_DELAY_S": json.dumps({"default": 0.5, "guest_reachable": 4}),
        "GPUCLOUD_SIM_PHASE_JITTER": "0.2",
        "GPUCLOUD_SIM_FAULTS": json.dumps(
            [
                {"activity": SLICE_VM_PROVISION, "kind": "vfio_error"},
                {
                    "activity": SLICE_VM_RELEASE,
                    "kind": "release_error",
                    "times": 2,
                    "node_id": other,
                },
            ]
        ),
        "GPUCLOUD_SIM_CONFIG": json.dumps({"nodes": {node: {"jitter": 0.0}}}),
    }

    config = SimHostConfig.from_env(node, env)

    assert config.phase_delay_s == 0.5
    assert config.phase_delays_s == {"guest_reachable": 4.0}
    assert config.jitter == 0.0  # the per-node override wins
    assert [f.kind for f in config.faults] == ["vfio_error"]  # the other node's fault is not ours
    assert config.faults[0].phase == "vm_started"  # where VFIO binding fails on a real host
    assert SimHostConfig.from_env(other, env).jitter == 0.2
    assert len(SimHostConfig.from_env(other, env).faults) == 2


def test_plain_number_delay_and_jitter_bounds() -> None:
    config = SimHostConfig.from_env(
        None, {"GPUCLOUD_SIM_PHASE_DELAY_S": "2", "GPUCLOUD_SIM_PHASE_JITTER": "0.5"}
    )
    rng = random.Random(1)
    delays = [config.delay_for("vm_started", rng) for _ in range(200)]
    assert all(1.0 <= d <= 3.0 for d in delays)
    assert SimHostConfig().delay_for("vm_started", rng) == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        {"activity": "slice.nope", "kind": "image_error"},
        {"activity": SLICE_VM_PROVISION, "kind": "meteor_strike"},
        {"activity": SLICE_VM_PROVISION, "kind": "image_error", "phase": "user_created"},
        {"activity": SLICE_VM_PROVISION, "kind": "graceful_shutdown_fails"},
        {"activity": SLICE_VM_PROVISION, "kind": "image_error", "colour": "red"},
        {"activity": SLICE_VM_PROVISION, "kind": "image_error", "times": 0},
    ],
)
def test_bad_fault_specs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        FaultSpec.from_dict(bad)


def test_config_faults_are_armed_on_the_host() -> None:
    node = str(uuid.uuid4())
    config = SimHostConfig(faults=(FaultSpec(SLICE_VM_PROVISION, "image_error", times=None),))
    host = SimulatedHost(node, config=config)
    for _ in range(3):
        with pytest.raises(HostError) as failed:
            host.provision_slice_vm(
                slice_input(node, str(uuid.uuid4()), ["0000:17:00.0"]), RecordingProgress()
            )
        assert failed.value.error_type == HostErrorType.IMAGE_ERROR


def test_faults_can_target_one_allocation() -> None:
    node = str(uuid.uuid4())
    host = SimulatedHost(node)
    target, bystander = str(uuid.uuid4()), str(uuid.uuid4())
    host.faults.inject(SLICE_VM_PROVISION, HostErrorType.VFIO_ERROR, allocation_id=target)

    host.provision_slice_vm(slice_input(node, bystander, ["0000:17:00.0"]), RecordingProgress())
    with pytest.raises(HostError):
        host.provision_slice_vm(slice_input(node, target, ["0000:31:00.0"]), RecordingProgress())
    assert host.faults.armed == []


def test_hang_blocks_until_cancelled_and_stops_heartbeats() -> None:
    node, allocation = str(uuid.uuid4()), str(uuid.uuid4())
    host = SimulatedHost(node)
    fault = host.faults.hang(SLICE_VM_PROVISION, phase="domain_defined")
    assert fault.spec.kind == HANG
    progress = RecordingProgress()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            host.provision_slice_vm, slice_input(node, allocation, ["0000:17:00.0"]), progress
        )
        with pytest.raises(TimeoutError):
            running.result(timeout=0.3)
        progress.cancel()
        with pytest.raises(HostCancelled):
            running.result(timeout=5)
    assert progress.heartbeats_suspended
    assert [c.phase for c in host.cancelled_phases] == ["domain_defined"]
    assert host.domain(allocation) is None  # the hung phase did no work


def test_concurrent_provisions_never_share_a_gpu() -> None:
    """Many threads race for the same four GPUs: exactly one allocation wins each GPU set."""
    node = str(uuid.uuid4())
    host = SimulatedHost(node)
    pci = ["0000:17:00.0", "0000:31:00.0", "0000:4b:00.0", "0000:65:00.0"]
    allocations = [str(uuid.uuid4()) for _ in range(16)]

    def provision(allocation: str) -> str:
        try:
            host.provision_slice_vm(slice_input(node, allocation, pci), RecordingProgress())
            return "ok"
        except HostError as err:
            return err.error_type.value

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(provision, allocations))

    assert outcomes.count("ok") == 1
    assert outcomes.count(HostErrorType.LEASE_CONFLICT.value) == 15
    winner = allocations[outcomes.index("ok")]
    assert set(host.gpu_leases.values()) == {winner}
    host.release_slice_vm(slice_release(node, winner), RecordingProgress())
    assert host.gpu_leases == {}


def test_baremetal_node_is_exclusive() -> None:
    node = str(uuid.uuid4())
    host = SimulatedHost(node, hostname="bm-01")

    def spec(allocation: str) -> HostProvisionInput:
        return HostProvisionInput(str(uuid.uuid4()), allocation, node, "baremetal", "tenant", [])

    first = host.provision_baremetal_user(spec("a"), RecordingProgress())
    with pytest.raises(HostError) as conflict:
        host.provision_baremetal_user(spec("b"), RecordingProgress())
    assert conflict.value.error_type == HostErrorType.LEASE_CONFLICT
    assert first.connect_host == connect_host_for("bm-01")
    assert host.attempts(BAREMETAL_PROVISION_USER) == 2


def test_keys_are_remembered_as_fingerprints_only() -> None:
    node, allocation = str(uuid.uuid4()), str(uuid.uuid4())
    host = SimulatedHost(node)
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIsecretbody tenant@laptop"
    spec = HostProvisionInput(str(uuid.uuid4()), allocation, node, "baremetal", "tenant", [key])
    progress = RecordingProgress()
    host.provision_baremetal_user(spec, progress)
    user = host.user(allocation)
    assert user is not None
    assert user.key_fingerprints[0].startswith("SHA256:")
    assert "secretbody" not in repr(host.users)
