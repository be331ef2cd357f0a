"""The production node services, built from the agent config (agent/config_file.py: agent.toml
and its agent.d drop-ins). Every table is optional; the defaults are a real node's:

    [host]
    connect_host = "10.0.0.5"            # what tenants SSH to (default: this host's name)

    [libvirt]                            # GPU slices
    uri = "qemu:///system"
    domain_type = "kvm"                  # or "qemu" (TCG) where KVM is unusable (CI, nested VMs)
    image_dir = "/var/lib/gpucloud/images"
    seed_dir = "/var/lib/gpucloud/seeds"
    state_dir = "/var/lib/gpucloud/vms"
    readiness = "guest-agent"            # "ssh", or "fixed" with fixed_address (a test driver)
    check_gpu_health = true              # config-space and driver check of every released GPU
    bridge_per_allocation = true         # slice bridges of our own (agent/network)
    uplink = "bond0"                     # the NIC slice segments cross (optional, see below)
    segment_encapsulation = "vlan"       # or "vxlan" (see below)
    vxlan_group = "239.1.1.1"            # vxlan: the multicast group (the default), or instead
    # vxlan_peers = ["10.0.0.6", "10.0.0.7"]  # the nodes' uplink addresses (static flooding)
    vxlan_port = 4789                    # vxlan: the UDP port

    [libvirt.images]                     # name → expected sha256 (default: the task's sha256)
    "ubuntu-22.04-cuda-12.4" = "9f86d0…"

    [users]                              # bare-metal tenant accounts (baremetal_users.py)
    uid_min = 20000
    uid_max = 29999
    grant_sudo = false

    [gpu]
    sysfs = "/sys"                       # where PCI devices are read (under the host root)
    nvidia_smi = "/usr/bin/nvidia-smi"   # the vendor tool, read-only queries only
    expected_drivers = ["vfio-pci", "nvidia"]  # a released GPU bound elsewhere is quarantined
    allow_unverified = false             # node policy: GPU state that cannot be verified passes

    [storage]                            # storage attachments (agent/storage_mounts.py)
    export_root = "/srv/gpucloud-storage"  # the shared directory provider's tree on this host
    mount_base = "/mnt/gpucloud/storage"   # attachments are mounted at <mount_base>/<id>

Slice networks: the control plane gives each project a VLAN id per region; the allocations of
one project on this node share a bridge for that id, joined to `uplink` so they share L2 with the
project's VMs on the other nodes. `segment_encapsulation` says how a segment crosses `uplink`:

* "vlan" (the default): an 802.1Q sub-interface, VLAN id = the segment's; the switch port of
  `uplink` must trunk the region's slice VLAN pool.
* "vxlan": a VXLAN device, VNI = the segment's id, sending UDP `vxlan_port` from the first
  address of `uplink` (which must have one, of the family of the group or peers) to the
  multicast group `vxlan_group` (flood and learn; the underlay carries that group between the
  nodes: one L2 domain, as multicast leaves with TTL 1) or, with `vxlan_peers`, to each listed
  peer (head-end replication over a routed underlay; this node's own address may be listed).
  The underlay must be private to the nodes (VXLAN carries no authentication). A segment's MTU
  is the uplink's minus 50 (70 over IPv6): give the uplink 1550 (or jumbo frames) to keep 1500
  for the VMs, or give the guests the smaller MTU.

Without `uplink` that bridge stays on this node; an allocation without a VLAN gets an isolated
bridge of its own.

Both allocation shapes are served: slices through libvirt (connected on first use, so a node
without libvirtd still serves bare metal), bare metal through system accounts; node maintenance
(agent/maintenance.py) runs on the same host root.
"""

from __future__ import annotations

import socket
from typing import Any

