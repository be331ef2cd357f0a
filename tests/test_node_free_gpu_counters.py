"""Each node's free-GPU counters (nodes.free_gpus, nodes.free_gpus_by_numa), kept by triggers on
gpu_slots, against a recount of the slots themselves: after every kind of slot change, under
concurrent releases on one node, and when migration 0013 backfills an existing fleet."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest
from alembic import command
from sqlalchemy import delete, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from contracts.states import SlotStatus
from devstack.postgres import PostgresCluster
from schema.db import create_engine
from schema.migrate import alembic_config, upgrade
from schema.models import GpuSlot, Node
from tests.factories import create_node

Sessions = async_sessionmaker[AsyncSession]


async def _counters(engine: AsyncEngine) -> dict[uuid.UUID, tuple[int, dict[int, int]]]:
    """Every node's counters, the per-NUMA array read as {numa node: free} without zeros; the
    generated largest-per-NUMA-node column is checked against that array on the way."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id, free_gpus, array_lower(free_gpus_by_numa, 1), free_gpus_by_numa, "
                "free_gpus_one_numa FROM nodes"
            )
        )
        counters = {}
        for node_id, free, lower, by_numa, one_numa in rows:
            # NULL gaps and zeros alike: no free slot on that NUMA node.
            numa = {(lower or 0) + i: n for i, n in enumerate(by_numa or []) if n}
            assert one_numa == max(numa.values(), default=0), node_id
            counters[node_id] = (free, numa)
        return counters


async def _recount(engine: AsyncEngine) -> dict[uuid.UUID, tuple[int, dict[int, int]]]:
    async with engine.connect() as conn:
        nodes = (await conn.execute(select(Node.id))).scalars().all()
        free = Counter(
            (node_id, numa)
            for node_id, numa in await conn.execute(
                select(GpuSlot.node_id, GpuSlot.numa_node).where(GpuSlot.status == SlotStatus.FREE)
            )
        )
    recount = {}
    for node_id in nodes:
        numa = {n: c for (owner, n), c in free.items() if owner == node_id}
        recount[node_id] = (sum(numa.values()), numa)
    return recount


async def _assert_counted(engine: AsyncEngine) -> None:
    assert await _counters(engine) == await _recount(engine)


async def _slots(sessions: Sessions, node_id: uuid.UUID) -> list[GpuSlot]:
    async with sessions() as session:
        rows = await session.scalars(
            select(GpuSlot).where(GpuSlot.node_id == node_id).order_by(GpuSlot.gpu_index)
        )
        return list(rows)


async def _set(sessions: Sessions, slot_ids: list[uuid.UUID], **values: object) -> None:
    async with sessions() as session, session.begin():
        await session.execute(update(GpuSlot).where(GpuSlot.id.in_(slot_ids)).values(**values))


async def test_counters_follow_every_kind_of_slot_change(
    db_engine: AsyncEngine, db_sessions: Sessions
) -> None:
    one = await create_node(db_sessions, gpus=8, numa_nodes=2)
    other = await create_node(db_sessions, gpus=4, numa_nodes=1)
    empty = await create_node(db_sessions, gpus=0)
    counters = await _counters(db_engine)
    assert counters[one.id] == (8, {0: 4, 1: 4})
    assert counters[other.id] == (4, {0: 4})
    assert counters[empty.id] == (0, {})

    slots = await _slots(db_sessions, one.id)
    allocation_id = uuid.uuid4()
    # Reserved, then one of them quarantined, then the rest freed: what a release does.
    await _set(
        db_sessions,
        [s.id for s in slots[:3]],
        status=SlotStatus.RESERVED,
        allocation_id=allocation_id,
    )
    assert (await _counters(db_engine))[one.id] == (5, {0: 1, 1: 4})
    await _set(db_sessions, [slots[0].id], status=SlotStatus.DISABLED, allocation_id=None)
    await _set(db_sessions, [s.id for s in slots[1:3]], status=SlotStatus.FREE, allocation_id=None)
    assert (await _counters(db_engine))[one.id] == (7, {0: 3, 1: 4})
    # Changes that leave the status alone change nothing; a disabled slot returned to service
    # counts again.
    await _set(db_sessions, [s.id for s in slots], quarantine_reason=None)
    await _set(db_sessions, [slots[0].id], status=SlotStatus.FREE)
    await _assert_counted(db_engine)

    # A free slot moved to another NUMA node, and one moved to another node.
    await _set(db_sessions, [slots[7].id], numa_node=0)
    assert (await _counters(db_engine))[one.id] == (8, {0: 5, 1: 3})
    await _set(db_sessions, [slots[6].id], node_id=other.id, gpu_index=99)
    counters = await _counters(db_engine)
    assert counters[one.id] == (7, {0: 5, 1: 2})
    assert counters[other.id] == (5, {0: 4, 1: 1})

    # Slots deleted, free or not.
    await _set(db_sessions, [slots[1].id], status=SlotStatus.DISABLED)
    async with db_sessions() as session, session.begin():
        await session.execute(delete(GpuSlot).where(GpuSlot.id.in_([slots[1].id, slots[2].id])))
    assert (await _counters(db_engine))[one.id] == (5, {0: 3, 1: 2})
    await _assert_counted(db_engine)


