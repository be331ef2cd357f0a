"""Slice networks isolated for real, in network namespaces on the real kernel: the agent's network
code (agent/network, through SliceNetworks as the libvirt backend calls it) builds each node's
slice networks; stand-in VMs plug into the bridges it answers. Two allocations of one project
share an L2 segment (on one node, and across nodes through the uplink's VLAN); VMs of two
projects never exchange a single frame. End to end, the control plane assigns the VLANs: the
allocations go through the API and the workflow to agents running the libvirt slice backend.

Cross-node cases need 802.1Q sub-interfaces (CONFIG_VLAN_8021Q) and are skipped on a kernel
without them; the one-node cases run everywhere.
"""

from __future__ import annotations

import asyncio
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
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.network import (
    InvalidNetworkSpec,
    VlanSegmentMember,
    bridge_name,
    dump_state,
    segment_bridge_name,
    segment_member_name,
    segment_tag,
    segment_vlan_name,
)
from agent.network.slice_networks import SliceNetworks
from contracts.states import NodeStatus
from schema.models import GpuSlot, Node, ProjectSliceVlan
from tests.factories import REGION, SLICE_SKU, create_sku
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import slice_request, wait_status
from tests.slice_vlan_rig import (
    Rig,
    Vm,
    frames_from,
    index_of,
    isolated,
    links_of,
    reaches,
    vlan_supported,
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


def test_a_projects_segment_spans_nodes_over_its_uplink_vlan(rig: Rig) -> None:
    switch = rig.switch()
    n1, n2 = rig.namespace("n1"), rig.namespace("n2")
    require_vlans(n1)
    rig.uplink(n1, switch)
    rig.uplink(n2, switch)
    before = {n1: dump_state(n1), n2: dump_state(n2)}
    net1 = SliceNetworks(uplink="uplink0", netns=n1)
    net2 = SliceNetworks(uplink="uplink0", netns=n2)

    p_a = rig.vm(n1, net1.prepare("p-a", 100), "10.77.0.11")
    p_b = rig.vm(n2, net2.prepare("p-b", 100), "10.77.0.12")
    p_c = rig.vm(n1, net1.prepare("p-c", 100), "10.77.0.13")
    q_x = rig.vm(n1, net1.prepare("q-x", 101), "10.77.0.21")
    q_y = rig.vm(n2, net2.prepare("q-y", 101), "10.77.0.22")

    links = links_of(n1)
    vlan = links[segment_vlan_name(100)]
    assert vlan.get(("linkinfo", "data", "vlan_id")) == 100
    assert vlan.get("link") == links["uplink0"]["index"]
    assert vlan.get("master") == links[segment_bridge_name(100)]["index"]
    assert links["uplink0"].get("master") is None  # the uplink itself is never enslaved

    assert reaches(p_a, p_b)  # across nodes
    assert reaches(p_b, p_c)
    assert reaches(p_a, p_c)  # on one node
    assert reaches(q_x, q_y)
    for p in (p_a, p_b, p_c):
        for q in (q_x, q_y):
            assert isolated(p, q), (p.name, q.name)

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


# --- end to end: the control plane assigns the VLANs -----------------------------------------


class LibvirtNode:
    """A node of the e2e fleet: its namespace, its libvirt slice backend (test driver) whose
    slice networks live in that namespace."""

    def __init__(self, tmp_path: Path, ns: str, uplink: str | None) -> None:
        self.ns = ns
        self.id = uuid.uuid4()
        images = tmp_path / "images"
        images.mkdir(parents=True)
        content = b"QFI\xfb" + b"\0" * 4092
        (images / IMAGE).write_bytes(content)
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
            networks=SliceNetworks(uplink=uplink, netns=ns),
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
async def test_the_control_plane_puts_each_project_on_its_own_vlan_end_to_end(
    rig: Rig,
    tmp_path: Path,
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
) -> None:
    # pyroute2 runs its own event loop: every rig step goes to a thread, as the agent's do.
    switch = await asyncio.to_thread(rig.switch)
    namespaces = [await asyncio.to_thread(rig.namespace, role) for role in ("n1", "n2")]
    spans_nodes = await asyncio.to_thread(vlan_supported, namespaces[0])
    if spans_nodes:
        for ns in namespaces:
            await asyncio.to_thread(rig.uplink, ns, switch)
    nodes = [
        LibvirtNode(tmp_path / ns, ns, "uplink0" if spans_nodes else None) for ns in namespaces
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
        if spans_nodes:  # one project, two nodes, through the switch
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
