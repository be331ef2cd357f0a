"""Observed MAAS state as typed values: what the MAAS 2.0 REST API answers (see
shared/maas-api-notes.md), parsed once at the client so that callers never read raw dicts.

Parsers raise KeyError/TypeError/ValueError on a shape they do not understand; the client turns
those into MaasProtocolError. Secrets (machine tokens, BMC passwords) are kept out of reprs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar

import msgspec

Json = Mapping[str, Any]


# ---------------------------------------------------------------------------- statuses


class MachineStatus(IntEnum):
    """maascommon/node.py NODE_STATUS: the numbers MAAS sends as `status`."""

    NEW = 0
    COMMISSIONING = 1
    FAILED_COMMISSIONING = 2
    MISSING = 3
    READY = 4
    RESERVED = 5
    DEPLOYED = 6
    RETIRED = 7
    BROKEN = 8
    DEPLOYING = 9
    ALLOCATED = 10
    FAILED_DEPLOYMENT = 11
    RELEASING = 12
    FAILED_RELEASING = 13
    DISK_ERASING = 14
    FAILED_DISK_ERASING = 15
    RESCUE_MODE = 16
    ENTERING_RESCUE_MODE = 17
    FAILED_ENTERING_RESCUE_MODE = 18
    EXITING_RESCUE_MODE = 19
    FAILED_EXITING_RESCUE_MODE = 20
    TESTING = 21
    FAILED_TESTING = 22

    @property
    def label(self) -> str:
        """The `status_name` MAAS shows (NODE_STATUS_LABELS)."""
        return _STATUS_LABELS[self]

    @classmethod
    def from_label(cls, label: str) -> MachineStatus:
        for status, known in _STATUS_LABELS.items():
            if known == label:
                return status
        raise ValueError(f"unknown MAAS status name {label!r}")

    @property
    def is_failure(self) -> bool:
        """A failed state, or Broken: MAAS stopped and waits for someone to act."""
        return self in _FAILURE_STATUSES


_STATUS_LABELS: dict[MachineStatus, str] = {
    MachineStatus.NEW: "New",
    MachineStatus.COMMISSIONING: "Commissioning",
    MachineStatus.FAILED_COMMISSIONING: "Failed commissioning",
    MachineStatus.MISSING: "Missing",
    MachineStatus.READY: "Ready",
    MachineStatus.RESERVED: "Reserved",
    MachineStatus.DEPLOYED: "Deployed",
    MachineStatus.RETIRED: "Retired",
    MachineStatus.BROKEN: "Broken",
    MachineStatus.DEPLOYING: "Deploying",
    MachineStatus.ALLOCATED: "Allocated",
    MachineStatus.FAILED_DEPLOYMENT: "Failed deployment",
    MachineStatus.RELEASING: "Releasing",
    MachineStatus.FAILED_RELEASING: "Releasing failed",
    MachineStatus.DISK_ERASING: "Disk erasing",
    MachineStatus.FAILED_DISK_ERASING: "Failed disk erasing",
    MachineStatus.RESCUE_MODE: "Rescue mode",
    MachineStatus.ENTERING_RESCUE_MODE: "Entering rescue mode",
    MachineStatus.FAILED_ENTERING_RESCUE_MODE: "Failed to enter rescue mode",
    MachineStatus.EXITING_RESCUE_MODE: "Exiting rescue mode",
    MachineStatus.FAILED_EXITING_RESCUE_MODE: "Failed to exit rescue mode",
    MachineStatus.TESTING: "Testing",
    MachineStatus.FAILED_TESTING: "Failed testing",
}

_FAILURE_STATUSES = frozenset(
    {
        MachineStatus.FAILED_COMMISSIONING,
        MachineStatus.BROKEN,
        MachineStatus.FAILED_DEPLOYMENT,
        MachineStatus.FAILED_RELEASING,
        MachineStatus.FAILED_DISK_ERASING,
        MachineStatus.FAILED_ENTERING_RESCUE_MODE,
        MachineStatus.FAILED_EXITING_RESCUE_MODE,
        MachineStatus.FAILED_TESTING,
    }
)


class PowerState(StrEnum):
    ON = "on"
    OFF = "off"
    UNKNOWN = "unknown"
    ERROR = "error"


class LinkMode(StrEnum):
    AUTO = "auto"
    DHCP = "dhcp"
    STATIC = "static"
    LINK_UP = "link_up"


class StorageLayout(StrEnum):
    FLAT = "flat"
    LVM = "lvm"
    BCACHE = "bcache"
    VMFS6 = "vmfs6"
    VMFS7 = "vmfs7"
    CUSTOM = "custom"
    BLANK = "blank"


class EraseMode(StrEnum):
    """How `release` wipes disks: MAAS's erase flag, plus secure_erase or quick_erase."""

    NONE = "none"
    STANDARD = "standard"
    SECURE = "secure"
    QUICK = "quick"


