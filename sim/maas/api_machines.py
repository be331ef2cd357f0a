"""machines/ and machines/{system_id}/: list/create/accept/allocate, and each machine's read,
update, delete and operations (commission, deploy, release, abort, mark_broken, mark_fixed,
power_on, power_off, query_power_state, get_token, power_parameters, set_storage_layout)."""

from __future__ import annotations

from typing import Any

from sim.maas import enlistment, forms, hardware, hwsync, lifecycle, network, render, storage
from sim.maas.context import Ctx
from sim.maas.enums import COMMISSIONABLE, Ev, NodeStatus, PowerState
from sim.maas.errors import (
    bad_request,
    conflict,
    field_errors,
    forbidden,
    unauthorized,
    unavailable,
)
from sim.maas.http import Params, Response
from sim.maas.model import Interface, Machine

S = NodeStatus


def _machine(ctx: Ctx, system_id: str) -> Machine:
    return ctx.region.machine_or_404(system_id)


def _json(ctx: Ctx, machine: Machine) -> dict[str, Any]:
    return render.machine(ctx.region, machine)


# --- machines/ ---


# ReadNodesForm's filters (src/maasserver/forms/__init__.py); any other key is ignored.
LIST_FILTERS = ("id", "hostname", "mac_address", "status", "agent_name", "zone", "pool", "arch")


def is_filtered(params: Params) -> bool:
    return any(params.getlist(key) for key in LIST_FILTERS)


def list_machines(ctx: Ctx) -> list[dict[str, Any]]:
    """GET machines/ with ReadNodesForm filters: id, hostname, mac_address, status, agent_name,
    zone, pool, arch (each may repeat)."""
    q = ctx.params
    ids = set(q.getlist("id"))
    hostnames = {h.split(".")[0] for h in q.getlist("hostname")}
    macs = {forms.normalise_mac(m, "mac_address") for m in q.getlist("mac_address")}
    statuses: set[NodeStatus] = set()
    for text in q.getlist("status"):
        try:
            statuses.add(NodeStatus.parse(text))
        except ValueError:
            raise field_errors(
                {"status": f"Select a valid choice. {text} is not one of the available choices."}
            ) from None
    found = []
    for machine in ctx.region.machines.values():
        if ids and machine.system_id not in ids:
            continue
        if hostnames and machine.hostname not in hostnames:
            continue
        if macs and not macs & {i.mac_address for i in machine.interfaces}:
            continue
        if statuses and machine.status not in statuses:
            continue
        if not _matches(q, "agent_name", machine.agent_name):
            continue
        if not _matches(q, "zone", machine.zone) or not _matches(q, "pool", machine.pool):
            continue
        if not _matches(q, "arch", machine.architecture):
            continue
        found.append(_json(ctx, machine))
    return found


def _matches(q: Params, key: str, value: str) -> bool:
    wanted = q.getlist(key)
    return not wanted or value in wanted


def create_machine(ctx: Ctx) -> dict[str, Any]:
    """POST machines/ (admin). IPMI-only machines (no architecture) ignore MACs and stay New:
    without interfaces they cannot be commissioned, and the admin create skips that silently."""
    region, p = ctx.region, ctx.params
    ptype = forms.power_type(p, None)
    params = forms.power_parameters(p) or {}
    arch_text = p.get("architecture")
    macs = [forms.normalise_mac(m, "mac_addresses") for m in p.getlist("mac_addresses")]
    errors: dict[str, str] = {}
    if ptype != "ipmi":
        if not arch_text:
            errors["architecture"] = "This field is required."
        if not macs:
            errors["mac_addresses"] = "This field is required."
    if ptype == "ipmi" and not params.get("power_address"):
        errors["power_parameters"] = "power_address: This field is required."
    hostname = (p.get("hostname") or "").split(".")[0]
    if hostname and region.machine_by_hostname(hostname) is not None:
        errors["hostname"] = "Node with this Hostname already exists."
    if errors:
        raise field_errors(errors)
    arch = forms.architecture(arch_text) if arch_text else ""
    if not arch:
        macs = []  # WithMACAddressesMixin.save: no architecture, no interfaces
    _check_macs_free(ctx, macs)
    machine = hardware.new_machine(region, hostname or region.petname(), S.NEW)
    machine.architecture = arch
    machine.description = p.get("description") or ""
    machine.power_type = ptype or "manual"
    if ptype == "ipmi":
        machine.power_parameters = {**hardware.ipmi_parameters("", "", ""), **params}
    hardware.link_hardware(region, machine)
    machine.interfaces = _interfaces_for_macs(ctx, macs)
    for iface in machine.interfaces:
        network.ensure_link_up(region, iface)
    if p.bool("deployed"):
        machine.owner = ctx.user
        machine.status = S.DEPLOYED
    elif p.bool("commission", True) and machine.interfaces:
        lifecycle.start_commissioning(
            region,
            machine,
            ctx.username,
            enable_ssh=p.bool("enable_ssh"),
            skip_networking=p.bool("skip_networking"),
            skip_storage=p.bool("skip_storage"),
        )
    return _json(ctx, machine)


