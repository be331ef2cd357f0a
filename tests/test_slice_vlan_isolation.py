"""Slice networks isolated for real, in network namespaces on the real kernel: the agent's network
code (agent/network, through SliceNetworks as the libvirt backend calls it) builds each node's
slice networks; stand-in VMs plug into the bridges it answers. Two allocations of one project
share an L2 segment (on one node, and across nodes over the uplink); VMs of two projects never
exchange a single frame. End to end, the control plane assigns the VLANs: the allocations go
through the API and the workflow to agents running the libvirt slice backend.

Cross-node cases run once per segment encapsulation, each node's slice networks built from the
agent config keys that ask for it (`[libvirt] uplink`, `segment_encapsulation`, `vxlan_*`):
802.1Q ("vlan": the switch trunks the tagged frames; skipped on a kernel without
CONFIG_VLAN_8021Q), VXLAN to a multicast group and VXLAN to static peers (the nodes' uplinks
have addresses on one underlay subnet; skipped on a kernel without CONFIG_VXLAN). The one-node
cases run everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest
from pyroute2 import IPRoute
from sqlalchemy import insert, select

from agent.backends import FixedAddressProbe
from agent.backends.from_config import slice_networks_from_config
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.config_file import ConfigError, read_agent_config, table
from agent.network import (
    VLAN_8021Q,
    InvalidNetworkSpec,
    VlanSegmentMember,
    Vxlan,
    bridge_name,
    dump_state,
    segment_bridge_name,
    segment_link_name,
    segment_member_name,
    segment_tag,
    segment_vlan_name,
)
from agent.network.slice_networks import SliceNetworks
from contracts.states import NodeStatus
from schema.models import GpuSlot, Node, ProjectSliceVlan
from tests.disk_images import write_base_image
from tests.factories import REGION, SLICE_SKU, create_sku
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import slice_request, wait_status
from tests.slice_vlan_rig import (
    Rig,
    Vm,
    drain,
    frames_from,
    index_of,
    isolated,
    links_of,
    reaches,
    vlan_supported,
    vxlan_frames,
    vxlan_supported,
)
from tests.test_allocation_libvirt_e2e import HOST_XML, IMAGE, host_gpus


@pytest.fixture
def rig(host_untouched: None) -> Iterator[Rig]:
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_SYS_ADMIN)")
    made = Rig()
    try:
        yield made
    finally:
        made.close()


def require_vlans(ns: str) -> None:
    if not vlan_supported(ns):
        pytest.skip("this kernel has no 802.1Q VLAN support (CONFIG_VLAN_8021Q unset)")


def require_vxlan(ns: str) -> None:
    if not vxlan_supported(ns):
        pytest.skip("this kernel has no VXLAN support (CONFIG_VXLAN unset)")


# The nodes' uplink addresses on the underlay (the rig's switch), and the agent config lines of
# each way a segment crosses it, besides `uplink = "uplink0"`.
UNDERLAY = ("192.0.2.1", "192.0.2.2")
FABRICS = {
    "vlan": "",  # the default
    "vxlan-group": 'segment_encapsulation = "vxlan"\n',
    "vxlan-peers": (
        'segment_encapsulation = "vxlan"\n'
        f"vxlan_peers = [{', '.join(f'{address!r}' for address in UNDERLAY)}]\n"
    ),
}


def require_fabric(ns: str, fabric: str) -> None:
    if fabric == "vlan":
        require_vlans(ns)
    else:
        require_vxlan(ns)


def agent_networks(tmp_path: Path, fabric: str, ns: str) -> SliceNetworks:
    """The slice networks of an agent whose agent.toml asks for `fabric` over uplink0, as the
    production agent builds them from its config, working in the node's namespace (the one
    thing the rig adds: a real node's agent works in its host's)."""
    path = tmp_path / ns / "agent.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[libvirt]\nuplink = "uplink0"\n{FABRICS[fabric]}')
    networks = slice_networks_from_config(table(read_agent_config(path), "libvirt"))
    assert networks is not None
    return dataclasses.replace(networks, netns=ns)


def delete_link(ns: str, name: str) -> None:
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("del", index=index_of(ipr, name))


# --- the agent's network code, one node ------------------------------------------------------


def test_one_projects_allocations_share_a_segment_and_other_projects_never_do(rig: Rig) -> None:
    node = rig.namespace("n1")
    before = dump_state(node)
    nets = SliceNetworks(netns=node)  # no uplink: the segments stay on this node

    p1, p2 = nets.prepare("p-one", 100), nets.prepare("p-two", 100)
    q1 = nets.prepare("q-one", 101)
    assert p1 == p2 == segment_bridge_name(100)
    assert q1 == segment_bridge_name(101)
    links = links_of(node)
    for alloc, bridge in (("p-one", p1), ("p-two", p2), ("q-one", q1)):
        member = links[segment_member_name(alloc)]
        assert member.get("master") == links[bridge]["index"]
        assert member.get("ifalias") == f"gpucloud:alloc:{alloc}"
    assert links[p1].get("ifalias") == segment_tag(100)
    assert bridge_name("p-one") not in links  # no per-allocation bridge with a VLAN

    vm_p1 = rig.vm(node, p1, "10.77.0.11")
    vm_p2 = rig.vm(node, p2, "10.77.0.12")
    vm_q1 = rig.vm(node, q1, "10.77.0.21")
    assert reaches(vm_p1, vm_p2)
    assert frames_from(vm_p2, vm_p1), "the capture sees what the peer sends"
    assert isolated(vm_p1, vm_q1)
    assert isolated(vm_p2, vm_q1)

    # Releasing one of the project's allocations leaves the segment to the other.
    rig.unplug(vm_p1, node)
    assert nets.remove("p-one") == 1  # its member only
    assert p1 in links_of(node)
    rig.unplug(vm_p2, node)
    assert nets.remove("p-two") == 2  # its member, then the segment's bridge
    assert p1 not in links_of(node)
    assert q1 in links_of(node)
    rig.unplug(vm_q1, node)
    nets.remove("q-one")
    assert nets.remove("q-one") == 0
    assert dump_state(node) == before


def test_without_a_vlan_an_allocation_keeps_an_isolated_bridge(rig: Rig) -> None:
    node = rig.namespace("n1")
    before = dump_state(node)
    nets = SliceNetworks(uplink="uplink0", netns=node)  # the uplink is not used without a VLAN
    a, b = nets.prepare("a-1", None), nets.prepare("b-1", None)
    assert (a, b) == (bridge_name("a-1"), bridge_name("b-1"))
    vm_a = rig.vm(node, a, "10.77.0.11")
    vm_b = rig.vm(node, b, "10.77.0.12")
    assert isolated(vm_a, vm_b)
    rig.unplug(vm_a, node)
    rig.unplug(vm_b, node)
    nets.remove("a-1")
    nets.remove("b-1")
    assert dump_state(node) == before


def test_a_crash_between_steps_is_finished_by_the_next_call(rig: Rig) -> None:
    node = rig.namespace("n1")
    before = dump_state(node)
    nets = SliceNetworks(netns=node)
    bridge = nets.prepare("p-a", 100)
    member = segment_member_name("p-a")

    # A provision that crashed after making the segment, before its member: the retry adds it.
    delete_link(node, member)
    assert nets.prepare("p-a", 100) == bridge
    links = links_of(node)
    assert links[member].get("master") == links[bridge]["index"]

    # A release that crashed after deleting the member, before the segment: the retry (or any
    # later release on the node) deletes the segment nothing uses.
    delete_link(node, member)
    assert nets.remove("p-a") == 1
    assert dump_state(node) == before

    # An allocation moved to another VLAN (or none) leaves its old segment.
    nets.prepare("p-a", 100)
    assert nets.prepare("p-a", 102) == segment_bridge_name(102)
    assert segment_bridge_name(100) not in links_of(node)
    assert nets.prepare("p-a", None) == bridge_name("p-a")
    assert segment_bridge_name(102) not in links_of(node)
    nets.remove("p-a")
    assert dump_state(node) == before


def test_a_segment_in_use_by_a_vm_nic_is_never_pruned(rig: Rig) -> None:
    node = rig.namespace("n1")
    nets = SliceNetworks(netns=node)
    bridge = nets.prepare("p-a", 100)
    vm = rig.vm(node, bridge, "10.77.0.11")
    # The allocation's member is gone, but a NIC is still on the bridge: it stays.
    assert nets.remove("p-a") == 1
    assert bridge in links_of(node)
    rig.unplug(vm, node)
    assert nets.remove("p-a") == 1
    assert bridge not in links_of(node)


def test_concurrent_provisions_and_releases_never_pull_a_segment_from_under_a_member(
    rig: Rig,
) -> None:
    node = rig.namespace("n1")
    before = dump_state(node)
    nets = SliceNetworks(netns=node)
    failures: list[BaseException] = []

    def churn(i: int) -> None:
        alloc = f"p-{i}"
        try:
            for _ in range(12):
                bridge = nets.prepare(alloc, 100)
                links = links_of(node)  # read without the lock: nothing may have removed it
                assert links[segment_member_name(alloc)].get("master") == links[bridge]["index"]
                nets.remove(alloc)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    assert dump_state(node) == before


def test_vlan_ids_are_validated() -> None:
    with pytest.raises(InvalidNetworkSpec, match=r"1\.\.4094"):
        VlanSegmentMember("a-1", 4095).validate()
    with pytest.raises(InvalidNetworkSpec, match=r"1\.\.4094"):
        segment_bridge_name(0)
    names = [segment_bridge_name(4094), segment_vlan_name(4094), segment_member_name("x" * 128)]
    assert all(len(name) <= 15 for name in names)


# --- the agent's network code, two nodes on a switch -----------------------------------------


@pytest.mark.parametrize("fabric", list(FABRICS))
def test_a_projects_segment_spans_nodes_over_its_uplink(
    rig: Rig, tmp_path: Path, fabric: str
) -> None:
    switch = rig.switch()
    n1, n2 = rig.namespace("n1"), rig.namespace("n2")
    require_fabric(n1, fabric)
    rig.uplink(n1, switch, address=UNDERLAY[0])
    wire = rig.capture(switch, rig.uplink(n2, switch, address=UNDERLAY[1]))  # n2's cable
    before = {n1: dump_state(n1), n2: dump_state(n2)}
    net1, net2 = agent_networks(tmp_path, fabric, n1), agent_networks(tmp_path, fabric, n2)
    encapsulation = net1.encapsulation

    p_a = rig.vm(n1, net1.prepare("p-a", 100), "10.77.0.11")
    p_b = rig.vm(n2, net2.prepare("p-b", 100), "10.77.0.12")
    p_c = rig.vm(n1, net1.prepare("p-c", 100), "10.77.0.13")
    q_x = rig.vm(n1, net1.prepare("q-x", 101), "10.77.0.21")
    q_y = rig.vm(n2, net2.prepare("q-y", 101), "10.77.0.22")

    links = links_of(n1)
    uplink, bridge = links["uplink0"], links[segment_bridge_name(100)]
    link = links[segment_link_name(100, encapsulation)]
    assert link.get(("linkinfo", "kind")) == encapsulation.kind
    assert link.get("ifalias") == segment_tag(100)
    assert link.get("master") == bridge["index"]
    assert uplink.get("master") is None  # the uplink itself is never enslaved
    if isinstance(encapsulation, Vxlan):
        data = dict(link.get(("linkinfo", "data"))["attrs"])
        assert data["IFLA_VXLAN_ID"] == 100  # VNI = the segment's id
        assert data["IFLA_VXLAN_LINK"] == uplink["index"]
        assert data["IFLA_VXLAN_LOCAL"] == UNDERLAY[0]
        assert data["IFLA_VXLAN_PORT"] == 4789
        assert data.get("IFLA_VXLAN_GROUP") == ("239.1.1.1" if fabric == "vxlan-group" else None)
        # The segment keeps what VXLAN leaves of the uplink's MTU; the VMs' NICs take it.
        assert bridge.get("mtu") == link.get("mtu") == uplink.get("mtu") - 50 == p_a.mtu
    else:
        assert link.get(("linkinfo", "data", "vlan_id")) == 100
        assert link.get("link") == uplink["index"]
        assert bridge.get("mtu") == uplink.get("mtu")

    assert reaches(p_a, p_b)  # across nodes
    assert reaches(p_a, p_b, full_size=True)  # frames filling the segment's MTU cross too
    assert reaches(p_b, p_c)
    assert reaches(p_a, p_c)  # on one node
    assert reaches(q_x, q_y)
    for p in (p_a, p_b, p_c):
        for q in (q_x, q_y):
            assert isolated(p, q), (p.name, q.name)

    if isinstance(encapsulation, Vxlan):
        # On the underlay, the VMs' frames travel only inside VXLAN, each in its segment's VNI.
        frames = drain(wire)
        segment_of = {vm.mac: 100 for vm in (p_a, p_b, p_c)} | {vm.mac: 101 for vm in (q_x, q_y)}
        assert not [frame for frame in frames if frame[6:12].hex(":") in segment_of]
        carried = [
            (vni, segment_of[inner[6:12].hex(":")])
            for vni, inner in vxlan_frames(frames)
            if inner[6:12].hex(":") in segment_of
        ]
        assert {vni for vni, _ in carried} == {100, 101}
        assert all(vni == segment for vni, segment in carried), carried
    # The segment's own links carry no host address (no IPv6 link-local to reach the node by).
    bridge_name, link_name = segment_bridge_name(100), segment_link_name(100, encapsulation)
    for node, name in ((n1, bridge_name), (n1, link_name), (n2, bridge_name), (n2, link_name)):
        with IPRoute(netns=node, flags=0) as ipr:
            assert ipr.get_addr(index=index_of(ipr, name)) == (), (node, name)

    for vm, nets, node, alloc in (
        (p_a, net1, n1, "p-a"),
        (p_b, net2, n2, "p-b"),
        (p_c, net1, n1, "p-c"),
        (q_x, net1, n1, "q-x"),
        (q_y, net2, n2, "q-y"),
    ):
        rig.unplug(vm, node)
        nets.remove(alloc)
    assert {n1: dump_state(n1), n2: dump_state(n2)} == before


def test_a_segments_uplink_link_follows_the_agent_config(rig: Rig) -> None:
    """A join converges the segment's link over the uplink to the node's configuration: another
    group or peers replace the VXLAN device, an uplink no longer configured drops it; the
    segment's bridge and the VMs on it stay."""
    node = rig.namespace("n1")
    require_vxlan(node)
    before = dump_state(node)
    with IPRoute(netns=node, flags=0) as ipr:
        ipr.link("add", ifname="uplink0", kind="veth", peer="uplink0-peer")
        ipr.link("set", index=index_of(ipr, "uplink0"), state="up")
        ipr.addr("add", index=index_of(ipr, "uplink0"), address=UNDERLAY[0], prefixlen=24)
    group = SliceNetworks(uplink="uplink0", netns=node, encapsulation=Vxlan())
    bridge = group.prepare("p-a", 100)
    vm = rig.vm(node, bridge, "10.77.0.11")
    name = segment_link_name(100, group.encapsulation)
    first = links_of(node)[name]

    other = dataclasses.replace(group, encapsulation=Vxlan(group="239.1.1.2"))
    other.prepare("p-b", 100)
    links = links_of(node)
    assert links[name]["index"] != first["index"]  # replaced
    assert links[name].get(("linkinfo", "data", "vxlan_group")) == "239.1.1.2"
    assert links[name].get("master") == links[bridge]["index"]

    peers = dataclasses.replace(group, encapsulation=Vxlan(group=None, peers=UNDERLAY))
    peers.prepare("p-c", 100)
    assert links_of(node)[name].get(("linkinfo", "data", "vxlan_group")) is None

    local = SliceNetworks(netns=node)  # the uplink left the config: the segment stays local
    local.prepare("p-d", 100)
    links = links_of(node)
    assert name not in links
    assert links[vm.host_end].get("master") == links[bridge]["index"]

    rig.unplug(vm, node)
    for alloc in ("p-a", "p-b", "p-c", "p-d"):
        local.remove(alloc)
    with IPRoute(netns=node, flags=0) as ipr:
        ipr.link("del", index=index_of(ipr, "uplink0"))
    assert dump_state(node) == before