# ---------------------------------------------------------------------------- parsing helpers


def _str(data: Json, key: str) -> str:
    value = data.get(key)
    return "" if value is None else str(value)


def _opt_str(data: Json, key: str) -> str | None:
    value = data.get(key)
    return None if value in (None, "") else str(value)


def _int(data: Json, key: str, default: int = 0) -> int:
    value = data.get(key)
    return default if value is None else int(value)


def _opt_int(data: Json, key: str) -> int | None:
    value = data.get(key)
    return None if value is None else int(value)


def _strs(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        raise TypeError("expected a list of strings")
    return tuple(str(v) for v in value)


def _objects(value: Any) -> Sequence[Json]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TypeError("expected a list of objects")
    return value


def _name_of(value: Any) -> str:
    """`zone`, `pool` and `domain` are objects; older answers sometimes carry just a name."""
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return _str(value, "name")
    return str(value)


def parse_datetime(value: Any) -> dt.datetime | None:
    """MAAS ≥ 3.6 sends `…T03:04:05.678Z`, ≤ 3.5 a naive `…T03:04:05.678`; the region keeps
    its clock in UTC, so a naive value is read as UTC and every result is timezone-aware."""
    if value in (None, ""):
        return None
    parsed = dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


# ---------------------------------------------------------------------------- network


@dataclass(frozen=True)
class Vlan:
    id: int
    vid: int
    name: str
    fabric: str
    fabric_id: int | None
    mtu: int
    dhcp_on: bool

    @classmethod
    def from_json(cls, data: Json) -> Vlan:
        return cls(
            id=int(data["id"]),
            vid=int(data["vid"]),
            name=_str(data, "name"),
            fabric=_str(data, "fabric"),
            fabric_id=_opt_int(data, "fabric_id"),
            mtu=_int(data, "mtu", 1500),
            dhcp_on=bool(data.get("dhcp_on", False)),
        )


@dataclass(frozen=True)
class Subnet:
    id: int
    name: str
    cidr: str
    vlan: Vlan | None
    gateway_ip: str | None
    dns_servers: tuple[str, ...]
    managed: bool
    space: str | None

    @classmethod
    def from_json(cls, data: Json) -> Subnet:
        vlan = data.get("vlan")
        return cls(
            id=int(data["id"]),
            name=_str(data, "name"),
            cidr=str(data["cidr"]),
            vlan=Vlan.from_json(vlan) if isinstance(vlan, Mapping) else None,
            gateway_ip=_opt_str(data, "gateway_ip"),
            dns_servers=_strs(data.get("dns_servers")),
            managed=bool(data.get("managed", True)),
            space=_opt_str(data, "space"),
        )


@dataclass(frozen=True)
class InterfaceLink:
    """One link of an interface. `subnet` and `ip_address` are absent from MAAS's answer when
    unset: an AUTO link has no address until deployment."""

    id: int
    mode: LinkMode
    subnet: Subnet | None
    ip_address: str | None

    @classmethod
    def from_json(cls, data: Json) -> InterfaceLink:
        subnet = data.get("subnet")
        return cls(
            id=int(data["id"]),
            mode=LinkMode(str(data["mode"]).lower()),
            subnet=Subnet.from_json(subnet) if isinstance(subnet, Mapping) else None,
            ip_address=_opt_str(data, "ip_address"),
        )


@dataclass(frozen=True)
class Interface:
    id: int
    name: str
    type: str
    mac_address: str
    enabled: bool
    vlan: Vlan | None
    links: tuple[InterfaceLink, ...]
    link_connected: bool
    interface_speed: int
    link_speed: int
    parents: tuple[str, ...]
    children: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Json) -> Interface:
        vlan = data.get("vlan")
        return cls(
            id=int(data["id"]),
            name=str(data["name"]),
            type=_str(data, "type"),
            mac_address=_str(data, "mac_address"),
            enabled=bool(data.get("enabled", True)),
            vlan=Vlan.from_json(vlan) if isinstance(vlan, Mapping) else None,
            links=tuple(InterfaceLink.from_json(link) for link in _objects(data.get("links"))),
            link_connected=bool(data.get("link_connected", True)),
            interface_speed=_int(data, "interface_speed"),
            link_speed=_int(data, "link_speed"),
            parents=_strs(data.get("parents")),
            children=_strs(data.get("children")),
        )

    def subnet_links(self) -> tuple[InterfaceLink, ...]:
        """Links that attach a subnet (what deployment needs), not bare link_up ones."""
        return tuple(link for link in self.links if link.mode != LinkMode.LINK_UP and link.subnet)


