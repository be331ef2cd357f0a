"""How a slice segment leaves the node: the link its bridge holds beside its members, made on the
node's uplink for the segment's id (the VLAN id the control plane assigned the project). One
strategy per node, picked by the agent config (`[libvirt] segment_encapsulation`):

* `Vlan8021Q` ("vlan", the default): an 802.1Q sub-interface of the uplink with the segment id as
  its VLAN id. The uplink's switch port trunks the region's VLAN pool; no overhead.
* `Vxlan` ("vxlan"): a VXLAN device with the segment id as its VNI, sending UDP (port 4789) from
  the uplink's own address over the uplink, either to a multicast group (flood and learn: every
  node joins the group on its uplink; `group`, default 239.1.1.1) or to a static list of peers
  (`peers`: head-end replication, one all-zeros forwarding entry per peer; the node's own
  address in the list is skipped, so one list serves a region). It needs an address on the
  uplink and the nodes' UDP port reachable from each other, and takes 50 bytes of the uplink's
  MTU (70 over IPv6): the segment's bridge gets the rest (`mtu`).

The strategies only describe: the link's kind and name part, the attributes it is created with,
what makes an existing one stale, the MTU it leaves the segment and the peers it floods to.
agent/network/allocation_network.py does the netlink work, one way for both.
"""

from __future__ import annotations

import ipaddress
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from agent.network.errors import InvalidNetworkSpec, MissingInterface, NetworkOperationFailed
from agent.network.netns import get_link, link_kind, vlan_id_of

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

VXLAN_PORT = 4789  # IANA's
DEFAULT_VXLAN_GROUP = "239.1.1.1"
# What a VXLAN frame adds inside the uplink's MTU: outer IP (20, or 40 for IPv6), UDP (8) and
# VXLAN (8) headers, and the inner frame's own Ethernet header (14).
VXLAN_OVERHEAD = {4: 50, 6: 70}

# ifa_flags that make an address unfit to send from: a secondary IPv4 address, an IPv6 address
# still in (or failed) duplicate address detection, or deprecated.
_IFA_F_SECONDARY = 0x01
_IFA_F_DADFAILED = 0x08
_IFA_F_DEPRECATED = 0x20
_IFA_F_TENTATIVE = 0x40
_UNFIT = _IFA_F_SECONDARY | _IFA_F_DADFAILED | _IFA_F_DEPRECATED | _IFA_F_TENTATIVE
_RT_SCOPE_UNIVERSE = 0


@dataclass(frozen=True)
class Uplink:
    """The node's uplink as an encapsulation needs it: its index and MTU, and the addresses it
    can send from (global scope, primary first, as the kernel lists them)."""

    name: str
    index: int
    mtu: int
    addresses: tuple[IpAddress, ...] = ()


def read_uplink(ipr: Any, name: str, netns: str | None) -> Uplink:
    link = get_link(ipr, name)
    if link is None:
        raise MissingInterface(name, netns)
    addresses: list[IpAddress] = []
    for addr in ipr.get_addr(index=link["index"]):
        flags = int(addr["flags"]) | int(addr.get_attr("IFA_FLAGS") or 0)
        if addr["scope"] != _RT_SCOPE_UNIVERSE or flags & _UNFIT:
            continue
        # IFA_LOCAL is the interface's own address (IFA_ADDRESS the peer's, point-to-point).
        local = addr.get_attr("IFA_LOCAL") or addr.get_attr("IFA_ADDRESS")
        addresses.append(ipaddress.ip_address(local))
    return Uplink(name, int(link["index"]), int(link.get("mtu") or 1500), tuple(addresses))


def _linkinfo(link: Any, key: str) -> Any:
    return link.get(("linkinfo", "data", key))


class SegmentEncapsulation(ABC):
    """How a segment's frames cross to the other nodes over the uplink (see the module doc)."""

    name: ClassVar[str]  # the config value
    kind: ClassVar[str]  # the link kind the kernel reports
    short: ClassVar[str]  # in link names: gcs<short>-<vid> (segment), gc<short>-<hex> (allocation)

    @abstractmethod
    def validate(self) -> None:
        """Refuse a setting that could never work (InvalidNetworkSpec)."""

    def overhead(self) -> int:
        return 0

    def mtu(self, uplink: Uplink) -> int:
        """The MTU left to the segment (its link and bridge, hence the VMs' taps)."""
        return uplink.mtu - self.overhead()

    @abstractmethod
    def link_attrs(self, vlan_id: int, uplink: Uplink) -> dict[str, Any]:
        """The attributes `ip link add` gets for the segment's link (the name aside)."""

    @abstractmethod
    def mismatch(self, link: Any, vlan_id: int, uplink: Uplink) -> str | None:
        """Why an existing link of ours is not what `link_attrs` would make now, or None."""

    def flood_to(self, uplink: Uplink) -> frozenset[str] | None:
        """The remote endpoints the link's all-zeros forwarding entries must name exactly, or None
        when the link has no such list (a VLAN, a multicast group)."""
        return None


