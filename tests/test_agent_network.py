"""agent.network against the real kernel, through pyroute2, inside a network namespace each test
creates and always removes. The host's own namespace is compared before and after every test:
nothing here may touch it. A network over an uplink is checked with each encapsulation (802.1Q,
skipped on a kernel without CONFIG_VLAN_8021Q; VXLAN to a group and to peers)."""

from __future__ import annotations

import errno
import socket
import uuid
from typing import Any

import pytest
from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from agent.network import (
    VLAN_8021Q,
    AllocationNetworkSpec,
    InvalidNetworkSpec,
    MissingInterface,
    NamespaceNotFound,
    NetworkConflict,
    NetworkOperationFailed,
    RoceAssignment,
    SegmentEncapsulation,
    VlanSegmentMember,
    Vxlan,
    apply_allocation_network,
    apply_roce_policy,
    bridge_name,
    dump_state,
    join_vlan_segment,
    prune_vlan_segments,
    remove_allocation_network,
    remove_roce_policy,
    roce_table_id,
    tap_names,
    vlan_name,
)
from agent.network.roce import ROCE_PROTO

IFF_UP = 0x1


def add_veth(ns: str, name: str, peer: str) -> int:
    """A veth pair, both ends up: `name` stands in for a physical NIC (uplink or RoCE port)."""
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("add", ifname=name, kind="veth", peer=peer)
        for ifname in (name, peer):
            ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state="up")
        return int(ipr.link_lookup(ifname=name)[0])


def links_by_name(ns: str) -> dict[str, Any]:
    with IPRoute(netns=ns, flags=0) as ipr:
        return {link.get("ifname"): link for link in ipr.get_links()}


def require_support(ns: str, encapsulation: SegmentEncapsulation) -> None:
    """Skip unless this kernel makes the encapsulation's links (802.1Q: CONFIG_VLAN_8021Q,
    VXLAN: CONFIG_VXLAN)."""
    vxlan = isinstance(encapsulation, Vxlan)
    attrs: dict[str, Any] = (
        {"kind": "vxlan", "vxlan_id": 9, "vxlan_port": 4789}
        if vxlan
        else {"kind": "vlan", "vlan_id": 9}
    )
    missing = "VXLAN support (CONFIG_VXLAN" if vxlan else "802.1Q VLAN support (CONFIG_VLAN_8021Q"
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("add", ifname="probe0", kind="veth", peer="probe1")
        try:
            parent = ipr.link_lookup(ifname="probe0")[0]
            ipr.link("add", ifname="probe0.9", link=parent, **attrs)
        except NetlinkError as exc:
            if exc.code == errno.EOPNOTSUPP:
                pytest.skip(f"this kernel has no {missing} unset)")
            raise
        finally:
            ipr.link("del", index=ipr.link_lookup(ifname="probe0")[0])


UPLINK_ADDRESS = "192.0.2.1"
ENCAPSULATIONS = {
    "vlan": VLAN_8021Q,
    "vxlan-group": Vxlan(),
    # A region-wide list: this node's own address in it is skipped.
    "vxlan-peers": Vxlan(group=None, peers=(UPLINK_ADDRESS, "192.0.2.2", "192.0.2.3")),
}


def add_uplink(ns: str, *, address: str | None = UPLINK_ADDRESS) -> int:
    index = add_veth(ns, "uplink0", "uplink0-peer")
    if address is not None:
        with IPRoute(netns=ns, flags=0) as ipr:
            ipr.addr("add", index=index, address=address, prefixlen=24)
    return index


def flood_list(ns: str, name: str) -> set[str]:
    """The remote endpoints of a VXLAN device's all-zeros forwarding entries."""
    with IPRoute(netns=ns, flags=0) as ipr:
        index = ipr.link_lookup(ifname=name)[0]
        return {
            str(entry.get("dst"))
            for entry in ipr.fdb("dump", ifindex=index)
            if entry["ifindex"] == index and entry.get("lladdr") == "00:00:00:00:00:00"
        }


# --- names and validation -------------------------------------------------------------------


