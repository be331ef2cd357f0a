"""Domain XML for a GPU slice VM, and the bits of libvirt XML the backend reads back (host NUMA
topology from capabilities, PCI node devices, a domain's hostdevs and allocation metadata).

All XML parsed here comes from the local libvirt daemon, not from tenants.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

METADATA_NS = "https://gpucloud.dev/libvirt/slice/1"
METADATA_PREFIX = "gpc"
DOMAIN_PREFIX = "gpc-"
# The libvirt domain types a node's agent may run slices as (`[libvirt] domain_type`): "kvm" in
# production; "qemu" (TCG, software emulation) where KVM is unusable (CI machines whose CPU model
# KVM refuses). The domain XML is the same apart from the type and the KVM-only `<cpu>` element.
# ("test" is libvirt's test driver, chosen by the backend from the connection, never configured.)
DOMAIN_TYPES = ("kvm", "qemu")
DEFAULT_DOMAIN_TYPE = "kvm"


def domain_name(allocation_id: str) -> str:
    return f"{DOMAIN_PREFIX}{allocation_id}"


def _parse(text: str) -> ET.Element:
    return ET.fromstring(text)  # noqa: S314 - libvirt's own XML


# ------------------------------------------------------------------------------ host topology


def parse_numa_topology(xml_text: str) -> dict[int, tuple[int, ...]]:
    """NUMA cell id -> host CPU ids, from capabilities XML (`host/topology/cells/cell`), or from
    any document carrying a `topology/cells` block of the same shape."""
    root = _parse(xml_text)
    cells: dict[int, tuple[int, ...]] = {}
    for cell in root.iter("cell"):
        cell_id = cell.get("id")
        if cell_id is None:
            continue
        cpus = tuple(sorted(int(cpu.get("id", "-1")) for cpu in cell.iter("cpu")))
        cells[int(cell_id)] = tuple(c for c in cpus if c >= 0)
    return cells


def format_cpuset(cpus: Iterable[int]) -> str:
    """[0,1,2,3,8] -> "0-3,8" (libvirt's cpuset syntax)."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif prev is not None and cpu == prev + 1:
            prev = cpu
        else:
            ranges.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = cpu
    if start is not None:
        ranges.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(ranges)


# ------------------------------------------------------------------------------ PCI devices


@dataclass(frozen=True)
class PciAddress:
    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """ "0000:17:00.0" -> PciAddress."""
        dom, bus, rest = text.lower().split(":")
        slot, function = rest.split(".")
        return cls(int(dom, 16), int(bus, 16), int(slot, 16), int(function, 16))

    @property
    def nodedev_name(self) -> str:
        return f"pci_{self.domain:04x}_{self.bus:02x}_{self.slot:02x}_{self.function:x}"

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"


@dataclass(frozen=True)
class PciDevice:
    address: PciAddress
    vendor_id: str
    product_id: str
    device_class: str
    numa_node: int | None


def parse_pci_nodedev(xml_text: str) -> PciDevice:
    root = _parse(xml_text)
    cap = root.find("capability[@type='pci']")
    if cap is None:
        raise ValueError("not a PCI node device")

    def number(tag: str) -> int:
        return int((cap.findtext(tag) or "0").strip(), 0)

    numa = cap.find("numa")
    vendor, product = cap.find("vendor"), cap.find("product")
    return PciDevice(
        address=PciAddress(number("domain"), number("bus"), number("slot"), number("function")),
        vendor_id=(vendor.get("id", "") if vendor is not None else "").lower(),
        product_id=(product.get("id", "") if product is not None else "").lower(),
        device_class=(cap.findtext("class") or "").strip().lower(),
        numa_node=int(numa.get("node", "-1")) if numa is not None else None,
    )


# ------------------------------------------------------------------------------ the domain


@dataclass(frozen=True)
class SliceDomain:
    allocation_id: str
    domain_type: str  # DOMAIN_TYPES ("kvm" in production), or "test" on libvirt's test driver
    vcpus: int
    memory_mib: int
    numa_nodes: tuple[int, ...]
    cpuset: tuple[int, ...]
    gpus: tuple[PciAddress, ...]
    disk_path: str
    disk_format: str  # "qcow2" | "raw"
    seed_path: str
    seed_is_iso: bool
    network: str = "default"
    # The per-allocation bridge (agent/network); when set it replaces the libvirt network.
    bridge: str | None = None
    # The agent's own tap for the NIC, already on `bridge` (agent/network/slice_networks.py):
    # `<interface type='ethernet'>`, libvirt opens the tap and changes nothing on it. Without
    # one, libvirt makes a tap of its own on `bridge` (or the libvirt network).
    tap: str | None = None
    # The NIC's MTU (the bridge's): the host tap's and, through virtio, the guest's.
    mtu: int | None = None
    mac_address: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return domain_name(self.allocation_id)


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrs)
    if text is not None:
        element.text = text
    return element


