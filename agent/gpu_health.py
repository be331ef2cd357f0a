"""Health of a GPU after its VM released it. Some GPUs read all-ones from PCI config space after
a failed function-level reset, until the host reboots; handing such a GPU to the next tenant
fails that tenant's VM. A GPU must also be bound back to vfio-pci (libvirt's managed hostdev
does the rebinding; this only checks). Read-only: nothing here resets or rebinds a device."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

VFIO_DRIVER = "vfio-pci"


class GpuHealthCheck(Protocol):
    def check(self, pci_address: str) -> str | None:
        """None when healthy, else why not (short, no secrets)."""
        ...


class SysfsGpuHealthCheck:
    def __init__(self, sysfs_root: Path | str = "/sys") -> None:
        self._devices = Path(sysfs_root) / "bus" / "pci" / "devices"

    def check(self, pci_address: str) -> str | None:
        device = self._devices / pci_address
        try:
            header = (device / "config").read_bytes()[:4]
        except OSError:
            return "PCI config space is not readable"
        if len(header) < 4 or header == b"\xff\xff\xff\xff":
            return "PCI config space reads all-ones (failed function-level reset; reboot the host)"
        driver = device / "driver"
        bound = driver.resolve().name if driver.is_symlink() else None
        if bound != VFIO_DRIVER:
            return f"not bound to {VFIO_DRIVER} (bound to {bound or 'no driver'})"
        return None
