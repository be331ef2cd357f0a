"""The post-release GPU health check (agent/gpu_health.py) on a sysfs tree laid out as the kernel
lays it out: `bus/pci/devices/<address>` a symlink into `devices/pci…/`, the device's `driver` a
relative symlink into `bus/pci/drivers/<name>`, `config` the device's real config-space bytes.
Plus a slice VM released on libvirt's test driver with the check reading that tree: a GPU libvirt
handed back to the NVIDIA driver (`managed='yes'`) is healthy and is not quarantined."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.gpu_health import (
    DEFAULT_EXPECTED_DRIVERS,
    SysfsGpuHealthCheck,
    bound_driver,
)
from tests.test_agent_libvirt import (  # the libvirt test-driver host and its specs
    NODE1_GPUS,
    Host,
    RecordingProgress,
    host,  # noqa: F401 - a fixture
    provision_spec,
    release_spec,
)

NVIDIA = 0x10DE
H100_SXM = 0x2330


def config_header(vendor: int = NVIDIA, device: int = H100_SXM) -> bytes:
    """The first 64 bytes of an H100's config space: ids, command (memory + bus master), status
    (capability list), revision a1, class 0x030200 (3D controller), a 64-bit BAR0, the subsystem
    ids, the capability pointer and the interrupt pin."""
    header = bytearray(64)
    header[0:4] = vendor.to_bytes(2, "little") + device.to_bytes(2, "little")
    header[4:8] = bytes.fromhex("06051000")
    header[8:12] = bytes.fromhex("a1000203")
    header[0x10:0x14] = bytes.fromhex("040000e0")
    header[0x2C:0x30] = bytes.fromhex("de10c116")
    header[0x34] = 0x60
    header[0x3C:0x3E] = bytes.fromhex("ff01")
    return bytes(header) + b"\0" * 192  # the rest of the 256-byte conventional space


class FakeSysfs:
    """A sysfs tree under `root` (pass `root` as the check's sysfs root)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        (root / "bus/pci/drivers").mkdir(parents=True, exist_ok=True)

    def device_dir(self, address: str) -> Path:
        return self.root / "devices" / f"pci{address[:4]}:{address[5:7]}" / address

    def add_gpu(
        self,
        address: str,
        *,
        driver: str | None = "nvidia",
        config: bytes | None = None,
        vendor: int = NVIDIA,
        device: int = H100_SXM,
        numa_node: int = 0,
    ) -> Path:
        path = self.device_dir(address)
        path.mkdir(parents=True)
        (path / "config").write_bytes(config if config is not None else config_header(vendor))
        (path / "vendor").write_text(f"{vendor:#06x}\n")
        (path / "device").write_text(f"{device:#06x}\n")
        (path / "class").write_text("0x030200\n")
        (path / "numa_node").write_text(f"{numa_node}\n")
        (self.root / "bus/pci/devices" / address).symlink_to(
            Path("../../..") / path.relative_to(self.root)
        )
        self.bind(address, driver)
        return path

    def bind(self, address: str, driver: str | None) -> None:
        link = self.device_dir(address) / "driver"
        if link.is_symlink():
            link.unlink()
        if driver is not None:
            (self.root / "bus/pci/drivers" / driver).mkdir(exist_ok=True)
            link.symlink_to(Path("../../../bus/pci/drivers") / driver)

    def fall_off_the_bus(self, address: str) -> None:
        (self.device_dir(address) / "config").write_bytes(b"\xff" * 256)


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


def test_a_gpu_libvirt_gave_back_to_the_nvidia_driver_is_healthy(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", driver="nvidia")
    sysfs.add_gpu("0000:3d:00.0", driver="vfio-pci")
    check = SysfsGpuHealthCheck(sysfs.root)
    assert check.check("0000:17:00.0") is None
    assert check.check("0000:3d:00.0") is None
    assert check.check("0000:17:00.0".upper()) is None
    assert {"vfio-pci", "nvidia"} == DEFAULT_EXPECTED_DRIVERS


def test_all_ones_config_space_means_fallen_off_the_bus(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", driver="nvidia")
    sysfs.fall_off_the_bus("0000:17:00.0")
    reason = SysfsGpuHealthCheck(sysfs.root).check("0000:17:00.0") or ""
    assert "all-ones" in reason
    assert "0xffff" in reason
    assert "fell off the bus" in reason


def test_a_missing_device_is_unhealthy(sysfs: FakeSysfs) -> None:
    assert SysfsGpuHealthCheck(sysfs.root).check("0000:9a:00.0") == (
        "device not present in sysfs (removed from the PCI bus)"
    )


def test_an_unexpected_driver_is_reported_by_node_policy(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", driver="nouveau")
    assert SysfsGpuHealthCheck(sysfs.root).check("0000:17:00.0") == (
        "bound to nouveau (expected nvidia or vfio-pci)"
    )
    # A node whose policy keeps GPUs on VFIO: the NVIDIA driver is unexpected there.
    sysfs.add_gpu("0000:3d:00.0", driver="nvidia")
    vfio_only = SysfsGpuHealthCheck(sysfs.root, expected_drivers={"vfio-pci"})
    assert vfio_only.check("0000:3d:00.0") == "bound to nvidia (expected vfio-pci)"
    # A node that runs nouveau on purpose, and one that accepts any bound driver.
    nouveau = SysfsGpuHealthCheck(sysfs.root, expected_drivers=["nouveau"])
    assert nouveau.check("0000:17:00.0") is None
    assert SysfsGpuHealthCheck(sysfs.root, expected_drivers=None).check("0000:17:00.0") is None
    with pytest.raises(ValueError, match="empty"):
        SysfsGpuHealthCheck(sysfs.root, expected_drivers=[])


def test_an_unbound_gpu_passes_only_where_policy_allows(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", driver=None)
    assert SysfsGpuHealthCheck(sysfs.root).check("0000:17:00.0") == (
        "bound to no driver (expected nvidia or vfio-pci)"
    )
    assert SysfsGpuHealthCheck(sysfs.root, expected_drivers=None).check("0000:17:00.0") == (
        "bound to no driver (expected a driver)"
    )
    assert SysfsGpuHealthCheck(sysfs.root, allow_unbound=True).check("0000:17:00.0") is None


def test_config_space_problems(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", config=config_header(vendor=0x8086))  # not what was enumerated
    sysfs.add_gpu("0000:3d:00.0", config=b"\xde\x10")
    sysfs.add_gpu("0000:63:00.0", config=b"\0" * 64)
    path = sysfs.add_gpu("0000:86:00.0")
    (path / "config").unlink()
    (path / "config").mkdir()  # unreadable as a file
    check = SysfsGpuHealthCheck(sysfs.root)
    assert check.check("0000:17:00.0") == (
        "PCI config space reads vendor id 0x8086, enumerated as 0x10de"
    )
    assert check.check("0000:3d:00.0") == "PCI config space is truncated (2 bytes)"
    assert check.check("0000:63:00.0") == "PCI config space reads vendor id 0x0000"
    assert check.check("0000:86:00.0") == "PCI config space is not readable (IsADirectoryError)"


def test_only_pci_addresses_are_looked_up(sysfs: FakeSysfs) -> None:
    (sysfs.root / "secret").mkdir()
    check = SysfsGpuHealthCheck(sysfs.root)
    for bad in ("../../secret", "", "0000:17:00.0/../..", "17:00.0"):
        assert (check.check(bad) or "").startswith("not a PCI address")


def test_the_check_is_read_only(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu("0000:17:00.0", driver="nvidia")
    sysfs.add_gpu("0000:3d:00.0", driver="vfio-pci")
    sysfs.fall_off_the_bus("0000:3d:00.0")

    def tree() -> dict[str, tuple[int, int, bytes | str]]:
        out: dict[str, tuple[int, int, bytes | str]] = {}
        for p in sorted(sysfs.root.rglob("*")):
            st = p.lstat()
            content: bytes | str = (
                str(p.readlink()) if p.is_symlink() else p.read_bytes() if p.is_file() else ""
            )
            out[str(p)] = (st.st_mode, st.st_mtime_ns, content)
        return out

    before = tree()
    check = SysfsGpuHealthCheck(sysfs.root)
    for address in ("0000:17:00.0", "0000:3d:00.0", "0000:9a:00.0"):
        check.check(address)
    assert tree() == before


def test_bound_driver_reads_the_link_only(sysfs: FakeSysfs) -> None:
    path = sysfs.add_gpu("0000:17:00.0", driver="nvidia")
    assert bound_driver(path) == "nvidia"
    (sysfs.root / "bus/pci/drivers/nvidia").rmdir()  # a dangling link still names the driver
    assert bound_driver(path) == "nvidia"
    sysfs.bind("0000:17:00.0", None)
    assert bound_driver(path) is None


# --------------------------------------------------------------------------- on release


def test_release_on_a_managed_hostdev_node_quarantines_only_the_broken_gpu(
    host: Host,  # noqa: F811 - the fixture imported above
    sysfs: FakeSysfs,
) -> None:
    """libvirt's managed hostdevs: after the VM is gone both GPUs are back on the NVIDIA driver;
    one of them reads all-ones. Only that one is reported."""
    healthy, broken = NODE1_GPUS
    for address in NODE1_GPUS:
        sysfs.add_gpu(address, driver="nvidia", numa_node=1)
    backend = host.new_backend(gpu_health=SysfsGpuHealthCheck(sysfs.root))
    backend.provision_slice_vm(provision_spec(), RecordingProgress())
    sysfs.fall_off_the_bus(broken)

    progress = RecordingProgress()
    outcome = backend.release_slice_vm(release_spec(), progress)
    assert [g.pci_address for g in outcome.unhealthy_gpus] == [broken]
    assert "all-ones" in outcome.unhealthy_gpus[0].reason
    checked = [m for phase, _, m in progress.events if phase == "gpus_health_checked"]
    assert checked[-1] == "1 healthy, 1 quarantined"
    assert healthy not in [g.pci_address for g in outcome.unhealthy_gpus]


def test_release_on_a_managed_hostdev_node_with_healthy_gpus_quarantines_none(
    host: Host,  # noqa: F811 - the fixture imported above
    sysfs: FakeSysfs,
) -> None:
    for address in NODE1_GPUS:
        sysfs.add_gpu(address, driver="nvidia", numa_node=1)
    backend = host.new_backend(gpu_health=SysfsGpuHealthCheck(sysfs.root))
    backend.provision_slice_vm(provision_spec(), RecordingProgress())
    progress = RecordingProgress()
    outcome = backend.release_slice_vm(release_spec(), progress)
    assert list(outcome.unhealthy_gpus) == []
    checked = [m for phase, _, m in progress.events if phase == "gpus_health_checked"]
    assert checked[-1] == "2 healthy, 0 quarantined"