def test_names_are_deterministic_and_fit_ifnamsiz() -> None:
    alloc = "3f2b9a4e-0d6c-4f51-9a57-2f1f6b7e8c90"
    assert bridge_name(alloc) == bridge_name(alloc)
    assert bridge_name(alloc) != bridge_name(alloc + "x")
    names = [bridge_name(alloc), vlan_name(alloc), *tap_names(alloc, 100)]
    assert all(len(n) <= 15 for n in names)
    assert len(set(names)) == len(names)
    assert bridge_name(alloc).startswith("gcbr-")
    with pytest.raises(InvalidNetworkSpec, match="tap count"):
        tap_names(alloc, 101)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (AllocationNetworkSpec("a1", gateway_cidr="10.0.0.300/24"), "not an address/prefix"),
        (AllocationNetworkSpec("a1", gateway_cidr="10.0.0.1"), "needs a prefix length"),
        (AllocationNetworkSpec("a1", gateway_cidr="10.0.0.0/24"), "network address"),
        (AllocationNetworkSpec("a1", uplink="eth0", vlan_id=4095), "VLAN id must be 1..4094"),
        (AllocationNetworkSpec("a1", uplink="eth0"), "uplink and vlan_id go together"),
        (AllocationNetworkSpec("a1", taps=("a-tap-name-too-long",)), "IFNAMSIZ"),
        (AllocationNetworkSpec("a1", taps=("t0", "t0")), "repeat"),
        (AllocationNetworkSpec("a1", uplink="x" * 16, vlan_id=5), "IFNAMSIZ"),
        (AllocationNetworkSpec("bad id/with slash"), "allocation id"),
    ],
)
def test_allocation_spec_validation(spec: AllocationNetworkSpec, message: str) -> None:
    with pytest.raises(InvalidNetworkSpec, match=message):
        spec.validate()


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        (RoceAssignment("enp28s0np0", "172.30.9.610/31"), "not an IPv4 CIDR"),
        (RoceAssignment("enp28s0np0", "172.30.9.61"), "needs a prefix length"),
        (RoceAssignment("enp28s0np0", "172.30.9.61/30"), "not a /31"),
        (RoceAssignment("enp28s0np0", "172.30.9.61/32"), "must be /31 or wider"),
        (RoceAssignment("enp28s0np0", "172.30.9.61/30", gateway="10.0.0.1"), "must be another"),
        (RoceAssignment("enp28s0np0", "fd00::1/127"), "not an IPv4 CIDR"),
        (RoceAssignment("enp28s0np0-much-too-long", "172.30.9.61/31"), "IFNAMSIZ"),
    ],
)
def test_roce_assignment_validation(assignment: RoceAssignment, message: str) -> None:
    with pytest.raises(InvalidNetworkSpec, match=message):
        assignment.validate()


def test_roce_peer_and_table_are_deterministic() -> None:
    assert str(RoceAssignment("enp28s0np0", "172.30.9.61/31").peer) == "172.30.9.60"
    assert str(RoceAssignment("enp28s0np0", "172.30.9.60/31").peer) == "172.30.9.61"
    assert str(RoceAssignment("e0", "10.1.0.5/30", gateway="10.1.0.6").peer) == "10.1.0.6"
    table = roce_table_id("enp28s0np0")
    assert table == roce_table_id("enp28s0np0")
    assert 20000 <= table < 30000
    assert table != roce_table_id("enp29s0np0")


def test_missing_namespace_is_an_error_not_created() -> None:
    name = f"gct-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(NamespaceNotFound, match=name):
        apply_allocation_network(AllocationNetworkSpec("a1"), netns=name)
    assert name not in netns.listnetns()


# --- allocation network ---------------------------------------------------------------------


