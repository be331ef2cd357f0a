"""Libvirt-test hosts: one node's real host backends running against libvirt's test driver.

For a node (its GPUs: PCI address + NUMA node; its NUMA layout from the nodes table), this writes
under `state_dir` (e.g. .state/libvirt-hosts/<node id>/):

  host.xml      a test-driver host (test:///abs/path/host.xml): CPUs and memory per NUMA cell, a
                `<topology><cells>` block (the test driver builds no NUMA cells from a custom file,
                so the slice backend reads this block instead), and one NVIDIA PCI node
                device (vendor 0x10de, class 0x030200, its own IOMMU group) per GPU
  images/       a tiny base image per catalog name; its content is chosen so that its sha256 is
                the demo catalog's stand-in digest (sim.demo_fleet.image_sha256_for)
  root/         a system root standing for "/" with minimal etc/passwd, group, shadow, gshadow
  seeds/, state/  the slice backend's cloud-init seeds, disks and GPU leases

and builds `NodeHostBackend(slice=LibvirtSliceBackend(...),
baremetal=FileBaremetalUserBackend(...))` with a fixed guest address derived from the node id,
and simulated session termination and GPU scrubbing (recorded: nothing is killed or cleared).
A `test:///` connection keeps its domains only while it is open: `LibvirtTestHost` holds one for
the process lifetime; `close()` ends it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt

from agent.backends.baremetal_users import FileBaremetalUserBackend
from agent.backends.composite import NodeHostBackend
from agent.backends.domain_xml import PciAddress
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.backends.readiness import FixedAddressProbe
from agent.backends.system_root import SystemRoot
from sim.demo_fleet import DEMO_IMAGE, image_sha256_for

logger = logging.getLogger("sim.libvirt_hosts")

DEFAULT_IMAGE = "ubuntu-22.04-cuda"  # schema.models.Sku.image's default
DEFAULT_IMAGES = (DEFAULT_IMAGE, DEMO_IMAGE)
DEFAULT_NUMA_CELLS = 2
DEFAULT_CPUS_PER_CELL = 16
DEFAULT_MEMORY_MB_PER_CELL = 64 * 1024
NVIDIA_VENDOR = "0x10de"
GPU_CLASS = "0x030200"  # 3D controller
GPU_PRODUCT = ("0x2330", "GH100 [H100 SXM5 80GB]")
FIRST_IOMMU_GROUP = 20

_MINIMAL_ACCOUNTS = {
    "etc/passwd": ("root:x:0:0:root:/root:/bin/bash\n", 0o644),
    "etc/group": ("root:x:0:\n", 0o644),
    "etc/shadow": ("root:*:19000:0:99999:7:::\n", 0o600),
    "etc/gshadow": ("root:*::\n", 0o600),
}


@dataclass(frozen=True)
class GpuPlacement:
    pci_address: str
    numa_node: int


@dataclass(frozen=True)
class NumaCell:
    id: int
    cpus: tuple[int, ...]
    memory_mb: int


class SimulatedSessionTerminator:
    """Stands for `loginctl terminate-user` + SIGKILL: records the call, ends nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def terminate(self, username: str, uid: int) -> int:
        with self._lock:
            self.calls.append((username, uid))
        return 0


class SimulatedGpuScrubber:
    """Stands for the vendor's GPU memory scrub: counts the calls, clears nothing."""

    def __init__(self) -> None:
        self.scrubs = 0
        self._lock = threading.Lock()

    def scrub(self) -> str:
        with self._lock:
            self.scrubs += 1
        return "GPU memory scrub simulated (libvirt-test host)"