def _check_macs_free(ctx: Ctx, macs: list[str]) -> None:
    for mac in macs:
        for other in ctx.region.machines.values():
            if any(i.mac_address == mac for i in other.interfaces):
                raise field_errors(
                    {"mac_addresses": f"MAC address {mac} already in use on {other.hostname}."}
                )


def _interfaces_for_macs(ctx: Ctx, macs: list[str]) -> list[Interface]:
    """What MAAS knows of NICs given only their MACs: names, no VLAN until commissioning."""
    return [
        Interface(id=ctx.region.next_id("interface"), name=f"eth{n}", mac_address=mac, vlan=None)
        for n, mac in enumerate(macs)
    ]


def anonymous_enlist(ctx: Ctx) -> dict[str, Any]:
    """Unsigned POST machines/: a node enlisting itself. A New/Commissioning machine with the
    same power address is updated instead of creating another one."""
    region, p = ctx.region, ctx.params
    params = forms.power_parameters(p) or {}
    address = params.get("power_address")
    arch_text, macs = p.get("architecture"), p.getlist("mac_addresses")
    physical = region.hardware.get(str(address)) if address else None
    if physical is None:  # a scenario machine enlisting itself is known by its MACs
        wanted = {m.strip().lower() for m in macs}
        physical = next(
            (h for h in region.hardware.values() if wanted & {i.mac for i in h.spec.interfaces}),
            None,
        )
    records = [m for m in region.machines.values() if physical and m.hardware is physical]
    if physical is not None and all(m.status in (S.NEW, S.COMMISSIONING) for m in records):
        return _json(ctx, enlistment.enlist(region, physical))
    if not arch_text or not macs:
        raise field_errors(
            {
                k: "This field is required."
                for k, v in (("architecture", arch_text), ("mac_addresses", macs))
                if not v
            }
        )
    normalised = [forms.normalise_mac(m, "mac_addresses") for m in macs]
    _check_macs_free(ctx, normalised)
    machine = hardware.new_machine(region, region.petname(), S.NEW)
    machine.architecture = forms.architecture(arch_text)
    machine.interfaces = _interfaces_for_macs(ctx, normalised)
    return _json(ctx, machine)


def anonymous_accept(ctx: Ctx) -> None:
    raise unauthorized("You must be logged in to accept machines.", challenge=False)


def anonymous_is_registered(ctx: Ctx) -> bool:
    mac = forms.normalise_mac(ctx.params.get("mac_address") or "", "mac_address")
    return any(i.mac_address == mac for m in ctx.region.machines.values() for i in m.interfaces)


def accept(ctx: Ctx) -> list[dict[str, Any]]:
    """op=accept: every named machine, or none (one transaction)."""
    ids = ctx.params.getlist("machines")
    unknown = [i for i in ids if i not in ctx.region.machines]
    if unknown:
        raise bad_request(f"Unknown machine(s): {', '.join(unknown)}.")
    machines = [ctx.region.machines[i] for i in ids]
    for machine in machines:
        if machine.status not in (S.NEW, S.READY, S.COMMISSIONING):
            lifecycle.accept(ctx.region, machine, ctx.username)  # raises the 409
    accepted = [m for m in machines if lifecycle.accept(ctx.region, m, ctx.username)]
    return [_json(ctx, m) for m in accepted]


def accept_all(ctx: Ctx) -> list[dict[str, Any]]:
    new = [m for m in ctx.region.machines.values() if m.status == S.NEW]
    for machine in new:
        lifecycle.accept(ctx.region, machine, ctx.username)
    return [_json(ctx, m) for m in new]


def allocate(ctx: Ctx) -> dict[str, Any]:
    """op=allocate: a Ready machine matching `system_id` / `name`, now owned by the caller."""
    p = ctx.params
    system_id, name = p.get("system_id"), p.get("name")
    for machine in ctx.region.machines.values():
        if machine.status != S.READY:
            continue
        if system_id and machine.system_id != system_id:
            continue
        if name and machine.hostname != name.split(".")[0]:
            continue
        lifecycle.allocate(ctx.region, machine, ctx.username, p.get("agent_name") or "")
        return _json(ctx, machine)
    wanted = ", ".join(f"{k}={v}" for k, v in (("system_id", system_id), ("name", name)) if v)
    raise conflict(f"No available machine matches constraints: {wanted or 'none'}")


