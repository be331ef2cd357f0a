"""Slice networks on a node: a per-allocation isolated bridge, or a per-VLAN shared segment.

Declarative and idempotent: `apply_allocation_network(spec)` makes the namespace match the spec
(creating what is missing, leaving what is right, deleting what an earlier apply of the same
allocation made but the spec no longer lists) and reports which was which. Every link it creates
carries the allocation's tag in its ifalias (`gpucloud:alloc:<allocation id>`), so
`remove_allocation_network` deletes exactly those links (and, with the bridge, its addresses) and
never anything else. A name that exists without our tag is a conflict, never adopted.

A VLAN segment is what the allocations of one project on a node share (`join_vlan_segment`): one
bridge per VLAN id, holding the VLAN's sub-interface of the node's uplink (so the project's
allocations on other nodes are on the same L2 segment, and no other project's are), tagged
`gpucloud:vlan:<vid>`. Each allocation on it keeps a member link (a persistent tap, tagged with
the allocation, enslaved to the segment's bridge) from the moment it joins until it is removed,
so the segment is known to be in use before its VM has a NIC on it. `prune_vlan_segments` deletes
every segment nothing but its own uplink sub-interface is attached to; it re-derives that from
the links alone, so it also finishes the work of a join or a prune that crashed half-way.

Names fit IFNAMSIZ. From the allocation id (sha256 prefix): bridge `gcbr-<10 hex>`, VLAN
`gcvl-<10 hex>`, taps `gtNN-<10 hex>` (see `tap_names`), segment member `gcsm-<10 hex>`. From the
VLAN id: segment bridge `gcsbr-<vid>`, its uplink sub-interface `gcsvl-<vid>`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from agent.network.errors import (
    InvalidNetworkSpec,
    MissingInterface,
    NetworkConflict,
    NetworkOperationFailed,
)
from agent.network.netns import (
    create_tap,
    get_link,
    link_index,
    link_kind,
    rtnl,
    validate_ifname,
    vlan_id_of,
)
from contracts.host_tasks import HostErrorType

TAG_PREFIX = "gpucloud:alloc:"
SEGMENT_TAG_PREFIX = "gpucloud:vlan:"
MAX_TAPS = 100
_ALLOCATION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_IFF_UP = 0x1


def _digest(allocation_id: str) -> str:
    return hashlib.sha256(allocation_id.encode()).hexdigest()[:10]


def _check_allocation_id(allocation_id: str) -> str:
    if not _ALLOCATION_ID_RE.match(allocation_id):
        raise InvalidNetworkSpec(
            f"allocation id {allocation_id!r} must be 1..128 characters of "
            "letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
        )
    return allocation_id


def allocation_tag(allocation_id: str) -> str:
    """The ifalias every link of this allocation carries."""
    return TAG_PREFIX + _check_allocation_id(allocation_id)


def bridge_name(allocation_id: str) -> str:
    return f"gcbr-{_digest(_check_allocation_id(allocation_id))}"


def vlan_name(allocation_id: str) -> str:
    return f"gcvl-{_digest(_check_allocation_id(allocation_id))}"


def _check_vlan_id(vlan_id: int) -> int:
    if isinstance(vlan_id, bool) or not isinstance(vlan_id, int) or not 1 <= vlan_id <= 4094:
        raise InvalidNetworkSpec(f"VLAN id must be 1..4094, got {vlan_id!r}")
    return vlan_id


def segment_tag(vlan_id: int) -> str:
    """The ifalias of a VLAN segment's own links (its bridge and uplink sub-interface)."""
    return f"{SEGMENT_TAG_PREFIX}{_check_vlan_id(vlan_id)}"


def segment_bridge_name(vlan_id: int) -> str:
    return f"gcsbr-{_check_vlan_id(vlan_id)}"


def segment_vlan_name(vlan_id: int) -> str:
    return f"gcsvl-{_check_vlan_id(vlan_id)}"


def segment_member_name(allocation_id: str) -> str:
    return f"gcsm-{_digest(_check_allocation_id(allocation_id))}"