def render_domain(plan: SliceDomain) -> str:
    dom = ET.Element("domain", {"type": plan.domain_type})
    _sub(dom, "name", plan.name)
    metadata = _sub(dom, "metadata")
    meta = _sub(
        metadata, f"{METADATA_PREFIX}:allocation", **{f"xmlns:{METADATA_PREFIX}": METADATA_NS}
    )
    _sub(meta, f"{METADATA_PREFIX}:id", plan.allocation_id)
    for key, value in plan.extra.items():
        _sub(meta, f"{METADATA_PREFIX}:{key}", value)
    _sub(dom, "memory", str(plan.memory_mib), unit="MiB")
    # Guest memory shared with the host's virtiofsd: what a virtiofs filesystem (an attached
    # storage namespace, agent/storage_mounts.py) needs to be hot-plugged into the VM later.
    backing = _sub(dom, "memoryBacking")
    _sub(backing, "source", type="memfd")
    _sub(backing, "access", mode="shared")
    _sub(dom, "vcpu", str(plan.vcpus), placement="static")
    cputune = _sub(dom, "cputune")
    cpuset = format_cpuset(plan.cpuset)
    for vcpu in range(plan.vcpus):
        _sub(cputune, "vcpupin", vcpu=str(vcpu), cpuset=cpuset)
    _sub(cputune, "emulatorpin", cpuset=cpuset)
    numatune = _sub(dom, "numatune")
    _sub(numatune, "memory", mode="strict", nodeset=format_cpuset(plan.numa_nodes))
    os_el = _sub(dom, "os")
    _sub(os_el, "type", "hvm", arch="x86_64")
    _sub(os_el, "boot", dev="hd")
    features = _sub(dom, "features")
    _sub(features, "acpi")  # a graceful shutdown is an ACPI power-button press
    if plan.domain_type == "kvm":
        # KVM only: TCG cannot pass the host CPU through (libvirt refuses the domain).
        _sub(dom, "cpu", mode="host-passthrough")
    devices = _sub(dom, "devices")
    disk = _sub(devices, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type=plan.disk_format)
    _sub(disk, "source", file=plan.disk_path)
    _sub(disk, "target", dev="vda", bus="virtio")
    if plan.seed_is_iso:
        seed = _sub(devices, "disk", type="file", device="cdrom")
        _sub(seed, "driver", name="qemu", type="raw")
        _sub(seed, "source", file=plan.seed_path)
    else:
        # Only on libvirt's test driver (no guest reads it): the seed directory's path.
        seed = _sub(devices, "disk", type="dir", device="floppy")
        _sub(seed, "source", dir=plan.seed_path)
    _sub(
        seed,
        "target",
        dev="sda" if plan.seed_is_iso else "fda",
        bus="sata" if plan.seed_is_iso else "fdc",
    )
    _sub(seed, "readonly")
    _render_interface(devices, plan)
    channel = _sub(devices, "channel", type="unix")
    _sub(channel, "target", type="virtio", name="org.qemu.guest_agent.0")
    for gpu in plan.gpus:
        hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        source = _sub(hostdev, "source")
        _sub(
            source,
            "address",
            domain=f"0x{gpu.domain:04x}",
            bus=f"0x{gpu.bus:02x}",
            slot=f"0x{gpu.slot:02x}",
            function=f"0x{gpu.function:x}",
        )
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode")


def _render_interface(devices: ET.Element, plan: SliceDomain) -> None:
    if plan.tap:
        iface = _sub(devices, "interface", type="ethernet")
    else:
        iface = _sub(devices, "interface", type="bridge" if plan.bridge else "network")
    if plan.mac_address:
        _sub(iface, "mac", address=plan.mac_address)
    if plan.tap:
        # Made, configured and enslaved by the agent before the domain starts; libvirt only
        # opens it (and leaves it in place when the domain stops: the agent removes it).
        _sub(iface, "target", dev=plan.tap, managed="no")
    elif plan.bridge:
        _sub(iface, "source", bridge=plan.bridge)
    else:
        _sub(iface, "source", network=plan.network)
    _sub(iface, "model", type="virtio")
    if plan.mtu is not None:
        _sub(iface, "mtu", size=str(plan.mtu))


