"""version/, users/?op=whoami, rackcontrollers/, fabrics/, subnets/ and events/?op=query."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlencode

from sim.maas import forms, render
from sim.maas.context import Ctx
from sim.maas.enums import LEVELS_BY_NAME
from sim.maas.errors import bad_request, field_errors, not_found
from sim.maas.http import Params, Response
from sim.maas.model import Subnet
from sim.maas.scenario import ScenarioError, parse_duration

CAPABILITIES = [
    "networks-management",
    "static-ipaddresses",
    "ipv6-deployment-ubuntu",
    "devices-management",
    "storage-deployment-ubuntu",
    "network-deployment-ubuntu",
    "bridging-interface-ubuntu",
    "bridging-automatic-ubuntu",
    "authenticate-api",
]
MAX_EVENT_LOG_COUNT = 1000
DEFAULT_EVENT_LOG_LIMIT = 100
_EVENT_PARAMS = ("agent_name", "domain", "hostname", "id", "level", "limit", "mac_address", "op",
                 "zone", "owner")  # fmt: skip
_INVALID_CHOICE = "Select a valid choice. That choice is not one of the available choices."


def version(ctx: Ctx) -> dict[str, Any]:
    return {
        "capabilities": CAPABILITIES,
        "version": ctx.region.site.maas_version,
        "subversion": "",
    }


def whoami(ctx: Ctx) -> dict[str, Any]:
    name = ctx.username
    return {
        "is_superuser": ctx.is_superuser,
        "username": name,
        "email": f"{name}@example.com",
        "is_local": True,
        "resource_uri": f"{render.API}/users/{name}/",
    }


def rack_controllers(ctx: Ctx) -> list[dict[str, Any]]:
    region = ctx.region
    first = next(iter(region.subnets.values()), None)
    address = str(next(first.network.hosts())) if first is not None else "127.0.0.1"
    return [
        {
            "system_id": "rack01",
            "hostname": "maas-region",
            "fqdn": f"maas-region.{region.site.domain}",
            "node_type": 4,
            "node_type_name": "Region and rack controller",
            "version": region.site.maas_version,
            "architecture": "amd64/generic",
            "ip_addresses": [address],
            "interface_set": [],
            "service_set": [
                {"name": name, "status": "running", "status_info": ""}
                for name in (
                    "rackd",
                    "http",
                    "tftp",
                    "dhcpd",
                    "ntp_rack",
                    "dns_rack",
                    "syslog_rack",
                )
            ],
            "resource_uri": f"{render.API}/rackcontrollers/rack01/",
        }
    ]


def list_fabrics(ctx: Ctx) -> list[dict[str, Any]]:
    return [render.fabric(ctx.region, f) for f in ctx.region.fabrics.values()]


# --- subnets ---


def list_subnets(ctx: Ctx) -> list[dict[str, Any]]:
    return [render.subnet(s) for s in ctx.region.subnets.values()]


def _subnet(ctx: Ctx, ref: str) -> Subnet:
    subnet = ctx.region.subnet_by_ref(ref)
    if subnet is None:
        raise not_found("Subnet")
    return subnet


def read_subnet(ctx: Ctx, subnet_id: str) -> dict[str, Any]:
    return render.subnet(_subnet(ctx, subnet_id))


def delete_subnet(ctx: Ctx, subnet_id: str) -> Response:
    subnet = _subnet(ctx, subnet_id)
    for machine in ctx.region.machines.values():
        for iface in machine.interfaces:
            iface.links = [link for link in iface.links if link.subnet is not subnet]
    del ctx.region.subnets[subnet.id]
    return Response(204, b"", "text/plain; charset=utf-8")


def create_subnet(ctx: Ctx) -> dict[str, Any]:
    """POST subnets/ (SubnetForm): cidr required; vlan by database id, or fabric + vid, or the
    default fabric's untagged VLAN."""
    region, p = ctx.region, ctx.params
    cidr_text = p.get("cidr")
    if not cidr_text:
        raise field_errors({"cidr": "This field is required."})
    try:
        network = ipaddress.ip_network(cidr_text, strict=False)
    except ValueError:
        raise field_errors({"cidr": "Required format: <network>/<prefixlen>."}) from None
    cidr = str(network)
    if any(s.cidr == cidr for s in region.subnets.values()):
        raise field_errors({"cidr": "Subnet with this Cidr already exists."})
    vlan = _vlan_for(ctx, p)
    gateway = p.get("gateway_ip") or None
    if gateway is not None:
        try:
            inside = ipaddress.ip_address(gateway) in network
        except ValueError:
            inside = False
        if not inside:
            raise field_errors({"gateway_ip": "Gateway IP must be within CIDR range."})
    dns = tuple(d for v in p.getlist("dns_servers") for d in v.replace(",", " ").split())
    subnet = Subnet(
        id=region.next_id("subnet"),
        name=p.get("name") or cidr,
        cidr=cidr,
        vlan=vlan,
        gateway_ip=gateway,
        dns_servers=dns,
        managed=p.bool("managed", True),
        description=p.get("description") or "",
    )
    return render.subnet(region.add_subnet(subnet))