# --- the agent config that picks the encapsulation -------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", SliceNetworks(uplink="uplink0", encapsulation=VLAN_8021Q)),
        ('segment_encapsulation = "vlan"\n', SliceNetworks(uplink="uplink0")),
        (
            'segment_encapsulation = "vxlan"\n',
            SliceNetworks(uplink="uplink0", encapsulation=Vxlan()),
        ),
        (
            'segment_encapsulation = "vxlan"\nvxlan_group = "ff05::100"\nvxlan_port = 8472\n',
            SliceNetworks(uplink="uplink0", encapsulation=Vxlan(group="ff05::100", port=8472)),
        ),
        (
            'segment_encapsulation = "vxlan"\nvxlan_peers = ["10.0.0.6", "10.0.0.7"]\n',
            SliceNetworks(
                uplink="uplink0",
                encapsulation=Vxlan(group=None, peers=("10.0.0.6", "10.0.0.7")),
            ),
        ),
    ],
)
def test_the_agent_config_picks_the_segment_encapsulation(
    tmp_path: Path, body: str, expected: SliceNetworks
) -> None:
    (tmp_path / "agent.toml").write_text(f'[libvirt]\nuplink = "uplink0"\n{body}')
    section = table(read_agent_config(tmp_path / "agent.toml"), "libvirt")
    assert slice_networks_from_config(section) == expected