@dataclass(frozen=True)
class Vlan8021Q(SegmentEncapsulation):
    """An 802.1Q sub-interface of the uplink; VLAN id = segment id."""

    name: ClassVar[str] = "vlan"
    kind: ClassVar[str] = "vlan"
    short: ClassVar[str] = "vl"

    def validate(self) -> None:
        return None  # nothing to choose

    def link_attrs(self, vlan_id: int, uplink: Uplink) -> dict[str, Any]:
        return {"kind": "vlan", "link": uplink.index, "vlan_id": vlan_id}

    def mismatch(self, link: Any, vlan_id: int, uplink: Uplink) -> str | None:
        if link_kind(link) != self.kind:
            return f"is a {link_kind(link)!r}, expected a VLAN"
        if vlan_id_of(link) != vlan_id or link.get("link") != uplink.index:
            return (
                f"has VLAN id {vlan_id_of(link)} on link index {link.get('link')}, "
                f"expected VLAN id {vlan_id} on {uplink.name!r}"
            )
        return None


@dataclass(frozen=True)
class Vxlan(SegmentEncapsulation):
    """A VXLAN device over the uplink; VNI = segment id. Exactly one of `group` (a multicast
    group) and `peers` (unicast addresses of the other nodes' uplinks) is given."""

    name: ClassVar[str] = "vxlan"
    kind: ClassVar[str] = "vxlan"
    short: ClassVar[str] = "vx"

    group: str | None = DEFAULT_VXLAN_GROUP
    peers: tuple[str, ...] = ()
    port: int = VXLAN_PORT

    def validate(self) -> None:
        if (self.group is None) == (not self.peers):
            raise InvalidNetworkSpec("VXLAN needs either a multicast group or a list of peers")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise InvalidNetworkSpec("VXLAN port must be an integer")
        if not 1 <= self.port <= 65535:
            raise InvalidNetworkSpec("VXLAN port must be 1..65535")
        if self.group is not None:
            group = _address(self.group, "VXLAN group")
            if not group.is_multicast:
                raise InvalidNetworkSpec(f"VXLAN group {self.group!r} is not a multicast address")
        families = set()
        for peer in self.peers:
            address = _address(peer, "VXLAN peer")
            if address.is_multicast or address.is_unspecified:
                raise InvalidNetworkSpec(f"VXLAN peer {peer!r} is not a unicast address")
            families.add(address.version)
        if len(families) > 1:
            raise InvalidNetworkSpec("VXLAN peers mix IPv4 and IPv6 addresses")

    @property
    def family(self) -> int:
        """4 or 6: the underlay's IP version (of the group, else of the peers)."""
        first = self.group if self.group is not None else self.peers[0]
        return ipaddress.ip_address(first).version

    def overhead(self) -> int:
        return VXLAN_OVERHEAD[self.family]

    def local(self, uplink: Uplink) -> IpAddress:
        """The uplink's first address of the underlay's family: what the node sends from."""
        for address in uplink.addresses:
            if address.version == self.family:
                return address
        raise NetworkOperationFailed(
            f"uplink {uplink.name!r} has no usable IPv{self.family} address to send VXLAN from"
        )

    def link_attrs(self, vlan_id: int, uplink: Uplink) -> dict[str, Any]:
        six = self.family == 6
        attrs: dict[str, Any] = {
            "kind": "vxlan",
            "vxlan_id": vlan_id,
            "vxlan_link": uplink.index,
            "vxlan_port": self.port,
            "vxlan_learning": 1,
            "vxlan_local6" if six else "vxlan_local": str(self.local(uplink)),
            "mtu": self.mtu(uplink),
        }
        if self.group is not None:
            attrs["vxlan_group6" if six else "vxlan_group"] = self.group
        return attrs

    def mismatch(self, link: Any, vlan_id: int, uplink: Uplink) -> str | None:
        if link_kind(link) != self.kind:
            return f"is a {link_kind(link)!r}, expected a VXLAN"
        six = self.family == 6
        have = (
            _linkinfo(link, "vxlan_id"),
            _linkinfo(link, "vxlan_link"),
            _linkinfo(link, "vxlan_port"),
            _ip(_linkinfo(link, "vxlan_local6" if six else "vxlan_local")),
            _ip(_linkinfo(link, "vxlan_group6" if six else "vxlan_group")),
        )
        want = (
            vlan_id,
            uplink.index,
            self.port,
            self.local(uplink),
            _ip(self.group),
        )
        if have != want:
            return (
                "has VNI, uplink index, port, local address, group "
                f"{tuple(map(str, have))}, expected {tuple(map(str, want))}"
            )
        return None

    def flood_to(self, uplink: Uplink) -> frozenset[str] | None:
        if self.group is not None:
            return None  # the kernel's own default entry names the group
        local = self.local(uplink)
        return frozenset(
            str(address)
            for address in map(ipaddress.ip_address, self.peers)
            if address != local and address not in uplink.addresses
        )


VLAN_8021Q = Vlan8021Q()
ENCAPSULATIONS: dict[str, type[SegmentEncapsulation]] = {
    Vlan8021Q.name: Vlan8021Q,
    Vxlan.name: Vxlan,
}


def _address(value: object, what: str) -> IpAddress:
    if not isinstance(value, str):
        raise InvalidNetworkSpec(f"{what} must be an IP address string")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise InvalidNetworkSpec(f"{what} {value!r} is not an IP address") from None


def _ip(value: object) -> IpAddress | None:
    """An address attribute as read back (None, '0.0.0.0' and '::' mean unset)."""
    if value is None:
        return None
    address = ipaddress.ip_address(str(value))
    return None if address.is_unspecified else address
