"""What the simulated region stores: fabrics, VLANs, subnets, machines with their interfaces,
links and block devices, node keys and events; and the physical machines (BMC + hardware) behind
them. Plain mutable dataclasses: the region changes them in place, one request at a time."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from sim.maas.enums import EventType, NodeStatus, PowerState, ScriptStatus
from sim.maas.faults import FaultSet
from sim.maas.scenario import MachineSpec, Timings


@dataclass
class Fabric:
    id: int
    name: str


@dataclass
class Vlan:
    id: int
    vid: int
    fabric: Fabric
    mtu: int = 1500
    dhcp_on: bool = False

    @property
    def name(self) -> str:
        return "untagged" if self.vid == 0 else str(self.vid)


@dataclass
class Subnet:
    id: int
    name: str
    cidr: str
    vlan: Vlan
    gateway_ip: str | None = None
    dns_servers: tuple[str, ...] = ()
    dynamic_range: tuple[str, str] | None = None
    managed: bool = True
    description: str = ""
    space: str | None = None

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(self.cidr, strict=False)

    def in_dynamic_range(self, ip: str) -> bool:
        if self.dynamic_range is None:
            return False
        start, end = (int(ipaddress.ip_address(a)) for a in self.dynamic_range)
        return start <= int(ipaddress.ip_address(ip)) <= end


# Link modes, as the API writes them.
AUTO = "auto"
DHCP = "dhcp"
STATIC = "static"
LINK_UP = "link_up"
LINK_MODES = (AUTO, DHCP, STATIC, LINK_UP)


@dataclass
class Link:
    """A StaticIPAddress row: the link's id is what op=unlink_subnet takes."""

    id: int
    mode: str
    subnet: Subnet | None = None
    ip_address: str | None = None


@dataclass
class Interface:
    id: int
    name: str
    mac_address: str
    vlan: Vlan | None
    links: list[Link] = field(default_factory=list)
    enabled: bool = True
    link_connected: bool = True
    speed: int = 25000
    vendor: str = ""
    product: str = ""
    cabled_subnet: Subnet | None = None  # the network the port is plugged into
    planned_ip: str | None = None  # the address its AUTO link gets on deployment


@dataclass
class Partition:
    id: int
    uuid: str
    size: int
    index: int
    bootable: bool
    fstype: str
    mount_point: str
    fs_uuid: str
    mount_options: str | None = None
    label: str = ""


@dataclass
class BlockDevice:
    id: int
    name: str
    uuid: str
    model: str
    serial: str
    id_path: str | None
    size: int
    block_size: int
    firmware_version: str
    tags: tuple[str, ...]
    partitions: list[Partition] = field(default_factory=list)

    @property
    def partition_table_type(self) -> str | None:
        return "GPT" if self.partitions else None


@dataclass
class NodeKey:
    """The node's OAuth token: what the deployed OS (and hardware sync) signs with."""

    consumer_key: str
    token_key: str
    token_secret: str
    created_at: float  # monotonic


@dataclass
class Event:
    id: int
    system_id: str
    hostname: str
    type: EventType
    description: str
    created: float  # wall clock
    username: str = "unknown"


class Steppable:
    """Something that owns scheduled steps; bumping `generation` cancels all of them."""

    generation: int = 0

    def cancel_steps(self) -> None:
        self.generation += 1


@dataclass(eq=False)
class Hardware(Steppable):
    """A physical machine: its BMC (by address), its parts, its faults, its power."""

    spec: MachineSpec
    faults: FaultSet
    timings: Timings
    power: str = PowerState.OFF
    generation: int = 0

    @property
    def bmc_address(self) -> str:
        return self.spec.bmc.address


@dataclass(eq=False)
class Machine(Steppable):
    system_id: str
    hostname: str
    status: NodeStatus
    hardware: Hardware | None = None
    previous_status: NodeStatus = NodeStatus.NEW
    resume_status: NodeStatus = NodeStatus.NEW  # where aborting commissioning/testing returns
    owner: str | None = None
    architecture: str = ""
    cpu_count: int = 0
    memory: int = 0
    description: str = ""
    power_type: str = "ipmi"
    power_parameters: dict[str, object] = field(default_factory=dict)
    power_error: bool = False  # the last BMC query failed
    osystem: str = ""
    distro_series: str = ""
    hwe_kernel: str | None = None
    user_data: bytes | None = None
    agent_name: str = ""
    enable_hw_sync: bool = False
    sync_interval: int | None = None  # seconds
    deployed_sync: float | None = None  # wall clock: last_sync set by end_deployment
    sync_agent_since: float | None = None  # monotonic: the in-OS sync timer's start
    enable_ssh: bool = False
    interfaces: list[Interface] = field(default_factory=list)
    block_devices: list[BlockDevice] = field(default_factory=list)
    boot_disk_id: int | None = None
    boot_interface_id: int | None = None
    node_key: NodeKey | None = None
    error_description: str = ""
    commissioning_status: ScriptStatus = ScriptStatus.NONE
    testing_status: ScriptStatus = ScriptStatus.NONE
    swap_size: int | None = None
    zone: str = "default"
    pool: str = "default"
    generation: int = 0

    @property
    def power_state(self) -> str:
        if self.power_error:
            return PowerState.ERROR
        if self.hardware is None:
            return PowerState.UNKNOWN
        return self.hardware.power

    @property
    def power_address(self) -> str | None:
        value = self.power_parameters.get("power_address")
        return str(value) if value else None

    def interface(self, interface_id: int) -> Interface | None:
        return next((i for i in self.interfaces if i.id == interface_id), None)

    def block_device(self, device_id: int) -> BlockDevice | None:
        return next((d for d in self.block_devices if d.id == device_id), None)

    @property
    def boot_interface(self) -> Interface | None:
        if self.boot_interface_id is not None:
            found = self.interface(self.boot_interface_id)
            if found is not None:
                return found
        return self.interfaces[0] if self.interfaces else None

    @property
    def ip_addresses(self) -> list[str]:
        return [link.ip_address for i in self.interfaces for link in i.links if link.ip_address]