def test_isolated_bridge_with_taps_apply_twice_then_remove(ns: str) -> None:
    alloc = "alloc-0001"
    taps = tap_names(alloc, 2)
    spec = AllocationNetworkSpec(alloc, taps=taps, gateway_cidr="10.77.0.1/24")
    before = dump_state(ns)

    first = apply_allocation_network(spec, netns=ns)
    br = spec.bridge
    assert {f"link:{br}", f"link:{taps[0]}", f"link:{taps[1]}", f"addr:10.77.0.1/24@{br}"} <= set(
        first.created
    )
    assert first.present == ()

    links = links_by_name(ns)
    assert links[br].get(("linkinfo", "kind")) == "bridge"
    for name in (br, *taps):
        assert links[name].get("ifalias") == f"gpucloud:alloc:{alloc}"
        assert links[name]["flags"] & IFF_UP
    for tap in taps:
        assert links[tap].get(("linkinfo", "kind")) == "tun"
        assert links[tap].get("master") == links[br]["index"]
    with IPRoute(netns=ns, flags=0) as ipr:
        addrs = [
            (a.get("address"), a["prefixlen"])
            for a in ipr.get_addr(index=links[br]["index"], family=socket.AF_INET)
        ]
    assert addrs == [("10.77.0.1", 24)]

    after_first = dump_state(ns)
    second = apply_allocation_network(spec, netns=ns)
    assert second.created == ()
    assert second.deleted == ()
    assert not second.changed
    assert set(second.present) == set(first.created)
    assert dump_state(ns) == after_first

    removed = remove_allocation_network(alloc, netns=ns)
    assert set(removed.deleted) == {
        f"link:{br}",
        f"link:{taps[0]}",
        f"link:{taps[1]}",
        f"addr:10.77.0.1/24@{br}",
    }
    assert dump_state(ns) == before
    assert remove_allocation_network(spec, netns=ns).deleted == ()


@pytest.mark.parametrize("encapsulation", ENCAPSULATIONS.values(), ids=list(ENCAPSULATIONS))
def test_vlan_backed_network_apply_twice_then_remove(
    ns: str, encapsulation: SegmentEncapsulation
) -> None:
    require_support(ns, encapsulation)
    uplink_index = add_uplink(ns)
    alloc = "alloc-vlan"
    spec = AllocationNetworkSpec(
        alloc,
        uplink="uplink0",
        vlan_id=142,
        taps=tap_names(alloc, 1),
        gateway_cidr="10.9.0.1/29",
        encapsulation=encapsulation,
    )
    before = dump_state(ns)

    first = apply_allocation_network(spec, netns=ns)
    assert spec.vlan is not None
    assert spec.vlan.startswith(f"gc{encapsulation.short}-")
    assert f"link:{spec.vlan}" in first.created
    links = links_by_name(ns)
    link = links[spec.vlan]
    assert link.get(("linkinfo", "kind")) == encapsulation.kind
    assert link.get("master") == links[spec.bridge]["index"]
    assert links["uplink0"].get("master") is None  # the uplink itself is never enslaved
    if isinstance(encapsulation, Vxlan):
        assert link.get(("linkinfo", "data", "vxlan_id")) == 142
        assert link.get(("linkinfo", "data", "vxlan_link")) == uplink_index
        assert link.get(("linkinfo", "data", "vxlan_local")) == UPLINK_ADDRESS
        assert link.get(("linkinfo", "data", "vxlan_group")) == encapsulation.group
        assert flood_list(ns, spec.vlan) == set(encapsulation.peers) - {UPLINK_ADDRESS}
        assert links[spec.bridge].get("mtu") == link.get("mtu") == 1500 - 50
    else:
        assert link.get(("linkinfo", "data", "vlan_id")) == 142
        assert link.get("link") == uplink_index

    after_first = dump_state(ns)
    assert not apply_allocation_network(spec, netns=ns).changed
    assert dump_state(ns) == after_first

    remove_allocation_network(alloc, netns=ns)
    assert dump_state(ns) == before


def test_vlan_network_requires_the_uplink(ns: str) -> None:
    spec = AllocationNetworkSpec("alloc-x", uplink="nosuch0", vlan_id=10)
    before = dump_state(ns)
    with pytest.raises(MissingInterface, match="nosuch0"):
        apply_allocation_network(spec, netns=ns)
    assert dump_state(ns) == before


