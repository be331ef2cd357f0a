"""RoCE phase-2 node-local policy routing (docs/maas-sites.md#roce-assignments, "RoCE routing policy
script + unit").

For each site RoCE assignment `{interface, ipv4_cidr}` (e.g. `enp28s0np0 172.30.9.61/31`):

* the address on the interface;
* a routing table of its own, `roce_table_id(interface)`, holding the connected route
  (`172.30.9.60/31 dev enp28s0np0 src 172.30.9.61 scope link`) and a default route via the
  /31 peer (`default via 172.30.9.60 dev enp28s0np0`);
* `from 172.30.9.61 lookup <table>` at priority `roce_rule_priority(interface)`.

Table ids and priorities are a function of the interface name alone, so every node and every run
agrees. Routes and rules are created with protocol `ROCE_PROTO` so that a later apply can tell
its own stale entries from anyone else's. Apply is idempotent (pyroute2 adds duplicate rules
happily, so each object is looked up first); remove deletes exactly the rules, routes and
addresses the assignments describe and leaves the interfaces themselves alone.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from agent.network.errors import (
    InvalidNetworkSpec,
    MissingInterface,
    NetworkConflict,
    NetworkOperationFailed,
)
from agent.network.netns import link_index, rtnl, validate_ifname
from contracts.host_tasks import HostErrorType

ROCE_PROTO = 210  # rtm_protocol / FRA_PROTOCOL marking what this module made
ROCE_TABLE_BASE = 20000
ROCE_TABLE_SPAN = 10000  # tables and priorities 20000..29999: below main's rule (32766)
_SCOPE_LINK = 253
_ANY_V4 = str(ipaddress.IPv4Address(0))


def roce_table_id(interface: str) -> int:
    """Deterministic routing table for the interface (crc32 of its name in 20000..29999)."""
    return ROCE_TABLE_BASE + zlib.crc32(interface.encode()) % ROCE_TABLE_SPAN


def roce_rule_priority(interface: str) -> int:
    """The `ip rule` priority for the interface: equal to its table id."""
    return roce_table_id(interface)


@dataclass(frozen=True)
class RoceAssignment:
    """One row of maas_roce_assignments. `gateway` defaults to the /31 peer."""

    interface: str
    ipv4_cidr: str
    gateway: str | None = None

    @property
    def address(self) -> ipaddress.IPv4Interface:
        if "/" not in self.ipv4_cidr:
            raise InvalidNetworkSpec(
                f"RoCE address {self.ipv4_cidr!r} for {self.interface!r} needs a prefix length"
            )
        try:
            return ipaddress.IPv4Interface(self.ipv4_cidr)
        except ValueError as exc:
            raise InvalidNetworkSpec(
                f"RoCE address {self.ipv4_cidr!r} for {self.interface!r} is not an IPv4 CIDR: {exc}"
            ) from exc

    @property
    def peer(self) -> ipaddress.IPv4Address:
        addr = self.address
        if self.gateway is not None:
            try:
                gateway = ipaddress.IPv4Address(self.gateway)
            except ValueError as exc:
                raise InvalidNetworkSpec(
                    f"RoCE gateway {self.gateway!r} for {self.interface!r} is not IPv4: {exc}"
                ) from exc
            if gateway not in addr.network or gateway == addr.ip:
                raise InvalidNetworkSpec(
                    f"RoCE gateway {gateway} for {self.interface!r} must be another address "
                    f"in {addr.network}"
                )
            return gateway
        if addr.network.prefixlen != 31:
            raise InvalidNetworkSpec(
                f"RoCE address {self.ipv4_cidr!r} for {self.interface!r} is not a /31, "
                "so the peer cannot be derived: give a gateway"
            )
        low, high = addr.network[0], addr.network[1]
        return high if addr.ip == low else low

    @property
    def table(self) -> int:
        return roce_table_id(self.interface)

    @property
    def priority(self) -> int:
        return roce_rule_priority(self.interface)

    def validate(self) -> None:
        validate_ifname(self.interface, "RoCE interface name")
        if self.address.network.prefixlen > 31:
            raise InvalidNetworkSpec(
                f"RoCE address {self.ipv4_cidr!r} for {self.interface!r} must be /31 or wider"
            )
        self.peer  # noqa: B018 - derives and validates the gateway


@dataclass(frozen=True)
class RoceApplyResult:
    """`created`/`present`/`deleted` items read like `addr:172.30.9.61/31@enp28s0np0`,
    `route:table 2xxxx 172.30.9.60/31 dev enp28s0np0`, `rule:from 172.30.9.61 lookup 2xxxx`."""

    created: tuple[str, ...]
    present: tuple[str, ...]
    deleted: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.created or self.deleted)


@dataclass(frozen=True)
class RoceRemoveResult:
    deleted: tuple[str, ...]


def _validated(assignments: Iterable[RoceAssignment]) -> list[RoceAssignment]:
    items = list(assignments)
    seen_if: set[str] = set()
    seen_ip: set[str] = set()
    tables: dict[int, str] = {}
    for item in items:
        item.validate()
        if item.interface in seen_if:
            raise InvalidNetworkSpec(f"RoCE interface {item.interface!r} is assigned twice")
        ip = str(item.address.ip)
        if ip in seen_ip:
            raise InvalidNetworkSpec(f"RoCE address {ip} is assigned twice")
        other = tables.get(item.table)
        if other is not None:
            raise InvalidNetworkSpec(
                f"RoCE interfaces {other!r} and {item.interface!r} hash to the same routing "
                f"table {item.table}"
            )
        seen_if.add(item.interface)
        seen_ip.add(ip)
        tables[item.table] = item.interface
    return items


def _nl(what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except NetlinkError as exc:
        raise NetworkOperationFailed(f"{what}: {exc}") from exc


def _wanted_routes(item: RoceAssignment, index: int) -> list[dict[str, Any]]:
    addr = item.address
    return [
        {
            "dst": str(addr.network.network_address),
            "dst_len": addr.network.prefixlen,
            "gateway": None,
            "oif": index,
            "prefsrc": str(addr.ip),
            "scope": _SCOPE_LINK,
        },
        {
            "dst": None,
            "dst_len": 0,
            "gateway": str(item.peer),
            "oif": index,
            "prefsrc": None,
            "scope": 0,
        },
    ]


def _route_key(route: Any) -> tuple[Any, ...]:
    return (
        route.get("dst") if route["dst_len"] else None,
        route["dst_len"],
        route.get("gateway"),
        route.get("oif"),
        route.get("prefsrc"),
        route["scope"],
    )


def _route_text(item: RoceAssignment, want: dict[str, Any]) -> str:
    dst = f"{want['dst']}/{want['dst_len']}" if want["dst_len"] else "default"
    via = f" via {want['gateway']}" if want["gateway"] else ""
    return f"route:table {item.table} {dst}{via} dev {item.interface}"


def _rule_text(item: RoceAssignment, src: str) -> str:
    return f"rule:from {src} lookup {item.table} priority {item.priority}"


def _our_rules(ipr: Any, item: RoceAssignment) -> list[Any]:
    return [
        rule
        for rule in ipr.get_rules(family=socket.AF_INET)
        if rule.get("table") == item.table and (rule.get("priority") or 0) == item.priority
    ]


def apply_roce_policy(
    assignments: Sequence[RoceAssignment], netns: str | None = None
) -> RoceApplyResult:
    """Make `netns` (None: the host's namespace) hold the policy routing for `assignments`."""
    items = _validated(assignments)
    created: list[str] = []
    present: list[str] = []
    deleted: list[str] = []
    with rtnl(netns) as ipr:
        indexes: dict[str, int] = {}
        for item in items:  # every interface must exist before anything changes
            index = link_index(ipr, item.interface)
            if index is None:
                raise MissingInterface(item.interface, netns)
            indexes[item.interface] = index
        for item in items:
            index = indexes[item.interface]
            addr = item.address
            ip = str(addr.ip)
            label = f"addr:{addr.with_prefixlen}@{item.interface}"

            holders = ipr.get_addr(family=socket.AF_INET, address=ip)
            if any(h["index"] != index for h in holders):
                raise NetworkConflict(f"RoCE address {ip} is already on another interface")
            if any(h["prefixlen"] == addr.network.prefixlen for h in holders):
                present.append(label)
            elif holders:
                raise NetworkConflict(
                    f"{ip} is on {item.interface!r} with prefix /{holders[0]['prefixlen']}, "
                    f"expected /{addr.network.prefixlen}"
                )
            else:
                _nl(
                    f"add {label}",
                    ipr.addr,
                    "add",
                    index=index,
                    address=ip,
                    prefixlen=addr.network.prefixlen,
                )
                created.append(label)

            wanted = _wanted_routes(item, index)
            wanted_keys = {_route_key_of(w) for w in wanted}
            existing = ipr.get_routes(family=socket.AF_INET, table=item.table)
            have = set()
            for route in existing:
                if route.get("table") != item.table:
                    continue
                key = _route_key(route)
                if key in wanted_keys:
                    have.add(key)
                elif route["proto"] == ROCE_PROTO and _delete_route(ipr, item.table, route):
                    deleted.append(f"route:table {item.table} {key}")
            for want in wanted:
                text = _route_text(item, want)
                if _route_key_of(want) in have:
                    present.append(text)
                    continue
                args = {k: v for k, v in want.items() if v is not None}
                if want["dst"] is None:
                    args["dst"] = _ANY_V4
                _nl(f"add {text}", ipr.route, "add", table=item.table, proto=ROCE_PROTO, **args)
                created.append(text)

            rule_found = False
            for rule in _our_rules(ipr, item):
                if rule.get("src") == ip and rule["src_len"] == 32 and not rule_found:
                    rule_found = True
                elif rule.get("protocol") == ROCE_PROTO:
                    _delete_rule(ipr, item, rule)
                    deleted.append(_rule_text(item, f"{rule.get('src')}/{rule['src_len']}"))
            if rule_found:
                present.append(_rule_text(item, ip))
            else:
                _nl(
                    f"add {_rule_text(item, ip)}",
                    ipr.rule,
                    "add",
                    family=socket.AF_INET,
                    table=item.table,
                    priority=item.priority,
                    src=ip,
                    src_len=32,
                    protocol=ROCE_PROTO,
                )
                created.append(_rule_text(item, ip))
    return RoceApplyResult(tuple(created), tuple(present), tuple(deleted))


def _route_key_of(want: dict[str, Any]) -> tuple[Any, ...]:
    return (
        want["dst"],
        want["dst_len"],
        want["gateway"],
        want["oif"],
        want["prefsrc"],
        want["scope"],
    )


def _delete_route(ipr: Any, table: int, route: Any) -> bool:
    """Delete exactly this route (matched on table, prefix, gateway, device, scope, protocol);
    False when it was already gone."""
    spec: dict[str, Any] = {
        "table": table,
        "dst": route.get("dst") or _ANY_V4,
        "dst_len": route["dst_len"],
        "scope": route["scope"],
        "proto": route["proto"],
    }
    for key in ("gateway", "oif"):
        if route.get(key) is not None:
            spec[key] = route.get(key)
    try:
        ipr.route("del", **spec)
    except NetlinkError as exc:
        if exc.code == errno.ESRCH:
            return False
        raise NetworkOperationFailed(
            f"delete route {spec['dst']}/{spec['dst_len']} in table {table}: {exc}",
            error_type=HostErrorType.RELEASE_ERROR,
        ) from exc
    return True


def _delete_rule(ipr: Any, item: RoceAssignment, rule: Any) -> None:
    kwargs: dict[str, Any] = {
        "family": socket.AF_INET,
        "table": item.table,
        "priority": item.priority,
        "src_len": rule["src_len"],
    }
    if rule.get("src") is not None:
        kwargs["src"] = rule.get("src")
    try:
        ipr.rule("del", **kwargs)
    except NetlinkError as exc:
        if exc.code != errno.ENOENT:  #: gone meanwhile
            raise NetworkOperationFailed(
                f"delete {_rule_text(item, str(rule.get('src')))}: {exc}",
                error_type=HostErrorType.RELEASE_ERROR,
            ) from exc


def remove_roce_policy(
    assignments: Sequence[RoceAssignment], netns: str | None = None
) -> RoceRemoveResult:
    """Delete the rules, routes and addresses `assignments` describe. An interface that is gone
    took its address and routes with it; its rule is still removed. Nothing else is touched."""
    items = _validated(assignments)
    deleted: list[str] = []
    with rtnl(netns) as ipr:
        for item in items:
            ip = str(item.address.ip)
            for rule in _our_rules(ipr, item):
                if rule.get("src") == ip and rule["src_len"] == 32:
                    _delete_rule(ipr, item, rule)
                    deleted.append(_rule_text(item, ip))
            index = link_index(ipr, item.interface)
            if index is None:
                continue
            wanted = {_route_key_of(w): w for w in _wanted_routes(item, index)}
            for route in ipr.get_routes(family=socket.AF_INET, table=item.table):
                key = _route_key(route)
                if route.get("table") != item.table or key not in wanted:
                    continue
                if not _delete_route(ipr, item.table, route):
                    continue
                deleted.append(_route_text(item, wanted[key]))
            addr = item.address
            for held in ipr.get_addr(family=socket.AF_INET, index=index, address=ip):
                if held["prefixlen"] != addr.network.prefixlen:
                    continue
                try:
                    ipr.addr("del", index=index, address=ip, prefixlen=held["prefixlen"])
                except NetlinkError as exc:
                    raise NetworkOperationFailed(
                        f"delete {ip} from {item.interface!r}: {exc}",
                        error_type=HostErrorType.RELEASE_ERROR,
                    ) from exc
                deleted.append(f"addr:{addr.with_prefixlen}@{item.interface}")
    return RoceRemoveResult(tuple(deleted))