async def test_concurrent_releases_on_one_node_lose_no_count(
    db_engine: AsyncEngine, db_sessions: Sessions
) -> None:
    node = await create_node(db_sessions, gpus=8, numa_nodes=2)
    slots = await _slots(db_sessions, node.id)
    owners = [uuid.uuid4() for _ in slots]
    for slot, owner in zip(slots, owners, strict=True):
        await _set(db_sessions, [slot.id], status=SlotStatus.RESERVED, allocation_id=owner)
    assert (await _counters(db_engine))[node.id] == (0, {})

    # Eight releases at once, each in its own transaction that holds its slot's lock for a
    # moment before it commits, so that they queue on the node's row.
    async def release(owner: uuid.UUID) -> None:
        async with db_sessions() as session, session.begin():
            await session.execute(
                update(GpuSlot)
                .where(GpuSlot.allocation_id == owner)
                .values(status=SlotStatus.FREE, allocation_id=None)
            )
            await asyncio.sleep(0.05)

    await asyncio.gather(*(release(owner) for owner in owners))
    assert (await _counters(db_engine))[node.id] == (8, {0: 4, 1: 4})


@pytest.fixture
def scratch_database(pg_cluster: PostgresCluster) -> str:
    pg_cluster.create_database("gpucloud_counters", recreate=True)
    return pg_cluster.url("gpucloud_counters")


async def test_migration_backfills_an_existing_fleet(scratch_database: str) -> None:
    await asyncio.to_thread(upgrade, scratch_database, "0012")
    engine = create_engine(scratch_database, pool_size=1, max_overflow=0)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO nodes (id, hostname, region, sku, status, gpu_count) VALUES "
                    "('00000000-0000-0000-0000-000000000001', 'a', 'r', 's', 'active', 4), "
                    "('00000000-0000-0000-0000-000000000002', 'b', 'r', 's', 'active', 2)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO gpu_slots (id, node_id, gpu_index, numa_node, pci_address, status)"
                    " SELECT gen_random_uuid(), '00000000-0000-0000-0000-000000000001', i, i / 2,"
                    " 'pci-' || i, CASE WHEN i = 0 THEN 'disabled' ELSE 'free' END"
                    " FROM generate_series(0, 3) AS i"
                )
            )
        await asyncio.to_thread(upgrade, scratch_database)
        counters = await _counters(engine)
        assert counters[uuid.UUID(int=1)] == (3, {0: 1, 1: 2})
        assert counters[uuid.UUID(int=2)] == (0, {})
        await _assert_counted(engine)

        # Down and up again: the downgrade removes all of it, the upgrade counts afresh.
        await engine.dispose()
        await asyncio.to_thread(command.downgrade, alembic_config(scratch_database), "0012")
        async with engine.connect() as conn:
            columns = await conn.scalars(
                text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'nodes' AND column_name LIKE 'free_gpus%'"
                )
            )
            assert list(columns) == []
        await asyncio.to_thread(upgrade, scratch_database)
        await _assert_counted(engine)
    finally:
        await engine.dispose()
