"""A GPU-slice allocation end to end on a real libvirt backend (the test:/// driver with a host
declaring its GPUs as PCI node devices): the gateway, the allocation workflow, a node agent
running LibvirtSliceBackend, and back to released with the domain gone."""

from __future__ import annotations

import hashlib
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest
from sqlalchemy import insert, select

from agent.backends import FixedAddressProbe
from agent.backends.domain_xml import parse_domain
from agent.backends.libvirt_slice import LibvirtSliceBackend
from contracts.states import NodeStatus
from schema.models import GpuSlot, Node
from tests.disk_images import write_base_image
from tests.factories import REGION, SLICE_SKU, create_sku
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import slice_request, wait_status

pytestmark = pytest.mark.usefixtures("control_plane")

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"
IMAGE = "ubuntu-22.04-cuda"  # the catalog's default image for the SKU


def host_gpus() -> list[tuple[str, int]]:
    """(PCI address, NUMA node) of every GPU the host XML declares."""
    gpus = []
    for device in ET.parse(HOST_XML).getroot().iter("device"):  # noqa: S314 - our own file
        cap = device.find("capability[@type='pci']")
        if cap is None or not (cap.findtext("class") or "").startswith("0x03"):
            continue
        address = (
            f"{int(cap.findtext('domain') or 0):04x}:{int(cap.findtext('bus') or 0):02x}:"
            f"{int(cap.findtext('slot') or 0):02x}.{int(cap.findtext('function') or 0)}"
        )
        numa = cap.find("numa")
        gpus.append((address, int(numa.get("node", "0")) if numa is not None else 0))
    return gpus


@pytest.fixture
def libvirt_host(tmp_path: Path) -> Iterator[tuple[Any, LibvirtSliceBackend]]:
    (tmp_path / "images").mkdir()
    content = write_base_image(tmp_path / "images" / IMAGE)
    conn = libvirt.open(f"test://{HOST_XML}")
    backend = LibvirtSliceBackend(
        f"test://{HOST_XML}",
        image_dir=tmp_path / "images",
        image_catalog={IMAGE: hashlib.sha256(content).hexdigest()},
        seed_dir=tmp_path / "seeds",
        state_dir=tmp_path / "state",
        readiness=FixedAddressProbe("10.20.0.5"),
        connection=conn,
        shutdown_timeout_s=5,
        poll_interval_s=0.05,
    )
    yield conn, backend
    conn.close()


async def test_slice_allocation_on_the_libvirt_backend(
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    libvirt_host: tuple[Any, LibvirtSliceBackend],
) -> None:
    conn, backend = libvirt_host
    gpus = host_gpus()
    assert len(gpus) == 8
    await create_sku(db_sessions)
    node_id = uuid.uuid4()
    async with db_sessions() as session, session.begin():
        session.add(
            Node(
                id=node_id,
                hostname="gpu-libvirt-test",
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
                    "node_id": node_id,
                    "gpu_index": i,
                    "numa_node": numa,
                    "pci_address": address,
                }
                for i, (address, numa) in enumerate(gpus)
            ],
        )
    await start_node_agent(node_id, host=backend)

    client = await api(token=await make_token("tenant", await make_project()))
    key = await client.post(
        "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
    )
    created = await client.post("/api/v1/allocations", json=slice_request(2, key.json()["id"]))
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(client, allocation_id, "active", timeout=60)
    assert active["connect_host"] == "10.20.0.5"

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
    final = await wait_status(client, allocation_id, "released", timeout=60)
    assert final["hard_stopped"] is False
    assert f"gpc-{allocation_id}" not in {d.name() for d in conn.listAllDomains()}
