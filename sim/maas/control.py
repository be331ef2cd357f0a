"""The out-of-band control API under /_sim/: what tests and the demo do behind the product's back,
plus inspection. JSON in and out; every call but /_sim/health needs
`Authorization: Bearer <control token>`. A machine `ref` is a system_id, a MAAS hostname, a
scenario hostname or a BMC address.

    GET    /_sim/health                          {"ok": true}
    POST   /_sim/reset                           {"scenario": {...}} or {"scenario_toml": "..."},
                                                 optional "time_scale"; counters start at zero
    GET    /_sim/state                           every machine's snapshot, request faults, scale
    GET    /_sim/machines/{ref}                  one snapshot (status, power, owner, user data,
                                                 faults and their strikes, pending steps, ...)
    GET    /_sim/counters                        {"ops": {op: n}, "machines": {system_id: {op: n}},
                                                  "answers": {op: {status: n}}}
    POST   /_sim/counters/reset
    POST   /_sim/machines/{ref}/release          {"erase": false, "comment": ""} as in the UI
    POST   /_sim/machines/{ref}/mark-broken      {"comment": ""} as an admin in the UI
    POST   /_sim/machines/{ref}/delete           gone from MAAS (the hardware stays)
    POST   /_sim/machines/{ref}/change-ip        {"ip": optional, "interface": optional name}
    POST   /_sim/machines/{ref}/planned-ip       {"ip": "...", "interface": optional name}: the
                                                 address the next deployment's AUTO link gets
                                                 (default interface: the boot interface)
    POST   /_sim/machines/{ref}/power            {"state": "on" | "off"} at the BMC
    POST   /_sim/machines/{ref}/status           {"status": "Deploying"}: forced, no transition
    POST   /_sim/machines/{ref}/hw-sync-timer    {"running": false}: the deployed OS's hardware-
                                                 sync timer stops (last_sync goes stale);
                                                 {"running": true}: systemctl restart of it (a
                                                 post now, then every period), what a re-seed
                                                 does; answers {"running", "posted"}
    POST   /_sim/machines/{ref}/faults           {"faults": [fault, ...]} or one fault object
    DELETE /_sim/machines/{ref}/faults
    POST   /_sim/faults                          site-wide request faults (http_error, slow,
                                                 truncate_list)
    DELETE /_sim/faults
    POST   /_sim/users                           {"username": "ops", "is_superuser": false}: a
                                                 user with a fresh API key of its own, answered
                                                 once as "api_key" (forgotten on reset)
    GET    /_sim/users                           the added users (never their keys)
    GET    /_sim/bmc/{address}                   {"bmc_address", "power": "on" | "off"}: the
                                                 chassis status a BMC answers (ipmitool
                                                 `chassis power status`); 404 when no BMC
                                                 answers there
    POST   /_sim/bmc/{address}/power-cycle       {"action": "cycle" | "on"} (default cycle) ->
                                                 {"result": "enlisting" | "booted"}
    GET    /_sim/bmc-log                         {"requests": [{"address", "action", "power_before",
                                                 "at"}]}: every BMC request above, in order
    GET    /_sim/erasures                        {"erasures": [{"system_id", "hostname", "method",
                                                 "outcome", "at"}]}: every disk erase MAAS ran
                                                 to its end (erased or failed)
    POST   /_sim/time-scale                      {"time_scale": 0.01}
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sim.maas import enlistment, hwsync, lifecycle, network, storage
from sim.maas.enums import NodeStatus, PowerState
from sim.maas.errors import ApiError
from sim.maas.faults import FaultError, FaultSpec
from sim.maas.http import Request, Response
from sim.maas.model import Hardware, Machine
from sim.maas.scenario import Scenario, ScenarioError

if TYPE_CHECKING:
    from sim.maas.server import Simulator


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


Handler = Callable[["Simulator", dict[str, Any], dict[str, str]], Any]
_ROUTES: list[tuple[str, re.Pattern[str], Handler]] = []


def _route(method: str, path: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        _ROUTES.append((method, re.compile(path), handler))
        return handler

    return register


def handle(sim: Simulator, request: Request, body: bytes) -> Response:
    path = request.path.rstrip("/")
    if path == "/_sim/health":
        return Response.json({"ok": True})
    expected = f"Bearer {sim.control_token}"
    if not hmac.compare_digest(request.headers.get("authorization", ""), expected):
        return Response.json({"error": "control token required (Authorization: Bearer ...)"}, 401)
    try:
        payload = json.loads(body) if body.strip() else {}
        if not isinstance(payload, dict):
            raise ControlError(400, "the body must be a JSON object")
        sim.region.advance()
        for method, pattern, handler in _ROUTES:
            found = pattern.fullmatch(path)
            if found is not None and method == request.method:
                return Response.json(handler(sim, payload, found.groupdict()))
        raise ControlError(404, f"no control endpoint {request.method} {request.path}")
    except ValueError as exc:  # JSON, scenario and fault errors
        return Response.json({"error": str(exc)}, 400)
    except ControlError as exc:
        return Response.json({"error": exc.message}, exc.status)
    except ApiError as exc:  # what MAAS itself would refuse (e.g. releasing a New machine)
        return Response.json({"error": exc.body}, exc.status)


def _machine(sim: Simulator, ref: str) -> Machine:
    machine = sim.region.find_machine(ref)
    if machine is None:
        raise ControlError(404, f"no machine {ref!r} in MAAS")
    return machine


def _hardware(sim: Simulator, ref: str) -> Hardware:
    hardware = sim.region.find_hardware(ref)
    if hardware is None:
        raise ControlError(404, f"no physical machine {ref!r} in the scenario")
    return hardware


def snapshot(sim: Simulator, machine: Machine) -> dict[str, Any]:
    region = sim.region
    disk = storage.boot_disk(machine)
    data = machine.user_data
    return {
        "system_id": machine.system_id,
        "hostname": machine.hostname,
        "scenario_hostname": machine.hardware.spec.hostname if machine.hardware else None,
        "bmc_address": machine.power_address,
        "status": int(machine.status),
        "status_name": machine.status.label,
        "previous_status_name": machine.previous_status.label,
        "power_state": machine.power_state,
        "owner": machine.owner,
        "osystem": machine.osystem,
        "distro_series": machine.distro_series,
        "enable_hw_sync": machine.enable_hw_sync,
        "ip_addresses": machine.ip_addresses,
        "boot_disk": disk.name if disk else None,
        "has_node_key": machine.node_key is not None,
        "user_data": base64.b64encode(data).decode() if data is not None else None,
        "user_data_text": data.decode(errors="replace") if data is not None else None,
        "faults": machine.hardware.faults.to_list() if machine.hardware else [],
        "pending_steps": region.pending_steps(machine),
    }


@_route("POST", "/_sim/reset")
def _reset(sim: Simulator, payload: dict[str, Any], _: dict[str, str]) -> Any:
    try:
        if "scenario_toml" in payload:
            scenario = Scenario.from_text(str(payload["scenario_toml"]), "toml")
        else:
            scenario = Scenario.from_dict(payload.get("scenario") or {})
    except ScenarioError as exc:
        raise ControlError(400, f"invalid scenario: {exc}") from exc
    scale = payload.get("time_scale")
    sim.reset(scenario, float(scale) if scale is not None else None)
    return _state(sim, {}, {})


@_route("GET", "/_sim/state")
def _state(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    region = sim.region
    return {
        "time_scale": region.clock.time_scale,
        "machines": [snapshot(sim, m) for m in region.machines.values()],
        "hardware": [
            {
                "hostname": h.spec.hostname,
                "bmc_address": h.bmc_address,
                "power": h.power,
                "in_maas": [m.system_id for m in region.machines.values() if m.hardware is h],
            }
            for h in region.hardware.values()
        ],
        "request_faults": region.request_faults.to_list(),
    }


@_route("GET", r"/_sim/machines/(?P<ref>[^/]+)")
def _machine_state(sim: Simulator, _: dict[str, Any], args: dict[str, str]) -> Any:
    return snapshot(sim, _machine(sim, args["ref"]))


@_route("GET", "/_sim/counters")
def _counters(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    return sim.counters.to_dict()


@_route("POST", "/_sim/counters/reset")
def _reset_counters(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    sim.counters.reset()
    return sim.counters.to_dict()


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/release")
def _release(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    lifecycle.release(
        sim.region,
        machine,
        lifecycle.OPERATOR,
        bool(payload.get("erase", False)),
        str(payload.get("comment", "")),
    )
    return snapshot(sim, machine)


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/mark-broken")
def _mark_broken(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    lifecycle.mark_broken(sim.region, machine, lifecycle.OPERATOR, str(payload.get("comment", "")))
    return snapshot(sim, machine)


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/delete")
def _delete(sim: Simulator, _: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    sim.region.delete_machine(machine)
    return {"deleted": machine.system_id}


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/change-ip")
def _change_ip(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    name = payload.get("interface")
    if name:
        iface = next((i for i in machine.interfaces if i.name == name), None)
        link = next((lk for lk in iface.links if lk.ip_address), None) if iface else None
    else:
        link = network.primary_link(machine)
    if link is None or link.subnet is None:
        raise ControlError(409, "the machine has no address to change")
    old = link.ip_address
    wanted = payload.get("ip")
    new = str(wanted) if wanted else network.allocate_ip(sim.region, link.subnet)
    if new is None:
        raise ControlError(409, f"no free address in {link.subnet.cidr}")
    link.ip_address = new
    return {"old": old, "new": new, "machine": snapshot(sim, machine)}


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/planned-ip")
def _planned_ip(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    name = payload.get("interface")
    iface = (
        next((i for i in machine.interfaces if i.name == name), None)
        if name
        else machine.boot_interface
    )
    if iface is None:
        raise ControlError(404, f"no interface {name or '(boot)'} on {machine.hostname}")
    wanted = payload.get("ip")
    if not wanted:
        raise ControlError(400, "ip is required")
    subnet = iface.cabled_subnet
    try:
        inside = subnet is not None and ipaddress.ip_address(str(wanted)) in subnet.network
    except ValueError as exc:
        raise ControlError(400, str(exc)) from exc
    if not inside:
        raise ControlError(409, f"{wanted} is not on the network {iface.name} is cabled to")
    iface.planned_ip = str(wanted)
    return {"interface": iface.name, "planned_ip": iface.planned_ip}


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/power")
def _power(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    state = payload.get("state")
    if state not in (PowerState.ON, PowerState.OFF):
        raise ControlError(400, "state is 'on' or 'off'")
    hardware = _hardware(sim, args["ref"])
    lifecycle.set_hardware_power(sim.region, hardware, state == PowerState.ON)
    return {"bmc_address": hardware.bmc_address, "power": hardware.power}


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/status")
def _force_status(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    machine = _machine(sim, args["ref"])
    try:
        status = NodeStatus.parse(str(payload.get("status", "")))
    except ValueError as exc:
        raise ControlError(400, str(exc)) from exc
    machine.cancel_steps()
    lifecycle.set_status(sim.region, machine, status)
    return snapshot(sim, machine)


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/hw-sync-timer")
def _hw_sync_timer(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    running = payload.get("running")
    if not isinstance(running, bool):
        raise ControlError(400, "running is true or false")
    machine = _machine(sim, args["ref"])
    posted = False
    if running:
        posted = hwsync.restart_sync_timer(sim.region, machine)
    else:
        hwsync.stop_sync_timer(sim.region, machine)
    return {"running": hwsync.sync_timer_running(machine), "posted": posted}


def _fault_specs(payload: dict[str, Any]) -> list[FaultSpec]:
    raw = payload.get("faults", [payload] if "kind" in payload else [])
    try:
        return [FaultSpec.from_dict(f) for f in raw]
    except FaultError as exc:
        raise ControlError(400, str(exc)) from exc


@_route("POST", r"/_sim/machines/(?P<ref>[^/]+)/faults")
def _add_machine_faults(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    hardware = _hardware(sim, args["ref"])
    for spec in _fault_specs(payload):
        hardware.faults.add(spec)
    return {"faults": hardware.faults.to_list()}


@_route("DELETE", r"/_sim/machines/(?P<ref>[^/]+)/faults")
def _clear_machine_faults(sim: Simulator, _: dict[str, Any], args: dict[str, str]) -> Any:
    hardware = _hardware(sim, args["ref"])
    hardware.faults.clear()
    return {"faults": []}


@_route("POST", "/_sim/faults")
def _add_request_faults(sim: Simulator, payload: dict[str, Any], _: dict[str, str]) -> Any:
    specs = _fault_specs(payload)
    if any(not s.is_request_fault for s in specs):
        raise ControlError(
            400, "site-wide faults are request faults (http_error, slow, truncate_list)"
        )
    for spec in specs:
        sim.region.request_faults.add(spec)
    return {"faults": sim.region.request_faults.to_list()}


@_route("DELETE", "/_sim/faults")
def _clear_request_faults(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    sim.region.request_faults.clear()
    return {"faults": []}


@_route("POST", "/_sim/users")
def _add_user(sim: Simulator, payload: dict[str, Any], _: dict[str, str]) -> Any:
    username = str(payload.get("username") or "")
    is_superuser = payload.get("is_superuser", False)
    if not isinstance(is_superuser, bool):
        raise ControlError(400, "is_superuser is true or false")
    try:
        key = sim.auth.add_user(username, is_superuser=is_superuser)
    except ValueError as exc:
        raise ControlError(409, str(exc)) from exc
    return {"username": username, "is_superuser": is_superuser, "api_key": str(key)}


@_route("GET", "/_sim/users")
def _users(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    admin = {"username": sim.auth.username, "is_superuser": True}
    added = [
        {"username": u.username, "is_superuser": u.is_superuser}
        for u in sim.auth.added_users().values()
    ]
    return {"users": [admin, *added]}


def _bmc(sim: Simulator, address: str, action: str) -> Hardware:
    """The hardware whose BMC answers at `address` (operators reach a BMC at its own address,
    never at the one enlistment detects behind NAT); the request is logged either way."""
    hardware = sim.region.hardware.get(address)
    sim.region.bmc_log.append(
        {
            "address": address,
            "action": action,
            "power_before": hardware.power if hardware is not None else None,
            "at": sim.region.wall_now(),
        }
    )
    if hardware is None:
        raise ControlError(404, f"no BMC at {address}")
    return hardware


@_route("GET", r"/_sim/bmc/(?P<address>[^/]+)")
def _bmc_status(sim: Simulator, _: dict[str, Any], args: dict[str, str]) -> Any:
    hardware = _bmc(sim, args["address"], "status")
    return {"bmc_address": hardware.bmc_address, "power": hardware.power}


@_route("POST", r"/_sim/bmc/(?P<address>[^/]+)/power-cycle")
def _power_cycle(sim: Simulator, payload: dict[str, Any], args: dict[str, str]) -> Any:
    action = str(payload.get("action") or "cycle")
    if action not in ("cycle", "on"):
        raise ControlError(400, "action is 'cycle' or 'on'")
    hardware = _bmc(sim, args["address"], action)
    return {"result": enlistment.power_cycle_bmc(sim.region, hardware)}


@_route("GET", "/_sim/bmc-log")
def _bmc_log(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    return {"requests": list(sim.region.bmc_log)}


@_route("GET", "/_sim/erasures")
def _erasures(sim: Simulator, _: dict[str, Any], __: dict[str, str]) -> Any:
    return {"erasures": list(sim.region.erasures)}


@_route("POST", "/_sim/time-scale")
def _time_scale(sim: Simulator, payload: dict[str, Any], _: dict[str, str]) -> Any:
    scale = float(payload.get("time_scale", 0))
    if scale <= 0:
        raise ControlError(400, "time_scale must be positive")
    # Steps already queued keep their deadlines; new ones use the new scale.
    sim.region.clock.time_scale = scale
    return {"time_scale": scale}