def test_vxlan_needs_an_address_on_the_uplink_and_changes_nothing_without(ns: str) -> None:
    require_support(ns, Vxlan())
    add_uplink(ns, address=None)
    before = dump_state(ns)
    with pytest.raises(NetworkOperationFailed, match="no usable IPv4 address"):
        join_vlan_segment(VlanSegmentMember("a-1", 7, "uplink0", Vxlan()), netns=ns)
    with pytest.raises(NetworkOperationFailed, match="no usable IPv6 address"):
        apply_allocation_network(
            AllocationNetworkSpec(
                "a-1", uplink="uplink0", vlan_id=7, encapsulation=Vxlan(group="ff05::7")
            ),
            netns=ns,
        )
    assert dump_state(ns) == before


def test_vxlan_peers_converge_and_the_segment_goes_with_its_last_member(ns: str) -> None:
    require_support(ns, Vxlan())
    add_uplink(ns)
    before = dump_state(ns)
    first = Vxlan(group=None, peers=("192.0.2.2", "192.0.2.3"))
    join_vlan_segment(VlanSegmentMember("a-1", 7, "uplink0", first), netns=ns)
    name = "gcsvx-7"
    assert flood_list(ns, name) == {"192.0.2.2", "192.0.2.3"}
    index = links_by_name(ns)[name]["index"]

    # Another peer list: the entries follow, on the same device.
    later = Vxlan(group=None, peers=("192.0.2.3", "192.0.2.4", UPLINK_ADDRESS))
    changed = join_vlan_segment(VlanSegmentMember("a-2", 7, "uplink0", later), netns=ns)
    assert set(changed.deleted) == {f"flood:{name}->192.0.2.2"}
    assert f"flood:{name}->192.0.2.4" in changed.created
    assert flood_list(ns, name) == {"192.0.2.3", "192.0.2.4"}
    assert links_by_name(ns)[name]["index"] == index
    again = join_vlan_segment(VlanSegmentMember("a-2", 7, "uplink0", later), netns=ns)
    assert not again.changed

    remove_allocation_network("a-1", netns=ns)
    assert prune_vlan_segments(ns).deleted == ()  # a-2 is still on it
    remove_allocation_network("a-2", netns=ns)
    assert set(prune_vlan_segments(ns).deleted) == {f"link:{name}", "link:gcsbr-7"}
    assert dump_state(ns) == before


@pytest.mark.parametrize(
    ("encapsulation", "message"),
    [
        (Vxlan(group=None), "either a multicast group or a list of peers"),
        (Vxlan(peers=("10.0.0.2",)), "either a multicast group or a list of peers"),
        (Vxlan(group="10.0.0.1"), "not a multicast address"),
        (Vxlan(group=None, peers=("10.0.0.2", "fd00::2")), "mix IPv4 and IPv6"),
        (Vxlan(port=0), "1..65535"),
    ],
)
def test_vxlan_settings_are_validated(encapsulation: Vxlan, message: str) -> None:
    with pytest.raises(InvalidNetworkSpec, match=message):
        VlanSegmentMember("a-1", 7, "uplink0", encapsulation).validate()


def test_apply_converges_to_a_changed_spec(ns: str) -> None:
    alloc = "alloc-conv"
    two = tap_names(alloc, 2)
    apply_allocation_network(
        AllocationNetworkSpec(alloc, taps=two, gateway_cidr="10.1.0.1/24"), netns=ns
    )
    result = apply_allocation_network(
        AllocationNetworkSpec(alloc, taps=two[:1], gateway_cidr="10.2.0.1/24"), netns=ns
    )
    br = bridge_name(alloc)
    assert set(result.deleted) == {f"link:{two[1]}", f"addr:10.1.0.1/24@{br}"}
    assert f"addr:10.2.0.1/24@{br}" in result.created
    assert two[1] not in links_by_name(ns)


def test_remove_touches_only_its_own_allocation(ns: str) -> None:
    a = AllocationNetworkSpec("alloc-a", taps=tap_names("alloc-a", 1))
    b = AllocationNetworkSpec("alloc-b", taps=tap_names("alloc-b", 1))
    apply_allocation_network(a, netns=ns)
    with_a_only = dump_state(ns)
    apply_allocation_network(b, netns=ns)
    remove_allocation_network("alloc-b", netns=ns)
    assert dump_state(ns) == with_a_only
    assert a.bridge in links_by_name(ns)