from agent.backends.baremetal_users import FileBaremetalUserBackend, UserAccountConfig
from agent.backends.composite import NodeHostBackend
from agent.backends.domain_xml import DEFAULT_DOMAIN_TYPE, DOMAIN_TYPES
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.backends.readiness import (
    FixedAddressProbe,
    GuestAgentProbe,
    ReadinessProbe,
    SshPortProbe,
)
from agent.backends.system_root import SystemRoot
from agent.config_file import ConfigError, gpu_sysfs, table
from agent.gpu_health import DEFAULT_EXPECTED_DRIVERS, SysfsGpuHealthCheck
from agent.gpu_tools import (
    NvidiaSmi,
    NvidiaSmiMemoryProbe,
    NvidiaSmiScrubber,
    NvmlGpuMemoryProbe,
)
from agent.host_processes import ProcSessionTerminator, SystemctlUnits, UnitRestartRequests
from agent.maintenance import FileMaintenanceBackend, MaintenanceConfig
from agent.network.encapsulation import (
    DEFAULT_VXLAN_GROUP,
    ENCAPSULATIONS,
    VLAN_8021Q,
    VXLAN_PORT,
    SegmentEncapsulation,
    Vxlan,
)
from agent.network.errors import InvalidNetworkSpec
from agent.network.netns import validate_ifname
from agent.network.slice_networks import SliceNetworks
from agent.node_worker import NodeServices
from agent.storage_mounts import StorageMountBackend, StorageMountConfig
from agent.terminal import BaremetalLoginShell, NodeShells, SliceSerialConsole

READINESS = ("guest-agent", "ssh", "fixed")
NVIDIA_SMI = "/usr/bin/nvidia-smi"


def _readiness(section: dict[str, Any]) -> ReadinessProbe:
    kind = section.get("readiness", "guest-agent")
    if kind == "guest-agent":
        return GuestAgentProbe()
    if kind == "ssh":
        return SshPortProbe()
    if kind == "fixed":
        address = section.get("fixed_address")
        if not isinstance(address, str) or not address:
            raise ConfigError("[libvirt] readiness = 'fixed' needs fixed_address")
        return FixedAddressProbe(address)
    raise ConfigError(f"[libvirt] readiness must be one of {', '.join(READINESS)}")


def _uplink(section: dict[str, Any]) -> str | None:
    uplink = section.get("uplink")
    if uplink is None:
        return None
    message = "[libvirt] uplink must be an interface name (1..15 characters, no '/' or spaces)"
    if not isinstance(uplink, str):
        raise ConfigError(message)
    try:
        return validate_ifname(uplink, "uplink")
    except InvalidNetworkSpec:
        raise ConfigError(message) from None


_VXLAN_KEYS = ("vxlan_group", "vxlan_peers", "vxlan_port")