# ---------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class Partition:
    id: int
    size: int
    path: str
    bootable: bool
    used_for: str
    fstype: str | None
    mount_point: str | None

    @classmethod
    def from_json(cls, data: Json) -> Partition:
        filesystem = data.get("filesystem")
        fs: Json = filesystem if isinstance(filesystem, Mapping) else {}
        return cls(
            id=int(data["id"]),
            size=_int(data, "size"),
            path=_str(data, "path"),
            bootable=bool(data.get("bootable", False)),
            used_for=_str(data, "used_for"),
            fstype=_opt_str(fs, "fstype"),
            mount_point=_opt_str(fs, "mount_point"),
        )


@dataclass(frozen=True)
class BlockDevice:
    id: int
    name: str
    type: str  # "physical" or "virtual"; only physical disks can be the boot disk
    path: str
    model: str
    serial: str
    id_path: str
    size: int  # bytes
    block_size: int
    available_size: int
    used_size: int
    used_for: str
    tags: tuple[str, ...]
    partitions: tuple[Partition, ...]

    @classmethod
    def from_json(cls, data: Json) -> BlockDevice:
        return cls(
            id=int(data["id"]),
            name=str(data["name"]),
            type=_str(data, "type"),
            path=_str(data, "path"),
            model=_str(data, "model"),
            serial=_str(data, "serial"),
            id_path=_str(data, "id_path"),
            size=_int(data, "size"),
            block_size=_int(data, "block_size"),
            available_size=_int(data, "available_size"),
            used_size=_int(data, "used_size"),
            used_for=_str(data, "used_for"),
            tags=_strs(data.get("tags")),
            partitions=tuple(Partition.from_json(p) for p in _objects(data.get("partitions"))),
        )


# ---------------------------------------------------------------------------- hardware sync

# MAAS's own rule (Node.is_sync_healthy): a sync is late once 1.5 intervals have passed.
SYNC_GRACE_FACTOR = 1.5


@dataclass(frozen=True)
class HardwareSync:
    """The hardware-sync fields of a machine. The REST API has no `is_sync_healthy` (only the
    websocket handler has), so health is computed here with MAAS's own formula."""

    available: bool  # False when the MAAS predates the fields (exposed since 3.4)
    enabled: bool
    last_sync: dt.datetime | None
    sync_interval: dt.timedelta | None
    next_sync: dt.datetime | None

    @classmethod
    def from_machine_json(cls, data: Json) -> HardwareSync:
        interval = data.get("sync_interval")
        return cls(
            available="enable_hw_sync" in data,
            enabled=bool(data.get("enable_hw_sync") or False),
            last_sync=parse_datetime(data.get("last_sync")),
            sync_interval=None if interval is None else dt.timedelta(seconds=int(interval)),
            next_sync=parse_datetime(data.get("next_sync")),
        )

    def late_after(self) -> dt.datetime | None:
        if self.last_sync is None or not self.sync_interval:
            return None
        return self.last_sync + self.sync_interval * SYNC_GRACE_FACTOR

    def healthy(self, now: dt.datetime) -> bool:
        """enable_hw_sync and last_sync and sync_interval and now <= last_sync + 1.5 * interval.
        A naive `now` is read as UTC, like MAAS's naive datetimes."""
        deadline = self.late_after()
        if not self.enabled or deadline is None:
            return False
        if now.tzinfo is None:
            now = now.replace(tzinfo=dt.UTC)
        return now <= deadline


# ---------------------------------------------------------------------------- machines