def test_untagged_link_with_our_name_is_a_conflict(ns: str) -> None:
    spec = AllocationNetworkSpec("alloc-c")
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("add", ifname=spec.bridge, kind="bridge")
    before = dump_state(ns)
    with pytest.raises(NetworkConflict, match="not created for this allocation"):
        apply_allocation_network(spec, netns=ns)
    assert remove_allocation_network(spec, netns=ns).deleted == ()
    assert dump_state(ns) == before


# --- RoCE policy routing --------------------------------------------------------------------

SEED_ASSIGNMENTS = [
    RoceAssignment("enp28s0np0", "172.30.9.61/31"),
    RoceAssignment("enp29s0np0", "172.29.1.219/31"),
    RoceAssignment("enp62s0np0", "172.30.9.63/31"),
]


@pytest.fixture
def roce_ns(ns: str) -> str:
    for i, item in enumerate(SEED_ASSIGNMENTS):
        add_veth(ns, item.interface, f"roce-peer{i}")
    return ns


def test_roce_policy_apply_twice_then_remove(roce_ns: str) -> None:
    before = dump_state(roce_ns)

    first = apply_roce_policy(SEED_ASSIGNMENTS, netns=roce_ns)
    assert len(first.created) == 3 * 4  # address, two routes, one rule per interface
    links = links_by_name(roce_ns)
    with IPRoute(netns=roce_ns, flags=0) as ipr:
        for item in SEED_ASSIGNMENTS:
            index = links[item.interface]["index"]
            ip = str(item.address.ip)
            table = roce_table_id(item.interface)
            addrs = [(a.get("address"), a["prefixlen"]) for a in ipr.get_addr(index=index)]
            assert (ip, 31) in addrs
            rules = [r for r in ipr.get_rules(family=socket.AF_INET) if r.get("table") == table]
            assert [(r.get("src"), r["src_len"], r.get("priority")) for r in rules] == [
                (ip, 32, table)
            ]
            assert rules[0].get("protocol") == ROCE_PROTO
            routes = sorted(
                (
                    (r.get("dst"), r["dst_len"], r.get("gateway"), r.get("oif"), r.get("prefsrc"))
                    for r in ipr.get_routes(family=socket.AF_INET, table=table)
                    if r.get("table") == table
                ),
                key=repr,
            )
            network = item.address.network
            assert routes == sorted(
                [
                    (None, 0, str(item.peer), index, None),
                    (str(network.network_address), 31, None, index, ip),
                ],
                key=repr,
            )

    after_first = dump_state(roce_ns)
    second = apply_roce_policy(SEED_ASSIGNMENTS, netns=roce_ns)
    assert second.created == ()
    assert second.deleted == ()
    assert len(second.present) == len(first.created)
    assert dump_state(roce_ns) == after_first  # no duplicate rules, routes or addresses

    removed = remove_roce_policy(SEED_ASSIGNMENTS, netns=roce_ns)
    assert len(removed.deleted) == 3 * 4
    assert dump_state(roce_ns) == before
    assert remove_roce_policy(SEED_ASSIGNMENTS, netns=roce_ns).deleted == ()


def test_roce_reassignment_replaces_its_own_rule_and_routes(roce_ns: str) -> None:
    apply_roce_policy([RoceAssignment("enp28s0np0", "172.30.9.61/31")], netns=roce_ns)
    result = apply_roce_policy([RoceAssignment("enp28s0np0", "172.30.9.65/31")], netns=roce_ns)
    table = roce_table_id("enp28s0np0")
    assert any(d.startswith("rule:from 172.30.9.61/32") for d in result.deleted)
    assert sum(d.startswith("route:") for d in result.deleted) == 2, result.deleted
    with IPRoute(netns=roce_ns, flags=0) as ipr:
        rules = [r for r in ipr.get_rules(family=socket.AF_INET) if r.get("table") == table]
        assert [r.get("src") for r in rules] == ["172.30.9.65"]
        gateways = {
            r.get("gateway")
            for r in ipr.get_routes(family=socket.AF_INET, table=table)
            if r.get("table") == table
        }
        assert gateways == {None, "172.30.9.64"}


