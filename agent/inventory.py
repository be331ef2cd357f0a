"""GPU inventory of this node, for heartbeats: model, memory, PCI address and NUMA node of each
GPU, so the control plane's slice slots match the hardware.

Two probes, both strictly read-only (they never reset a GPU or change any setting):

- `probe_nvml()`: NVIDIA's NVML through the official binding (`nvidia-ml-py`, imported lazily as
  `pynvml`), calling only nvmlInit, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
  nvmlDeviceGetName, nvmlDeviceGetMemoryInfo, nvmlDeviceGetPciInfo and nvmlShutdown. The NUMA
  node is read from sysfs for the PCI address NVML reports.
- `probe_sysfs()`: the kernel's PCI device tree (`<sysfs>/bus/pci/devices/<address>/`): vendor
  0x10de with a display class (0x0300xx VGA, 0x0302xx 3D controller). The model comes from a
  small table of device ids (else "NVIDIA <device id>"). Memory is None: the BAR sizes in the
  `resource` file are apertures, not VRAM (BAR1 is 256 MiB on many boards, and larger or smaller
  than VRAM on others), so they cannot be reported as memory.

`probe_gpus()` uses NVML where it imports and initialises, and sysfs otherwise. Indices follow
PCI bus order on both paths (NVML's default enumeration order), so they agree.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("agent.inventory")

NVIDIA_VENDOR_ID = 0x10DE
# PCI class codes (class << 8 | subclass): display controllers GPUs appear as.
_GPU_CLASSES = frozenset({0x0300, 0x0302})

# Device id -> name as NVML reports it, for the sysfs path (NVML reports the name itself).
NVIDIA_MODELS: dict[int, str] = {
    0x1DB1: "Tesla V100-SXM2-16GB",
    0x1DB4: "Tesla V100-PCIE-16GB",
    0x1DB5: "Tesla V100-SXM2-32GB",
    0x1EB8: "Tesla T4",
    0x20B0: "NVIDIA A100-SXM4-40GB",
    0x20B2: "NVIDIA A100-SXM4-80GB",
    0x20B5: "NVIDIA A100 80GB PCIe",
    0x20B7: "NVIDIA A30",
    0x20F1: "NVIDIA A100-PCIE-40GB",
    0x2230: "NVIDIA RTX A6000",
    0x2235: "NVIDIA A40",
    0x2236: "NVIDIA A10",
    0x2321: "NVIDIA H100 NVL",
    0x2330: "NVIDIA H100 80GB HBM3",
    0x2331: "NVIDIA H100 PCIe",
    0x2335: "NVIDIA H200",
    0x26B5: "NVIDIA L40",
    0x26B9: "NVIDIA L40S",
    0x27B8: "NVIDIA L4",
}

DEFAULT_SYSFS_ROOT = Path("/sys")


@dataclass(frozen=True)
class GpuRecord:
    index: int
    pci_address: str  # "0000:17:00.0", lower case, 4-digit domain
    vendor_id: int
    device_id: int
    model: str
    memory_mib: int | None  # None where the probe cannot know (sysfs)
    numa_node: int | None  # None where the kernel reports no affinity (-1) or nothing
    source: str = "sysfs"  # "sysfs" | "nvml"


class InventoryUnavailable(Exception):
    """The probe cannot run here (no NVML library, no driver, no sysfs tree)."""


def normalize_pci_address(address: str) -> str:
    """NVML's "00000000:17:00.0" (or any case) -> sysfs's "0000:17:00.0"."""
    text = address.strip().lower()
    domain, rest = text.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def model_name(device_id: int) -> str:
    return NVIDIA_MODELS.get(device_id, f"NVIDIA {device_id:#06x}")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_hex(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def numa_node_of(pci_address: str, sysfs_root: Path | str = DEFAULT_SYSFS_ROOT) -> int | None:
    text = _read(Path(sysfs_root) / "bus/pci/devices" / pci_address / "numa_node")
    try:
        node = int(text) if text else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def probe_sysfs(sysfs_root: Path | str = DEFAULT_SYSFS_ROOT) -> list[GpuRecord]:
    """NVIDIA GPUs in the PCI device tree, in PCI address order. Reads files only."""
    devices = Path(sysfs_root) / "bus/pci/devices"
    if not devices.is_dir():
        raise InventoryUnavailable(f"{devices} is not a directory")
    records: list[GpuRecord] = []
    for entry in sorted(devices.iterdir(), key=lambda p: p.name):
        vendor = _read_hex(entry / "vendor")
        pci_class = _read_hex(entry / "class")
        device = _read_hex(entry / "device")
        if vendor != NVIDIA_VENDOR_ID or pci_class is None or device is None:
            continue
        if pci_class >> 8 not in _GPU_CLASSES:
            continue  # the GPU's audio function, NVSwitch bridges, ...
        address = normalize_pci_address(entry.name)
        records.append(
            GpuRecord(
                index=len(records),
                pci_address=address,
                vendor_id=vendor,
                device_id=device,
                model=model_name(device),
                memory_mib=None,
                numa_node=numa_node_of(entry.name, sysfs_root),
                source="sysfs",
            )
        )
    return records


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load_nvml() -> Any:
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError as err:
        raise InventoryUnavailable("the NVML binding (nvidia-ml-py) is not installed") from err
    return pynvml


def probe_nvml(sysfs_root: Path | str = DEFAULT_SYSFS_ROOT) -> list[GpuRecord]:
    """GPUs as NVML reports them. Read-only NVML calls only; InventoryUnavailable where the
    binding, the library or the driver is missing."""
    nvml = _load_nvml()
    try:
        nvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise InventoryUnavailable(f"NVML did not initialise: {type(err).__name__}") from err
    try:
        records = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            pci = nvml.nvmlDeviceGetPciInfo(handle)
            address = normalize_pci_address(_text(pci.busId))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            # pciDeviceId packs the device id in the high 16 bits and the vendor in the low ones.
            combined = int(pci.pciDeviceId)
            records.append(
                GpuRecord(
                    index=index,
                    pci_address=address,
                    vendor_id=combined & 0xFFFF,
                    device_id=combined >> 16,
                    model=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_mib=int(memory.total) // (1024 * 1024),
                    numa_node=numa_node_of(address, sysfs_root),
                    source="nvml",
                )
            )
        return records
    except nvml.NVMLError as err:
        raise InventoryUnavailable(f"NVML query failed: {type(err).__name__}") from err
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def probe_gpus(
    sysfs_root: Path | str = DEFAULT_SYSFS_ROOT, *, use_nvml: bool = True
) -> list[GpuRecord]:
    """NVML where present, else sysfs; [] on a node with neither (no GPUs to offer)."""
    if use_nvml:
        try:
            return probe_nvml(sysfs_root)
        except InventoryUnavailable as err:
            logger.info("GPU inventory from sysfs: %s", err)
    try:
        return probe_sysfs(sysfs_root)
    except InventoryUnavailable as err:
        logger.warning("no GPU inventory: %s", err)
        return []


class GpuInventory:
    """The probe as an object the agent holds: `GpuInventory().probe()` for its heartbeats."""

    def __init__(self, sysfs_root: Path | str = DEFAULT_SYSFS_ROOT, *, use_nvml: bool = True):
        self.sysfs_root = Path(sysfs_root)
        self.use_nvml = use_nvml

    def probe(self) -> list[GpuRecord]:
        return probe_gpus(self.sysfs_root, use_nvml=self.use_nvml)