def parse_cpuset(text: str) -> tuple[int, ...]:
    """ "0-3,8" -> (0, 1, 2, 3, 8)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(cpus))


def numa_cells(
    numa_layout: Sequence[Mapping[str, Any]], gpus: Sequence[GpuPlacement] = ()
) -> list[NumaCell]:
    """Cells from the nodes table's numa_layout (`numa_node`, `cpus` as a cpuset, `memory_mb`);
    without one, DEFAULT_NUMA_CELLS cells (more if a GPU sits on a higher NUMA node) of
    DEFAULT_CPUS_PER_CELL CPUs each."""
    cells: list[NumaCell] = []
    for entry in numa_layout:
        cell_id = int(entry.get("numa_node", len(cells)))
        cpus = parse_cpuset(str(entry.get("cpus", "")))
        memory_mb = int(entry.get("memory_mb") or DEFAULT_MEMORY_MB_PER_CELL)
        cells.append(NumaCell(cell_id, cpus, memory_mb))
    if cells and all(c.cpus for c in cells):
        return sorted(cells, key=lambda c: c.id)
    count = max([DEFAULT_NUMA_CELLS, *(g.numa_node + 1 for g in gpus)])
    return [
        NumaCell(
            n,
            tuple(range(n * DEFAULT_CPUS_PER_CELL, (n + 1) * DEFAULT_CPUS_PER_CELL)),
            DEFAULT_MEMORY_MB_PER_CELL,
        )
        for n in range(count)
    ]


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrs)
    if text is not None:
        element.text = text
    return element


def host_xml(cells: Sequence[NumaCell], gpus: Sequence[GpuPlacement]) -> str:
    """A libvirt test-driver host document (same shape as tests/data/libvirt/host.xml)."""
    root = ET.Element("node")
    cpu = _sub(root, "cpu")
    total_cpus = sum(len(c.cpus) for c in cells)
    _sub(cpu, "mhz", "2400")
    _sub(cpu, "model", "x86_64")
    _sub(cpu, "active", str(total_cpus))
    _sub(cpu, "nodes", str(len(cells)))
    _sub(cpu, "sockets", str(len(cells)))
    _sub(cpu, "cores", str(max(len(c.cpus) for c in cells)))
    _sub(cpu, "threads", "1")
    _sub(root, "memory", str(sum(c.memory_mb for c in cells) * 1024))
    topology_cells = _sub(_sub(root, "topology"), "cells", num=str(len(cells)))
    for socket, cell in enumerate(cells):
        element = _sub(topology_cells, "cell", id=str(cell.id))
        _sub(element, "memory", str(cell.memory_mb * 1024), unit="KiB")
        cpus = _sub(element, "cpus", num=str(len(cell.cpus)))
        for core, cpu_id in enumerate(cell.cpus):
            _sub(
                cpus,
                "cpu",
                id=str(cpu_id),
                socket_id=str(socket),
                core_id=str(core),
                siblings=str(cpu_id),
            )
    for index, gpu in enumerate(gpus):
        address = PciAddress.parse(gpu.pci_address)
        device = _sub(root, "device")
        _sub(device, "name", address.nodedev_name)
        _sub(device, "parent", "computer")
        cap = _sub(device, "capability", type="pci")
        _sub(cap, "class", GPU_CLASS)
        _sub(cap, "domain", str(address.domain))
        _sub(cap, "bus", str(address.bus))
        _sub(cap, "slot", str(address.slot))
        _sub(cap, "function", str(address.function))
        _sub(cap, "product", GPU_PRODUCT[1], id=GPU_PRODUCT[0])
        _sub(cap, "vendor", "NVIDIA Corporation", id=NVIDIA_VENDOR)
        group = _sub(cap, "iommuGroup", number=str(FIRST_IOMMU_GROUP + index))
        _sub(
            group,
            "address",
            domain=f"0x{address.domain:04x}",
            bus=f"0x{address.bus:02x}",
            slot=f"0x{address.slot:02x}",
            function=f"0x{address.function:x}",
        )
        _sub(cap, "numa", node=str(gpu.numa_node))
    ET.indent(root)
    comment = (
        "<!-- Generated by sim/libvirt_hosts.py for libvirt's test driver; the <topology> block is"
        " read by the backend (the test driver ignores it). -->\n"
    )
    return comment + ET.tostring(root, encoding="unicode") + "\n"


def guest_address(node_id: str) -> str:
    """A stable 10.x.y.z address for the node's guests (the fixed-address readiness probe)."""
    digest = hashlib.sha256(node_id.encode()).digest()
    return f"10.{digest[0]}.{digest[1]}.{digest[2] % 254 + 1}"


def image_content(name: str) -> bytes:
    """Bytes whose sha256 is the demo catalog's stand-in digest for `name`."""
    return f"gpucloud-sim-image:{name}".encode()