def _vlan_for(ctx: Ctx, p: Params) -> Any:
    region = ctx.region
    vlan_id = p.get("vlan")
    if vlan_id:
        vlan = region.vlans.get(int(vlan_id)) if vlan_id.isdigit() else None
        if vlan is None:
            raise field_errors({"vlan": _INVALID_CHOICE})
        return vlan
    fabric_ref, vid = p.get("fabric"), p.int("vid")
    if fabric_ref:
        fabric = next(
            (f for f in region.fabrics.values() if fabric_ref in (str(f.id), f.name)), None
        )
        if fabric is None:
            raise field_errors({"fabric": _INVALID_CHOICE})
        vid = vid or 0
        for vlan in region.vlans.values():
            if vlan.fabric is fabric and vlan.vid == vid:
                return vlan
        raise field_errors({"vid": f"No VLAN with vid {vid} in fabric {fabric.name}."})
    if vid:
        for vlan in region.vlans.values():
            if vlan.fabric.name == "fabric-0" and vlan.vid == vid:
                return vlan
        raise field_errors({"vid": f"No VLAN with vid {vid} in default fabric."})
    return region.default_vlan()


# --- events ---


def query_events(ctx: Ctx) -> dict[str, Any]:
    """GET events/?op=query (api/events.py): filtered by node (id, hostname, mac_address, zone,
    agent_name), minimum level (default INFO), owner (the event's user), paged by before/after."""
    region, q = ctx.region, ctx.request.query
    after, before = q.int("after"), q.int("before")
    level = q.get("level", "INFO") or "INFO"
    limit = q.int("limit", DEFAULT_EVENT_LOG_LIMIT) or DEFAULT_EVENT_LOG_LIMIT
    if limit > MAX_EVENT_LOG_COUNT:
        raise bad_request(
            f"Requested number of events {limit} is greater than limit: {MAX_EVENT_LOG_COUNT}"
        )
    limit = max(limit, 1)
    if level not in LEVELS_BY_NAME:
        raise bad_request(f"Unrecognised log level: {level}")
    if after is not None and before is not None:
        raise bad_request(
            "There is undetermined behaviour when both `after` and `before` are specified."
        )
    nodes = _event_nodes(ctx, q)
    owner = q.get("owner")
    threshold = LEVELS_BY_NAME[level]
    events = [
        e
        for e in region.events
        if e.system_id in nodes
        and (e.type.level >= threshold if threshold else e.type.level == 0)
        and (owner is None or e.username == owner)
    ]
    if after is None and before is None:
        chosen = sorted(events, key=lambda e: -e.id)[:limit]
    elif after is None:
        chosen = sorted((e for e in events if e.id < (before or 0)), key=lambda e: -e.id)[:limit]
    else:
        chosen = sorted((e for e in events if e.id > after), key=lambda e: e.id)[:limit]
        chosen.reverse()
    return {
        "count": len(chosen),
        "events": [render.event(region, e) for e in chosen],
        "next_uri": _page_uri(q, "after", chosen[0].id if chosen else None, before),
        "prev_uri": _page_uri(q, "before", chosen[-1].id if chosen else None, after, older=True),
    }


def _event_nodes(ctx: Ctx, q: Params) -> set[str]:
    ids, hostnames = set(q.getlist("id")), {h.split(".")[0] for h in q.getlist("hostname")}
    macs = {forms.normalise_mac(m, "mac_address") for m in q.getlist("mac_address")}
    zones, agents = set(q.getlist("zone")), set(q.getlist("agent_name"))
    return {
        m.system_id
        for m in ctx.region.machines.values()
        if (not ids or m.system_id in ids)
        and (not hostnames or m.hostname in hostnames)
        and (not macs or macs & {i.mac_address for i in m.interfaces})
        and (not zones or m.zone in zones)
        and (not agents or m.agent_name in agents)
    }


def _page_uri(
    q: Params, add: str, edge_id: int | None, bound: int | None, older: bool = False
) -> str | None:
    """next_uri (newer events: add=after) / prev_uri (older: add=before), as the region builds
    them: the node/level/limit parameters of the request plus the new bound."""
    params = [(k, v) for k in _EVENT_PARAMS for v in q.getlist(k)]
    if edge_id is not None:
        params.append((add, str(edge_id)))
    elif bound is not None:
        params.append((add, str(bound + 1 if older else bound - 1)))
    elif older:
        return None  # no older events, and there never will be
    return f"{render.API}/events/?{urlencode(params)}"


# --- maas/ (global config) ---

# The config names the simulator knows (src/maasserver/models/config.py has many more).
_CONFIG_NAMES = ("hardware_sync_interval", "enable_disk_erasing_on_release")


def _config_name(ctx: Ctx) -> str:
    name = ctx.params.get("name") or ""
    if not name:
        raise field_errors({"name": "This field is required."})
    if name not in _CONFIG_NAMES:
        raise field_errors({"name": f"{name} is not a valid config name."})
    return name


def get_config(ctx: Ctx) -> Any:
    """GET maas/?op=get_config&name=…: the stored value as JSON ("15m")."""
    return ctx.region.config[_config_name(ctx)]


def set_config(ctx: Ctx) -> Response:
    """POST maas/?op=set_config name=… value=… (admin): 200 "OK". hardware_sync_interval takes
    a systemd-style timespan ("15m", "1h30m", "900s"); machines pick it up the next time
    enable_hw_sync is saved."""
    name = _config_name(ctx)
    value = ctx.params.get("value")
    if value is None:
        raise field_errors({"value": "This field is required."})
    if name == "hardware_sync_interval":
        try:
            seconds = parse_duration(value)
        except ScenarioError:
            seconds = 0.0
        if seconds <= 0:
            raise field_errors({"value": f"Unable to parse timespan: '{value}'."})
        ctx.region.config[name] = value.strip()
    else:
        ctx.region.config[name] = ctx.params.bool("value")
    return Response.text("OK")