def test_roce_missing_interface_changes_nothing(roce_ns: str) -> None:
    before = dump_state(roce_ns)
    with pytest.raises(MissingInterface, match="enp99s0np0"):
        apply_roce_policy(
            [*SEED_ASSIGNMENTS, RoceAssignment("enp99s0np0", "172.30.9.71/31")], netns=roce_ns
        )
    assert dump_state(roce_ns) == before


def test_roce_duplicate_interface_is_rejected() -> None:
    with pytest.raises(InvalidNetworkSpec, match="assigned twice"):
        apply_roce_policy(
            [
                RoceAssignment("enp28s0np0", "172.30.9.61/31"),
                RoceAssignment("enp28s0np0", "172.30.9.63/31"),
            ],
            netns="unused-never-reached",
        )


def test_roce_address_held_elsewhere_is_a_conflict(roce_ns: str) -> None:
    with IPRoute(netns=roce_ns, flags=0) as ipr:
        index = ipr.link_lookup(ifname="enp29s0np0")[0]
        ipr.addr("add", index=index, address="172.30.9.61", prefixlen=31)
    with pytest.raises(NetworkConflict, match="another interface"):
        apply_roce_policy([RoceAssignment("enp28s0np0", "172.30.9.61/31")], netns=roce_ns)


def test_roce_remove_after_interface_vanished_still_removes_the_rule(roce_ns: str) -> None:
    item = RoceAssignment("enp62s0np0", "172.30.9.63/31")
    before_apply = dump_state(roce_ns)
    apply_roce_policy([item], netns=roce_ns)
    with IPRoute(netns=roce_ns, flags=0) as ipr:
        ipr.link("del", index=ipr.link_lookup(ifname="enp62s0np0")[0])
    removed = remove_roce_policy([item], netns=roce_ns)
    assert [d for d in removed.deleted if d.startswith("rule:")] == [
        f"rule:from 172.30.9.63 lookup {item.table} priority {item.priority}"
    ]
    expected = {
        k: [row for row in rows if "enp62s0np0" not in repr(row) and "roce-peer2" not in repr(row)]
        for k, rows in before_apply.items()
    }
    assert dump_state(roce_ns) == expected


def _ipv6_of(ns: str, name: str) -> list[tuple[str, int]]:
    with IPRoute(netns=ns, flags=0) as ipr:
        index = ipr.link_lookup(ifname=name)[0]
        return [
            (a.get("address"), a["scope"])
            for a in ipr.get_addr(index=index, family=socket.AF_INET6)
        ]


def test_taps_and_an_isolated_bridge_get_no_ipv6_address_unless_the_gateway_is_ipv6(
    ns: str,
) -> None:
    from pathlib import Path

    from tests.slice_vlan_rig import in_netns

    def disabled(name: str) -> str:
        path = Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6")  # read inside the namespace
        return in_netns(ns, lambda: path.read_text().strip())

    v4 = AllocationNetworkSpec("v4-only", taps=tap_names("v4-only", 2), gateway_cidr="10.7.0.1/24")
    apply_allocation_network(v4, netns=ns)
    for name in (v4.bridge, *v4.taps):
        assert links_by_name(ns)[name]["flags"] & IFF_UP
        assert _ipv6_of(ns, name) == [], name  # no link-local: the host is no IPv6 neighbour
        assert disabled(name) == "1", name
    v6 = AllocationNetworkSpec("v6-gw", taps=tap_names("v6-gw", 1), gateway_cidr="fd00:7::1/64")
    apply_allocation_network(v6, netns=ns)
    assert ("fd00:7::1", 0) in _ipv6_of(ns, v6.bridge)  # an IPv6 gateway keeps IPv6 on
    assert _ipv6_of(ns, v6.taps[0]) == []  # but never on a VM's tap
    remove_allocation_network("v4-only", netns=ns)
    remove_allocation_network("v6-gw", netns=ns)
