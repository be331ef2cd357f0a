"""nodes/{system_id}/blockdevices/ and nodes/{system_id}/interfaces/: listing, reading,
op=set_boot_disk, op=link_subnet and op=unlink_subnet (forms/interface_link.py rules)."""

from __future__ import annotations

import ipaddress
from typing import Any

from sim.maas import network, render
from sim.maas.context import Ctx
from sim.maas.enums import INTERFACE_EDITABLE, NodeStatus
from sim.maas.errors import conflict, field_errors, not_found
from sim.maas.http import Response
from sim.maas.model import AUTO, DHCP, LINK_MODES, LINK_UP, STATIC, BlockDevice, Interface, Machine

_INVALID_CHOICE = "Select a valid choice. That choice is not one of the available choices."


def _node(ctx: Ctx, system_id: str) -> Machine:
    machine = ctx.region.machines.get(system_id)
    if machine is None:
        raise not_found("Node")
    return machine


def _device(machine: Machine, device_id: str) -> BlockDevice:
    device = machine.block_device(int(device_id)) if device_id.isdigit() else None
    if device is None:
        raise not_found("BlockDevice")
    return device


def _interface(machine: Machine, interface_id: str) -> Interface:
    iface = machine.interface(int(interface_id)) if interface_id.isdigit() else None
    if iface is None:
        raise not_found("Interface")
    return iface


# --- block devices ---


def list_block_devices(ctx: Ctx, system_id: str) -> list[dict[str, Any]]:
    machine = _node(ctx, system_id)
    return [render.block_device(machine, d) for d in machine.block_devices]


def read_block_device(ctx: Ctx, system_id: str, device_id: str) -> dict[str, Any]:
    machine = _node(ctx, system_id)
    return render.block_device(machine, _device(machine, device_id))


def set_boot_disk(ctx: Ctx, system_id: str, device_id: str) -> Response:
    """Chooses the disk layouts go on; it does not re-apply the current layout."""
    machine = _node(ctx, system_id)
    device = _device(machine, device_id)
    if machine.status != NodeStatus.READY:
        raise conflict("Cannot set as boot disk because the machine is not Ready.")
    machine.boot_disk_id = device.id
    return Response.text("OK")


# --- interfaces ---


def list_interfaces(ctx: Ctx, system_id: str) -> list[dict[str, Any]]:
    machine = _node(ctx, system_id)
    return [render.interface(machine, i) for i in machine.interfaces]


def read_interface(ctx: Ctx, system_id: str, interface_id: str) -> dict[str, Any]:
    machine = _node(ctx, system_id)
    return render.interface(machine, _interface(machine, interface_id))


def link_subnet(ctx: Ctx, system_id: str, interface_id: str) -> dict[str, Any]:
    region, p = ctx.region, ctx.params
    machine = _node(ctx, system_id)
    iface = _interface(machine, interface_id)
    if machine.status not in INTERFACE_EDITABLE:
        raise conflict(
            "Cannot link subnet interface because the machine is not New, Ready, Allocated, "
            "or Broken."
        )
    force = p.bool("force")
    mode = (p.get("mode") or "").lower()
    if not mode:
        raise field_errors({"mode": "This field is required."})
    if mode not in LINK_MODES:
        choices = ", ".join(f"'{m}'" for m in LINK_MODES)
        raise field_errors(
            {"mode": f"'{p.get('mode')}' is not a valid mode.  It should be one of: {choices}."}
        )
    subnet = None
    subnet_ref = p.get("subnet")
    if subnet_ref:
        subnet = region.subnet_by_ref(subnet_ref)
        # Without force, only subnets on the interface's VLAN are choices.
        if subnet is None or (
            iface.vlan is not None and not force and subnet.vlan is not iface.vlan
        ):
            raise field_errors({"subnet": _INVALID_CHOICE})
    ip = p.get("ip_address") or None
    if mode in (AUTO, STATIC) and subnet is None:
        raise field_errors({"subnet": "This field is required."})
    if mode == DHCP and any(link.mode == DHCP for link in iface.links):
        raise field_errors({"mode": "Interface is already set to DHCP."})
    if mode == LINK_UP and not force and any(link.mode != LINK_UP for link in iface.links):
        raise field_errors(
            {
                "mode": "Cannot configure interface to link up (with no IP address) while other "
                "links are already configured. Specify force=True to override this behavior and "
                "delete all links."
            }
        )
    if mode == STATIC and subnet is not None:
        ip = _static_address(ctx, subnet, ip)
    if p.bool("default_gateway") and (subnet is None or not subnet.gateway_ip):
        raise field_errors({"default_gateway": "Subnet is required when default_gateway is True."})
    if mode == LINK_UP or force:
        iface.links = []
    if force and subnet is not None:
        iface.vlan = None  # link_subnet then takes the subnet's VLAN
    network.add_link(region, iface, mode, subnet, ip if mode == STATIC else None)
    network.ensure_link_up(region, iface)
    return render.interface(machine, iface)


def _static_address(ctx: Ctx, subnet: Any, ip: str | None) -> str:
    if ip is None:
        allocated = network.allocate_ip(ctx.region, subnet)
        if allocated is None:
            raise field_errors({"ip_address": f"No more IPs available in subnet: {subnet.cidr}."})
        return allocated
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise field_errors({"ip_address": "Enter a valid IPv4 or IPv6 address."}) from None
    if address not in subnet.network:
        raise field_errors(
            {"ip_address": f"IP address is not in the given subnet '{subnet.cidr}'."}
        )
    if subnet.in_dynamic_range(ip):
        start, end = subnet.dynamic_range
        raise field_errors(
            {"ip_address": f"IP address is inside a dynamic range {start} to {end}."}
        )
    if ip in network.used_addresses(ctx.region):
        raise field_errors({"ip_address": f"IP address {ip} is already in use."})
    return ip


def unlink_subnet(ctx: Ctx, system_id: str, interface_id: str) -> dict[str, Any]:
    machine = _node(ctx, system_id)
    iface = _interface(machine, interface_id)
    if machine.status not in INTERFACE_EDITABLE:
        raise conflict(
            "Cannot unlink subnet interface because the machine is not New, Ready, Allocated, "
            "or Broken."
        )
    link_id = ctx.params.get("id")
    ids = [link.id for link in iface.links]
    if not link_id:
        raise field_errors({"id": "This field is required."})
    if not link_id.isdigit() or int(link_id) not in ids:
        choices = ", ".join(f"'{i}'" for i in ids)
        raise field_errors(
            {"id": f"'{link_id}' is not a valid id.  It should be one of: {choices}."}
        )
    network.unlink(ctx.region, iface, int(link_id))
    return render.interface(machine, iface)