def write_images(image_dir: Path, names: Iterable[str]) -> dict[str, str]:
    """One tiny base image per name; answers the catalog (name -> sha256)."""
    image_dir.mkdir(parents=True, exist_ok=True)
    catalog: dict[str, str] = {}
    for name in dict.fromkeys(n for n in names if n):
        if "/" in name or name.startswith("."):
            raise ValueError(f"image name {name!r} is not a plain file name")
        content = image_content(name)
        path = image_dir / name
        if not path.is_file() or path.read_bytes() != content:
            path.write_bytes(content)
        catalog[name] = hashlib.sha256(content).hexdigest()
        assert catalog[name] == image_sha256_for(name)
    return catalog


def prepare_system_root(path: Path) -> SystemRoot:
    """A directory standing for "/" with the account databases a fresh host has (kept as they
    are when present: users of allocations still active survive a restart)."""
    for relative, (text, mode) in _MINIMAL_ACCOUNTS.items():
        target = path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.write_text(text)
            target.chmod(mode)
    (path / "home").mkdir(exist_ok=True)
    return SystemRoot(path, apply_ownership=False)


def _quiet_libvirt(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; the backend raises and classifies them."""


@dataclass
class LibvirtTestHost:
    """One node's backend and what it holds: the open test-driver connection and its files."""

    node_id: str
    directory: Path
    xml_path: Path
    system_root: SystemRoot
    backend: NodeHostBackend
    slice_backend: LibvirtSliceBackend
    baremetal_backend: FileBaremetalUserBackend
    sessions: SimulatedSessionTerminator
    scrubber: SimulatedGpuScrubber
    connection: Any = field(repr=False)

    @property
    def uri(self) -> str:
        return f"test://{self.xml_path}"

    def close(self) -> None:
        """End the connection (and with it every test-driver domain of this node)."""
        self.slice_backend.close()


def build_libvirt_test_host(
    node_id: str,
    gpus: Sequence[GpuPlacement],
    state_dir: Path | str,
    *,
    numa_layout: Sequence[Mapping[str, Any]] = (),
    images: Iterable[str] = (),
    poll_interval_s: float = 0.05,
    shutdown_timeout_s: float = 5.0,
    system_root: Path | None = None,
) -> LibvirtTestHost:
    """Write the node's files under `state_dir/<node_id>/` and build its backend (connected).
    `system_root`: the node's "/" when it has one already (a simulated machine's disk, so its
    tenant accounts and its maintenance tasks share it); default `<node dir>/root`."""
    directory = Path(state_dir).resolve() / node_id
    directory.mkdir(parents=True, exist_ok=True)
    cells = numa_cells(numa_layout, gpus)
    xml_text = host_xml(cells, gpus)
    xml_path = directory / "host.xml"
    xml_path.write_text(xml_text)
    catalog = write_images(directory / "images", [*DEFAULT_IMAGES, *images])
    root = prepare_system_root(system_root or directory / "root")
    address = guest_address(node_id)

    libvirt.registerErrorHandler(_quiet_libvirt, None)
    uri = f"test://{xml_path}"
    connection = libvirt.open(uri)
    slice_backend = LibvirtSliceBackend(
        uri,
        image_dir=directory / "images",
        image_catalog=catalog,
        seed_dir=directory / "seeds",
        state_dir=directory / "state",
        readiness=FixedAddressProbe(address),
        default_image=DEFAULT_IMAGE,
        connection=connection,
        shutdown_timeout_s=shutdown_timeout_s,
        poll_interval_s=poll_interval_s,
    )
    sessions = SimulatedSessionTerminator()
    scrubber = SimulatedGpuScrubber()
    baremetal_backend = FileBaremetalUserBackend(
        root, connect_host=address, sessions=sessions, scrubber=scrubber
    )
    logger.info("node %s: libvirt-test host %s with %d GPU(s)", node_id, xml_path, len(gpus))
    return LibvirtTestHost(
        node_id=node_id,
        directory=directory,
        xml_path=xml_path,
        system_root=root,
        backend=NodeHostBackend(slice=slice_backend, baremetal=baremetal_backend),
        slice_backend=slice_backend,
        baremetal_backend=baremetal_backend,
        sessions=sessions,
        scrubber=scrubber,
        connection=connection,
    )
