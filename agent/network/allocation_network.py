"""Slice networks on a node: a per-allocation isolated bridge, or a per-VLAN shared segment.

Declarative and idempotent: `apply_allocation_network(spec)` makes the namespace match the spec
(creating what is missing, leaving what is right, deleting what an earlier apply of the same
allocation made but the spec no longer lists) and reports which was which. Every link it creates
carries the allocation's tag in its ifalias (`gpucloud:alloc:<allocation id>`), so
`remove_allocation_network` deletes exactly those links (and, with the bridge, its addresses) and
never anything else. A name that exists without our tag is a conflict, never adopted.

A VLAN segment is what the allocations of one project on a node share (`join_vlan_segment`): one
bridge per VLAN id (the segment id), holding the segment's link over the node's uplink (so the
project's allocations on other nodes are on the same L2 segment, and no other project's are),
both tagged `gpucloud:vlan:<vid>`. That link is the node's encapsulation's
(agent/network/encapsulation.py): an 802.1Q sub-interface of the uplink (the default), or a
VXLAN device whose VNI is the segment id; with an uplink, the bridge's MTU is what the
encapsulation leaves of the uplink's. Each allocation on it keeps a member link (a persistent
tap, tagged with the allocation, enslaved to the segment's bridge) from the moment it joins until
it is removed, so the segment is known to be in use before its VM has a NIC on it; that member is
the VM's NIC (the libvirt backend hands it to the domain, agent/network/slice_networks.py).

No host address on tenant links: every tap (an isolated bridge's, a segment's member), a
segment's bridge and link over the uplink, and an isolated bridge unless its gateway is IPv6 get
IPv6 address generation off (netlink) and IPv6 off (`disable_ipv6`, the link's sysctl in the
namespace) before they come up, and lose any IPv6 address they had: no link-local to reach the
node by, and no SLAAC address from a router advertisement a VM sends. Taps take their bridge's
MTU.
`prune_vlan_segments` deletes every segment nothing but its own uplink link is attached to; it
re-derives that from the links alone, so it also finishes the work of a join or a prune that
crashed half-way. A join also converges the segment's own link to the node's configuration: a
link of another encapsulation (or of an uplink no longer configured), or one whose attributes
differ (another VXLAN group, a changed uplink address), is replaced.

Names fit IFNAMSIZ. From the allocation id (sha256 prefix): bridge `gcbr-<10 hex>`, VLAN
`gcvl-<10 hex>` (VXLAN `gcvx-<10 hex>`), taps `gtNN-<10 hex>` (see `tap_names`), segment member
`gcsm-<10 hex>`. From the VLAN id: segment bridge `gcsbr-<vid>`, its uplink link `gcsvl-<vid>`
(VXLAN `gcsvx-<vid>`).
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

from agent.network.encapsulation import (
    VLAN_8021Q,
    SegmentEncapsulation,
    Uplink,
    read_uplink,
)
from agent.network.errors import (
    InvalidNetworkSpec,
    NetworkConflict,
    NetworkOperationFailed,
)
from agent.network.netns import (
    create_tap,
    disable_ipv6,
    get_link,
    link_index,
    link_kind,
    rtnl,
    validate_ifname,
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


def allocation_link_name(
    allocation_id: str, encapsulation: SegmentEncapsulation = VLAN_8021Q
) -> str:
    """The name of an allocation's own link over the uplink (`gcvl-<hex>`, `gcvx-<hex>`)."""
    return f"gc{encapsulation.short}-{_digest(_check_allocation_id(allocation_id))}"


def vlan_name(allocation_id: str) -> str:
    return allocation_link_name(allocation_id, VLAN_8021Q)


def _check_vlan_id(vlan_id: int) -> int:
    if isinstance(vlan_id, bool) or not isinstance(vlan_id, int) or not 1 <= vlan_id <= 4094:
        raise InvalidNetworkSpec(f"VLAN id must be 1..4094, got {vlan_id!r}")
    return vlan_id


