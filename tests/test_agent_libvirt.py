"""LibvirtSliceBackend on libvirt's real test driver (test:///…/host.xml): domains are defined,
started, shut down, destroyed and undefined by libvirt itself. The host XML (tests/data/libvirt/
host.xml) declares 8 H100s as PCI node devices on 2 NUMA cells. No guest runs on the test driver,
so readiness goes through the backend's probe seam with a fixed address."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt
import pytest

from agent.backend import (
    HARD_STOP_PHASE,
    SLICE_PROVISION_PHASES,
    SLICE_RELEASE_PHASES,
    HostCancelled,
    HostError,
    PhaseStatus,
)
from agent.backends import FixedAddressProbe
from agent.backends.domain_xml import parse_domain, parse_numa_topology
from agent.backends.libvirt_slice import LibvirtSliceBackend
from contracts.host_tasks import GpuAssignment, HostErrorType, HostProvisionInput, HostReleaseInput
from tests.disk_images import empty_qcow2, write_base_image

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"
IMAGE = "ubuntu-22.04-cuda.img"
SECRET_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIVerySecretKeyMaterial tenant@laptop"
# GPUs of the host XML: 17, 3d, 63, 86 on NUMA node 0; 9a, b8, cc, dc on node 1.
NODE1_GPUS = ("0000:9a:00.0", "0000:b8:00.0")


@dataclass
class RecordingProgress:
    """A Progress for driving the backend directly (the agent uses TaskProgress)."""

    events: list[tuple[str, str, str]] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        if status == PhaseStatus.STARTED and self.cancel.is_set():
            raise HostCancelled(f"cancelled before {phase}")
        self.events.append((phase, str(status), message))

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def wait(self, seconds: float | None) -> None:
        if self.cancel.wait(seconds):
            raise HostCancelled("cancelled while waiting")

    def suspend_heartbeats(self) -> None:
        pass

    def succeeded(self) -> list[str]:
        return [phase for phase, status, _ in self.events if status == PhaseStatus.SUCCEEDED]


@dataclass
class Host:
    conn: Any
    backend: LibvirtSliceBackend
    probe: FixedAddressProbe
    root: Path
    image_sha: str

    def new_backend(self, **overrides: Any) -> LibvirtSliceBackend:
        """Another backend on the same host (a restarted agent: same libvirt state)."""
        return make_backend(self.conn, self.root, self.image_sha, self.probe, **overrides)


def make_backend(
    conn: Any, root: Path, image_sha: str, probe: FixedAddressProbe, **overrides: Any
) -> LibvirtSliceBackend:
    options: dict[str, Any] = {
        "image_dir": root / "images",
        "image_catalog": {IMAGE: image_sha},
        "seed_dir": root / "seeds",
        "state_dir": root / "state",
        "readiness": probe,
        "connection": conn,
        "shutdown_timeout_s": 5,
        "poll_interval_s": 0.05,
    }
    options.update(overrides)
    return LibvirtSliceBackend(f"test://{HOST_XML}", **options)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    (tmp_path / "images").mkdir()
    content = write_base_image(tmp_path / "images" / IMAGE)
    conn = libvirt.open(f"test://{HOST_XML}")
    probe = FixedAddressProbe("10.20.0.5")
    sha = hashlib.sha256(content).hexdigest()
    yield Host(conn, make_backend(conn, tmp_path, sha, probe), probe, tmp_path, sha)
    conn.close()


def provision_spec(
    allocation_id: str = "a1b2", gpus: tuple[str, ...] = NODE1_GPUS, **kw: Any
) -> HostProvisionInput:
    nodes = {"17": 0, "3d": 0, "63": 0, "86": 0}
    return HostProvisionInput(
        task_id=f"task-{allocation_id}",
        allocation_id=allocation_id,
        node_id="node-1",
        shape="gpu_slice",
        username="alice",
        ssh_public_keys=[SECRET_KEY],
        gpus=[
            GpuAssignment(pci_address=a, numa_node=nodes.get(a[5:7], 1), gpu_index=i)
            for i, a in enumerate(gpus)
        ],
        vcpus=kw.pop("vcpus", 6),
        memory_mb=kw.pop("memory_mb", 8192),
        image=kw.pop("image", IMAGE),
        image_sha256=kw.pop("image_sha256", ""),
    )


def release_spec(allocation_id: str = "a1b2", force: bool = False) -> HostReleaseInput:
    return HostReleaseInput(
        task_id=f"rel-{allocation_id}",
        allocation_id=allocation_id,
        node_id="node-1",
        shape="gpu_slice",
        username="alice",
        force=force,
    )


def domain_names(conn: Any) -> set[str]:
    return {d.name() for d in conn.listAllDomains(0)}


# ------------------------------------------------------------------------------ provision


def test_provision_defines_and_starts_a_pinned_vfio_domain(host: Host) -> None:
    progress = RecordingProgress()
    outcome = host.backend.provision_slice_vm(provision_spec(), progress)

    assert outcome.connect_host == "10.20.0.5"
    assert outcome.adopted_existing is False
    assert progress.succeeded() == list(SLICE_PROVISION_PHASES)
    assert [p for p, s, _ in progress.events if s == PhaseStatus.STARTED] == list(
        SLICE_PROVISION_PHASES
    )

    domain = host.conn.lookupByName("gpc-a1b2")
    assert domain.isActive()
    assert domain.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    facts = parse_domain(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    assert facts.allocation_id == "a1b2"
    assert sorted(str(a) for a in facts.hostdevs) == sorted(NODE1_GPUS)
    assert facts.numa_nodeset == "1"
    assert facts.vcpupins == dict.fromkeys(range(6), "8-15")
    assert domain.maxVcpus() == 6 or domain.info()[3] == 6
    assert domain.info()[1] == 8192 * 1024
    xml = domain.XMLDesc(0)
    assert "managed='yes'" in xml
    assert "mode='strict'" in xml
    # The allocation's own disk (a copy or overlay of the verified image) and the seed.
    disk = host.root / "state" / "disks" / "gpc-a1b2.qcow2"
    assert str(disk) in facts.disk_paths
    assert disk.is_file()
    assert any(p.startswith(str(host.root / "seeds" / "a1b2")) for p in facts.disk_paths)


def test_cloud_init_seed_is_private_and_carries_user_keys_and_marker(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    seed = host.root / "seeds" / "a1b2"
    user_data = (seed / "user-data").read_text()
    assert user_data.startswith("#cloud-config\n")
    assert SECRET_KEY in user_data
    assert '"name": "alice"' in user_data
    assert "/var/lib/gpucloud/ready" in user_data
    assert "a1b2" in (seed / "meta-data").read_text()
    for name in ("user-data", "meta-data"):
        assert stat.S_IMODE((seed / name).stat().st_mode) == 0o600
    # Traversable (QEMU, as libvirt-qemu, opens seed.iso), never listable by others.
    assert stat.S_IMODE(seed.stat().st_mode) == 0o711


def test_ssh_keys_never_reach_logs_or_phase_messages(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    progress = RecordingProgress()
    host.backend.provision_slice_vm(provision_spec(), progress)
    host.backend.release_slice_vm(release_spec(), progress)
    logged = [r.getMessage() for r in caplog.records if r.name == "agent.backends.libvirt_slice"]
    assert any("slice VM ready" in m for m in logged), logged  # the check below reads something
    assert any("slice VM released" in m for m in logged), logged
    assert "VerySecretKeyMaterial" not in caplog.text
    assert all("VerySecretKeyMaterial" not in message for _, _, message in progress.events)


def test_image_sha_mismatch_is_image_error(host: Host) -> None:
    (host.root / "images" / IMAGE).write_bytes(b"tampered")
    with pytest.raises(HostError) as err:
        host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    assert err.value.error_type == HostErrorType.IMAGE_ERROR
    assert "gpc-a1b2" not in domain_names(host.conn)


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img (qemu-utils)")
def test_an_image_qemu_cannot_read_is_image_error(host: Host) -> None:
    """The format is what qemu-img reads, never assumed from the first bytes: a catalogued file
    with a qcow2 header QEMU refuses (a 2^40-byte cluster) fails before any disk or domain."""
    broken = bytearray(empty_qcow2())
    broken[20:24] = (40).to_bytes(4, "big")  # cluster_bits
    (host.root / "images" / IMAGE).write_bytes(bytes(broken))
    backend = make_backend(host.conn, host.root, hashlib.sha256(broken).hexdigest(), host.probe)
    with pytest.raises(HostError) as err:
        backend.provision_slice_vm(provision_spec(), RecordingProgress())
    assert err.value.error_type == HostErrorType.IMAGE_ERROR
    assert "qemu-img cannot read it" in str(err.value)
    assert "gpc-a1b2" not in domain_names(host.conn)
    assert not (host.root / "state" / "disks" / "gpc-a1b2.qcow2").exists()


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img (qemu-utils)")
def test_a_raw_base_gets_a_raw_backed_overlay(host: Host) -> None:
    """A file that merely starts with qcow2's magic (version 0) is raw to QEMU, and the overlay
    names it so: `-F qcow2` over it is what qemu-img used to refuse."""
    fake = b"QFI\xfb" + b"\0" * 4092
    (host.root / "images" / IMAGE).write_bytes(fake)
    backend = make_backend(host.conn, host.root, hashlib.sha256(fake).hexdigest(), host.probe)
    backend.provision_slice_vm(provision_spec(), RecordingProgress())
    info = disk_info(host.root / "state" / "disks" / "gpc-a1b2.qcow2")
    assert (info["format"], info["backing-filename-format"]) == ("qcow2", "raw")


def disk_info(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return dict(json.loads(out))


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img (qemu-utils)")
def test_allocation_disk_is_a_qcow2_overlay_of_the_base(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    info = disk_info(host.root / "state" / "disks" / "gpc-a1b2.qcow2")
    assert info["format"] == "qcow2"
    assert info["backing-filename"] == str(host.root / "images" / IMAGE)
    assert info["backing-filename-format"] == "qcow2"


def test_requested_sha_not_the_catalogs_is_image_error(host: Host) -> None:
    with pytest.raises(HostError) as err:
        host.backend.provision_slice_vm(provision_spec(image_sha256="0" * 64), RecordingProgress())
    assert err.value.error_type == HostErrorType.IMAGE_ERROR


def test_image_reused_on_second_provision(host: Host) -> None:
    first, second = RecordingProgress(), RecordingProgress()
    host.backend.provision_slice_vm(provision_spec("one"), first)
    host.backend.provision_slice_vm(provision_spec("two", gpus=("0000:17:00.0",)), second)
    assert "verified" in first.events[1][2]
    assert "reused" in second.events[1][2]


def test_unknown_pci_address_is_vfio_error(host: Host) -> None:
    with pytest.raises(HostError) as err:
        host.backend.provision_slice_vm(
            provision_spec(gpus=("0000:9a:00.0", "0000:ee:00.0")), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.VFIO_ERROR
    assert "0000:ee:00.0" in err.value.message
    assert "gpc-a1b2" not in domain_names(host.conn)


def test_non_gpu_pci_device_is_vfio_error(host: Host) -> None:
    with pytest.raises(HostError) as err:
        host.backend.provision_slice_vm(provision_spec(gpus=("0000:01:00.0",)), RecordingProgress())
    assert err.value.error_type == HostErrorType.VFIO_ERROR


class RefusingStart:
    """The host's libvirt connection, except that starting a domain fails as libvirtd reports it
    on a host whose VFIO setup is wrong (or for another reason)."""

    def __init__(self, conn: Any, message: str) -> None:
        self._conn, self._message = conn, message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def lookupByName(self, name: str) -> Any:
        domain, message = self._conn.lookupByName(name), self._message

        class Domain:
            def __getattr__(self, attr: str) -> Any:
                return getattr(domain, attr)

            def create(self) -> int:
                raise libvirt.libvirtError(message)

        return Domain()


@pytest.mark.parametrize(
    "message",
    [
        "internal error: qemu unexpectedly closed the monitor: vfio 0000:9a:00.0: group 30 is not"
        " viable",
        "unable to open /dev/vfio/30: Permission denied",
        "internal error: Failed to bind PCI device '0000:9a:00.0' to vfio-pci",
        "operation failed: IOMMU not found",
    ],
)
def test_a_start_refused_by_the_hosts_vfio_setup_is_vfio_error(host: Host, message: str) -> None:
    backend = host.new_backend(connection=RefusingStart(host.conn, message))
    progress = RecordingProgress()
    with pytest.raises(HostError) as err:
        backend.provision_slice_vm(provision_spec(), progress)
    assert err.value.error_type == HostErrorType.VFIO_ERROR
    assert "vm_started" not in progress.succeeded()


def test_another_start_failure_stays_a_libvirt_error(host: Host) -> None:
    """Not VFIO: the libvirt error itself, which the activity retries (then provisioning_error)."""
    backend = host.new_backend(connection=RefusingStart(host.conn, "cannot allocate memory"))
    with pytest.raises(libvirt.libvirtError):
        backend.provision_slice_vm(provision_spec(), RecordingProgress())


def test_gpu_held_by_another_domain_is_lease_conflict(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec("first"), RecordingProgress())
    with pytest.raises(HostError) as err:
        host.backend.provision_slice_vm(
            provision_spec("second", gpus=("0000:b8:00.0",)), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.LEASE_CONFLICT


def test_gpus_on_both_cells_pin_to_both_nodes(host: Host) -> None:
    host.backend.provision_slice_vm(
        provision_spec(gpus=("0000:17:00.0", "0000:dc:00.0"), vcpus=2), RecordingProgress()
    )
    facts = parse_domain(host.conn.lookupByName("gpc-a1b2").XMLDesc(0))
    assert facts.numa_nodeset == "0-1"
    assert facts.vcpupins == {0: "0-15", 1: "0-15"}


def test_reprovision_after_crash_adopts_the_domain_and_starts_it(host: Host) -> None:
    # The first attempt defined the domain, then the agent died before it started.
    class Crash(Exception):
        pass

    crashing = RecordingProgress()

    def crash_at_start(phase: str, status: PhaseStatus, message: str = "") -> None:
        if phase == "vm_started":
            raise Crash
        RecordingProgress.__call__(crashing, phase, status, message)

    with pytest.raises(Crash):
        host.backend.provision_slice_vm(provision_spec(), crash_at_start)  # type: ignore[arg-type]
    domain = host.conn.lookupByName("gpc-a1b2")
    assert not domain.isActive()

    restarted = host.new_backend()  # a new agent process, same host
    progress = RecordingProgress()
    outcome = restarted.provision_slice_vm(provision_spec(), progress)
    assert outcome.adopted_existing is True
    assert progress.succeeded() == list(SLICE_PROVISION_PHASES)
    assert "adopted" in dict((p, m) for p, _, m in progress.events if m)["domain_defined"]
    assert host.conn.lookupByName("gpc-a1b2").isActive()
    assert domain_names(host.conn) == {"gpc-a1b2"}

    # And once more while it runs: nothing is redefined or restarted.
    again = RecordingProgress()
    assert restarted.provision_slice_vm(provision_spec(), again).adopted_existing is True
    assert ("vm_started", "succeeded", "already running") in again.events


# ------------------------------------------------------------------------------ release


def test_release_shuts_down_destroys_undefines_and_wipes(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    lease = host.root / "state" / "leases" / "a1b2.json"
    assert lease.is_file()

    progress = RecordingProgress()
    outcome = host.backend.release_slice_vm(release_spec(), progress)

    assert outcome.released
    assert outcome.wiped
    assert outcome.leases_released
    assert outcome.hard_stopped is False
    assert progress.succeeded() == list(SLICE_RELEASE_PHASES)
    assert "gpc-a1b2" not in domain_names(host.conn)
    with pytest.raises(libvirt.libvirtError):
        host.conn.lookupByName("gpc-a1b2")
    assert not (host.root / "state" / "disks" / "gpc-a1b2.qcow2").exists()
    assert not (host.root / "seeds" / "a1b2").exists()
    assert not lease.exists()
    # The GPUs are free again for another allocation.
    host.backend.provision_slice_vm(provision_spec("next"), RecordingProgress())


def test_force_release_hard_stops(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    progress = RecordingProgress()
    outcome = host.backend.release_slice_vm(release_spec(force=True), progress)
    assert outcome.hard_stopped is True
    assert progress.succeeded() == [HARD_STOP_PHASE, *SLICE_RELEASE_PHASES[1:]]
    assert "gpc-a1b2" not in domain_names(host.conn)


def test_release_is_idempotent(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    host.backend.release_slice_vm(release_spec(), RecordingProgress())
    progress = RecordingProgress()
    outcome = host.backend.release_slice_vm(release_spec(), progress)
    assert outcome.released
    assert outcome.wiped
    assert outcome.leases_released
    assert not outcome.hard_stopped
    assert progress.succeeded() == list(SLICE_RELEASE_PHASES)
    messages = dict((p, m) for p, _, m in progress.events if m)
    assert "already" in messages["graceful_shutdown"]
    assert "already" in messages["domain_undefined"]


def test_release_of_never_provisioned_allocation_succeeds(host: Host) -> None:
    outcome = host.backend.release_slice_vm(release_spec("ghost"), RecordingProgress())
    assert outcome.released


def test_release_of_defined_but_stopped_domain(host: Host) -> None:
    host.backend.provision_slice_vm(provision_spec(), RecordingProgress())
    host.conn.lookupByName("gpc-a1b2").destroy()
    outcome = host.backend.release_slice_vm(release_spec(), RecordingProgress())
    assert outcome.released
    assert not outcome.hard_stopped
    assert "gpc-a1b2" not in domain_names(host.conn)


def test_cancelled_task_stops_at_a_phase_boundary(host: Host) -> None:
    progress = RecordingProgress()
    progress.cancel.set()
    with pytest.raises(HostCancelled):
        host.backend.provision_slice_vm(provision_spec(), progress)
    assert "gpc-a1b2" not in domain_names(host.conn)


def test_bare_metal_is_not_served(host: Host) -> None:
    spec = provision_spec()
    spec.shape = "baremetal"
    with pytest.raises(HostError) as err:
        host.backend.provision_baremetal_user(spec, RecordingProgress())
    assert err.value.error_type == HostErrorType.INVALID_SPEC


def test_capabilities_topology_is_read_when_not_given() -> None:
    # test:///default builds 2 NUMA cells of 8 CPUs (the custom-file driver builds none).
    conn = libvirt.open("test:///default")
    try:
        topology = parse_numa_topology(conn.getCapabilities())
    finally:
        conn.close()
    assert topology == {0: tuple(range(8)), 1: tuple(range(8, 16))}


@dataclass
class OneBadGpu:
    """A GpuHealthCheck that fails one address (as the sysfs check does after a failed reset)."""

    bad: str
    checked: list[str] = field(default_factory=list)

    def check(self, pci_address: str) -> str | None:
        self.checked.append(pci_address)
        return "PCI config space reads all-ones" if pci_address == self.bad else None


def test_release_checks_each_gpu_it_freed_and_reports_the_unhealthy_one(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    health = OneBadGpu(bad=NODE1_GPUS[1])
    backend = host.new_backend(gpu_health=health)
    backend.provision_slice_vm(provision_spec(), RecordingProgress())
    progress = RecordingProgress()
    outcome = backend.release_slice_vm(release_spec(), progress)
    assert sorted(health.checked) == sorted(NODE1_GPUS)  # read before the domain was undefined
    assert [(g.pci_address, g.reason) for g in outcome.unhealthy_gpus] == [
        (NODE1_GPUS[1], "PCI config space reads all-ones")
    ]
    checked = [m for phase, status, m in progress.events if phase == "gpus_health_checked"]
    assert checked[-1] == "1 healthy, 1 quarantined"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(NODE1_GPUS[1] in m and "quarantined" in m for m in warnings), warnings


# ------------------------------------------------------------------------------ domain type


def _plan_of(domain_type: str) -> Any:
    from agent.backends.domain_xml import PciAddress, SliceDomain

    return SliceDomain(
        allocation_id="a1b2",
        domain_type=domain_type,
        vcpus=2,
        memory_mib=1024,
        numa_nodes=(0,),
        cpuset=(0, 1),
        gpus=(PciAddress.parse("0000:17:00.0"),),
        disk_path="/var/lib/gpucloud/vms/disks/gpc-a1b2.qcow2",
        disk_format="qcow2",
        seed_path="/var/lib/gpucloud/seeds/a1b2/seed.iso",
        seed_is_iso=True,
        bridge="gcbr-0123456789",
    )


def test_qemu_domain_type_changes_only_the_type_and_the_kvm_cpu() -> None:
    from agent.backends.domain_xml import render_domain

    kvm, qemu = render_domain(_plan_of("kvm")), render_domain(_plan_of("qemu"))
    assert kvm.startswith('<domain type="kvm">')
    assert qemu.startswith('<domain type="qemu">')
    kvm_lines = kvm.replace('type="kvm"', 'type="qemu"', 1).splitlines()
    # TCG cannot pass the host CPU through: the one element only KVM gets.
    assert [line for line in kvm_lines if line not in qemu.splitlines()] == [
        '  <cpu mode="host-passthrough" />'
    ]


def test_domain_type_setting_defaults_to_kvm_and_refuses_others(tmp_path: Path) -> None:
    from agent.backends.from_config import slice_backend_from_config
    from agent.backends.system_root import SystemRoot
    from agent.config_file import ConfigError

    root = SystemRoot(tmp_path)
    assert slice_backend_from_config({}, root).domain_type == "kvm"
    tcg = slice_backend_from_config({"libvirt": {"domain_type": "qemu"}}, root)
    assert tcg.domain_type == "qemu"
    with pytest.raises(ConfigError, match="domain_type must be one of kvm, qemu"):
        slice_backend_from_config({"libvirt": {"domain_type": "xen"}}, root)
    with pytest.raises(ValueError, match="domain_type"):
        LibvirtSliceBackend(
            "qemu:///system",
            image_dir=tmp_path,
            image_catalog={},
            seed_dir=tmp_path,
            state_dir=tmp_path,
            readiness=FixedAddressProbe("10.0.0.1"),
            domain_type="test",
        )


def test_the_test_driver_keeps_its_own_type_whatever_the_setting(host: Host) -> None:
    backend = host.new_backend(domain_type="qemu")
    backend.provision_slice_vm(provision_spec(), RecordingProgress())
    domain = host.conn.lookupByName("gpc-a1b2")
    assert domain.XMLDesc(0).startswith("<domain type='test'")


# ------------------------------------------------------------------------------ the NIC


def test_the_agents_tap_is_an_unmanaged_ethernet_nic_with_the_bridges_mtu(host: Host) -> None:
    import dataclasses
    import xml.etree.ElementTree as ET

    from agent.backends.domain_xml import parse_domain, render_domain

    plan = dataclasses.replace(_plan_of("qemu"), tap="gt00-0123456789", mtu=1450)
    xml = render_domain(plan)
    (iface,) = ET.fromstring(xml).findall("devices/interface")  # noqa: S314
    assert iface.get("type") == "ethernet"
    target = iface.find("target")
    assert target is not None
    assert target.attrib == {"dev": "gt00-0123456789", "managed": "no"}
    assert iface.find("source") is None  # the agent put the tap on the bridge itself
    assert [e.attrib for e in iface.iter("mtu")] == [{"size": "1450"}]
    assert [e.attrib for e in iface.iter("model")] == [{"type": "virtio"}]
    assert parse_domain(xml).interfaces == (("gt00-0123456789", 1450),)
    # Without a tap of the agent's, libvirt's own on the bridge, still at the given MTU.
    bridged = render_domain(dataclasses.replace(_plan_of("qemu"), mtu=9000))
    (iface,) = ET.fromstring(bridged).findall("devices/interface")  # noqa: S314
    assert iface.get("type") == "bridge"
    assert iface.find("mtu").attrib == {"size": "9000"}  # type: ignore[union-attr]
    assert "<mtu" not in render_domain(_plan_of("qemu"))  # no MTU known: none claimed
    # libvirt's own validation (every driver's) takes the unmanaged ethernet NIC.
    test_plan = dataclasses.replace(plan, domain_type="test", allocation_id="nic1", gpus=())
    domain = host.conn.defineXML(render_domain(test_plan))
    try:
        assert "managed='no'" in domain.XMLDesc(0)
        assert parse_domain(domain.XMLDesc(0)).interfaces == (("gt00-0123456789", 1450),)
    finally:
        domain.undefine()