@dataclass(frozen=True)
class MachineState:
    """Where a machine stands: the part of `Machine` a site's reconciler compares with its nodes
    (MaasClient.list_machine_states decodes only these fields of a machines list)."""

    system_id: str
    hostname: str
    status: MachineStatus
    power_state: PowerState
    ip_addresses: tuple[str, ...]
    hardware_sync: HardwareSync

    @classmethod
    def from_json(cls, data: Json) -> MachineState:
        return cls(
            system_id=str(data["system_id"]),
            hostname=_str(data, "hostname"),
            status=MachineStatus(int(data["status"])),
            power_state=PowerState(_str(data, "power_state") or PowerState.UNKNOWN),
            ip_addresses=_strs(data.get("ip_addresses")),
            hardware_sync=HardwareSync.from_machine_json(data),
        )

    @property
    def status_name(self) -> str:
        return self.status.label


class _MachineStateFields(msgspec.Struct):
    """The keys of a machines list entry that MachineState.from_json reads, typed Any so that
    it checks them as it checks a whole Machine's; a key MAAS leaves out stays UNSET (the
    hardware-sync fields' absence means a MAAS that predates them). Every other key (interfaces,
    block devices, storage: nine tenths of an entry's bytes) is skipped without being built."""

    system_id: Any
    status: Any
    hostname: Any = msgspec.UNSET
    power_state: Any = msgspec.UNSET
    ip_addresses: Any = msgspec.UNSET
    enable_hw_sync: Any = msgspec.UNSET
    last_sync: Any = msgspec.UNSET
    sync_interval: Any = msgspec.UNSET
    next_sync: Any = msgspec.UNSET


_MACHINE_STATES = msgspec.json.Decoder(list[_MachineStateFields])


def machine_states_json(body: bytes) -> list[dict[str, Any]]:
    """A machines list's bytes as the entries MachineState.from_json reads, each holding only
    the keys it has of those. Raises msgspec.DecodeError on malformed JSON or another shape."""
    return [
        {
            name: value
            for name in entry.__struct_fields__
            if (value := getattr(entry, name)) is not msgspec.UNSET
        }
        for entry in _MACHINE_STATES.decode(body)
    ]


@dataclass(frozen=True)
class Machine:
    system_id: str
    hostname: str
    fqdn: str
    domain: str
    status: MachineStatus
    status_message: str  # "<event type> - <description>" of the newest INFO+ event
    error_description: str
    owner: str | None
    architecture: str
    cpu_count: int
    memory_mib: int
    osystem: str
    distro_series: str
    power_type: str
    power_state: PowerState
    ip_addresses: tuple[str, ...]
    zone: str
    pool: str
    boot_disk_id: int | None
    boot_interface_id: int | None
    interfaces: tuple[Interface, ...]
    block_devices: tuple[BlockDevice, ...]
    hardware_sync: HardwareSync

    @classmethod
    def from_json(cls, data: Json) -> Machine:
        boot_disk = data.get("boot_disk")
        boot_interface = data.get("boot_interface")
        state = MachineState.from_json(data)
        return cls(
            system_id=state.system_id,
            hostname=state.hostname,
            fqdn=_str(data, "fqdn"),
            domain=_name_of(data.get("domain")),
            status=state.status,
            status_message=_str(data, "status_message"),
            error_description=_str(data, "error_description"),
            owner=_opt_str(data, "owner"),
            architecture=_str(data, "architecture"),
            cpu_count=_int(data, "cpu_count"),
            memory_mib=_int(data, "memory"),
            osystem=_str(data, "osystem"),
            distro_series=_str(data, "distro_series"),
            power_type=_str(data, "power_type"),
            power_state=state.power_state,
            ip_addresses=state.ip_addresses,
            zone=_name_of(data.get("zone")),
            pool=_name_of(data.get("pool")),
            boot_disk_id=_opt_int(boot_disk, "id") if isinstance(boot_disk, Mapping) else None,
            boot_interface_id=(
                _opt_int(boot_interface, "id") if isinstance(boot_interface, Mapping) else None
            ),
            interfaces=tuple(Interface.from_json(i) for i in _objects(data.get("interface_set"))),
            block_devices=tuple(
                BlockDevice.from_json(b) for b in _objects(data.get("blockdevice_set"))
            ),
            hardware_sync=state.hardware_sync,
        )

    @property
    def status_name(self) -> str:
        return self.status.label

    def interface_named(self, name: str) -> Interface | None:
        return next((i for i in self.interfaces if i.name == name), None)