def segment_tag(vlan_id: int) -> str:
    """The ifalias of a VLAN segment's own links (its bridge and its link over the uplink)."""
    return f"{SEGMENT_TAG_PREFIX}{_check_vlan_id(vlan_id)}"


def segment_bridge_name(vlan_id: int) -> str:
    return f"gcsbr-{_check_vlan_id(vlan_id)}"


def segment_link_name(vlan_id: int, encapsulation: SegmentEncapsulation = VLAN_8021Q) -> str:
    """The name of a segment's link over the uplink (`gcsvl-<vid>`, `gcsvx-<vid>`)."""
    return f"gcs{encapsulation.short}-{_check_vlan_id(vlan_id)}"


def segment_vlan_name(vlan_id: int) -> str:
    return segment_link_name(vlan_id, VLAN_8021Q)


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

    `uplink` and `vlan_id` go together: with them, the encapsulation's link of the uplink for
    that id (a VLAN sub-interface by default, or a VXLAN device) joins the bridge; without them
    the bridge is isolated (host-only). `gateway_cidr` (e.g. "10.77.0.1/24") is put on the bridge
    when given.
    """

    allocation_id: str
    uplink: str | None = None
    vlan_id: int | None = None
    taps: tuple[str, ...] = ()
    gateway_cidr: str | None = None
    encapsulation: SegmentEncapsulation = VLAN_8021Q

    @property
    def tag(self) -> str:
        return allocation_tag(self.allocation_id)

    @property
    def bridge(self) -> str:
        return bridge_name(self.allocation_id)

    @property
    def vlan(self) -> str | None:
        """The allocation's link over the uplink (named for its encapsulation)."""
        if self.vlan_id is None:
            return None
        return allocation_link_name(self.allocation_id, self.encapsulation)

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
        self.encapsulation.validate()
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
) -> int:
    """Create `name` if missing; an existing one must carry our tag and kind."""
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


def _ensure_mtu(ipr: Any, rec: _Recorder, name: str, index: int, mtu: int) -> None:
    if ipr.get_links(index)[0].get("mtu") != mtu:
        _nl(f"set the MTU of {name!r} to {mtu}", ipr.link, "set", index=index, mtu=mtu)
        rec.created.append(f"mtu:{name}={mtu}")
    else:
        rec.present.append(f"mtu:{name}={mtu}")


# IFLA_INET6_ADDR_GEN_MODE "none": the kernel gives the link no IPv6 link-local address.
_ADDR_GEN_MODE_NONE = 1


def _match_mtu(ipr: Any, rec: _Recorder, name: str, index: int, mtu: int) -> None:
    """Give the link `mtu`, recording only a change (a tap created at the bridge's MTU reads as
    created with its link)."""
    if ipr.get_links(index)[0].get("mtu") != mtu:
        _nl(f"set the MTU of {name!r} to {mtu}", ipr.link, "set", index=index, mtu=mtu)
        rec.created.append(f"mtu:{name}={mtu}")


def _link_mtu(ipr: Any, index: int) -> int:
    return int(ipr.get_links(index)[0].get("mtu") or 1500)


def _ensure_no_host_address(
    ipr: Any, rec: _Recorder, name: str, index: int, netns: str | None
) -> None:
    """A slice's links carry tenant frames only (a segment's bridge and its link over the uplink,
    an isolated bridge without an IPv6 gateway, every VM's tap): the host must not be an IPv6
    neighbour on them (a link-local address would let the project's VMs, and the other nodes'
    VMs of the project, reach the node over fe80::; a router advertisement a VM sends would give
    it a global one). Address generation goes off through netlink and IPv6 itself through the
    link's sysctl, both before the link comes up; any address it already has goes."""
    _nl(
        f"turn off IPv6 address generation on {name!r}",
        ipr.link,
        "set",
        index=index,
        IFLA_AF_SPEC={
            "attrs": [["AF_INET6", {"attrs": [["IFLA_INET6_ADDR_GEN_MODE", _ADDR_GEN_MODE_NONE]]}]]
        },
    )
    for addr in ipr.get_addr(index=index, family=socket.AF_INET6):
        address = addr.get_attr("IFA_ADDRESS")
        _nl(f"delete {address} from {name!r}", ipr.addr, "del", index=index, address=address,
            prefixlen=addr["prefixlen"])  # fmt: skip
        rec.deleted.append(f"addr:{address}@{name}")
    disable_ipv6(name, netns)


