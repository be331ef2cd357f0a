"""Storage namespaces hot-plugged into a real guest over virtiofs, through the agent's own storage
path (libvirt's QEMU driver, TCG; see tests/test_qemu_guest.py for the kernel-boot seam this
reuses): `StorageMountBackend.mount` checks the provider's grant and bind-mounts the namespace on
the host, then gives the mount to the running VM through `LibvirtSliceBackend.attach_filesystem`
(virDomainAttachDeviceFlags, live and in the definition; libvirt starts a virtiofsd for it);
`unmount` takes it out of the VM first (the live unplug, virtiofsd stopped) and then off the host.

The guest's init (a busybox initramfs with the host kernel's virtio and virtiofs modules) knows the
two tags from the start and mounts each as soon as it appears: from the read-write namespace it
reads the host's file and writes one of its own; on the read-only one a write is refused (the
device has no read-only flag on this libvirt, the host's read-only bind mount is the guard). It
then reads the read-write mount until that fails, which is what the agent's detach must cause.
Every step is reported on the serial console, which the test reads.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import libvirt
import pytest

from activities.storage_provider import SharedDirectoryProvider
from agent.backend import HostError, PhaseStatus
from agent.backends.domain_xml import parse_domain
from agent.backends.system_root import SystemRoot
from agent.network.slice_networks import SliceNetworks
from agent.storage_mounts import (
    GUEST_ATTACH_PHASE,
    GUEST_DETACH_PHASE,
    KernelBindMounter,
    MountFailed,
    StorageMountBackend,
    StorageMountConfig,
)
from contracts.host_tasks import HostErrorType
from contracts.states import SkuShape
from contracts.storage import (
    PROVIDER_SHARED_DIRECTORY,
    StorageMountInput,
    StorageUnmountInput,
    WriteMode,
    virtiofs_tag,
)
from tests.test_agent_libvirt import RecordingProgress
from tests.test_qemu_guest import (
    MARKER,
    build_initramfs,
    guest_kernel,
    real_guest,
    workdir,  # noqa: F401 - the fixture
)

# virtio-pci and virtiofs (FUSE over virtio), in load order (Debian builds them as modules).
MODULES = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko",
    "drivers/virtio/virtio_pci.ko",
    "fs/fuse/fuse.ko",
    "fs/fuse/virtiofs.ko",
)
VIRTIOFS = "GPUCLOUD-VIRTIOFS"
HOST_TEXT = "written on the host"
GUEST_STEP_TIMEOUT_S = 60.0  # a hot-plug reaches the loaded TCG guest in a few seconds


def init_script(rw_tag: str, ro_tag: str) -> str:
    return f"""#!/bin/busybox sh
