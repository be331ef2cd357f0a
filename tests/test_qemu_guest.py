"""A real guest through the agent's own LibvirtSliceBackend on libvirt's QEMU driver
(`qemu:///system`, domain type `qemu`: TCG, as KVM is unusable on the CI machines).

The agent provisions as on a node: base image verified, qcow2 overlay built with qemu-img, the
cloud-init seed packed as an ISO, its per-allocation bridge created, the domain it renders
defined and started by libvirtd, QEMU running. No GPUs: the hostdev list is empty.

The one test-only change to what QEMU runs: the agent's domain boots its disk, and the test has
no bootable disk image yet, so the connection the backend uses adds a direct kernel boot (Debian's
kernel and a busybox initramfs built here) and a serial console to a file to the XML the agent
renders, and nothing else. The readiness probe is the test's: the guest's init writes a marker
with the allocation id to that console. Release is the agent's: graceful shutdown (the busybox
guest ignores the ACPI button, so it times out), hard stop, destroy, undefine, disk and seed gone.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import libvirt
import pytest

from agent.backend import HARD_STOP_PHASE, PhaseStatus
from agent.backends.domain_xml import parse_domain
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.backends.readiness import NotReady
from agent.network.allocation_network import bridge_name
from agent.network.slice_networks import SliceNetworks
from contracts.host_tasks import HostProvisionInput, HostReleaseInput
from tests.qemu_fixtures import QEMU_URI
from tests.test_agent_libvirt import RecordingProgress

IMAGE = "tiny-base.qcow2"
MARKER = "GPUCLOUD-GUEST-INIT"
BOOT_TIMEOUT_S = 90.0  # init is reached in 15-25 s on a loaded 2-core CI machine


# ------------------------------------------------------------------------------ the guest


def _cpio_newc(entries: list[tuple[str, int, bytes, tuple[int, int]]]) -> bytes:
    """A "newc" cpio archive (what the kernel unpacks as initramfs): (name, mode, data, rdev)."""
    out = bytearray()
    for ino, (name, mode, data, (major, minor)) in enumerate(
        [*entries, ("TRAILER!!!", 0, b"", (0, 0))], start=1
    ):
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, major, minor, len(encoded), 0)
        out += b"070701" + b"".join(b"%08X" % value for value in fields) + encoded
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


INIT = f"""#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
for word in $(/bin/busybox cat /proc/cmdline); do
    case "$word" in gpucloud.alloc=*) alloc="${{word#gpucloud.alloc=}}" ;; esac