_ALL_ZEROS = "00:00:00:00:00:00"


def _converge_flood_list(
    ipr: Any, rec: _Recorder, name: str, index: int, wanted: frozenset[str] | None
) -> None:
    """Make the link's all-zeros forwarding entries (where unknown and broadcast frames go) name
    exactly `wanted`; None leaves them to the kernel."""
    if wanted is None:
        return
    have = {
        str(entry.get("dst"))
        for entry in ipr.fdb("dump", ifindex=index)
        if entry["ifindex"] == index and entry.get("lladdr") == _ALL_ZEROS and entry.get("dst")
    }
    for dst in sorted(have - wanted):
        _nl(
            f"drop flood entry {dst} of {name!r}",
            ipr.fdb,
            "del",
            ifindex=index,
            lladdr=_ALL_ZEROS,
            dst=dst,
        )
        rec.deleted.append(f"flood:{name}->{dst}")
    for dst in sorted(wanted - have):
        _nl(
            f"add flood entry {dst} to {name!r}",
            ipr.fdb,
            "append",
            ifindex=index,
            lladdr=_ALL_ZEROS,
            dst=dst,
        )
        rec.created.append(f"flood:{name}->{dst}")
    rec.present.extend(f"flood:{name}->{dst}" for dst in sorted(have & wanted))


@dataclass(frozen=True)
class _UplinkLink:
    """The link an allocation or a segment has over the uplink, as one apply wants it."""

    name: str
    tag: str
    vlan_id: int
    encapsulation: SegmentEncapsulation
    uplink: Uplink

    def attrs(self) -> dict[str, Any]:
        """Its creation attributes; raises before anything changed when the uplink cannot carry
        it (e.g. VXLAN without an address on the uplink)."""
        return self.encapsulation.link_attrs(self.vlan_id, self.uplink)


def _ensure_uplink_link(
    ipr: Any,
    rec: _Recorder,
    want: _UplinkLink,
    bridge_index: int,
    bridge: str,
    netns: str | None,
) -> None:
    """Create (or replace, when ours but stale) the link, converge its MTU and flood list, attach
    it to the bridge and bring it up; then give the bridge the same MTU."""
    encapsulation, name = want.encapsulation, want.name
    attrs = want.attrs()
    link = get_link(ipr, name)
    if (
        link is not None
        and link.get("ifalias") == want.tag
        and encapsulation.mismatch(link, want.vlan_id, want.uplink)
    ):
        _nl(f"delete stale link {name!r}", ipr.link, "del", index=link["index"])
        rec.deleted.append(f"link:{name}")
    index = _ensure_link(
        ipr,
        rec,
        name,
        want.tag,
        encapsulation.kind,
        lambda: _nl(f"create {encapsulation.name} {name!r}", ipr.link, "add", ifname=name, **attrs),
    )
    mtu = encapsulation.mtu(want.uplink)
    _ensure_mtu(ipr, rec, name, index, mtu)
    _converge_flood_list(ipr, rec, name, index, encapsulation.flood_to(want.uplink))
    _ensure_no_host_address(ipr, rec, name, index, netns)
    _ensure_master_and_up(ipr, rec, name, index, bridge_index, bridge)
    _ensure_mtu(ipr, rec, bridge, bridge_index, mtu)


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
        over_uplink: _UplinkLink | None = None
        if spec.uplink is not None and spec.vlan is not None and spec.vlan_id is not None:
            over_uplink = _UplinkLink(
                spec.vlan,
                tag,
                spec.vlan_id,
                spec.encapsulation,
                read_uplink(ipr, spec.uplink, netns),
            )
            over_uplink.attrs()  # refuse before changing anything

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
        gateway = spec.gateway
        if gateway is None or gateway.version == 4:
            # The host has no IPv6 business on it (an IPv6 gateway is the one reason to).
            _ensure_no_host_address(ipr, rec, bridge, bridge_index, netns)
        _ensure_master_and_up(ipr, rec, bridge, bridge_index, None, bridge)

        if over_uplink is not None:
            _ensure_uplink_link(ipr, rec, over_uplink, bridge_index, bridge, netns)

        for tap in spec.taps:
            tap_index = _ensure_link(
                ipr, rec, tap, tag, "tun", functools.partial(create_tap, tap, netns)
            )
            # A VM's NIC: no host address on it, and the bridge's MTU (the guest gets the same).
            _ensure_no_host_address(ipr, rec, tap, tap_index, netns)
            _match_mtu(ipr, rec, tap, tap_index, _link_mtu(ipr, bridge_index))
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
    other nodes through the encapsulation's link of the uplink for that id (an 802.1Q
    sub-interface, or a VXLAN device), without it the segment stays on this node."""

    allocation_id: str
    vlan_id: int
    uplink: str | None = None
    encapsulation: SegmentEncapsulation = VLAN_8021Q

    @property
    def tag(self) -> str:
        return allocation_tag(self.allocation_id)

    @property
    def bridge(self) -> str:
        return segment_bridge_name(self.vlan_id)

    @property
    def link(self) -> str | None:
        """The segment's link over the uplink, if it has one."""
        if self.uplink is None:
            return None
        return segment_link_name(self.vlan_id, self.encapsulation)

    @property
    def member(self) -> str:
        return segment_member_name(self.allocation_id)

    def validate(self) -> None:
        _check_allocation_id(self.allocation_id)
        _check_vlan_id(self.vlan_id)
        self.encapsulation.validate()
        if self.uplink is not None:
            validate_ifname(self.uplink, "uplink name")
            if self.uplink in (self.bridge, self.link, self.member):
                raise InvalidNetworkSpec(f"uplink {self.uplink!r} clashes with a segment link")