VX = 'uplink = "u0"\nsegment_encapsulation = "vxlan"\n'


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ('uplink = "u0"\nsegment_encapsulation = "gre"\n', "must be one of vlan, vxlan"),
        ('segment_encapsulation = "vxlan"\n', "needs uplink"),
        ('uplink = "u0"\nvxlan_group = "239.1.1.1"\n', "need segment_encapsulation = 'vxlan'"),
        (VX + 'vxlan_group = "10.0.0.1"\n', "multicast"),
        (VX + "vxlan_port = 0\n", "1..65535"),
        (VX + "vxlan_peers = []\n", "non-empty"),
        (VX + 'vxlan_peers = ["10.0.0.1", "fd00::1"]\n', "one family"),
        (VX + 'vxlan_peers = ["239.1.1.1"]\n', "unicast"),
        (VX + 'vxlan_group = "239.1.1.1"\nvxlan_peers = ["10.0.0.1"]\n', "exclude each other"),
    ],
)
def test_bad_encapsulation_config_is_refused_clearly(
    tmp_path: Path, body: str, complaint: str
) -> None:
    (tmp_path / "agent.toml").write_text(f"[libvirt]\n{body}")
    section = table(read_agent_config(tmp_path / "agent.toml"), "libvirt")
    with pytest.raises(ConfigError) as err:
        slice_networks_from_config(section)
    assert str(err.value).startswith("[libvirt] ")
    assert complaint in str(err.value)


