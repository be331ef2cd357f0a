"""Placement alone, by fleet size: the `allocation.place` activity called directly (no Temporal,
no gateway) against a private PostgreSQL, one-GPU slice requests until the fleet is half full.

    .venv/bin/python -m bench.placement [--nodes 150 600 2400] [--concurrency 1]

For each fleet size (a fresh database each, 8 GPUs on 2 NUMA nodes per node, analyzed as a
running system's autovacuum would have), it prints the wall time per placement (p50/p99), and
the CPU per placement of PostgreSQL (all its processes) and of this process (asyncpg and the
activity's Python). Placement's ranking reads one counter row per node, so its cost should grow
far slower than the fleet; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from sqlalchemy import insert, text

from activities.allocations import AllocationActivities
from activities.billing.ledger import EntryKind, post_entry
from bench.stack import cpu_seconds, private_postgres
from contracts.allocation_activities import PlaceInput
from schema.db import create_engine, session_factory
from schema.migrate import upgrade
from schema.models import Project
from sim.demo_fleet import SLICE_SKU, build_fleet, seed_fleet

REGION = "bench-placement"


def _request(project_id: uuid.UUID) -> PlaceInput:
    allocation_id = str(uuid.uuid4())
    return PlaceInput(
        allocation_id=allocation_id,
        project_id=str(project_id),
        sku=SLICE_SKU,
        gpus=1,
        region=REGION,
        ssh_key_ids=[],
        idempotency_key=None,
        workflow_id=f"allocation-{allocation_id}",
        provision_task_id=str(uuid.uuid4()),
    )


async def measure(url: str, nodes: int, concurrency: int) -> str:
    engine = create_engine(url, pool_size=concurrency + 1, max_overflow=0)
    try:
        async with session_factory(engine)() as session, session.begin():
            await seed_fleet(session, build_fleet(nodes, region=REGION))
            project_id = uuid.uuid4()
            await session.execute(insert(Project).values(id=project_id, name="bench"))
            # A project that was never credited is depleted, and placement refuses it.
            await post_entry(
                session,
                project_id=project_id,
                amount_minor=10**12,
                kind=EntryKind.ADMIN_CREDIT,
                idempotency_key=f"bench:{project_id}",
            )
        async with engine.connect() as connection:
            await connection.execute(text("ANALYZE"))
        activities = AllocationActivities(engine)
        # Warm the pool's connections and their prepared statements; not counted.
        await asyncio.gather(*(activities.place(_request(project_id)) for _ in range(concurrency)))

        placements = nodes * 8 // 2
        pending = iter(range(placements))
        walls: list[float] = []

        async def placer() -> None:
            for _ in pending:
                started = time.perf_counter()
                await activities.place(_request(project_id))
                walls.append(time.perf_counter() - started)

        cpu_before = cpu_seconds({})
        started = time.perf_counter()
        await asyncio.gather(*(placer() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu_after = cpu_seconds({})
    finally:
        await engine.dispose()
    per = {name: (cpu_after[name] - cpu_before[name]) / placements * 1000 for name in cpu_after}
    walls.sort()
    return (
        f"{nodes:5d} nodes, {placements:5d} placements: "
        f"{placements / elapsed:6.0f}/s, wall p50 {statistics.median(walls) * 1000:.2f} ms "
        f"p99 {walls[int(len(walls) * 0.99)] * 1000:.2f} ms; CPU per placement: "
        f"PostgreSQL {per['postgres']:.2f} ms, this process {per['bench-client']:.2f} ms"
    )


async def main_async(sizes: list[int], concurrency: int) -> None:
    print(f"one-GPU slice placements, {concurrency} at a time, until each fleet is half full")
    with private_postgres() as cluster:
        for nodes in sizes:
            database = f"placement_{nodes}"
            cluster.create_database(database, recreate=True)
            url = cluster.url(database)
            await asyncio.to_thread(upgrade, url)
            print(await measure(url, nodes, concurrency))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[150, 600, 2400])
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main_async(args.nodes, args.concurrency))


if __name__ == "__main__":
    main()