def join_vlan_segment(spec: VlanSegmentMember, netns: str | None = None) -> NetworkApplyResult:
    """Make the allocation a member of its VLAN's segment in `netns`, creating the segment (bridge,
    then its link over the uplink) if this is its first member, and answer what changed. Links an
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
        over_uplink: _UplinkLink | None = None
        if spec.uplink is not None and spec.link is not None:
            over_uplink = _UplinkLink(
                spec.link,
                segment,
                spec.vlan_id,
                spec.encapsulation,
                read_uplink(ipr, spec.uplink, netns),
            )
            over_uplink.attrs()  # refuse before changing anything

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
        _ensure_no_host_address(ipr, rec, bridge, bridge_index, netns)
        _ensure_master_and_up(ipr, rec, bridge, bridge_index, None, bridge)

        # The segment's links over the uplink other than the one wanted now (another
        # encapsulation's, or an uplink no longer configured) leave it.
        for link in _tagged_links(ipr, segment):
            if link_kind(link) != "bridge" and link.get("ifname") != spec.link:
                _nl(
                    f"delete stale link {link.get('ifname')!r}",
                    ipr.link,
                    "del",
                    index=link["index"],
                )
                rec.deleted.append(f"link:{link.get('ifname')}")

        if over_uplink is not None:
            _ensure_uplink_link(ipr, rec, over_uplink, bridge_index, bridge, netns)

        member_index = _ensure_link(
            ipr, rec, member, spec.tag, "tun", functools.partial(create_tap, member, netns)
        )
        _ensure_no_host_address(ipr, rec, member, member_index, netns)
        _match_mtu(ipr, rec, member, member_index, _link_mtu(ipr, bridge_index))
        _ensure_master_and_up(ipr, rec, member, member_index, bridge_index, bridge)
    return rec.result()


def prune_vlan_segments(netns: str | None = None) -> NetworkRemoveResult:
    """Delete every VLAN segment in `netns` that nothing is attached to but its own link over the
    uplink (no allocation's member, no VM's NIC), and the halves of segments a crash left behind
    (such a link whose bridge is gone). Segments in use are never touched."""
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
            own.sort(key=lambda link: link_kind(link) == "bridge")  # the uplink link first
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
