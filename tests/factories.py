"""Factories for catalog, fleet and tenant rows: tests describe the world they need in one line."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from activities.billing.ledger import EntryKind, post_entry
from contracts.states import NodeStatus, SkuShape
from schema.models import GpuSlot, Node, Project, Sku

REGION = "test-region-1"
SLICE_SKU = "h100.slice"
BAREMETAL_SKU = "h100.8x.baremetal"


@dataclass
class FleetNode:
    id: uuid.UUID
    hostname: str
    gpu_count: int


async def create_sku(
    sessions: async_sessionmaker[AsyncSession],
    name: str = SLICE_SKU,
    *,
    shape: SkuShape = SkuShape.GPU_SLICE,
    region: str = REGION,
    allowed: tuple[int, ...] = (1, 2, 4, 8),
) -> None:
    async with sessions() as session, session.begin():
        session.add(
            Sku(
                name=name,
                region=region,
                shape=shape,
                gpu_model="NVIDIA H100 80GB HBM3",
                allowed_gpu_counts=list(allowed),
                price_per_gpu_hour_minor=250,
            )
        )


async def create_node(
    sessions: async_sessionmaker[AsyncSession],
    *,
    sku: str = SLICE_SKU,
    region: str = REGION,
    gpus: int = 8,
    numa_nodes: int = 2,
    status: NodeStatus = NodeStatus.ACTIVE,
    hostname: str | None = None,
) -> FleetNode:
    node_id = uuid.uuid4()
    hostname = hostname or f"gpu-{node_id.hex[:8]}"
    per_numa = max(1, gpus // numa_nodes)
    async with sessions() as session, session.begin():
        session.add(
            Node(
                id=node_id,
                hostname=hostname,
                region=region,
                sku=sku,
                status=status,
                gpu_count=gpus,
                numa_layout=[
                    {"numa_node": n, "gpus": per_numa, "cpus": f"{n * 48}-{n * 48 + 47}"}
                    for n in range(numa_nodes)
                ],
                host_address=f"192.0.2.{node_id.int % 250 + 1}",
            )
        )
        await session.flush()
        if gpus:
            await session.execute(
                insert(GpuSlot),
                [
                    {
                        "id": uuid.uuid4(),
                        "node_id": node_id,
                        "gpu_index": i,
                        "numa_node": min(i // per_numa, numa_nodes - 1),
                        "pci_address": f"0000:{0x17 + i * 0x10:02x}:00.0",
                    }
                    for i in range(gpus)
                ],
            )
    return FleetNode(node_id, hostname, gpus)


# What a test project starts with: enough for any test's usage. A project that was never
# credited is depleted and cannot allocate (docs/lifecycles/balance.md).
STARTING_CREDIT_MINOR = 10_000_000


async def fund_project(
    sessions: async_sessionmaker[AsyncSession], project_id: uuid.UUID, amount_minor: int
) -> None:
    """Credit the project as production does (a ledger posting, which recomputes the account's
    state); nothing for 0."""
    if amount_minor <= 0:
        return
    async with sessions() as session, session.begin():
        await post_entry(
            session,
            project_id=project_id,
            amount_minor=amount_minor,
            kind=EntryKind.ADMIN_CREDIT,
            idempotency_key=f"test-starting-credit-{project_id}",
            description="test: starting credit",
        )


async def create_project(
    sessions: async_sessionmaker[AsyncSession],
    name: str | None = None,
    *,
    credit_minor: int = STARTING_CREDIT_MINOR,
) -> uuid.UUID:
    project_id = uuid.uuid4()
    async with sessions() as session, session.begin():
        session.add(Project(id=project_id, name=name or f"project-{project_id.hex[:8]}"))
    await fund_project(sessions, project_id, credit_minor)
    return project_id