# --- end to end: the control plane assigns the VLANs -----------------------------------------


class LibvirtNode:
    """A node of the e2e fleet: its namespace, its libvirt slice backend (test driver) whose
    slice networks (from the agent config keys, see `agent_networks`) live in that namespace."""

    def __init__(self, tmp_path: Path, ns: str, networks: SliceNetworks) -> None:
        self.ns = ns
        self.id = uuid.uuid4()
        images = tmp_path / "images"
        images.mkdir(parents=True)
        content = write_base_image(images / IMAGE)
        self.conn = libvirt.open(f"test://{HOST_XML}")
        self.backend = LibvirtSliceBackend(
            f"test://{HOST_XML}",
            image_dir=images,
            image_catalog={IMAGE: hashlib.sha256(content).hexdigest()},
            seed_dir=tmp_path / "seeds",
            state_dir=tmp_path / "state",
            readiness=FixedAddressProbe("10.20.0.5"),
            connection=self.conn,
            shutdown_timeout_s=5,
            poll_interval_s=0.05,
            networks=networks,
        )

    def bridge_of(self, allocation_id: str) -> str:
        """The bridge libvirt plugged the domain's NIC into (from the domain XML)."""
        xml = self.conn.lookupByName(f"gpc-{allocation_id}").XMLDesc(0)
        marker = "<source bridge='"
        start = xml.index(marker) + len(marker)
        return str(xml[start : xml.index("'", start)])