@dataclass(frozen=True)
class IpmiPowerParameters:
    """IPMI power parameters for create/update, sent as `power_parameters_<name>` form fields.
    `power_pass` and `k_g` are secrets: kept out of reprs and redacted from error messages."""

    power_address: str
    power_user: str = ""
    power_pass: str = field(default="", repr=False)
    power_driver: str = "LAN_2_0"
    power_boot_type: str | None = None
    k_g: str | None = field(default=None, repr=False)
    cipher_suite_id: str | None = None
    privilege_level: str | None = None
    mac_address: str | None = None
    power_off_mode: str | None = None

    POWER_TYPE: ClassVar[str] = "ipmi"

    def form_fields(self) -> list[tuple[str, str]]:
        values = {
            "power_address": self.power_address,
            "power_user": self.power_user,
            "power_pass": self.power_pass,
            "power_driver": self.power_driver,
            "power_boot_type": self.power_boot_type,
            "k_g": self.k_g,
            "cipher_suite_id": self.cipher_suite_id,
            "privilege_level": self.privilege_level,
            "mac_address": self.mac_address,
            "power_off_mode": self.power_off_mode,
        }
        return [(f"power_parameters_{k}", v) for k, v in values.items() if v is not None]

    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.power_pass, self.k_g) if s)


@dataclass(frozen=True)
class MachineToken:
    """A machine's NodeKey, which its hardware-sync agent signs with. MAAS erases it whenever
    the owner changes (deploying a Ready machine allocates it; release clears the owner), so
    fetch it after deploy and never cache it across owner changes."""

    consumer_key: str
    token_key: str
    token_secret: str = field(repr=False)

    @classmethod
    def from_json(cls, data: Json) -> MachineToken:
        return cls(
            consumer_key=str(data["consumer_key"]),
            token_key=str(data["token_key"]),
            token_secret=str(data["token_secret"]),
        )


# ---------------------------------------------------------------------------- site


@dataclass(frozen=True)
class MaasVersion:
    version: str
    subversion: str
    capabilities: frozenset[str]

    @classmethod
    def from_json(cls, data: Json) -> MaasVersion:
        return cls(
            version=str(data["version"]),
            subversion=_str(data, "subversion"),
            capabilities=frozenset(_strs(data.get("capabilities"))),
        )

    def has_capability(self, name: str) -> bool:
        return name in self.capabilities


@dataclass(frozen=True)
class MaasUser:
    """`GET users/?op=whoami`: the user an API key belongs to. Only a superuser may make the
    calls onboarding needs (accept, commission, link_subnet, POST subnets/, …); anything but a
    JSON `true` counts as not one (fail closed)."""

    username: str
    email: str
    is_superuser: bool

    @classmethod
    def from_json(cls, data: Json) -> MaasUser:
        return cls(
            username=str(data["username"]),
            email=_str(data, "email"),
            is_superuser=data.get("is_superuser") is True,
        )


@dataclass(frozen=True)
class RackController:
    system_id: str
    hostname: str
    fqdn: str
    version: str
    ip_addresses: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Json) -> RackController:
        return cls(
            system_id=str(data["system_id"]),
            hostname=_str(data, "hostname"),
            fqdn=_str(data, "fqdn"),
            version=_str(data, "version"),
            ip_addresses=_strs(data.get("ip_addresses")),
        )


# MAAS renders event times with this strftime format, in the region's (UTC) clock.
EVENT_TIME_FORMAT = "%a, %d %b. %Y %H:%M:%S"


@dataclass(frozen=True)
class Event:
    id: int
    system_id: str
    hostname: str
    username: str  # "unknown" for events MAAS itself records
    level: str  # DEBUG, INFO, WARNING, ERROR, CRITICAL, AUDIT
    created: dt.datetime | None
    type: str
    description: str

    @classmethod
    def from_json(cls, data: Json) -> Event:
        return cls(
            id=int(data["id"]),
            system_id=_str(data, "node"),
            hostname=_str(data, "hostname"),
            username=_str(data, "username"),
            level=_str(data, "level"),
            created=_event_time(data.get("created")),
            type=_str(data, "type"),
            description=_str(data, "description"),
        )


def _event_time(value: Any) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.strptime(str(value), EVENT_TIME_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError:
        return None  # a display string: an odd one must not make the whole page unreadable
