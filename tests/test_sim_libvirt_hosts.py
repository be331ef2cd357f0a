"""Libvirt-test hosts (sim/libvirt_hosts.py, `sim.fleet --hosts libvirt-test`): the generated host
opens with libvirt's test driver and shows the node's GPUs; NodeHostBackend routes slice and
bare-metal work; and allocations of both shapes run end to end on a node built from the demo
fleet's PCI addresses and NUMA layout."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest
from sqlalchemy import select

from agent.backend import HostError, ProvisionOutcome, ReleaseOutcome
from agent.backends.composite import NodeHostBackend
from agent.backends.domain_xml import parse_domain, parse_numa_topology, parse_pci_nodedev
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput
from contracts.states import SkuShape
from schema.models import GpuSlot
from sim.demo_fleet import Fleet, NodeSpec, build_node, image_sha256_for, seed_fleet
from sim.fleet import AgentNode, LibvirtTestHosts
from sim.libvirt_hosts import (
    DEFAULT_IMAGE,
    GpuPlacement,
    LibvirtTestHost,
    build_libvirt_test_host,
    guest_address,
    numa_cells,
)
from tests.factories import BAREMETAL_SKU, REGION, SLICE_SKU, create_sku
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import baremetal_request, slice_request, wait_status

NO_PROGRESS: Any = None  # the backends under test never report progress here


def demo_node(sku: str = SLICE_SKU) -> NodeSpec:
    return build_node(f"gpu-{uuid.uuid4().hex[:8]}.libvirt.test", sku=sku, region=REGION)


def placements(node: NodeSpec) -> list[GpuPlacement]:
    return [GpuPlacement(s.pci_address, s.numa_node) for s in node.slots]


@pytest.fixture
def demo_host(tmp_path: Path) -> Iterator[tuple[NodeSpec, LibvirtTestHost]]:
    node = demo_node()
    host = build_libvirt_test_host(
        str(node.id), placements(node), tmp_path, numa_layout=node.numa_layout
    )
    yield node, host
    host.close()


# ------------------------------------------------------------------ the generated host


def test_generated_host_lists_the_nodes_gpus_with_their_numa_nodes(
    demo_host: tuple[NodeSpec, LibvirtTestHost],
) -> None:
    node, host = demo_host
    assert host.xml_path == host.directory / "host.xml"
    conn = libvirt.open(host.uri)  # a second, independent connection to the generated file
    try:
        devices = {}
        for dev in conn.listAllDevices(0):
            parsed = parse_pci_nodedev(dev.XMLDesc(0))
            devices[str(parsed.address)] = parsed
        assert sorted(devices) == sorted(s.pci_address for s in node.slots)
        for slot in node.slots:
            device = devices[slot.pci_address]
            assert device.numa_node == slot.numa_node
            assert device.device_class == "0x030200"
        cpu_count = conn.getInfo()[2]
        assert cpu_count == 112  # the demo layout: cpus 0-55 and 56-111
    finally:
        conn.close()
    topology = parse_numa_topology(host.xml_path.read_text())
    assert topology == {0: tuple(range(56)), 1: tuple(range(56, 112))}
    assert host.slice_backend.numa_topology() == topology


def test_default_layout_and_files(tmp_path: Path) -> None:
    gpus = [GpuPlacement("0000:17:00.0", 0), GpuPlacement("0000:3d:00.0", 2)]
    cells = numa_cells([], gpus)
    assert [c.id for c in cells] == [0, 1, 2]  # two by default, more for a GPU on cell 2
    assert all(len(c.cpus) == 16 for c in cells)
    host = build_libvirt_test_host("node-a", gpus, tmp_path)
    try:
        assert host.directory == tmp_path.resolve() / "node-a"
        for name in ("passwd", "group", "shadow", "gshadow"):
            assert (host.directory / "root" / "etc" / name).is_file()
        image = host.directory / "images" / DEFAULT_IMAGE
        assert image.is_file()
        assert host.slice_backend.images.catalog[DEFAULT_IMAGE] == image_sha256_for(DEFAULT_IMAGE)
        assert host.slice_backend.readiness.wait_reachable(None, 1, NO_PROGRESS) == guest_address(
            "node-a"
        )
        assert guest_address("node-a") == guest_address("node-a") != guest_address("node-b")
        assert guest_address("node-a").startswith("10.")
    finally:
        host.close()


# ------------------------------------------------------------------ NodeHostBackend


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Any) -> ProvisionOutcome:
        self.calls.append("provision_slice_vm")
        return ProvisionOutcome("slice-host")

    def release_slice_vm(self, spec: HostReleaseInput, progress: Any) -> ReleaseOutcome:
        self.calls.append("release_slice_vm")
        return ReleaseOutcome(True, False, True, True)

    def provision_baremetal_user(self, spec: HostProvisionInput, progress: Any) -> ProvisionOutcome:
        self.calls.append("provision_baremetal_user")
        return ProvisionOutcome("bm-host")

    def deprovision_baremetal_user(self, spec: HostReleaseInput, progress: Any) -> ReleaseOutcome:
        self.calls.append("deprovision_baremetal_user")
        return ReleaseOutcome(True, False, True, True)


def _provision(shape: str) -> HostProvisionInput:
    return HostProvisionInput("t", "a", "n", shape, "tenant", [])


def _release(shape: str) -> HostReleaseInput:
    return HostReleaseInput("t", "a", "n", shape, "tenant")


def test_node_host_backend_routes_each_shape() -> None:
    slices, metal = _Recorder(), _Recorder()
    backend = NodeHostBackend(slice=slices, baremetal=metal)
    slice_outcome = backend.provision_slice_vm(_provision("gpu_slice"), NO_PROGRESS)
    assert slice_outcome.connect_host == "slice-host"
    backend.release_slice_vm(_release("gpu_slice"), NO_PROGRESS)
    metal_outcome = backend.provision_baremetal_user(_provision("baremetal"), NO_PROGRESS)
    assert metal_outcome.connect_host == "bm-host"
    backend.deprovision_baremetal_user(_release("baremetal"), NO_PROGRESS)
    assert slices.calls == ["provision_slice_vm", "release_slice_vm"]
    assert metal.calls == ["provision_baremetal_user", "deprovision_baremetal_user"]


def test_node_host_backend_refuses_what_it_does_not_serve() -> None:
    only_slices = NodeHostBackend(slice=_Recorder())
    only_metal = NodeHostBackend(baremetal=_Recorder())
    calls = [
        lambda: only_slices.provision_baremetal_user(_provision("baremetal"), NO_PROGRESS),
        lambda: only_slices.deprovision_baremetal_user(_release("baremetal"), NO_PROGRESS),
        lambda: only_metal.provision_slice_vm(_provision("gpu_slice"), NO_PROGRESS),
        lambda: only_metal.release_slice_vm(_release("gpu_slice"), NO_PROGRESS),
    ]
    for call in calls:
        with pytest.raises(HostError) as caught:
            call()
        assert caught.value.error_type == HostErrorType.INVALID_SPEC
        assert "not served on this node" in caught.value.message


# ------------------------------------------------------------------ end to end


async def _seed_node(db_sessions: Any, node: NodeSpec) -> None:
    async with db_sessions() as session, session.begin():
        await seed_fleet(session, Fleet(skus=(), nodes=(node,)))


@pytest.fixture
def libvirt_hosts(tmp_path: Path) -> Iterator[LibvirtTestHosts]:
    hosts = LibvirtTestHosts(tmp_path / "libvirt-hosts")
    yield hosts
    hosts.close()


async def _start(
    db_sessions: Any, start_node_agent: Any, hosts: LibvirtTestHosts, node: NodeSpec
) -> LibvirtTestHost:
    async with db_sessions() as session:
        await hosts.load(session, [str(node.id)])
    assert [g.pci_address for g in hosts.hardware[str(node.id)].gpus] == [
        s.pci_address for s in node.slots
    ]
    services = hosts(AgentNode(str(node.id), node.hostname))
    await start_node_agent(node.id, host=services.host)
    return hosts.hosts[str(node.id)]


@pytest.mark.usefixtures("control_plane")
async def test_slice_allocation_on_a_generated_libvirt_host(
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    libvirt_hosts: LibvirtTestHosts,
) -> None:
    await create_sku(db_sessions)
    node = demo_node()
    await _seed_node(db_sessions, node)
    host = await _start(db_sessions, start_node_agent, libvirt_hosts, node)
    conn = host.connection

    client = await api(token=await make_token("tenant", await make_project()))
    key = await client.post(
        "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
    )
    created = await client.post("/api/v1/allocations", json=slice_request(2, key.json()["id"]))
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(client, allocation_id, "active", timeout=60)
    assert active["connect_host"] == guest_address(str(node.id))

    async with db_sessions() as session:
        reserved = (
            await session.execute(
                select(GpuSlot.pci_address, GpuSlot.numa_node).where(
                    GpuSlot.allocation_id == uuid.UUID(allocation_id)
                )
            )
        ).all()
    domain = conn.lookupByName(f"gpc-{allocation_id}")
    assert domain.isActive()
    parsed = parse_domain(domain.XMLDesc(0))
    assert sorted(str(h) for h in parsed.hostdevs) == sorted(address for address, _ in reserved)
    assert parsed.numa_nodeset == str(reserved[0][1])

    released = await client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202
    await wait_status(client, allocation_id, "released", timeout=60)
    assert f"gpc-{allocation_id}" not in {d.name() for d in conn.listAllDomains()}


@pytest.mark.usefixtures("control_plane")
async def test_baremetal_allocation_on_a_generated_libvirt_host(
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    libvirt_hosts: LibvirtTestHosts,
) -> None:
    await create_sku(db_sessions, BAREMETAL_SKU, shape=SkuShape.BAREMETAL, allowed=(8,))
    node = demo_node(BAREMETAL_SKU)
    await _seed_node(db_sessions, node)
    host = await _start(db_sessions, start_node_agent, libvirt_hosts, node)
    passwd = host.system_root.host_path("/etc/passwd")
    public_key = ed25519_public_key()

    def tenant_users() -> list[list[str]]:
        rows = [line.split(":") for line in passwd.read_text().splitlines() if line]
        return [r for r in rows if r[0] != "root"]

    client = await api(token=await make_token("tenant", await make_project()))
    key = await client.post("/api/v1/ssh-keys", json={"name": "k", "public_key": public_key})
    created = await client.post("/api/v1/allocations", json=baremetal_request(key.json()["id"]))
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(client, allocation_id, "active", timeout=60)
    assert active["connect_host"] == guest_address(str(node.id))

    users = tenant_users()
    assert len(users) == 1
    assert allocation_id in users[0][4]  # the GECOS tag names the allocation
    username, home = users[0][0], users[0][5]
    keys = host.system_root.host_path(f"{home}/.ssh/authorized_keys")
    assert keys.read_text().split() == public_key.split()

    released = await client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202
    await wait_status(client, allocation_id, "released", timeout=60)
    assert tenant_users() == []
    assert not host.system_root.host_path(home).exists()
    assert [name for name, _ in host.sessions.calls] == [username]
    assert host.scrubber.scrubs == 1