done
echo "{MARKER} $alloc $(/bin/busybox uname -r) nproc=$(/bin/busybox nproc)"
exec /bin/busybox sleep 100000
"""


def build_initramfs(
    target: Path,
    init: str = INIT,
    *,
    kernel_release: str = "",
    modules: Sequence[str] = (),
    directories: Sequence[str] = (),
) -> None:
    """A gzipped busybox initramfs at `target`: `init` as /init, and `modules` (paths under
    /lib/modules/<kernel_release>/kernel) as /lib/gpucloud/NN.ko in the order given, for the
    init to insmod; `directories` made besides the ones every guest needs."""
    directory, executable, console = 0o040755, 0o100755, 0o020600
    names = ["bin", "dev", "proc", "sys", *directories]
    if modules:
        names += ["lib", "lib/gpucloud"]
    entries = [(name, directory, b"", (0, 0)) for name in names]
    entries += [
        ("dev/console", console, b"", (5, 1)),  # init's stdio: the kernel's console (ttyS0)
        ("bin/busybox", executable, Path("/bin/busybox").read_bytes(), (0, 0)),
        ("init", executable, init.encode(), (0, 0)),
    ]
    tree = Path("/lib/modules") / kernel_release / "kernel"
    for i, module in enumerate(modules):  # named so the shell glob keeps the load order
        entries.append((f"lib/gpucloud/{i:02d}.ko", 0o100644, (tree / module).read_bytes(), (0, 0)))
    target.write_bytes(gzip.compress(_cpio_newc(entries), compresslevel=1))


def guest_kernel() -> Path | None:
    kernels = sorted(Path("/boot").glob("vmlinuz-*"))
    return kernels[-1] if kernels else None


# ------------------------------------------------------------------------------ test seams


class KernelBootConnection:
    """The backend's libvirt connection, adding a direct kernel boot and a file console to each
    domain XML the agent defines (see the module docstring); every other call is libvirt's."""

    def __init__(self, conn: Any, kernel: Path, initrd: Path, console_dir: Path) -> None:
        self._conn = conn
        self.kernel, self.initrd, self.console_dir = kernel, initrd, console_dir
        self.agent_xml: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def console_log(self, domain_name: str) -> Path:
        return self.console_dir / f"{domain_name}.log"

    def defineXML(self, xml: str) -> Any:  # libvirt's name
        self.agent_xml.append(xml)
        root = ET.fromstring(xml)  # noqa: S314 - the agent's own XML
        name = root.findtext("name") or ""
        allocation = parse_domain(xml).allocation_id
        os_el = root.find("os")
        devices = root.find("devices")
        assert os_el is not None
        assert devices is not None
        ET.SubElement(os_el, "kernel").text = str(self.kernel)
        ET.SubElement(os_el, "initrd").text = str(self.initrd)
        cmdline = f"console=ttyS0 panic=-1 loglevel=4 gpucloud.alloc={allocation}"
        ET.SubElement(os_el, "cmdline").text = cmdline
        serial = ET.SubElement(devices, "serial", {"type": "file"})
        ET.SubElement(serial, "source", {"path": str(self.console_log(name))})
        ET.SubElement(serial, "target", {"port": "0"})
        return self._conn.defineXML(ET.tostring(root, encoding="unicode"))


class ConsoleMarkerProbe:
    """Ready when the guest's init wrote its marker line with this domain's allocation id to the
    serial console."""

    def __init__(self, conn: KernelBootConnection, address: str = "192.0.2.10") -> None:
        self.conn = conn
        self.address = address
        self.seen = ""
        self.waited_s = 0.0

    def wait_reachable(self, domain: Any, timeout: float, progress: Any) -> str:
        allocation = parse_domain(domain.XMLDesc(0)).allocation_id
        log = self.conn.console_log(domain.name())
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            text = log.read_text(errors="replace") if log.exists() else ""
            for line in text.splitlines():
                if line.startswith(f"{MARKER} {allocation} "):
                    self.seen, self.waited_s = line.strip(), time.monotonic() - started
                    return self.address
            progress.wait(0.25)
        tail = text.strip().splitlines()[-3:] if text else ["(no console output)"]
        raise NotReady(f"no init marker on the console; last: {' | '.join(tail)}")

    def wait_driver_ready(self, domain: Any, gpu_count: int, timeout: float, progress: Any) -> str:
        return f"{gpu_count} GPU(s): none to check"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Files QEMU opens (run as libvirt-qemu): in a directory it can traverse, unlike
    pytest's 0700 tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="gpucloud-qemu-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def real_guest(
    qemu_connection: Any,
    workdir: Path,
    kernel: Path,
    initrd: Path,
    allocation: str,
    networks: SliceNetworks,
    **task: Any,
) -> tuple[ConsoleMarkerProbe, LibvirtSliceBackend, HostProvisionInput, HostReleaseInput]:
    """A 64M qcow2 base image, the console probe on a kernel-booting connection (probe.conn),
    the agent's backend on qemu:///system with domain type qemu, and the provision/release
    tasks of one GPU-less slice (`task` adds fields such as vlan_id)."""
    (workdir / "images").mkdir(mode=0o755)
    (workdir / "console").mkdir(mode=0o777)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(workdir / "images" / IMAGE), "64M"],
        check=True,
    )
    sha = hashlib.sha256((workdir / "images" / IMAGE).read_bytes()).hexdigest()
    conn = KernelBootConnection(qemu_connection, kernel, initrd, workdir / "console")
    probe = ConsoleMarkerProbe(conn)
    backend = LibvirtSliceBackend(
        QEMU_URI,
        image_dir=workdir / "images",
        image_catalog={IMAGE: sha},
        seed_dir=workdir / "seeds",
        state_dir=workdir / "state",
        readiness=probe,
        connection=conn,
        networks=networks,
        domain_type="qemu",
        shutdown_timeout_s=1,
        readiness_timeout_s=BOOT_TIMEOUT_S,
        poll_interval_s=0.2,
    )
    spec = HostProvisionInput(
        task_id=f"task-{allocation}",
        allocation_id=allocation,
        node_id="node-qemu",
        shape="gpu_slice",
        username="alice",
        ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITestKeyOnly tenant@laptop"],
        gpus=[],
        vcpus=1,
        memory_mb=256,
        image=IMAGE,
        **task,
    )
    release = HostReleaseInput(
        task_id=f"rel-{allocation}",
        allocation_id=allocation,
        node_id="node-qemu",
        shape="gpu_slice",
        username="alice",
    )
    return probe, backend, spec, release