def tap_names(allocation_id: str, count: int) -> tuple[str, ...]:
    """`count` deterministic tap names for the allocation (`gt00-<hex>` … `gt99-<hex>`)."""
    if not 0 <= count <= MAX_TAPS:
        raise InvalidNetworkSpec(f"tap count must be 0..{MAX_TAPS}, got {count}")
    digest = _digest(_check_allocation_id(allocation_id))
    return tuple(f"gt{i:02d}-{digest}" for i in range(count))


@dataclass(frozen=True)
class AllocationNetworkSpec:
    """What one allocation's network is.

    `uplink` and `vlan_id` go together: with them, a VLAN sub-interface of the uplink joins the
    bridge; without them the bridge is isolated (host-only). `gateway_cidr` (e.g. "10.77.0.1/24")
    is put on the bridge when given.
    """

    allocation_id: str
    uplink: str | None = None
    vlan_id: int | None = None
    taps: tuple[str, ...] = ()
    gateway_cidr: str | None = None

    @property
    def tag(self) -> str:
        return allocation_tag(self.allocation_id)

    @property
    def bridge(self) -> str:
        return bridge_name(self.allocation_id)

    @property
    def vlan(self) -> str | None:
        return vlan_name(self.allocation_id) if self.vlan_id is not None else None

    @property
    def gateway(self) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface | None:
        if self.gateway_cidr is None:
            return None
        try:
            iface = ipaddress.ip_interface(self.gateway_cidr)
        except ValueError as exc:
            raise InvalidNetworkSpec(
                f"gateway {self.gateway_cidr!r} is not an address/prefix CIDR: {exc}"
            ) from exc
        if "/" not in self.gateway_cidr:
            raise InvalidNetworkSpec(f"gateway {self.gateway_cidr!r} needs a prefix length")
        if iface.ip == iface.network.network_address and iface.network.prefixlen < (
            iface.max_prefixlen - 1
        ):
            raise InvalidNetworkSpec(
                f"gateway {self.gateway_cidr!r} is the network address of its subnet"
            )
        return iface

    def validate(self) -> None:
        _check_allocation_id(self.allocation_id)
        if (self.uplink is None) != (self.vlan_id is None):
            raise InvalidNetworkSpec(
                "uplink and vlan_id go together: give both for a VLAN-backed network, "
                "neither for an isolated bridge"
            )
        if self.uplink is not None:
            validate_ifname(self.uplink, "uplink name")
        if self.vlan_id is not None and not 1 <= self.vlan_id <= 4094:
            raise InvalidNetworkSpec(f"VLAN id must be 1..4094, got {self.vlan_id}")
        if len(self.taps) > MAX_TAPS:
            raise InvalidNetworkSpec(f"at most {MAX_TAPS} taps, got {len(self.taps)}")
        for tap in self.taps:
            validate_ifname(tap, "tap name")
        if len(set(self.taps)) != len(self.taps):
            raise InvalidNetworkSpec(f"tap names repeat: {list(self.taps)}")
        own = {self.bridge, self.vlan, self.uplink}
        clash = own.intersection(self.taps)
        if clash:
            raise InvalidNetworkSpec(f"tap names clash with other links: {sorted(map(str, clash))}")
        self.gateway  # noqa: B018 - parses and validates the CIDR


@dataclass(frozen=True)
class NetworkApplyResult:
    """What apply did: `created` changed the namespace, `present` already matched, `deleted`
    were stale objects of this allocation that the spec no longer lists. Items read like
    `link:gcbr-…`, `master:gt00-…->gcbr-…`, `up:gcbr-…`, `addr:10.77.0.1/24@gcbr-…`."""

    created: tuple[str, ...]
    present: tuple[str, ...]
    deleted: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.created or self.deleted)


@dataclass(frozen=True)
class NetworkRemoveResult:
    deleted: tuple[str, ...]


