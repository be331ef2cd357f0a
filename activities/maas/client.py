"""The MAAS 2.0 API client: one method per operation the bare-metal lifecycle needs, answering
typed values (activities/maas/types.py) and raising classified errors (activities/maas/errors.py).

    async with MaasClient(site.api_base_url, api_key, timeout=10) as maas:
        version = await maas.version()          # also the credential check
        (docs/maas-sites.md#admin-api) user = await maas.require_admin()       # …and that it is an
        admin's (MaasNotAdmin) machine = await maas.get_machine("abc123")

Everything here follows shared/maas-api-notes.md, in particular:
- storage: the boot disk is chosen with set_boot_disk *before* set_storage_layout, which has no
  boot-device parameter (`apply_flat_layout` does both in that order);
- hardware sync: health is computed from last_sync and sync_interval (`HardwareSync.healthy`);
  the REST API has no is_sync_healthy;
- the machine token changes whenever the owner does: fetch it after deploy, never cache it;
- a machine in Failed deployment must be released before a new deploy: deploy answers 409
  (MaasStateConflict, current_status=FAILED_DEPLOYMENT) otherwise. Which recovery to take is the
  workflow's decision, so the client does not release on its own.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import re
import ssl
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from activities.maas.auth import parse_api_key
from activities.maas.errors import MaasCapabilityMissing, MaasNotAdmin, MaasProtocolError
from activities.maas.images import normalise_distro_series
from activities.maas.transport import FormFields, MaasTransport, api_root, form_bool
from activities.maas.types import (
    BlockDevice,
    EraseMode,
    Event,
    HardwareSync,
    Interface,
    IpmiPowerParameters,
    LinkMode,
    MaasUser,
    MaasVersion,
    Machine,
    MachineState,
    MachineStatus,
    MachineToken,
    PowerState,
    RackController,
    StorageLayout,
    Subnet,
    machine_states_json,
)

T = TypeVar("T")

MAX_EVENTS_LIMIT = 1000  # MAAS answers 400 above this
_SYSTEM_ID = re.compile(r"[A-Za-z0-9_-]+")
_SUBNET_REF = re.compile(r"[A-Za-z0-9_.:-]+")


class MaasClient:
    """An async client for one MAAS region. `timeout` bounds each attempt (connect, read,
    write); idempotent requests are tried up to `max_attempts` times with jittered backoff."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        max_attempts: int = 3,
        backoff_initial: float = 0.25,
        backoff_max: float = 2.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self._root = api_root(base_url)
        self._key = parse_api_key(api_key)
        self._timeout = timeout
        self._retry = (max_attempts, backoff_initial, backoff_max)
        self._http: httpx.AsyncClient | None = None
        self._transport: MaasTransport | None = None

    def __repr__(self) -> str:
        return f"MaasClient({self._root!r})"

    async def __aenter__(self) -> MaasClient:
        max_attempts, backoff_initial, backoff_max = self._retry
        self._http = httpx.AsyncClient(
            base_url=self._root, timeout=httpx.Timeout(self._timeout), verify=_tls_context()
        )
        self._transport = MaasTransport(
            self._http,
            self._key,
            max_attempts=max_attempts,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = self._transport = None

    # ------------------------------------------------------------------ plumbing

    async def _get(self, path: str, *, op: str | None = None, query: FormFields = ()) -> Any:
        return await self._io().request("GET", path, op=op, query=query, retry_safe=True)

    async def _post(
        self,
        path: str,
        op: str | None,
        form: FormFields = (),
        *,
        retry_safe: bool = False,
        secrets: Sequence[str] = (),
    ) -> Any:
        return await self._io().request(
            "POST", path, op=op, form=form, retry_safe=retry_safe, secrets=secrets
        )

    def _io(self) -> MaasTransport:
        if self._transport is None:
            raise RuntimeError("MaasClient is used outside `async with`")
        return self._transport

    @staticmethod
    def _parse(operation: str, parse: Callable[[Any], T], data: Any) -> T:
        try:
            return parse(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MaasProtocolError(
                f"MAAS {operation} answered in a shape this client does not understand "
                f"({type(exc).__name__}: {str(exc)[:120]})",
                operation=operation,
            ) from exc

    def _many(self, operation: str, parse: Callable[[Any], T], data: Any) -> list[T]:
        if not isinstance(data, list):
            raise MaasProtocolError(f"MAAS {operation} did not answer a list", operation=operation)
        return [self._parse(operation, parse, item) for item in data]

    # ------------------------------------------------------------------ site

    async def version(self) -> MaasVersion:
        """GET version/. Anonymous in MAAS, but signed here so that it checks the key too: a bad
        key answers 401 (MaasAuthError)."""
        return self._parse("version", MaasVersion.from_json, await self._get("version/"))

    async def whoami(self) -> MaasUser:
        """GET users/?op=whoami: whose key this is, and whether that user is an admin. A valid
        signature (`version`) does not make the key an admin's; onboarding needs one."""
        return self._parse("whoami", MaasUser.from_json, await self._get("users/", op="whoami"))

    async def require_admin(self) -> MaasUser:
        """whoami, refused unless the user is a superuser (MaasNotAdmin). A MAAS that has no
        whoami cannot prove it either: refused too (fail closed), never assumed."""
        try:
            user = await self.whoami()
        except MaasCapabilityMissing as err:
            raise MaasNotAdmin(
                "MAAS cannot say whose API key this is (no users/?op=whoami), so it cannot be "
                "confirmed as an administrator's",
                operation=err.operation,
                username=None,
            ) from err
        if not user.is_superuser:
            raise MaasNotAdmin(
                f"the MAAS API key belongs to {user.username!r}, who is not a MAAS administrator "
                "(onboarding needs an admin's key: accept, commission, link_subnet)",
                operation="GET users/?op=whoami",
                username=user.username,
            )
        return user

    # ------------------------------------------------------------------ global config

    async def get_config(self, name: str) -> Any:
        """GET maas/?op=get_config&name=…: the config value as MAAS stores it (JSON)."""
        return await self._get("maas/", op="get_config", query=[("name", name)])

    async def set_config(self, name: str, value: str) -> None:
        """POST maas/?op=set_config name=… value=… (admin). Retried: it sets the same value."""
        await self._post("maas/", "set_config", [("name", name), ("value", value)], retry_safe=True)

    async def ensure_hardware_sync_interval(self, interval: str) -> bool:
        """The site's config hardware_sync_interval (a systemd-style timespan such as "15m",
        docs/lifecycles/onboarding.md#hardware-sync step 1); True when it had to be written. MAAS
        copies it into a machine's sync_interval whenever that machine's enable_hw_sync is saved."""
        if str(await self.get_config("hardware_sync_interval")) == interval:
            return False
        await self.set_config("hardware_sync_interval", interval)
        return True

    async def rack_controllers(self) -> list[RackController]:
        data = await self._get("rackcontrollers/")
        return self._many("rackcontrollers", RackController.from_json, data)

    # ------------------------------------------------------------------ machines

    async def list_machines(
        self,
        *,
        hostnames: Sequence[str] = (),
        system_ids: Sequence[str] = (),
        mac_addresses: Sequence[str] = (),
        statuses: Sequence[MachineStatus] = (),
    ) -> list[Machine]:
        """Machines, filtered by MAAS when filters are given (ReadNodesForm; a status by its
        short label, e.g. `status=new`). The same exact match is applied here as well, so a
        MAAS that ignores a filter cannot widen the answer."""
        query = [
            *(("hostname", h) for h in hostnames),
            *(("id", s) for s in system_ids),
            *(("mac_address", m) for m in mac_addresses),
            *(("status", s.name.lower()) for s in statuses),
        ]
        machines = self._many(
            "machines", Machine.from_json, await self._get("machines/", query=query)
        )
        macs = {m.lower() for m in mac_addresses}
        return [
            m
            for m in machines
            if (not hostnames or m.hostname in hostnames)
            and (not system_ids or m.system_id in system_ids)
            and (not macs or any(i.mac_address.lower() in macs for i in m.interfaces))
            and (not statuses or m.status in statuses)
        ]

    async def list_machine_states(self) -> list[MachineState]:
        """GET machines/, unfiltered: each machine's MachineState only. The list is the largest
        answer MAAS gives (about 12 KB per machine, 240 MB for 20,000), so only those keys are
        decoded from its bytes (bench/reconciler.py)."""
        entries = await self._io().request(
            "GET", "machines/", retry_safe=True, decode_json=machine_states_json
        )
        return self._many("machines", MachineState.from_json, entries)

    async def get_machine(self, system_id: str) -> Machine:
        data = await self._get(_machine(system_id))
        return self._parse("machine", Machine.from_json, data)

    async def power_addresses(self) -> dict[str, str]:
        """system_id → IPMI power_address of every machine that has one (for lookup by BMC
        address, docs/lifecycles/onboarding.md#discovery-ambiguity). The other power parameters,
        passwords included, are dropped here so they never leave the client."""
        data = await self._get("machines/", op="power_parameters")
        if not isinstance(data, dict):
            raise MaasProtocolError(
                "MAAS machines power_parameters did not answer an object",
                operation="power_parameters",
            )
        return {
            str(system_id): str(params["power_address"])
            for system_id, params in data.items()
            if isinstance(params, dict) and params.get("power_address")
        }

    async def create_machine(
        self,
        *,
        hostname: str,
        power: IpmiPowerParameters,
        architecture: str | None = None,
        mac_addresses: Sequence[str] = (),
        commission: bool | None = None,
        domain: str | None = None,
        description: str | None = None,
    ) -> Machine:
        """POST machines/ with IPMI power. Without an architecture MAAS ignores the MACs and
        answers a New machine with no interfaces, which cannot be commissioned until it is
        accepted (or PXE-boots and enlists into this record). Not retried: a lost answer
        followed by a retry would meet "Node with this Hostname already exists"."""
        form: list[tuple[str, str]] = [("hostname", hostname), ("power_type", power.POWER_TYPE)]
        form += power.form_fields()
        if architecture is not None:
            form.append(("architecture", architecture))
        form += [("mac_addresses", mac) for mac in mac_addresses]
        if commission is not None:
            form.append(("commission", form_bool(commission)))
        if domain is not None:
            form.append(("domain", domain))
        if description is not None:
            form.append(("description", description))
        data = await self._post("machines/", None, form, secrets=power.secrets())
        return self._parse("create machine", Machine.from_json, data)

    async def update_machine(
        self,
        system_id: str,
        *,
        hostname: str | None = None,
        description: str | None = None,
        power: IpmiPowerParameters | None = None,
        enable_hw_sync: bool | None = None,
    ) -> Machine:
        """PUT machines/{id}/ with only the given fields. Retried: it sets the same values."""
        form: list[tuple[str, str]] = []
        if hostname is not None:
            form.append(("hostname", hostname))
        if description is not None:
            form.append(("description", description))
        if power is not None:
            form += [("power_type", power.POWER_TYPE), *power.form_fields()]
        if enable_hw_sync is not None:
            form.append(("enable_hw_sync", form_bool(enable_hw_sync)))
        data = await self._io().request(
            "PUT",
            _machine(system_id),
            form=form,
            retry_safe=True,
            secrets=power.secrets() if power else (),
        )
        return self._parse("update machine", Machine.from_json, data)

    async def accept_machines(self, *system_ids: str) -> list[Machine]:
        """New → Commissioning. Answers the machines actually accepted: Ready or Commissioning
        ones are skipped, which is also why a retry after a lost answer is harmless (it comes
        within seconds, long before commissioning moves on to Testing)."""
        if not system_ids:
            raise ValueError("accept_machines needs at least one system_id")
        form = [("machines", s) for s in system_ids]
        data = await self._post("machines/", "accept", form, retry_safe=True)
        return self._many("accept", Machine.from_json, data)

    async def commission(
        self,
        system_id: str,
        *,
        enable_ssh: bool = False,
        skip_bmc_config: bool = False,
        skip_networking: bool = False,
        skip_storage: bool = False,
        commissioning_scripts: Sequence[str] = (),
        testing_scripts: Sequence[str] = (),
    ) -> Machine:
        form = [
            ("enable_ssh", form_bool(enable_ssh)),
            ("skip_bmc_config", form_bool(skip_bmc_config)),
            ("skip_networking", form_bool(skip_networking)),
            ("skip_storage", form_bool(skip_storage)),
        ]
        if commissioning_scripts:
            form.append(("commissioning_scripts", ",".join(commissioning_scripts)))
        if testing_scripts:
            form.append(("testing_scripts", ",".join(testing_scripts)))
        data = await self._post(_machine(system_id), "commission", form)
        return self._parse("commission", Machine.from_json, data)

    async def deploy(
        self,
        system_id: str,
        *,
        distro_series: str,
        user_data: bytes | str | None = None,
        enable_hw_sync: bool = False,
        hwe_kernel: str | None = None,
        comment: str | None = None,
    ) -> Machine:
        """Ready (auto-allocated to the key's user) or Allocated → Deploying. `user_data` is
        the raw cloud-init payload; it is base64-encoded here. `distro_series` is normalised
        (gpuaas-* images → custom/<name>, docs/maas-sites.md#policy-knobs). Never retried."""
        form = [
            ("distro_series", normalise_distro_series(distro_series)),
            ("enable_hw_sync", form_bool(enable_hw_sync)),
        ]
        if user_data is not None:
            raw = user_data.encode() if isinstance(user_data, str) else user_data
            form.append(("user_data", base64.b64encode(raw).decode("ascii")))
        if hwe_kernel is not None:
            form.append(("hwe_kernel", hwe_kernel))
        if comment is not None:
            form.append(("comment", comment))
        data = await self._post(_machine(system_id), "deploy", form)
        return self._parse("deploy", Machine.from_json, data)

    async def release(
        self,
        system_id: str,
        *,
        erase: EraseMode = EraseMode.NONE,
        force: bool = False,
        comment: str | None = None,
    ) -> Machine:
        """Back to Ready (through Disk erasing when erasing). Releasing a Ready or Releasing
        machine is a no-op success, so a release without erase is retried; with erase a lost
        answer would leave the machine in Disk erasing, where a second release is a 409."""
        form = [
            ("erase", form_bool(erase != EraseMode.NONE)),
            ("force", form_bool(force)),
        ]
        if erase == EraseMode.SECURE:
            form.append(("secure_erase", "true"))
        elif erase == EraseMode.QUICK:
            form.append(("quick_erase", "true"))
        if comment is not None:
            form.append(("comment", comment))
        data = await self._post(
            _machine(system_id), "release", form, retry_safe=erase == EraseMode.NONE
        )
        return self._parse("release", Machine.from_json, data)

    async def delete_machine(self, system_id: str) -> None:
        """DELETE the machine record (the hardware stays;
        docs/lifecycles/decommission.md#full-decommission RemoveMaasRecord). A machine already gone
        answers MaasNotFound, which callers treat as done. Retry-safe: a repeated delete either
        deletes or finds nothing."""
        await self._io().request("DELETE", _machine(system_id), retry_safe=True)

    async def abort(self, system_id: str, *, comment: str | None = None) -> Machine:
        data = await self._post(_machine(system_id), "abort", _comment(comment))
        return self._parse("abort", Machine.from_json, data)

    async def mark_fixed(self, system_id: str, *, comment: str | None = None) -> Machine:
        data = await self._post(_machine(system_id), "mark_fixed", _comment(comment))
        return self._parse("mark_fixed", Machine.from_json, data)

    async def power_on(self, system_id: str, *, comment: str | None = None) -> Machine:
        """Needs an owner (409 otherwise); on an Allocated machine it starts the deployment."""
        data = await self._post(_machine(system_id), "power_on", _comment(comment))
        return self._parse("power_on", Machine.from_json, data)

    async def power_off(
        self, system_id: str, *, stop_mode: str | None = None, comment: str | None = None
    ) -> Machine | None:
        """None when MAAS cannot control this machine's power."""
        form = _comment(comment) + ([("stop_mode", stop_mode)] if stop_mode else [])
        data = await self._post(_machine(system_id), "power_off", form)
        return None if data is None else self._parse("power_off", Machine.from_json, data)

    async def query_power_state(self, system_id: str) -> PowerState:
        """Asks the BMC now (through the rack), unlike Machine.power_state, MAAS's last view."""
        data = await self._get(_machine(system_id), op="query_power_state")
        return self._parse("query_power_state", lambda d: PowerState(d["state"]), data)

    # ------------------------------------------------------------------ hardware sync

    async def get_machine_token(self, system_id: str) -> MachineToken | None:
        """The machine's hardware-sync token, or None while MAAS has not created one (it does
        when it renders user data for commissioning or deployment)."""
        data = await self._get(_machine(system_id), op="get_token")
        return None if data is None else self._parse("get_token", MachineToken.from_json, data)

    async def get_hardware_sync(self, system_id: str) -> HardwareSync:
        return (await self.get_machine(system_id)).hardware_sync

    # ------------------------------------------------------------------ storage

    async def list_block_devices(self, system_id: str) -> list[BlockDevice]:
        data = await self._get(f"nodes/{_system_id(system_id)}/blockdevices/")
        return self._many("blockdevices", BlockDevice.from_json, data)

    async def set_boot_disk(self, system_id: str, block_device_id: int) -> None:
        """Ready machines only; a physical disk only. It does not re-apply the layout."""
        await self._post(
            f"nodes/{_system_id(system_id)}/blockdevices/{int(block_device_id)}/", "set_boot_disk"
        )

    async def set_storage_layout(
        self,
        system_id: str,
        layout: StorageLayout = StorageLayout.FLAT,
        *,
        boot_size: int | None = None,
        root_size: int | None = None,
        root_device: int | None = None,
    ) -> Machine:
        """Applies `layout` to the machine's boot disk (choose it first with set_boot_disk:
        MAAS has no boot-device parameter here and ignores unknown fields)."""
        form = [("storage_layout", layout.value)]
        for name, value in (
            ("boot_size", boot_size),
            ("root_size", root_size),
            ("root_device", root_device),
        ):
            if value is not None:
                form.append((name, str(value)))
        data = await self._post(_machine(system_id), "set_storage_layout", form)
        return self._parse("set_storage_layout", Machine.from_json, data)

    async def apply_flat_layout(self, system_id: str, boot_disk_id: int) -> Machine:
        """The flat layout on `boot_disk_id`: set_boot_disk, then set_storage_layout."""
        await self.set_boot_disk(system_id, boot_disk_id)
        return await self.set_storage_layout(system_id, StorageLayout.FLAT)

    # ------------------------------------------------------------------ networking

    async def list_interfaces(self, system_id: str) -> list[Interface]:
        data = await self._get(f"nodes/{_system_id(system_id)}/interfaces/")
        return self._many("interfaces", Interface.from_json, data)

    async def link_subnet(
        self,
        system_id: str,
        interface_id: int,
        *,
        mode: LinkMode,
        subnet: int | str | None = None,
        ip_address: str | None = None,
        default_gateway: bool = False,
        force: bool = False,
    ) -> Interface:
        """Adds a link (never retried: a repeat would add a second one). `subnet` is an id or
        a specifier such as "cidr:10.0.0.0/24"; AUTO and STATIC need one."""
        if mode in (LinkMode.AUTO, LinkMode.STATIC) and subnet is None:
            raise ValueError(f"link_subnet mode {mode.name} needs a subnet")
        if ip_address is not None and mode != LinkMode.STATIC:
            raise ValueError("ip_address is only valid with mode STATIC")
        form = [("mode", mode.name)]
        if subnet is not None:
            form.append(("subnet", str(subnet)))
        if ip_address is not None:
            form.append(("ip_address", ip_address))
        if default_gateway:
            form.append(("default_gateway", "true"))
        if force:
            form.append(("force", "true"))
        data = await self._post(_interface(system_id, interface_id), "link_subnet", form)
        return self._parse("link_subnet", Interface.from_json, data)

    async def unlink_subnet(self, system_id: str, interface_id: int, link_id: int) -> Interface:
        """Removes a link; MAAS gives an enabled interface left without links a link_up one."""
        form = [("id", str(link_id))]
        data = await self._post(_interface(system_id, interface_id), "unlink_subnet", form)
        return self._parse("unlink_subnet", Interface.from_json, data)

    async def list_subnets(self) -> list[Subnet]:
        return self._many("subnets", Subnet.from_json, await self._get("subnets/"))

    async def get_subnet(self, subnet: int | str) -> Subnet:
        """By id, or by a "name:<name>" specifier. A "cidr:" specifier cannot travel in the
        path (MAAS's URL pattern stops at its "/"): use find_subnet_by_cidr."""
        ref = str(subnet)
        if not _SUBNET_REF.fullmatch(ref):
            raise ValueError("subnet must be an id or a name: specifier (no '/')")
        return self._parse("subnet", Subnet.from_json, await self._get(f"subnets/{ref}/"))

    async def find_subnet_by_cidr(self, cidr: str) -> Subnet | None:
        wanted = ipaddress.ip_network(cidr, strict=False)
        for subnet in await self.list_subnets():
            if ipaddress.ip_network(subnet.cidr, strict=False) == wanted:
                return subnet
        return None

    async def create_subnet(
        self,
        cidr: str,
        *,
        name: str | None = None,
        vlan_id: int | None = None,
        gateway_ip: str | None = None,
        dns_servers: Sequence[str] = (),
        managed: bool | None = None,
    ) -> Subnet:
        """`vlan_id` is the VLAN's database id (not its VID); by default MAAS uses the default
        fabric's untagged VLAN."""
        form = [("cidr", cidr)]
        if name is not None:
            form.append(("name", name))
        if vlan_id is not None:
            form.append(("vlan", str(vlan_id)))
        if gateway_ip is not None:
            form.append(("gateway_ip", gateway_ip))
        if dns_servers:
            form.append(("dns_servers", " ".join(dns_servers)))
        if managed is not None:
            form.append(("managed", form_bool(managed)))
        data = await self._post("subnets/", None, form)
        return self._parse("create subnet", Subnet.from_json, data)

    # ------------------------------------------------------------------ events

    async def query_events(
        self,
        *,
        system_id: str | None = None,
        hostname: str | None = None,
        level: str | None = None,
        limit: int = 100,
        before: int | None = None,
        after: int | None = None,
    ) -> list[Event]:
        """Newest first. MAAS's default level is INFO, which hides DEBUG events such as
        "Node changed status"; pass level="DEBUG" to see them."""
        if not 1 <= limit <= MAX_EVENTS_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_EVENTS_LIMIT}")
        query = [("limit", str(limit))]
        for name, value in (
            ("id", system_id),
            ("hostname", hostname),
            ("level", level),
            ("before", before),
            ("after", after),
        ):
            if value is not None:
                query.append((name, str(value)))
        data = await self._get("events/", op="query", query=query)
        if not isinstance(data, dict):
            raise MaasProtocolError(
                "MAAS events query did not answer an object", operation="events"
            )
        return self._many("events", Event.from_json, data.get("events"))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process: building one loads the whole CA bundle (tens of ms of CPU)
    and lifecycle activities open a client per stage; profiling an onboarding batch found 40%
    of the worker's CPU there."""
    return httpx.create_ssl_context()


def _system_id(system_id: str) -> str:
    # It becomes a path segment: refuse anything that could step out of it.
    if not _SYSTEM_ID.fullmatch(system_id):
        raise ValueError("system_id may only hold letters, digits, '-' and '_'")
    return system_id


def _machine(system_id: str) -> str:
    return f"machines/{_system_id(system_id)}/"


def _interface(system_id: str, interface_id: int) -> str:
    return f"nodes/{_system_id(system_id)}/interfaces/{int(interface_id)}/"


def _comment(comment: str | None) -> list[tuple[str, str]]:
    return [] if comment is None else [("comment", comment)]