def _encapsulation(section: dict[str, Any], uplink: str | None) -> SegmentEncapsulation:
    name = section.get("segment_encapsulation", VLAN_8021Q.name)
    if name not in ENCAPSULATIONS:
        raise ConfigError(
            f"[libvirt] segment_encapsulation must be one of {', '.join(ENCAPSULATIONS)}"
        )
    given = [key for key in _VXLAN_KEYS if key in section]
    if name != Vxlan.name:
        if given:
            raise ConfigError(
                f"[libvirt] {', '.join(given)} need segment_encapsulation = {Vxlan.name!r}"
            )
        return VLAN_8021Q
    if uplink is None:
        raise ConfigError("[libvirt] segment_encapsulation = 'vxlan' needs uplink")
    peers = section.get("vxlan_peers")
    if peers is not None and "vxlan_group" in section:
        raise ConfigError("[libvirt] vxlan_group and vxlan_peers exclude each other")
    if peers is not None and (
        not isinstance(peers, list) or not peers or not all(isinstance(p, str) for p in peers)
    ):
        raise ConfigError("[libvirt] vxlan_peers is a non-empty list of IP addresses")
    port = section.get("vxlan_port", VXLAN_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError("[libvirt] vxlan_port must be an integer 1..65535")
    vxlan = Vxlan(
        group=None if peers is not None else section.get("vxlan_group", DEFAULT_VXLAN_GROUP),
        peers=tuple(peers or ()),
        port=port,
    )
    try:
        vxlan.validate()
    except InvalidNetworkSpec:
        key = "vxlan_peers" if peers is not None else "vxlan_group"
        expected = (
            "unicast IP addresses of one family" if peers is not None else "a multicast IP address"
        )
        raise ConfigError(f"[libvirt] {key} must be {expected}") from None
    return vxlan


def _domain_type(section: dict[str, Any]) -> str:
    kind = section.get("domain_type", DEFAULT_DOMAIN_TYPE)
    if kind not in DOMAIN_TYPES:
        raise ConfigError(f"[libvirt] domain_type must be one of {', '.join(DOMAIN_TYPES)}")
    return str(kind)


def slice_networks_from_config(section: dict[str, Any]) -> SliceNetworks | None:
    """The slice networks the `[libvirt]` table asks for (None: `bridge_per_allocation = false`,
    the libvirt network instead)."""
    if not section.get("bridge_per_allocation", True):
        return None
    uplink = _uplink(section)
    return SliceNetworks(uplink=uplink, encapsulation=_encapsulation(section, uplink))


def slice_backend_from_config(data: dict[str, Any], root: SystemRoot) -> LibvirtSliceBackend:
    section = table(data, "libvirt")
    images = section.get("images", {})
    if not isinstance(images, dict) or not all(isinstance(v, str) for v in images.values()):
        raise ConfigError("[libvirt.images] maps image names to sha256 strings")
    gpu = table(data, "gpu")
    drivers = gpu.get("expected_drivers", list(DEFAULT_EXPECTED_DRIVERS))
    if not isinstance(drivers, list) or not all(isinstance(d, str) for d in drivers):
        raise ConfigError("[gpu] expected_drivers is a list of driver names")
    return LibvirtSliceBackend(
        str(section.get("uri", "qemu:///system")),
        image_dir=root.host_path(str(section.get("image_dir", "/var/lib/gpucloud/images"))),
        image_catalog={str(k): v.lower() for k, v in images.items()},
        seed_dir=root.host_path(str(section.get("seed_dir", "/var/lib/gpucloud/seeds"))),
        state_dir=root.host_path(str(section.get("state_dir", "/var/lib/gpucloud/vms"))),
        readiness=_readiness(section),
        gpu_health=(
            SysfsGpuHealthCheck(gpu_sysfs(data, root), expected_drivers=drivers)
            if section.get("check_gpu_health", True)
            else None
        ),
        networks=slice_networks_from_config(section),
        domain_type=_domain_type(section),
    )


def _user_config(data: dict[str, Any]) -> UserAccountConfig:
    section = table(data, "users")
    try:
        return UserAccountConfig(**section)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"[users]: {err}") from None


def node_services_from_config(
    data: dict[str, Any], root: SystemRoot, *, hostname: str | None = None
) -> NodeServices:
    """The node's services on its host root, from the merged agent config."""
    host = table(data, "host")
    connect_host = str(host.get("connect_host") or hostname or socket.getfqdn())
    users = _user_config(data)
    gpu = table(data, "gpu")
    sysfs = gpu_sysfs(data, root)
    allow_unverified = bool(gpu.get("allow_unverified", False))
    smi = NvidiaSmi(root.host_path(str(gpu.get("nvidia_smi", NVIDIA_SMI))))
    scrubber = NvidiaSmiScrubber(smi, sysfs_root=sysfs, allow_unverified=allow_unverified)
    baremetal = FileBaremetalUserBackend(
        root,
        connect_host=connect_host,
        sessions=ProcSessionTerminator(root, kill=root.is_real_root),
        scrubber=scrubber,
        config=users,
    )
    maintenance = FileMaintenanceBackend(
        root,
        scrubber=scrubber,
        # NVML reads the driver of the machine the process runs on: only on the real root.
        gpu_probe=(
            NvmlGpuMemoryProbe(sysfs_root=sysfs)
            if root.is_real_root
            else NvidiaSmiMemoryProbe(smi, sysfs_root=sysfs)
        ),
        units=SystemctlUnits() if root.is_real_root else UnitRestartRequests(root),
        config=MaintenanceConfig(users=users),
        allow_unverified_gpu=allow_unverified,
    )
    storage = StorageMountConfig.from_table(table(data, "storage"))
    slices = slice_backend_from_config(data, root)
    return NodeServices(
        host=NodeHostBackend(slice=slices, baremetal=baremetal),
        maintenance=maintenance,
        storage=(
            StorageMountBackend(root, storage, guests=slices, tenants=baremetal)
            if storage.export_root
            else None
        ),
        terminal=NodeShells(
            baremetal=BaremetalLoginShell(baremetal),
            slice=SliceSerialConsole(str(table(data, "libvirt").get("uri", "qemu:///system"))),
        ),
    )