def _nl(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except NetlinkError as exc:
        raise NetworkOperationFailed(f"{what}: {exc}") from exc


class _Recorder:
    def __init__(self) -> None:
        self.created: list[str] = []
        self.present: list[str] = []
        self.deleted: list[str] = []

    def result(self) -> NetworkApplyResult:
        return NetworkApplyResult(tuple(self.created), tuple(self.present), tuple(self.deleted))


def _ensure_link(
    ipr: Any,
    rec: _Recorder,
    name: str,
    tag: str,
    kind: str,
    create: Callable[[], None],
    check: Callable[[Any], str | None] = lambda _link: None,
) -> int:
    """Create `name` if missing; an existing one must carry our tag, kind, and pass `check`."""
    link = get_link(ipr, name)
    if link is None:
        create()
        index = link_index(ipr, name)
        if index is None:
            raise NetworkOperationFailed(f"link {name!r} was created but cannot be found")
        _nl(f"tag link {name!r}", ipr.link, "set", index=index, ifalias=tag)
        rec.created.append(f"link:{name}")
        return index
    if link.get("ifalias") != tag:
        raise NetworkConflict(
            f"link {name!r} exists but was not created for this allocation "
            f"(ifalias {link.get('ifalias')!r}, expected {tag!r})"
        )
    if link_kind(link) != kind:
        raise NetworkConflict(f"link {name!r} is a {link_kind(link)!r}, expected {kind!r}")
    problem = check(link)
    if problem:
        raise NetworkConflict(f"link {name!r} {problem}; remove the allocation network first")
    rec.present.append(f"link:{name}")
    return int(link["index"])


def _ensure_master_and_up(
    ipr: Any, rec: _Recorder, name: str, index: int, master: int | None, bridge: str
) -> None:
    link = ipr.get_links(index)[0]
    if master is not None:
        if link.get("master") != master:
            _nl(f"attach {name!r} to {bridge!r}", ipr.link, "set", index=index, master=master)
            rec.created.append(f"master:{name}->{bridge}")
        else:
            rec.present.append(f"master:{name}->{bridge}")
    if not link["flags"] & _IFF_UP:
        _nl(f"set {name!r} up", ipr.link, "set", index=index, state="up")
        rec.created.append(f"up:{name}")
    else:
        rec.present.append(f"up:{name}")


def _tagged_links(ipr: Any, tag: str) -> list[Any]:
    return [link for link in ipr.get_links() if link.get("ifalias") == tag]


def apply_allocation_network(
    spec: AllocationNetworkSpec, netns: str | None = None
) -> NetworkApplyResult:
    """Make `netns` (None: the host's namespace) hold exactly the network `spec` describes."""
    spec.validate()
    rec = _Recorder()
    tag = spec.tag
    bridge = spec.bridge
    with rtnl(netns) as ipr:
        uplink_index: int | None = None
        if spec.uplink is not None:
            uplink_index = link_index(ipr, spec.uplink)
            if uplink_index is None:
                raise MissingInterface(spec.uplink, netns)

        # Stale links of this allocation (e.g. a tap the spec dropped) go first.
        wanted = {bridge, *spec.taps}
        if spec.vlan is not None:
            wanted.add(spec.vlan)
        for link in _tagged_links(ipr, tag):
            if link.get("ifname") not in wanted:
                _nl(
                    f"delete stale link {link.get('ifname')!r}",
                    ipr.link,
                    "del",
                    index=link["index"],
                )
                rec.deleted.append(f"link:{link.get('ifname')}")

        bridge_index = _ensure_link(
            ipr,
            rec,
            bridge,
            tag,
            "bridge",
            lambda: _nl(f"create bridge {bridge!r}", ipr.link, "add", ifname=bridge, kind="bridge"),
        )
        _ensure_master_and_up(ipr, rec, bridge, bridge_index, None, bridge)

        if spec.vlan is not None and uplink_index is not None and spec.vlan_id is not None:
            vlan, vid, parent = spec.vlan, spec.vlan_id, uplink_index

            def vlan_check(link: Any) -> str | None:
                if vlan_id_of(link) != vid or link.get("link") != parent:
                    return (
                        f"has VLAN id {vlan_id_of(link)} on link index {link.get('link')}, "
                        f"expected VLAN id {vid} on {spec.uplink!r}"
                    )
                return None

            vlan_index = _ensure_link(
                ipr,
                rec,
                vlan,
                tag,
                "vlan",
                lambda: _nl(
                    f"create VLAN {vlan!r}",
                    ipr.link,
                    "add",
                    ifname=vlan,
                    kind="vlan",
                    link=parent,
                    vlan_id=vid,
                ),
                vlan_check,
            )
            _ensure_master_and_up(ipr, rec, vlan, vlan_index, bridge_index, bridge)

        for tap in spec.taps:
            tap_index = _ensure_link(
                ipr, rec, tap, tag, "tun", functools.partial(create_tap, tap, netns)
            )
            _ensure_master_and_up(ipr, rec, tap, tap_index, bridge_index, bridge)

        _converge_gateway(ipr, rec, spec, bridge_index)
    return rec.result()


def _converge_gateway(ipr: Any, rec: _Recorder, spec: AllocationNetworkSpec, index: int) -> None:
    gateway = spec.gateway
    wanted = (str(gateway.ip), gateway.network.prefixlen) if gateway is not None else None
    family = socket.AF_INET6 if gateway is not None and gateway.version == 6 else socket.AF_INET
    for addr in ipr.get_addr(index=index):
        key = (addr.get("address"), addr["prefixlen"])
        if addr["family"] == socket.AF_INET6 and addr["scope"] != 0:
            continue  # link-local addresses the kernel adds itself
        if key == wanted and addr["family"] == family:
            rec.present.append(f"addr:{key[0]}/{key[1]}@{spec.bridge}")
            wanted = None
            continue
        _nl(
            f"delete stale address {key} on {spec.bridge!r}",
            ipr.addr,
            "del",
            index=index,
            address=key[0],
            prefixlen=key[1],
        )
        rec.deleted.append(f"addr:{key[0]}/{key[1]}@{spec.bridge}")
    if wanted is not None:
        _nl(
            f"add {wanted[0]}/{wanted[1]} to {spec.bridge!r}",
            ipr.addr,
            "add",
            index=index,
            address=wanted[0],
            prefixlen=wanted[1],
        )
        rec.created.append(f"addr:{wanted[0]}/{wanted[1]}@{spec.bridge}")


def remove_allocation_network(
    target: str | AllocationNetworkSpec, netns: str | None = None
) -> NetworkRemoveResult:
    """Delete every link tagged for the allocation (taps and VLAN, then the bridge, whose
    addresses go with it). Removing what is already gone deletes nothing and is not an error."""
    allocation_id = target.allocation_id if isinstance(target, AllocationNetworkSpec) else target
    tag = allocation_tag(allocation_id)
    deleted: list[str] = []
    with rtnl(netns) as ipr:
        links = _tagged_links(ipr, tag)
        # Bridges last: members first, so nothing is left half-attached if a delete fails.
        links.sort(key=lambda link: link_kind(link) == "bridge")
        for link in links:
            name = link.get("ifname")
            if link_kind(link) == "bridge":
                for addr in ipr.get_addr(index=link["index"]):
                    if addr["family"] == socket.AF_INET6 and addr["scope"] != 0:
                        continue
                    deleted.append(f"addr:{addr.get('address')}/{addr['prefixlen']}@{name}")
            try:
                ipr.link("del", index=link["index"])
            except NetlinkError as exc:
                if exc.code == errno.ENODEV:  # gone meanwhile
                    continue
                raise NetworkOperationFailed(
                    f"delete link {name!r}: {exc}", error_type=HostErrorType.RELEASE_ERROR
                ) from exc
            deleted.append(f"link:{name}")
    return NetworkRemoveResult(tuple(deleted))


# ------------------------------------------------------------------ VLAN segments


@dataclass(frozen=True)
class VlanSegmentMember:
    """An allocation on the VLAN segment of `vlan_id`; with `uplink`, the segment reaches the
    other nodes through the uplink's sub-interface for that VLAN, without it the segment stays
    on this node."""

    allocation_id: str
    vlan_id: int
    uplink: str | None = None

    @property
    def tag(self) -> str:
        return allocation_tag(self.allocation_id)

    @property
    def bridge(self) -> str:
        return segment_bridge_name(self.vlan_id)

    @property
    def vlan(self) -> str | None:
        return segment_vlan_name(self.vlan_id) if self.uplink is not None else None

    @property
    def member(self) -> str:
        return segment_member_name(self.allocation_id)

    def validate(self) -> None:
        _check_allocation_id(self.allocation_id)
        _check_vlan_id(self.vlan_id)
        if self.uplink is not None:
            validate_ifname(self.uplink, "uplink name")
            if self.uplink in (self.bridge, self.vlan, self.member):
                raise InvalidNetworkSpec(f"uplink {self.uplink!r} clashes with a segment link")


def join_vlan_segment(spec: VlanSegmentMember, netns: str | None = None) -> NetworkApplyResult:
    """Make the allocation a member of its VLAN's segment in `netns`, creating the segment (bridge,
    then uplink sub-interface) if this is its first member, and answer what changed. Links an
    earlier apply made for the allocation other than its member (an isolated bridge of its own)
    are deleted first; a member on another VLAN's bridge moves to this one (the segment it left
    is the caller's to prune). The caller serialises joins and prunes of one namespace
    (agent/network/slice_networks.py): a prune between finding the bridge and adding the member
    would delete the segment under it."""
    spec.validate()
    rec = _Recorder()
    segment = segment_tag(spec.vlan_id)
    bridge, member = spec.bridge, spec.member
    with rtnl(netns) as ipr:
        uplink_index: int | None = None
        if spec.uplink is not None:
            uplink_index = link_index(ipr, spec.uplink)
            if uplink_index is None:
                raise MissingInterface(spec.uplink, netns)

        stale = [link for link in _tagged_links(ipr, spec.tag) if link.get("ifname") != member]
        stale.sort(key=lambda link: link_kind(link) == "bridge")  # members before bridges
        for link in stale:
            _nl(f"delete stale link {link.get('ifname')!r}", ipr.link, "del", index=link["index"])
            rec.deleted.append(f"link:{link.get('ifname')}")

        bridge_index = _ensure_link(
            ipr,
            rec,
            bridge,
            segment,
            "bridge",
            lambda: _nl(f"create bridge {bridge!r}", ipr.link, "add", ifname=bridge, kind="bridge"),
        )
        _ensure_master_and_up(ipr, rec, bridge, bridge_index, None, bridge)

        if spec.vlan is not None and uplink_index is not None:
            vlan, vid, parent = spec.vlan, spec.vlan_id, uplink_index

            def vlan_check(link: Any) -> str | None:
                if vlan_id_of(link) != vid or link.get("link") != parent:
                    return (
                        f"has VLAN id {vlan_id_of(link)} on link index {link.get('link')}, "
                        f"expected VLAN id {vid} on {spec.uplink!r}"
                    )
                return None

            vlan_index = _ensure_link(
                ipr,
                rec,
                vlan,
                segment,
                "vlan",
                lambda: _nl(
                    f"create VLAN {vlan!r}",
                    ipr.link,
                    "add",
                    ifname=vlan,
                    kind="vlan",
                    link=parent,
                    vlan_id=vid,
                ),
                vlan_check,
            )
            _ensure_master_and_up(ipr, rec, vlan, vlan_index, bridge_index, bridge)

        member_index = _ensure_link(
            ipr, rec, member, spec.tag, "tun", functools.partial(create_tap, member, netns)
        )
        _ensure_master_and_up(ipr, rec, member, member_index, bridge_index, bridge)
    return rec.result()


def prune_vlan_segments(netns: str | None = None) -> NetworkRemoveResult:
    """Delete every VLAN segment in `netns` that nothing is attached to but its own uplink
    sub-interface (no allocation's member, no VM's NIC), and the halves of segments a crash left
    behind (a sub-interface whose bridge is gone). Segments in use are never touched."""
    deleted: list[str] = []
    with rtnl(netns) as ipr:
        links = list(ipr.get_links())
        segments: dict[str, list[Any]] = {}
        for link in links:
            alias = link.get("ifalias") or ""
            if alias.startswith(SEGMENT_TAG_PREFIX):
                segments.setdefault(alias, []).append(link)
        for own in segments.values():
            own_indexes = {int(link["index"]) for link in own}
            bridges = [int(link["index"]) for link in own if link_kind(link) == "bridge"]
            in_use = any(
                link.get("master") in bridges and int(link["index"]) not in own_indexes
                for link in links
            )
            if in_use:
                continue
            own.sort(key=lambda link: link_kind(link) == "bridge")  # sub-interface first
            for link in own:
                name = link.get("ifname")
                try:
                    ipr.link("del", index=link["index"])
                except NetlinkError as exc:
                    if exc.code == errno.ENODEV:  # gone meanwhile
                        continue
                    raise NetworkOperationFailed(
                        f"delete link {name!r}: {exc}", error_type=HostErrorType.RELEASE_ERROR
                    ) from exc
                deleted.append(f"link:{name}")
    return NetworkRemoveResult(tuple(deleted))