def render_filesystem(source_dir: str, tag: str) -> str:
    """A host directory for the guest to mount as virtiofs (`mount -t virtiofs <tag> <dir>`),
    served by the host's virtiofsd, which libvirt starts for the device (and stops with it).

    Never `<readonly/>`: libvirt 9.0 (Debian 12) refuses it for virtiofs ("virtiofs does not yet
    support read-only mode", for the device hot-plugged and in a definition alike). A read-only
    attachment is a read-only bind mount on the host (agent/storage_mounts.py), which virtiofsd
    serves as it is: the guest's writes fail with EROFS (tests/test_qemu_guest_virtiofs.py)."""
    fs = ET.Element("filesystem", {"type": "mount", "accessmode": "passthrough"})
    _sub(fs, "driver", type="virtiofs")
    _sub(fs, "source", dir=source_dir)
    _sub(fs, "target", dir=tag)
    return ET.tostring(fs, encoding="unicode")


def _filesystems(root: ET.Element) -> dict[str, ET.Element]:
    """The domain's filesystem devices by target tag."""
    found = {}
    for fs in root.findall("devices/filesystem"):
        target = fs.find("target")
        if target is not None:
            found[target.get("dir", "")] = fs
    return found


def filesystem_element(xml_text: str, tag: str) -> str | None:
    """The domain's filesystem device with this target tag, as XML (None: not there)."""
    fs = _filesystems(_parse(xml_text)).get(tag)
    return None if fs is None else ET.tostring(fs, encoding="unicode")


def with_filesystem(xml_text: str, tag: str, device_xml: str | None) -> str:
    """The domain XML with filesystem `tag` replaced by `device_xml` (None: taken out): for a
    driver that cannot attach or detach devices, whose persistent definition is redefined."""
    root = _parse(xml_text)
    devices = root.find("devices")
    assert devices is not None  # every domain we define has devices
    existing = _filesystems(root).get(tag)
    if existing is not None:
        devices.remove(existing)
    if device_xml is not None:
        devices.append(_parse(device_xml))
    return ET.tostring(root, encoding="unicode")


# ------------------------------------------------------------------------------ reading back


@dataclass(frozen=True)
class DomainFacts:
    """What the backend reads back from a defined domain's XML."""

    allocation_id: str | None
    hostdevs: tuple[PciAddress, ...]
    disk_paths: tuple[str, ...]
    numa_nodeset: str | None
    vcpupins: Mapping[int, str]
    mac_addresses: tuple[str, ...]
    # Each NIC's host side: (target dev or None, mtu or None), in document order.
    interfaces: tuple[tuple[str | None, int | None], ...] = ()
    # virtiofs filesystems: target tag -> host source directory.
    filesystems: Mapping[str, str] = field(default_factory=dict)


def parse_domain(xml_text: str) -> DomainFacts:
    root = _parse(xml_text)
    hostdevs = []
    for address in root.findall("devices/hostdev[@type='pci']/source/address"):
        hostdevs.append(
            PciAddress(
                *(int(address.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function"))
            )
        )
    disks = []
    for source in root.findall("devices/disk/source"):
        path = source.get("file") or source.get("dir")
        if path:
            disks.append(path)
    memory = root.find("numatune/memory")
    pins = {int(p.get("vcpu", "-1")): p.get("cpuset", "") for p in root.findall("cputune/vcpupin")}
    macs = tuple(m.get("address", "") for m in root.findall("devices/interface/mac"))
    alloc = root.find(f"metadata/{{{METADATA_NS}}}allocation/{{{METADATA_NS}}}id")
    filesystems = {
        tag: fs_source.get("dir", "")
        for tag, fs in _filesystems(root).items()
        if (fs_source := fs.find("source")) is not None
    }
    interfaces = tuple(
        (
            target.get("dev") if (target := iface.find("target")) is not None else None,
            int(mtu.get("size", "0")) if (mtu := iface.find("mtu")) is not None else None,
        )
        for iface in root.findall("devices/interface")
    )
    return DomainFacts(
        allocation_id=alloc.text if alloc is not None else None,
        hostdevs=tuple(hostdevs),
        disk_paths=tuple(disks),
        numa_nodeset=memory.get("nodeset") if memory is not None else None,
        vcpupins=pins,
        mac_addresses=macs,
        interfaces=interfaces,
        filesystems=filesystems,
    )


def cpus_of_nodes(topology: Mapping[int, Sequence[int]], nodes: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({cpu for node in nodes for cpu in topology.get(node, ())}))
