"""The scenario: the site the simulated MAAS region manages, as a TOML or JSON document.

    seed = 7                          # system_ids, petnames, 5xx rates: reproducible
    time_scale = 0.02                 # real seconds per simulated second (CLI/reset override it)

    [site]
    maas_version = "3.6.0"            # < 3.6 renders naive datetimes, as those releases did
    admin_user = "admin"              # the user every configured API key belongs to
    hardware_sync_interval = "15m"    # MAAS config hardware_sync_interval (maas/?op=set_config)
    hw_sync_fields = true             # false: machine reads omit the REST sync fields (< 3.4)
    enable_disk_erasing_on_release = false
    distro_series = ["jammy", "noble"]        # deployable Ubuntu series
    custom_images = ["gpuaas-noble-2025"]     # deployable as custom/<name>

    [timings]                         # simulated seconds for each transition
    commissioning = 300
    testing = 60
    deploying = 600
    disk_erasing = 300
    releasing = 30
    enlistment = 180                  # BMC power cycle -> the machine shows up as New
    hw_sync = 900                     # period of the deployed OS's hardware-sync timer

    [[subnets]]
    name = "pxe"
    cidr = "10.176.46.0/24"
    vid = 46                          # VLAN on `fabric` (default "fabric-0"); created as needed
    gateway_ip = "10.176.46.1"
    dynamic_range = ["10.176.46.200", "10.176.46.250"]

    [[machines]]
    hostname = "c07u43"
    enlisted = true                   # false: unknown to MAAS until its BMC is power-cycled
    status = "Ready"                  # where an enlisted machine starts
    power = "off"
    architecture = "amd64/generic"
    cpu_count = 96
    memory = 1048576                  # MiB
    boot_disk = "sda"                 # optional: the disk layouts go on (default: first disk)
    bmc = { address = "10.176.16.128", user = "root", password = "calvin" }
    # detected_address = "10.176.99.128": what BMC detection reports at enlistment when it is
    # not the address operators reach the BMC at (NAT, a second BMC port); default: address
    interfaces = [
      { name = "eno8303", mac = "b0:7b:25:00:00:01", subnet = "pxe", pxe = true },
      { name = "ens1f0np0", mac = "b0:7b:25:00:01:01", fabric = "roce", vid = 0 },
    ]
    block_devices = [
      { name = "sda", model = "Dell BOSS-N1", serial = "BOSS0001", size = 480103981056,
        id_path = "/dev/disk/by-id/ata-DELL_BOSS-N1_BOSS0001" },
      { name = "nvme0n1", model = "Dell Ent NVMe CM6", serial = "NV0001", size = 3840755982336 },
    ]
    timings = { deploying = 60 }      # per-machine overrides
    faults = [ { kind = "deploy_fails_datasource" } ]   # see sim.maas.faults

    [[faults]]                        # request faults for the whole site
    kind = "http_error"
    rate = 0.1

Machines that start Deployed may also set owner, osystem, distro_series and enable_hw_sync.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sim.maas.enums import NodeStatus, PowerState
from sim.maas.faults import FaultError, FaultSpec

DEFAULT_DISTRO_SERIES = ("focal", "jammy", "noble")


class ScenarioError(ValueError):
    pass


def parse_duration(value: Any) -> float:
    """Seconds from a number or a MAAS-style span: "90", "90s", "15m", "1h30m"."""
    if isinstance(value, bool):
        raise ScenarioError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        parts = re.fullmatch(
            r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text
        )
        if not text or parts is None:
            raise ScenarioError(f"not a duration: {value!r}")
        h, m, s = (float(p) if p else 0.0 for p in parts.groups())
        seconds = h * 3600 + m * 60 + s
    if seconds < 0:
        raise ScenarioError(f"a duration must not be negative: {value!r}")
    return seconds


def _check_keys(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(data) - allowed
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {', '.join(sorted(unknown))}")


@dataclass(frozen=True)
class Timings:
    """Simulated seconds per transition; the time scale turns them into real seconds."""

    commissioning: float = 300.0
    testing: float = 60.0
    deploying: float = 600.0
    disk_erasing: float = 300.0
    releasing: float = 30.0
    enlistment: float = 180.0
    hw_sync: float | None = None  # None: the site's hardware_sync_interval

    def merged(self, overrides: Mapping[str, Any]) -> Timings:
        names = {f.name for f in fields(self)}
        _check_keys("timings", overrides, names)
        return replace(self, **{k: parse_duration(v) for k, v in overrides.items()})


@dataclass(frozen=True)
class SiteSpec:
    name: str = "sim-maas"
    maas_version: str = "3.6.0"
    admin_user: str = "admin"
    domain: str = "maas"
    hardware_sync_interval: float = 900.0
    # False: a MAAS build whose machine read has no REST sync fields (enable_hw_sync, last_sync,
    # sync_interval, next_sync are absent; exposed since 3.4).
    hw_sync_fields: bool = True
    enable_disk_erasing_on_release: bool = False
    distro_series: tuple[str, ...] = DEFAULT_DISTRO_SERIES
    default_distro_series: str = "noble"
    custom_images: tuple[str, ...] = ()

    @property
    def aware_datetimes(self) -> bool:
        """MAAS >= 3.6 runs with USE_TZ=True and renders a trailing Z."""
        try:
            major, minor = (int(p) for p in self.maas_version.split(".")[:2])
        except ValueError:
            return True
        return (major, minor) >= (3, 6)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SiteSpec:
        _check_keys("site", data, {f.name for f in fields(cls)})
        values = dict(data)
        if "hardware_sync_interval" in values:
            values["hardware_sync_interval"] = parse_duration(values["hardware_sync_interval"])
        for key in ("distro_series", "custom_images"):
            if key in values:
                values[key] = tuple(str(v) for v in values[key])
        return cls(**values)


@dataclass(frozen=True)
class SubnetSpec:
    name: str
    cidr: str
    fabric: str = "fabric-0"
    vid: int = 0
    gateway_ip: str | None = None
    dns_servers: tuple[str, ...] = ()
    dynamic_range: tuple[str, str] | None = None
    managed: bool = True
    mtu: int = 1500
    dhcp_on: bool = True
    space: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SubnetSpec:
        _check_keys("subnet", data, {f.name for f in fields(cls)})
        values = dict(data)
        try:
            ipaddress.ip_network(str(values["cidr"]))
        except (KeyError, ValueError) as exc:
            raise ScenarioError(f"subnet needs a valid cidr: {data}") from exc
        values.setdefault("name", values["cidr"])
        if "dns_servers" in values:
            values["dns_servers"] = tuple(values["dns_servers"])
        if values.get("dynamic_range") is not None:
            start, end = values["dynamic_range"]
            values["dynamic_range"] = (str(start), str(end))
        return cls(**values)


@dataclass(frozen=True)
class InterfaceSpec:
    name: str
    mac: str
    subnet: str | None = None  # the subnet (name or cidr) the port is cabled to
    # The VLAN a port without a subnet is cabled to (a RoCE NIC's fabric): commissioning puts
    # the interface on it, so only subnets on that VLAN can be linked without force.
    fabric: str | None = None
    vid: int | None = None
    pxe: bool = False  # the boot interface
    ip: str | None = None  # the address MAAS gives its AUTO link on deployment
    speed: int = 25000  # Mbps
    vendor: str = "Broadcom Inc. and subsidiaries"
    product: str = "BCM57414 NetXtreme-E 10Gb/25Gb RDMA Ethernet Controller"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InterfaceSpec:
        _check_keys("interface", data, {f.name for f in fields(cls)})
        if not re.fullmatch(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}", str(data.get("mac", ""))):
            raise ScenarioError(f"interface needs a MAC like aa:bb:cc:dd:ee:ff: {data}")
        values = dict(data)
        values["mac"] = str(values["mac"]).lower()
        return cls(**values)


@dataclass(frozen=True)
class BlockDeviceSpec:
    name: str
    size: int  # bytes
    model: str = "Samsung SSD 990"
    serial: str = ""
    id_path: str | None = None
    block_size: int = 512
    firmware_version: str = "1.0"
    tags: tuple[str, ...] = ("ssd",)

    @property
    def looks_like_boss(self) -> bool:
        """How the onboarding workflow spots a BOSS boot disk (docs/lifecycles/onboarding.md#stages
        ConfigureStorage)."""
        text = f"{self.model} {self.name} {self.id_path or ''}".lower()
        return bool(re.search(r"boss|boot optimized|m\.2", text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockDeviceSpec:
        _check_keys("block device", data, {f.name for f in fields(cls)})
        values = dict(data)
        if "tags" in values:
            values["tags"] = tuple(values["tags"])
        if int(values.get("size", 0)) <= 0:
            raise ScenarioError(f"block device needs a positive size: {data}")
        return cls(**values)


@dataclass(frozen=True)
class BmcSpec:
    address: str
    user: str = "root"
    password: str = "calvin"  # noqa: S105 - the simulated BMC's factory default
    # The address enlistment's BMC detection reports (None: `address`). When it differs, real
    # MAAS cannot match the enlisting machine to a New record made with `address`, and the
    # machine enlists as another New machine with a petname.
    detected_address: str | None = None

    @property
    def enlists_as(self) -> str:
        return self.detected_address or self.address

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BmcSpec:
        _check_keys("bmc", data, {f.name for f in fields(cls)})
        if "address" not in data:
            raise ScenarioError("bmc needs an address")
        return cls(**data)


@dataclass(frozen=True)
class MachineSpec:
    """One physical machine: its BMC, hardware, faults, and where MAAS starts with it."""

    hostname: str
    bmc: BmcSpec
    interfaces: tuple[InterfaceSpec, ...] = ()
    block_devices: tuple[BlockDeviceSpec, ...] = ()
    architecture: str = "amd64/generic"
    cpu_count: int = 96
    memory: int = 1048576  # MiB
    enlisted: bool = True
    status: NodeStatus = NodeStatus.READY
    power: str | None = None  # None: on if it starts Deployed, else off
    owner: str | None = None
    osystem: str = "ubuntu"
    distro_series: str | None = None
    enable_hw_sync: bool = False
    boot_disk: str | None = None
    system_id: str | None = None
    description: str = ""
    system_vendor: str = "Dell Inc."
    system_product: str = "PowerEdge XE9680"
    system_serial: str = ""
    timing_overrides: Mapping[str, Any] = field(default_factory=dict)
    faults: tuple[FaultSpec, ...] = ()

    @property
    def pxe_interface(self) -> InterfaceSpec | None:
        return next((i for i in self.interfaces if i.pxe), None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MachineSpec:
        allowed = {f.name for f in fields(cls)} - {"timing_overrides"} | {"timings"}
        _check_keys(f"machine {data.get('hostname', '?')}", data, allowed)
        values = dict(data)
        if "hostname" not in values or "bmc" not in values:
            raise ScenarioError(f"a machine needs a hostname and a bmc: {data}")
        values["bmc"] = BmcSpec.from_dict(values["bmc"])
        values["interfaces"] = tuple(
            InterfaceSpec.from_dict(i) for i in values.get("interfaces", ())
        )
        values["block_devices"] = tuple(
            BlockDeviceSpec.from_dict(b) for b in values.get("block_devices", ())
        )
        if "status" in values:
            try:
                values["status"] = NodeStatus.parse(str(values["status"]))
            except ValueError as exc:
                raise ScenarioError(str(exc)) from exc
        if values.get("power") not in (None, PowerState.ON, PowerState.OFF):
            raise ScenarioError("power is 'on' or 'off'")
        values["timing_overrides"] = dict(values.pop("timings", {}) or {})
        Timings().merged(values["timing_overrides"])  # validates
        try:
            values["faults"] = tuple(FaultSpec.from_dict(f) for f in values.get("faults", ()))
        except FaultError as exc:
            raise ScenarioError(f"machine {values['hostname']}: {exc}") from exc
        if sum(1 for i in values["interfaces"] if i.pxe) > 1:
            raise ScenarioError(f"machine {values['hostname']}: more than one pxe interface")
        return cls(**values)


@dataclass(frozen=True)
class Scenario:
    site: SiteSpec = field(default_factory=SiteSpec)
    timings: Timings = field(default_factory=Timings)
    subnets: tuple[SubnetSpec, ...] = ()
    machines: tuple[MachineSpec, ...] = ()
    faults: tuple[FaultSpec, ...] = ()  # request faults for the whole site
    seed: int = 0
    time_scale: float | None = None  # None: 1.0 unless the CLI or a reset says otherwise

    def timings_for(self, machine: MachineSpec) -> Timings:
        return self.timings.merged(machine.timing_overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        _check_keys(
            "scenario",
            data,
            {"site", "timings", "subnets", "machines", "faults", "seed", "time_scale"},
        )
        try:
            faults = tuple(FaultSpec.from_dict(f) for f in data.get("faults", ()))
        except FaultError as exc:
            raise ScenarioError(f"faults: {exc}") from exc
        if any(not f.is_request_fault for f in faults):
            raise ScenarioError(
                "top-level faults are request faults (http_error, slow, truncate_list)"
            )
        scenario = cls(
            site=SiteSpec.from_dict(data.get("site", {})),
            timings=Timings().merged(data.get("timings", {})),
            subnets=tuple(SubnetSpec.from_dict(s) for s in data.get("subnets", ())),
            machines=tuple(MachineSpec.from_dict(m) for m in data.get("machines", ())),
            faults=faults,
            seed=int(data.get("seed", 0)),
            time_scale=float(data["time_scale"]) if "time_scale" in data else None,
        )
        scenario._validate()
        return scenario

    def _validate(self) -> None:
        if self.time_scale is not None and self.time_scale <= 0:
            raise ScenarioError("time_scale must be positive")
        _unique("subnet name", [s.name for s in self.subnets])
        _unique("machine hostname", [m.hostname for m in self.machines])
        _unique(
            "BMC address",
            [m.bmc.address for m in self.machines]
            + [m.bmc.detected_address for m in self.machines if m.bmc.detected_address],
        )
        _unique("MAC address", [i.mac for m in self.machines for i in m.interfaces])
        subnet_refs = {s.name for s in self.subnets} | {s.cidr for s in self.subnets}
        for machine in self.machines:
            for iface in machine.interfaces:
                if iface.subnet is not None and iface.subnet not in subnet_refs:
                    raise ScenarioError(
                        f"machine {machine.hostname}: interface {iface.name} names unknown "
                        f"subnet {iface.subnet!r}"
                    )
            disks = {d.name for d in machine.block_devices}
            if machine.boot_disk is not None and machine.boot_disk not in disks:
                raise ScenarioError(f"machine {machine.hostname}: no disk {machine.boot_disk!r}")

    @classmethod
    def from_text(cls, text: str, fmt: str = "toml") -> Scenario:
        try:
            data = json.loads(text) if fmt == "json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ScenarioError(f"cannot parse the scenario: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        p = Path(path)
        return cls.from_text(p.read_text(), "json" if p.suffix == ".json" else "toml")


def _unique(what: str, values: Sequence[str]) -> None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ScenarioError(f"duplicate {what}: {value}")
        seen.add(value)