async def add_node(db_sessions: Any, node: LibvirtNode, hostname: str) -> None:
    gpus = host_gpus()
    async with db_sessions() as session, session.begin():
        session.add(
            Node(
                id=node.id,
                hostname=hostname,
                region=REGION,
                sku=SLICE_SKU,
                status=NodeStatus.ACTIVE,
                gpu_count=len(gpus),
            )
        )
        await session.flush()
        await session.execute(
            insert(GpuSlot),
            [
                {
                    "id": uuid.uuid4(),
                    "node_id": node.id,
                    "gpu_index": i,
                    "numa_node": numa,
                    "pci_address": address,
                }
                for i, (address, numa) in enumerate(gpus)
            ],
        )


@pytest.mark.usefixtures("control_plane")
@pytest.mark.parametrize("fabric", ["vlan", "vxlan-group"])
async def test_the_control_plane_puts_each_project_on_its_own_vlan_end_to_end(
    rig: Rig,
    tmp_path: Path,
    fabric: str,
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
) -> None:
    # pyroute2 runs its own event loop: every rig step goes to a thread, as the agent's do.
    switch = await asyncio.to_thread(rig.switch)
    namespaces = [await asyncio.to_thread(rig.namespace, role) for role in ("n1", "n2")]
    await asyncio.to_thread(require_fabric, namespaces[0], fabric)
    for ns, address in zip(namespaces, UNDERLAY, strict=True):
        await asyncio.to_thread(rig.uplink, ns, switch, address=address)
    nodes = [
        LibvirtNode(tmp_path / ns, ns, agent_networks(tmp_path, fabric, ns)) for ns in namespaces
    ]
    try:
        await create_sku(db_sessions)
        for i, node in enumerate(nodes):
            await add_node(db_sessions, node, f"gpu-vlan-{i}")
            await start_node_agent(node.id, host=node.backend)
        by_id = {str(node.id): node for node in nodes}

        async def tenant() -> tuple[Any, uuid.UUID, str]:
            project = await make_project()
            client = await api(token=await make_token("tenant", project))
            key = await client.post(
                "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
            )
            return client, project.id, key.json()["id"]

        (p_client, p_project, p_key), (q_client, q_project, q_key) = await tenant(), await tenant()

        async def allocate(client: Any, key: str, gpus: int) -> tuple[str, LibvirtNode]:
            created = await client.post("/api/v1/allocations", json=slice_request(gpus, key))
            assert created.status_code == 201, created.text
            body = created.json()
            await wait_status(client, body["allocation_id"], "active", timeout=60)
            return body["allocation_id"], by_id[body["node_id"]]

        # Best-fit placement: P's two 4-GPU slices fill one node, Q's and P's third the other.
        p_one, p_two = await allocate(p_client, p_key, 4), await allocate(p_client, p_key, 4)
        q_one = await allocate(q_client, q_key, 4)
        p_three = await allocate(p_client, p_key, 2)
        assert p_one[1] is p_two[1]
        assert q_one[1] is p_three[1]
        assert p_one[1] is not q_one[1]

        async with db_sessions() as session:
            rows = await session.execute(
                select(ProjectSliceVlan.project_id, ProjectSliceVlan.vlan_id)
            )
            vlans = {project_id: vid for project_id, vid in rows}
        assert set(vlans) == {p_project, q_project}
        assert vlans[p_project] != vlans[q_project]

        async def vm(allocation: tuple[str, LibvirtNode], ip: str) -> Vm:
            allocation_id, node = allocation
            return await asyncio.to_thread(rig.vm, node.ns, node.bridge_of(allocation_id), ip)

        bridges = {a[0]: a[1].bridge_of(a[0]) for a in (p_one, p_two, q_one, p_three)}
        assert bridges[p_one[0]] == bridges[p_two[0]] == segment_bridge_name(vlans[p_project])
        assert bridges[p_three[0]] == segment_bridge_name(vlans[p_project])
        assert bridges[q_one[0]] == segment_bridge_name(vlans[q_project])

        vm_p1, vm_p2 = await vm(p_one, "10.77.0.11"), await vm(p_two, "10.77.0.12")
        vm_q1, vm_p3 = await vm(q_one, "10.77.0.21"), await vm(p_three, "10.77.0.13")
        assert await asyncio.to_thread(reaches, vm_p1, vm_p2)  # one project, one node
        # One project, two nodes, through the switch.
        assert await asyncio.to_thread(reaches, vm_p1, vm_p3)
        assert await asyncio.to_thread(reaches, vm_p2, vm_p3)
        for p in (vm_p1, vm_p2, vm_p3):
            assert await asyncio.to_thread(isolated, p, vm_q1), (p.name, vm_q1.name)

        for (allocation_id, node), client, guest in (
            (p_one, p_client, vm_p1),
            (p_two, p_client, vm_p2),
            (q_one, q_client, vm_q1),
            (p_three, p_client, vm_p3),
        ):
            await asyncio.to_thread(rig.unplug, guest, node.ns)  # the NIC goes with the domain
            released = await client.post(f"/api/v1/allocations/{allocation_id}/release")
            assert released.status_code == 202, released.text
            await wait_status(client, allocation_id, "released", timeout=60)
        async with db_sessions() as session:
            assert (await session.scalars(select(ProjectSliceVlan))).all() == []
        for node in nodes:
            names = await asyncio.to_thread(links_of, node.ns)
            left = [n for n in names if n.startswith(("gcs", "gcbr"))]
            assert left == [], left
    finally:
        for node in nodes:
            node.conn.close()
