"""GPU inventory: the sysfs probe against a tree each test builds (runs everywhere), the NVML probe
where a GPU and the NVML library are present (skipped with the reason otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import inventory
from agent.inventory import (
    GpuInventory,
    GpuRecord,
    InventoryUnavailable,
    normalize_pci_address,
    probe_gpus,
    probe_nvml,
    probe_sysfs,
)


def add_device(
    sysfs: Path,
    address: str,
    *,
    vendor: str,
    device: str,
    pci_class: str,
    numa_node: str | None = "0",
) -> Path:
    path = sysfs / "bus/pci/devices" / address
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")
    (path / "class").write_text(pci_class + "\n")
    if numa_node is not None:
        (path / "numa_node").write_text(numa_node + "\n")
    # What a real device directory also has; the probe must not need or touch it.
    (path / "resource").write_text("0x00000000d0000000 0x00000000d0ffffff 0x0000000000040200\n")
    return path


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    # Two H100 SXM on NUMA node 0, two on node 1 (listed out of order on purpose).
    add_device(root, "0000:cb:00.0", vendor="0x10de", device="0x2330", pci_class="0x030200",
               numa_node="1")  # fmt: skip
    add_device(root, "0000:18:00.0", vendor="0x10de", device="0x2330", pci_class="0x030200")
    add_device(root, "0000:2a:00.0", vendor="0x10de", device="0x2330", pci_class="0x030200")
    add_device(root, "0000:ba:00.0", vendor="0x10de", device="0x2330", pci_class="0x030200",
               numa_node="1")  # fmt: skip
    # Not GPUs: a NIC, the host bridge, an NVIDIA audio function and an NVSwitch bridge.
    add_device(root, "0000:17:00.0", vendor="0x15b3", device="0x1021", pci_class="0x020000")
    add_device(root, "0000:00:00.0", vendor="0x8086", device="0x09a2", pci_class="0x060000")
    add_device(root, "0000:18:00.1", vendor="0x10de", device="0x22ba", pci_class="0x040300")
    add_device(root, "0000:05:00.0", vendor="0x10de", device="0x22a3", pci_class="0x068000")
    return root


def test_sysfs_lists_gpus_in_pci_order_with_numa_nodes(sysfs: Path) -> None:
    records = probe_sysfs(sysfs)
    assert [r.pci_address for r in records] == [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:ba:00.0",
        "0000:cb:00.0",
    ]
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert [r.numa_node for r in records] == [0, 0, 1, 1]
    assert records[0] == GpuRecord(
        index=0,
        pci_address="0000:18:00.0",
        vendor_id=0x10DE,
        device_id=0x2330,
        model="NVIDIA H100 80GB HBM3",
        memory_mib=None,  # BARs are apertures, not VRAM: sysfs cannot tell
        numa_node=0,
        source="sysfs",
    )


def test_sysfs_handles_unknown_numa_unknown_model_and_vga_class(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    add_device(root, "0000:01:00.0", vendor="0x10de", device="0x1234", pci_class="0x030000",
               numa_node="-1")  # fmt: skip
    add_device(root, "0000:02:00.0", vendor="0x10de", device="0x27b8", pci_class="0x030200",
               numa_node=None)  # fmt: skip
    add_device(root, "0000:03:00.0", vendor="0x10de", device="0x27b8", pci_class="0x030200",
               numa_node="garbage")  # fmt: skip
    records = probe_sysfs(root)
    assert [(r.model, r.numa_node) for r in records] == [
        ("NVIDIA 0x1234", None),
        ("NVIDIA L4", None),
        ("NVIDIA L4", None),
    ]


def test_sysfs_without_gpus_and_without_a_tree(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    add_device(root, "0000:00:00.0", vendor="0x8086", device="0x09a2", pci_class="0x060000")
    assert probe_sysfs(root) == []
    with pytest.raises(InventoryUnavailable):
        probe_sysfs(tmp_path / "missing")
    assert probe_gpus(tmp_path / "missing", use_nvml=False) == []


def test_probe_is_read_only(sysfs: Path) -> None:
    def tree() -> dict[str, tuple[int, bytes]]:
        return {
            str(p): (p.stat().st_mode, p.read_bytes())
            for p in sorted(sysfs.rglob("*"))
            if p.is_file()
        }

    before = tree()
    probe_sysfs(sysfs)
    GpuInventory(sysfs, use_nvml=False).probe()
    assert tree() == before


def test_probe_gpus_falls_back_to_sysfs_without_nvml(
    sysfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_nvml() -> object:
        raise InventoryUnavailable("the NVML binding (nvidia-ml-py) is not installed")

    monkeypatch.setattr(inventory, "_load_nvml", no_nvml)
    records = GpuInventory(sysfs).probe()
    assert len(records) == 4
    assert {r.source for r in records} == {"sysfs"}


def test_pci_address_normalisation() -> None:
    assert normalize_pci_address("00000000:CB:00.0") == "0000:cb:00.0"
    assert normalize_pci_address("0000:18:00.0") == "0000:18:00.0"


def _nvml_reason() -> str | None:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"NVML does not initialise here ({type(err).__name__}): no NVIDIA driver or GPU"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML sees no GPU on this machine"
    finally:
        pynvml.nvmlShutdown()
    return None


_NVML_MISSING = _nvml_reason()


@pytest.mark.skipif(_NVML_MISSING is not None, reason=str(_NVML_MISSING))
def test_nvml_matches_sysfs_on_a_real_gpu_machine() -> None:
    nvml_records = probe_nvml()
    assert nvml_records, "NVML initialised but listed no GPU"
    for record in nvml_records:
        assert record.source == "nvml"
        assert record.vendor_id == 0x10DE
        assert record.memory_mib is not None
        assert record.memory_mib > 1024
        assert record.model
    # Same GPUs, same order, same NUMA nodes as the kernel's tree (unless some are hidden from
    # this process, e.g. by CUDA_VISIBLE_DEVICES-like container isolation).
    sysfs_records = {r.pci_address: r for r in probe_sysfs()}
    for record in nvml_records:
        if record.pci_address in sysfs_records:
            assert sysfs_records[record.pci_address].numa_node == record.numa_node
            assert sysfs_records[record.pci_address].device_id == record.device_id
    assert [r.source for r in probe_gpus()] == ["nvml"] * len(nvml_records)


class _FakeNvml:
    """Stands in for pynvml where no GPU is present, to check how answers are read. Only the
    read-only calls exist on it: a call to anything else (a reset, a setter) fails the test."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("nvmlDeviceGetCount")
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.calls.append("nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes | str:
        self.calls.append("nvmlDeviceGetName")
        return b"NVIDIA H200" if handle == 0 else "NVIDIA H200"  # old bindings answer bytes

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        self.calls.append("nvmlDeviceGetMemoryInfo")
        return type("Memory", (), {"total": 150754820096, "used": 0, "free": 0})()

    def nvmlDeviceGetPciInfo(self, handle: int) -> object:
        self.calls.append("nvmlDeviceGetPciInfo")
        bus = [b"00000000:18:00.0", "00000000:CB:00.0"][handle]
        return type("Pci", (), {"busId": bus, "pciDeviceId": 0x233510DE})()


def test_nvml_answers_are_read_with_read_only_calls(
    sysfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeNvml()
    monkeypatch.setattr(inventory, "_load_nvml", lambda: fake)
    records = GpuInventory(sysfs).probe()
    assert records == [
        GpuRecord(0, "0000:18:00.0", 0x10DE, 0x2335, "NVIDIA H200", 143771, 0, "nvml"),
        GpuRecord(1, "0000:cb:00.0", 0x10DE, 0x2335, "NVIDIA H200", 143771, 1, "nvml"),
    ]
    assert fake.calls[0] == "nvmlInit"
    assert fake.calls[-1] == "nvmlShutdown"
    assert set(fake.calls) <= {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPciInfo",
    }


def test_nvml_failure_falls_back_to_sysfs(sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()

    def broken(handle: int) -> object:
        raise fake.NVMLError("GPU is lost")

    fake.nvmlDeviceGetMemoryInfo = broken  # type: ignore[method-assign]
    monkeypatch.setattr(inventory, "_load_nvml", lambda: fake)
    records = probe_gpus(sysfs)
    assert [r.source for r in records] == ["sysfs"] * 4
    assert fake.calls[-1] == "nvmlShutdown"
