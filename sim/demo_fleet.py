"""The embedded default's catalog and fleet, as data, and one idempotent way to put it (or any
generated fleet) into the database.

Demo (region us-east-1):
  h100.8x.baremetal  bare metal, 8 GPUs       on 2 nodes of 8 GPUs
  h100.slice         GPU slice, 1/2/4/8 GPUs  on 3 nodes of 8 GPUs (2 NUMA nodes x 4 GPUs)

Node and slot ids are uuid5 of the hostname (and GPU index), so the agents started from the same
data (sim.fleet) and the database agree without coordination.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import NodeStatus, SkuShape, SlotStatus
from schema.models import GpuSlot, Node, Sku

FLEET_NAMESPACE = uuid.UUID("6f1d2c7e-3b9a-5e44-9a51-0c6c9d1e7a20")
DEMO_REGION = "us-east-1"
BAREMETAL_SKU = "h100.8x.baremetal"
SLICE_SKU = "h100.slice"
GPU_MODEL = "NVIDIA H100 80GB HBM3"
DEMO_IMAGE = "ubuntu-22.04-cuda-12.4"

_ROWS_PER_STATEMENT = 1000  # keeps each INSERT well under PostgreSQL's 32767 bind parameters


@dataclass(frozen=True)
class SkuSpec:
    name: str
    region: str
    shape: SkuShape
    allowed_gpu_counts: tuple[int, ...]
    gpu_model: str = GPU_MODEL
    price_per_gpu_hour_minor: int = 249
    vcpus_per_gpu: int = 8
    memory_mb_per_gpu: int = 65536
    image: str = DEMO_IMAGE
    image_sha256: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "region": self.region,
            "shape": self.shape.value,
            "gpu_model": self.gpu_model,
            "allowed_gpu_counts": list(self.allowed_gpu_counts),
            "price_per_gpu_hour_minor": self.price_per_gpu_hour_minor,
            "vcpus_per_gpu": self.vcpus_per_gpu,
            "memory_mb_per_gpu": self.memory_mb_per_gpu,
            "image": self.image,
            "image_sha256": self.image_sha256 or image_sha256_for(self.image),
            "active": True,
        }


@dataclass(frozen=True)
class SlotSpec:
    id: uuid.UUID
    gpu_index: int
    numa_node: int
    pci_address: str


@dataclass(frozen=True)
class NodeSpec:
    id: uuid.UUID
    hostname: str
    region: str
    sku: str
    numa_layout: tuple[dict[str, Any], ...]
    slots: tuple[SlotSpec, ...]

    @property
    def gpu_count(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class Fleet:
    skus: tuple[SkuSpec, ...]
    nodes: tuple[NodeSpec, ...]

    def nodes_of(self, sku: str) -> list[NodeSpec]:
        return [n for n in self.nodes if n.sku == sku]


def image_sha256_for(image: str) -> str:
    """A stand-in digest for a simulated image (stable, so the catalog is too)."""
    return hashlib.sha256(f"gpucloud-sim-image:{image}".encode()).hexdigest()


def node_id_for(hostname: str) -> uuid.UUID:
    return uuid.uuid5(FLEET_NAMESPACE, hostname)


def pci_address_for(gpu_index: int) -> str:
    """HGX-like bus numbers, 0000:17:00.0 first; past eight GPUs the device number grows."""
    bus = 0x17 + (gpu_index % 8) * 0x1A
    return f"0000:{bus:02x}:{gpu_index // 8:02x}.0"


def build_node(
    hostname: str, *, sku: str, region: str, gpus: int = 8, numa_nodes: int = 2
) -> NodeSpec:
    if gpus < 1 or numa_nodes < 1:
        raise ValueError("a node needs at least one GPU and one NUMA node")
    node_id = node_id_for(hostname)
    per_numa = math.ceil(gpus / numa_nodes)
    cores_per_numa = 56
    slots = tuple(
        SlotSpec(
            id=uuid.uuid5(node_id, f"gpu-{index}"),
            gpu_index=index,
            numa_node=index // per_numa,
            pci_address=pci_address_for(index),
        )
        for index in range(gpus)
    )
    layout = tuple(
        {
            "numa_node": numa,
            "cpus": f"{numa * cores_per_numa}-{(numa + 1) * cores_per_numa - 1}",
            "memory_mb": 1024 * 1024,
            "gpus": sum(1 for s in slots if s.numa_node == numa),
        }
        for numa in range(numa_nodes)
    )
    return NodeSpec(node_id, hostname, region, sku, layout, slots)


def build_fleet(
    nodes: int,
    gpus_per_node: int = 8,
    *,
    shape: SkuShape = SkuShape.GPU_SLICE,
    sku: str | None = None,
    region: str = DEMO_REGION,
    numa_nodes: int = 2,
    hostname_prefix: str = "bench",
) -> Fleet:
    """A fleet of any size with one SKU, for benchmarks: `nodes` nodes of `gpus_per_node` GPUs."""
    sku_name = sku or (SLICE_SKU if shape == SkuShape.GPU_SLICE else BAREMETAL_SKU)
    if shape == SkuShape.GPU_SLICE:
        counts = tuple(c for c in (1, 2, 4, 8, 16) if c <= gpus_per_node)
    else:
        counts = (gpus_per_node,)
    width = max(3, len(str(nodes)))
    return Fleet(
        skus=(SkuSpec(sku_name, region, shape, counts),),
        nodes=tuple(
            build_node(
                f"{hostname_prefix}-{i:0{width}d}.{region}.sim",
                sku=sku_name,
                region=region,
                gpus=gpus_per_node,
                numa_nodes=numa_nodes,
            )
            for i in range(1, nodes + 1)
        ),
    )


def demo_fleet() -> Fleet:
    baremetal = [
        build_node(f"h100-bm-{i:02d}.{DEMO_REGION}.demo", sku=BAREMETAL_SKU, region=DEMO_REGION)
        for i in (1, 2)
    ]
    slices = [
        build_node(f"h100-slice-{i:02d}.{DEMO_REGION}.demo", sku=SLICE_SKU, region=DEMO_REGION)
        for i in (1, 2, 3)
    ]
    return Fleet(
        skus=(
            SkuSpec(
                BAREMETAL_SKU,
                DEMO_REGION,
                SkuShape.BAREMETAL,
                (8,),
                price_per_gpu_hour_minor=229,
                vcpus_per_gpu=28,
                memory_mb_per_gpu=262144,
            ),
            SkuSpec(SLICE_SKU, DEMO_REGION, SkuShape.GPU_SLICE, (1, 2, 4, 8)),
        ),
        nodes=(*baremetal, *slices),
    )


def _chunks(rows: Sequence[dict[str, Any]]) -> Iterable[Sequence[dict[str, Any]]]:
    for start in range(0, len(rows), _ROWS_PER_STATEMENT):
        yield rows[start : start + _ROWS_PER_STATEMENT]


async def seed_fleet(session: AsyncSession, fleet: Fleet) -> None:
    """Upsert the fleet in the caller's transaction (the caller commits).

    Catalog rows and a node's static facts are refreshed; a node's status and a slot's status and
    owner are only set when the row is new, so re-seeding a running stack never frees a reserved
    GPU or re-activates a drained node.
    """
    sku_rows = [s.row() for s in fleet.skus]
    if sku_rows:
        stmt = insert(Sku).values(sku_rows)
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[Sku.name, Sku.region],
                set_={c: stmt.excluded[c] for c in sku_rows[0] if c not in ("name", "region")},
            )
        )
    node_rows = [
        {
            "id": n.id,
            "hostname": n.hostname,
            "region": n.region,
            "sku": n.sku,
            "status": NodeStatus.ACTIVE.value,
            "gpu_count": n.gpu_count,
            "numa_layout": list(n.numa_layout),
        }
        for n in fleet.nodes
    ]
    for chunk in _chunks(node_rows):
        stmt = insert(Node).values(list(chunk))
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[Node.id],
                set_={
                    c: stmt.excluded[c]
                    for c in ("hostname", "region", "sku", "gpu_count", "numa_layout")
                },
            )
        )
    slot_rows = [
        {
            "id": s.id,
            "node_id": n.id,
            "gpu_index": s.gpu_index,
            "numa_node": s.numa_node,
            "pci_address": s.pci_address,
            "status": SlotStatus.FREE.value,
        }
        for n in fleet.nodes
        for s in n.slots
    ]
    for chunk in _chunks(slot_rows):
        await session.execute(insert(GpuSlot).values(list(chunk)).on_conflict_do_nothing())


async def seed_demo_fleet(session: AsyncSession) -> Fleet:
    """Upsert the demo catalog and fleet (idempotent; the caller commits)."""
    fleet = demo_fleet()
    await seed_fleet(session, fleet)
    return fleet
