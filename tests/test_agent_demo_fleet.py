"""The embedded default's fleet, seeded into the real PostgreSQL."""

from __future__ import annotations

import re

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from contracts.states import NodeStatus
from schema.models import GpuSlot, Node, Sku
from sim.demo_fleet import (
    BAREMETAL_SKU,
    DEMO_REGION,
    SLICE_SKU,
    build_fleet,
    demo_fleet,
    node_id_for,
    seed_demo_fleet,
    seed_fleet,
)

Sessions = async_sessionmaker[AsyncSession]


async def counts(sessions: Sessions) -> tuple[int, int, int]:
    async with sessions() as session:
        skus = await session.scalar(select(func.count()).select_from(Sku))
        nodes = await session.scalar(select(func.count()).select_from(Node))
        slots = await session.scalar(select(func.count()).select_from(GpuSlot))
    return skus or 0, nodes or 0, slots or 0


async def test_demo_fleet_is_seeded_once_however_often_it_runs(db_sessions: Sessions) -> None:
    for _ in range(2):
        async with db_sessions() as session:
            await seed_demo_fleet(session)
            await session.commit()
        assert await counts(db_sessions) == (2, 5, 40)

    async with db_sessions() as session:
        skus = {s.name: s for s in (await session.scalars(select(Sku))).all()}
        nodes = (await session.scalars(select(Node))).all()
        slots = (await session.scalars(select(GpuSlot))).all()
    assert skus[BAREMETAL_SKU].shape == "baremetal"
    assert skus[BAREMETAL_SKU].allowed_gpu_counts == [8]
    assert skus[SLICE_SKU].shape == "gpu_slice"
    assert skus[SLICE_SKU].allowed_gpu_counts == [1, 2, 4, 8]
    assert {s.region for s in skus.values()} == {DEMO_REGION}
    assert sorted(n.sku for n in nodes) == [BAREMETAL_SKU] * 2 + [SLICE_SKU] * 3
    for node in nodes:
        assert node.id == node_id_for(node.hostname)
        assert node.status == NodeStatus.ACTIVE
        assert node.gpu_count == 8
        assert [numa["gpus"] for numa in node.numa_layout] == [4, 4]
    assert all(s.status == "free" and s.allocation_id is None for s in slots)
    assert all(re.fullmatch(r"0000:[0-9a-f]{2}:00\.0", s.pci_address) for s in slots)
    per_numa = sorted((s.node_id, s.numa_node) for s in slots)
    assert all(per_numa.count(key) == 4 for key in set(per_numa))


async def test_reseeding_keeps_operational_state(db_sessions: Sessions) -> None:
    async with db_sessions() as session:
        await seed_demo_fleet(session)
        await session.commit()
    drained = demo_fleet().nodes_of(SLICE_SKU)[0].id
    async with db_sessions() as session:
        await session.execute(
            update(Node).where(Node.id == drained).values(status=NodeStatus.DRAINING.value)
        )
        await session.execute(
            update(GpuSlot).where(GpuSlot.node_id == drained).values(status="disabled")
        )
        await session.commit()

    async with db_sessions() as session:
        await seed_demo_fleet(session)
        await session.commit()

    async with db_sessions() as session:
        node = await session.get(Node, drained)
        statuses = set(
            (await session.scalars(select(GpuSlot.status).where(GpuSlot.node_id == drained))).all()
        )
    assert node is not None
    assert node.status == NodeStatus.DRAINING
    assert statuses == {"disabled"}


async def test_benchmark_fleets_of_any_size(db_sessions: Sessions) -> None:
    fleet = build_fleet(300, 8)
    assert len({n.id for n in fleet.nodes}) == 300
    async with db_sessions() as session:
        await seed_fleet(session, fleet)
        await seed_fleet(session, fleet)
        await session.commit()
    assert await counts(db_sessions) == (1, 300, 2400)
    odd = build_fleet(2, 6, numa_nodes=4, hostname_prefix="odd")
    assert [s.numa_node for s in odd.nodes[0].slots] == [0, 0, 1, 1, 2, 2]
    assert odd.skus[0].allowed_gpu_counts == (1, 2, 4)