bb=/bin/busybox
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
for module in /lib/gpucloud/*.ko; do $bb insmod "$module"; done
for word in $($bb cat /proc/cmdline); do
    case "$word" in gpucloud.alloc=*) alloc="${{word#gpucloud.alloc=}}" ;; esac
done
echo "{MARKER} $alloc $($bb uname -r) nproc=$($bb nproc)"
say() {{ echo "{VIRTIOFS} $*"; }}
mount_when_plugged() {{
    $bb mkdir -p "$2"
    until $bb mount -t virtiofs "$1" "$2" 2>/dev/null; do $bb sleep 0.2; done
}}
mount_when_plugged {rw_tag} /mnt/rw
say "rw read: $($bb cat /mnt/rw/from-host.txt)"
echo "written in guest $alloc" > /mnt/rw/from-guest.txt && $bb sync && say "rw wrote"
mount_when_plugged {ro_tag} /mnt/ro
say "ro read: $($bb cat /mnt/ro/from-host.txt)"
if $bb touch /mnt/ro/from-guest.txt 2>/tmp/ro-error; then
    say "ro write succeeded"
else
    say "ro write refused: $($bb cat /tmp/ro-error)"
fi
say "checks done"
while $bb cat /mnt/rw/from-host.txt >/dev/null 2>/tmp/rw-error; do $bb sleep 0.2; done
say "rw gone: $($bb cat /tmp/rw-error)"
exec $bb sleep 100000
"""


def virtiofsd_serving(source: Path) -> list[int]:
    """The virtiofsd processes (libvirt starts one per device; it forks) serving `source`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # exited meanwhile
        if argv[0].endswith("virtiofsd") and f"source={source}" in argv:
            pids.append(int(proc.name))
    return pids


def wait_for(condition: Callable[[], Any], timeout: float, what: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, what()
        time.sleep(0.2)
    return result


class GuestConsole:
    """The guest's serial console log, read for its init's virtiofs lines."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[str]:
        text = self.path.read_text(errors="replace") if self.path.exists() else ""
        return [line.strip() for line in text.splitlines() if line.startswith(VIRTIOFS)]

    def line(self, prefix: str) -> str | None:
        wanted = f"{VIRTIOFS} {prefix}"
        return next((line for line in self.lines() if line.startswith(wanted)), None)

    def wait_line(self, prefix: str) -> str:
        found = wait_for(
            lambda: self.line(prefix),
            GUEST_STEP_TIMEOUT_S,
            lambda: f"guest never said {prefix!r}; it said {self.lines()}",
        )
        return str(found)


def test_a_namespace_is_hot_plugged_into_a_real_guest_over_virtiofs_and_unplugged(
    qemu_connection: Any,
    workdir: Path,  # noqa: F811 - the fixture imported above
) -> None:
    kernel = guest_kernel()
    assert kernel is not None, "no /boot/vmlinuz-* (bin/bootstrap installs linux-image-amd64)"
    rw_attachment, ro_attachment = str(uuid.uuid4()), str(uuid.uuid4())
    rw_tag, ro_tag = virtiofs_tag(rw_attachment), virtiofs_tag(ro_attachment)
    initrd = workdir / "initramfs.cpio.gz"
    build_initramfs(
        initrd,
        init_script(rw_tag, ro_tag),
        kernel_release=kernel.name.removeprefix("vmlinuz-"),
        modules=MODULES,
        directories=("tmp", "mnt"),
    )
    allocation = f"qvfs{os.getpid()}"
    probe, backend, spec, release = real_guest(
        qemu_connection, workdir, kernel, initrd, allocation, SliceNetworks()
    )
    console = GuestConsole(probe.conn.console_log(f"gpc-{allocation}"))

    # The shared directory provider's export (as the control plane's storage activities make
    # it: a namespace each, a grant each for this node) and the node's storage backend over a
    # system root of its own, its slice VMs being the agent's libvirt backend.
    export = workdir / "export"
    provider = SharedDirectoryProvider(export)
    rw_namespace, ro_namespace = str(uuid.uuid4()), str(uuid.uuid4())
    for key, attachment, mode in (
        (rw_namespace, rw_attachment, WriteMode.SINGLE_WRITER),
        (ro_namespace, ro_attachment, WriteMode.READ_ONLY),
    ):
        provider.create(key)
        (provider.namespace_dir(key) / "from-host.txt").write_text(f"{HOST_TEXT} {key}\n")
        provider.grant(key, attachment, spec.node_id, mode)
    (workdir / "root").mkdir(mode=0o755)
    storage = StorageMountBackend(
        SystemRoot(workdir / "root"), StorageMountConfig(export_root=export), guests=backend
    )
    points = {
        attachment: storage.root.host_path(storage.mount_point(attachment))
        for attachment in (rw_attachment, ro_attachment)
    }

    def mount(attachment: str, namespace: str, mode: str) -> RecordingProgress:
        progress = RecordingProgress()
        outcome = storage.mount(
            StorageMountInput(
                task_id=f"mount-{attachment}",
                attachment_id=attachment,
                allocation_id=allocation,
                node_id=spec.node_id,
                provider=PROVIDER_SHARED_DIRECTORY,
                namespace_key=namespace,
                mode=mode,
                allocation_shape=SkuShape.GPU_SLICE,
            ),
            progress,
        )
        assert outcome.guest_mount_tag == virtiofs_tag(attachment)
        return progress

    def unmount(attachment: str) -> RecordingProgress:
        progress = RecordingProgress()
        storage.unmount(
            StorageUnmountInput(
                task_id=f"unmount-{attachment}",
                attachment_id=attachment,
                allocation_id=allocation,
                node_id=spec.node_id,
                allocation_shape=SkuShape.GPU_SLICE,
            ),
            progress,
        )
        return progress

    def guest_phase(progress: RecordingProgress, phase: str) -> str:
        (message,) = [m for p, s, m in progress.events if p == phase and s == PhaseStatus.SUCCEEDED]
        return message

    def exercise_attachments(domain: Any) -> None:
        assert domain.isActive()
        # virtiofs needs the guest's memory shared with virtiofsd: the agent's domain has it.
        backing = ET.fromstring(domain.XMLDesc(0)).find("memoryBacking")  # noqa: S314
        assert backing is not None
        assert backing.find("source[@type='memfd']") is not None
        assert backing.find("access[@mode='shared']") is not None

        # Read-write: hot-plugged into the running guest, which reads the host's file and
        # writes its own, which the host sees in the namespace directory itself.
        attached = mount(rw_attachment, rw_namespace, WriteMode.SINGLE_WRITER)
        assert guest_phase(attached, GUEST_ATTACH_PHASE) == f"virtiofs {rw_tag} attached live"
        assert virtiofsd_serving(points[rw_attachment])
        read = console.wait_line("rw read:")
        assert read == f"{VIRTIOFS} rw read: {HOST_TEXT} {rw_namespace}"
        console.wait_line("rw wrote")
        guest_file = provider.namespace_dir(rw_namespace) / "from-guest.txt"
        assert guest_file.read_text() == f"written in guest {allocation}\n"

        # Read-only: the device cannot say so on this libvirt, so a writable host directory is
        # refused (here the namespace itself, not the read-only bind mount of it)...
        with pytest.raises(HostError) as refused_attach:
            backend.attach_filesystem(
                allocation, provider.namespace_dir(ro_namespace), ro_tag, read_only=True
            )
        assert refused_attach.value.error_type == HostErrorType.STORAGE_ERROR
        assert ro_tag not in parse_domain(domain.XMLDesc(0)).filesystems
        # ...and through the agent's mount the guest reads, and its write is refused by the
        # host's read-only mount.
        mount(ro_attachment, ro_namespace, WriteMode.READ_ONLY)
        read = console.wait_line("ro read:")
        assert read == f"{VIRTIOFS} ro read: {HOST_TEXT} {ro_namespace}"
        refused = console.wait_line("ro write")
        assert refused.startswith(f"{VIRTIOFS} ro write refused:"), refused
        assert "Read-only file system" in refused
        assert not (provider.namespace_dir(ro_namespace) / "from-guest.txt").exists()
        console.wait_line("checks done")
        for flags in (0, libvirt.VIR_DOMAIN_XML_INACTIVE):  # live, and in the definition
            assert parse_domain(domain.XMLDesc(flags)).filesystems == expected
        # A retried mount task adopts what is there.
        again = mount(rw_attachment, rw_namespace, WriteMode.SINGLE_WRITER)
        assert guest_phase(again, GUEST_ATTACH_PHASE) == f"virtiofs {rw_tag} already attached"

        # Detach while the guest has it mounted: out of the VM (virtiofsd stopped), then off
        # the host; the guest's mount has lost its device.
        detached = unmount(rw_attachment)
        assert guest_phase(detached, GUEST_DETACH_PHASE) == f"virtiofs {rw_tag} detached live"
        wait_for(
            lambda: virtiofsd_serving(points[rw_attachment]) == [],
            10,
            lambda: f"virtiofsd still serving {points[rw_attachment]} after the detach",
        )
        gone = console.wait_line("rw gone:")
        assert "Transport endpoint is not connected" in gone, gone
        for flags in (0, libvirt.VIR_DOMAIN_XML_INACTIVE):
            assert rw_tag not in parse_domain(domain.XMLDesc(flags)).filesystems
        assert not points[rw_attachment].exists()
        assert guest_file.exists()  # the namespace's data stays on the provider
        assert virtiofsd_serving(points[ro_attachment])  # the other attachment is untouched

    expected = {rw_tag: str(points[rw_attachment]), ro_tag: str(points[ro_attachment])}
    try:
        try:
            backend.provision_slice_vm(spec, RecordingProgress())
            exercise_attachments(qemu_connection.lookupByName(f"gpc-{allocation}"))
        finally:
            released = backend.release_slice_vm(release, RecordingProgress())
        assert released.released
        # The VM's release stopped the read-only attachment's virtiofsd with the guest; its
        # detach afterwards finds no VM and takes the mount off the host.
        wait_for(
            lambda: virtiofsd_serving(points[ro_attachment]) == [],
            10,
            lambda: f"virtiofsd still serving {points[ro_attachment]} after the VM's release",
        )
        detached = unmount(ro_attachment)
        assert guest_phase(detached, GUEST_DETACH_PHASE) == "no VM: nothing attached"
        assert not points[ro_attachment].exists()
    finally:
        for point in points.values():  # what a failed test left mounted
            if KernelBindMounter().is_mounted(point):
                with contextlib.suppress(MountFailed):
                    KernelBindMounter().unmount(point)