def test_agent_boots_a_real_tcg_guest_and_releases_it(qemu_connection: Any, workdir: Path) -> None:
    kernel = guest_kernel()
    assert kernel is not None, "no /boot/vmlinuz-* (bin/bootstrap installs linux-image-amd64)"
    initrd = workdir / "initramfs.cpio.gz"
    build_initramfs(initrd)
    allocation = f"qemu{os.getpid()}"
    probe, backend, spec, release = real_guest(
        qemu_connection, workdir, kernel, initrd, allocation, SliceNetworks()
    )
    progress = RecordingProgress()
    started = time.monotonic()
    try:
        outcome = backend.provision_slice_vm(spec, progress)
        booted_s = time.monotonic() - started

        assert outcome.connect_host == probe.address
        release_name = kernel.name.removeprefix("vmlinuz-")
        assert probe.seen.startswith(f"{MARKER} {allocation} {release_name} ")
        domain = qemu_connection.lookupByName(f"gpc-{allocation}")
        assert domain.isActive()
        live = domain.XMLDesc(0)
        assert ET.fromstring(live).get("type") == "qemu"  # noqa: S314
        assert parse_domain(live).hostdevs == ()
        # What the agent rendered is a production domain but for the type: no kernel, no serial.
        (agent_xml,) = probe.conn.agent_xml
        assert "<kernel>" not in agent_xml
        assert "<serial" not in agent_xml
        assert "host-passthrough" not in agent_xml  # KVM-only, refused by TCG
        disk = workdir / "state" / "disks" / f"gpc-{allocation}.qcow2"
        assert str(disk) in parse_domain(live).disk_paths
        # The agent's own bridge for the allocation, on this host.
        assert Path(f"/sys/class/net/{bridge_name(allocation)}/bridge").is_dir()
        seed_iso = workdir / "seeds" / allocation / "seed.iso"
        assert seed_iso.is_file()
        print(f"guest init reached {booted_s:.1f}s after provision started: {probe.seen}")
    finally:
        release_progress = RecordingProgress()
        released = backend.release_slice_vm(release, release_progress)
    assert released.released
    assert released.hard_stopped
    with pytest.raises(libvirt.libvirtError):
        qemu_connection.lookupByName(f"gpc-{allocation}")
    assert not (workdir / "state" / "disks" / f"gpc-{allocation}.qcow2").exists()
    assert not (workdir / "seeds" / allocation).exists()
    assert not Path(f"/sys/class/net/{bridge_name(allocation)}").exists()
    phases = [p for p, status, _ in progress.events if status == PhaseStatus.SUCCEEDED]
    assert phases[-1] == "driver_ready"
    # The busybox guest ignores the ACPI button: the graceful wait times out, the agent hard-stops.
    assert HARD_STOP_PHASE in release_progress.succeeded()
    assert release_progress.succeeded()[-2:] == ["leases_wiped", "gpus_health_checked"]