def power_parameters_all(ctx: Ctx) -> dict[str, Any]:
    ids = set(ctx.params.getlist("id"))
    return {
        m.system_id: m.power_parameters
        for m in ctx.region.machines.values()
        if not ids or m.system_id in ids
    }


# --- machines/{system_id}/ ---


def read_machine(ctx: Ctx, system_id: str) -> dict[str, Any]:
    return _json(ctx, _machine(ctx, system_id))


def update_machine(ctx: Ctx, system_id: str) -> dict[str, Any]:
    region, p, machine = ctx.region, ctx.params, _machine(ctx, system_id)
    hostname = p.get("hostname")
    if hostname is not None:
        short = hostname.split(".")[0]
        other = region.machine_by_hostname(short)
        if other is not None and other is not machine:
            raise field_errors({"hostname": "Node with this Hostname already exists."})
    ptype = forms.power_type(p, machine.power_type)
    params = forms.power_parameters(p)
    arch = forms.architecture(p.get("architecture") or "") if p.get("architecture") else None
    for key in ("cpu_count", "memory", "swap_size"):
        p.int(key)  # validates
    if "enable_hw_sync" in p and machine.osystem not in ("", "ubuntu", "custom"):
        raise field_errors({"enable_hw_sync": "Hardware sync is only available for Linux."})
    if hostname is not None:
        machine.hostname = hostname.split(".")[0]
    if "description" in p:
        machine.description = p.get("description") or ""
    if arch:
        machine.architecture = arch
    machine.power_type = ptype or machine.power_type
    if params is not None:
        machine.power_parameters = {**machine.power_parameters, **params}
    hardware.link_hardware(region, machine)
    machine.cpu_count = p.int("cpu_count", machine.cpu_count) or 0
    machine.memory = p.int("memory", machine.memory) or 0
    machine.swap_size = p.int("swap_size", machine.swap_size)
    machine.zone = p.get("zone") or machine.zone
    machine.pool = p.get("pool") or machine.pool
    if "enable_hw_sync" in p:
        hwsync.set_enable_hw_sync(region, machine, p.bool("enable_hw_sync"))
    return _json(ctx, machine)


def delete_machine(ctx: Ctx, system_id: str) -> Response:
    ctx.region.delete_machine(_machine(ctx, system_id))
    return Response(204, b"", "text/plain; charset=utf-8")


def commission(ctx: Ctx, system_id: str) -> dict[str, Any]:
    p, machine = ctx.params, _machine(ctx, system_id)
    # The Commission action needs a status that allows it and, since 3.1, networking.
    if machine.status not in COMMISSIONABLE or not machine.interfaces:
        raise field_errors(
            {"__all__": "Commission is not available because of the current state of the node."}
        )
    lifecycle.start_commissioning(
        ctx.region,
        machine,
        ctx.username,
        enable_ssh=p.bool("enable_ssh"),
        skip_networking=p.bool("skip_networking"),
        skip_storage=p.bool("skip_storage"),
    )
    return _json(ctx, machine)


def deploy(ctx: Ctx, system_id: str) -> dict[str, Any]:
    """Ready machines are allocated to the caller first; the whole call is one transaction, so
    a refusal leaves the machine as it was."""
    region, p, machine = ctx.region, ctx.params, _machine(ctx, system_id)
    if machine.status not in (S.READY, S.ALLOCATED):
        raise conflict(f"Can't deploy a machine that is in the '{machine.status.label}' state")
    removed = [k for k in ("install_kvm", "install_rackd", "register_vmhost") if p.bool(k)]
    if removed:
        raise field_errors({k: "This option is not supported." for k in removed})
    osystem, series = forms.distro_series(region, p.get("distro_series"), p.get("osystem"))
    enable_hw_sync = p.bool("enable_hw_sync")
    if not network.has_deployable_network(machine):
        raise field_errors({"network": "Node must be configured to use a network"})
    if not storage.has_root_filesystem(machine):
        raise field_errors(
            {"storage": "Mount the root '/' filesystem to be able to deploy this node."}
        )
    user_data = p.get("user_data")
    request = lifecycle.DeployRequest(
        osystem=osystem,
        distro_series=series,
        user_data=lifecycle.decode_user_data(user_data) if user_data else None,
        hwe_kernel=p.get("hwe_kernel"),
        enable_hw_sync=enable_hw_sync,
        agent_name=p.get("agent_name") or "",
    )
    lifecycle.start_deployment(region, machine, ctx.username, request)
    return _json(ctx, machine)


