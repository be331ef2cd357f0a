"""Health of a GPU after its slice VM released it, read from the kernel's PCI tree. Read-only:
nothing here resets, rebinds or writes to a device.

What a real host shows once libvirt has destroyed and undefined a domain whose GPUs were
`<hostdev mode='subsystem' type='pci' managed='yes'>`: libvirt re-attaches each device to the
host. A GPU libvirt itself moved to vfio-pci goes back to the driver it had before the VM started
(libvirt unbinds vfio-pci, clears `driver_override` and re-probes): `nvidia` where the NVIDIA
driver is loaded, `nouveau` on a host that left it in place, none on a host that blacklists both.
A GPU that was already on vfio-pci when libvirt took it (vfio-pci.ids=, driverctl) stays there.
So "bound to vfio-pci" is not what a healthy released GPU looks like on every node: which driver
is right is node policy.

The check, for one PCI address:

1. the device is present in sysfs (`bus/pci/devices/<address>`); gone means it left the bus;
2. its config space is readable and its vendor id is not 0xffff: a read of all-ones means the
   device fell off the bus, typically after a failed function-level reset, until the host
   reboots; handing it to the next tenant would fail that tenant's VM. A vendor id other than
   the one the kernel enumerated (the `vendor` file) is reported too;
3. its bound driver is one node policy expects: `expected_drivers` (default
   `DEFAULT_EXPECTED_DRIVERS` = {"vfio-pci", "nvidia"}: nodes that keep GPUs on VFIO and nodes
   where libvirt hands them back to the NVIDIA driver both pass). `None` accepts any bound
   driver. A GPU bound to no driver fails unless `allow_unbound` (a host that blacklists the
   GPU drivers and lets libvirt bind vfio-pci on each start).

A GPU that passes all three is healthy and is never quarantined.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

VFIO_DRIVER = "vfio-pci"
NVIDIA_DRIVER = "nvidia"
# Node policy when none is configured: a GPU back on vfio-pci or on the NVIDIA driver is fine.
DEFAULT_EXPECTED_DRIVERS: frozenset[str] = frozenset({VFIO_DRIVER, NVIDIA_DRIVER})

# The standard PCI header; the vendor id is its first two bytes (little-endian).
_HEADER_BYTES = 64
_NO_DEVICE = 0xFFFF
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class GpuHealthCheck(Protocol):
    def check(self, pci_address: str) -> str | None:
        """None when healthy, else why not (short, no secrets)."""
        ...


def bound_driver(device: Path) -> str | None:
    """The name of the driver a sysfs device directory is bound to (its `driver` symlink), or
    None. Reads the link only; its target need not exist."""
    try:
        return os.path.basename(os.readlink(device / "driver")) or None
    except OSError:
        return None


class SysfsGpuHealthCheck:
    """`GpuHealthCheck` over `<sysfs_root>/bus/pci/devices` (see the module doc for what it
    checks). `expected_drivers`: the drivers a released GPU may be bound to on this node (None:
    any); `allow_unbound`: whether a GPU bound to no driver passes."""

    def __init__(
        self,
        sysfs_root: Path | str = "/sys",
        *,
        expected_drivers: Iterable[str] | None = DEFAULT_EXPECTED_DRIVERS,
        allow_unbound: bool = False,
    ) -> None:
        self._devices = Path(sysfs_root) / "bus" / "pci" / "devices"
        self.expected_drivers = (
            frozenset(expected_drivers) if expected_drivers is not None else None
        )
        if self.expected_drivers is not None and not self.expected_drivers:
            raise ValueError("expected_drivers is empty: no GPU could ever pass")
        self.allow_unbound = allow_unbound

    def check(self, pci_address: str) -> str | None:
        address = pci_address.strip().lower()
        if not _PCI_ADDRESS.fullmatch(address):
            return f"not a PCI address: {pci_address[:32]!r}"
        device = self._devices / address
        if not device.is_dir():
            return "device not present in sysfs (removed from the PCI bus)"
        problem = self._config_problem(device)
        if problem is not None:
            return problem
        return self._driver_problem(bound_driver(device))

    def _config_problem(self, device: Path) -> str | None:
        try:
            with (device / "config").open("rb") as f:
                header = f.read(_HEADER_BYTES)
        except OSError as err:
            return f"PCI config space is not readable ({type(err).__name__})"
        if len(header) < 4:
            return f"PCI config space is truncated ({len(header)} bytes)"
        vendor = int.from_bytes(header[:2], "little")
        if vendor == _NO_DEVICE:
            return (
                "PCI config space reads all-ones (vendor id 0xffff: the device fell off the bus, "
                "e.g. after a failed function-level reset; reboot the host)"
            )
        if vendor == 0:
            return "PCI config space reads vendor id 0x0000"
        enumerated = _read_hex(device / "vendor")
        if enumerated is not None and enumerated != vendor:
            return (
                f"PCI config space reads vendor id {vendor:#06x}, enumerated as {enumerated:#06x}"
            )
        return None

    def _driver_problem(self, driver: str | None) -> str | None:
        expected = (
            " or ".join(sorted(self.expected_drivers))
            if self.expected_drivers is not None
            else "a driver"
        )
        if driver is None:
            return None if self.allow_unbound else f"bound to no driver (expected {expected})"
        if self.expected_drivers is None or driver in self.expected_drivers:
            return None
        return f"bound to {driver} (expected {expected})"


def _read_hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None