def release(ctx: Ctx, system_id: str) -> dict[str, Any]:
    p, machine = ctx.params, _machine(ctx, system_id)
    # MAAS: secure_erase wins over quick_erase; either implies erase.
    method = "secure" if p.bool("secure_erase") else "quick" if p.bool("quick_erase") else "plain"
    erase = p.bool("erase") or method != "plain"
    lifecycle.release(
        ctx.region, machine, ctx.username, erase, p.get("comment") or "", erase_method=method
    )
    return _json(ctx, machine)


def abort(ctx: Ctx, system_id: str) -> dict[str, Any]:
    machine = _machine(ctx, system_id)
    lifecycle.abort(ctx.region, machine, ctx.username, ctx.params.get("comment") or "")
    return _json(ctx, machine)


def mark_broken(ctx: Ctx, system_id: str) -> dict[str, Any]:
    """Only the owner may (403, empty body, even for an admin)."""
    machine = _machine(ctx, system_id)
    if machine.owner != ctx.user:
        raise forbidden()
    comment = ctx.params.get("comment") or ctx.params.get("error_description") or ""
    lifecycle.mark_broken(ctx.region, machine, ctx.username, comment)
    return _json(ctx, machine)


def mark_fixed(ctx: Ctx, system_id: str) -> dict[str, Any]:
    machine = _machine(ctx, system_id)
    lifecycle.mark_fixed(ctx.region, machine, ctx.username, ctx.params.get("comment") or "")
    return _json(ctx, machine)


def power_on(ctx: Ctx, system_id: str) -> dict[str, Any]:
    """On an Allocated machine this starts the deployment, as the region's power_on does."""
    region, machine = ctx.region, _machine(ctx, system_id)
    if machine.owner is not None and machine.status == S.ALLOCATED:
        if not network.has_deployable_network(machine):
            raise field_errors({"network": "Node must be configured to use a network"})
        if not storage.has_root_filesystem(machine):
            raise field_errors(
                {"storage": "Mount the root '/' filesystem to be able to deploy this node."}
            )
        osystem = machine.osystem or "ubuntu"
        series = machine.distro_series or region.site.default_distro_series
        request = lifecycle.DeployRequest(osystem, series, machine.user_data, machine.hwe_kernel)
        lifecycle.start_deployment(region, machine, ctx.username, request)
    else:
        lifecycle.power_on(region, machine, ctx.username)
    return _json(ctx, machine)


def power_off(ctx: Ctx, system_id: str) -> dict[str, Any] | None:
    machine = _machine(ctx, system_id)
    if machine.power_type != "ipmi":
        return None  # MAAS cannot control this machine's power
    lifecycle.power_off(ctx.region, machine, ctx.username)
    return _json(ctx, machine)


def query_power_state(ctx: Ctx, system_id: str) -> dict[str, str]:
    region, machine = ctx.region, _machine(ctx, system_id)
    if machine.hardware is None:
        machine.power_error = True
        region.log(machine, Ev.POWER_QUERY_FAILED, "Failed talking to node's BMC")
        raise unavailable(
            "Failed talking to node's BMC: Unable to establish IPMI v2 / RMCP+ session"
        )
    machine.power_error = False
    return {"state": machine.hardware.power or PowerState.UNKNOWN}


def get_token(ctx: Ctx, system_id: str) -> dict[str, str] | None:
    key = lifecycle.visible_node_key(ctx.region, _machine(ctx, system_id))
    if key is None:
        return None
    return {
        "token_key": key.token_key,
        "token_secret": key.token_secret,
        "consumer_key": key.consumer_key,
    }


def power_parameters(ctx: Ctx, system_id: str) -> dict[str, object]:
    return _machine(ctx, system_id).power_parameters


def set_storage_layout(ctx: Ctx, system_id: str) -> dict[str, Any]:
    p, machine = ctx.params, _machine(ctx, system_id)
    if machine.status != S.READY:
        raise conflict("Cannot change the storage layout on a machine that is not Ready.")
    layout = p.get("storage_layout")
    if not layout:
        raise field_errors({"storage_layout": "This field is required."})
    root_device = None
    root_id = p.int("root_device")
    if root_id is not None:
        root_device = machine.block_device(root_id)
        if root_device is None:
            raise field_errors(
                {
                    "root_device": "Select a valid choice. That choice is not one of the available "
                    "choices."
                }
            )
    storage.apply_layout(
        ctx.region,
        machine,
        layout,
        root_device=root_device,
        root_size=forms.size(p, "root_size"),
        boot_size=forms.size(p, "boot_size"),
    )
    return _json(ctx, machine)
