"""Placement alone, by fleet size: the `allocation.place` activity called directly (no Temporal,
no gateway) against a private PostgreSQL, timed over a fixed number of slice placements (one GPU
each unless --gpus) on a fleet already half full.

    .venv/bin/python -m bench.placement [--nodes 150 2000 10000] [--placements 200] [--gpus 1]
                                        [--concurrency 1] [--explain]

For each fleet size (a PostgreSQL cluster of its own, 8 GPUs on 2 NUMA nodes per node):

1. The fleet is filled to half in bulk: the first half of its GPU slots, in the order one-GPU
   placements one after another would take them (best-fit packs each node before the next, by
   node id, NUMA node, GPU index), each reserved for an allocation of its own by
   `placement_sql.reserve_given_slots` — the statement parts a placement writes with
   (allocation, events, queued host task, slot, claim, and the slot triggers' node counters),
   pipelined, with the slots chosen here instead of ranked and locked. The state is the one
   placing them one at a time leaves, in about a minute at 10,000 nodes (placing them one at a
   time took more than nine). Then VACUUM ANALYZE, as a running system's autovacuum would have.
2. A few real placements warm the connections (the first also takes the project's VLAN).
3. `--placements` real placements of `--gpus` GPUs are timed, in ten turns with the other sizes
   (the noise of a shared machine comes and goes within a minute; taking turns, every size
   meets the same). It prints the wall time per placement (p50/p99) and the CPU per placement
   of the fleet's PostgreSQL processes and of this process (asyncpg and the activity's Python);
   with `--explain`, the EXPLAIN (ANALYZE, BUFFERS) of one more placement (the fastest of a
   few, each rolled back).

Placement walks an index in its ranking order, so its cost should not grow with the fleet; see
bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from activities import placement_sql
from activities.allocations import AllocationActivities
from activities.billing.ledger import EntryKind, post_entry
from bench.stack import cpu_seconds, private_postgres
from contracts.allocation_activities import PlaceInput
from contracts.host_tasks import SLICE_VM_PROVISION
from contracts.states import SkuShape
from devstack.postgres import PostgresCluster
from schema.db import create_engine, driver_connection, session_factory
from schema.migrate import upgrade
from schema.models import Project
from sim.demo_fleet import SLICE_SKU, build_fleet, seed_fleet

REGION = "bench-placement"
GPUS_PER_NODE = 8
WARM_UP = 10
# Reservations per pipelined batch of the bulk fill.
FILL_BATCH = 2000
# Placements explained (each rolled back); the fastest is printed, the others having met the
# noise of a shared machine.
EXPLAINED = 5
# The timed placements of each size are made in this many turns, the sizes taking turns.
ROUNDS = 10

# The free slots of the region in the order one-GPU placements take them on an empty fleet.
_FILL_ORDER = """
SELECT s.node_id, s.id FROM gpu_slots s JOIN nodes n ON n.id = s.node_id
WHERE n.region = $1 AND n.sku = $2 AND s.status = 'free'
ORDER BY n.id, s.numa_node, s.gpu_index
LIMIT $3
"""


def _request(project_id: uuid.UUID, gpus: int = 1) -> PlaceInput:
    allocation_id = str(uuid.uuid4())
    return PlaceInput(
        allocation_id=allocation_id,
        project_id=str(project_id),
        sku=SLICE_SKU,
        gpus=gpus,
        region=REGION,
        ssh_key_ids=[],
        idempotency_key=None,
        workflow_id=f"allocation-{allocation_id}",
        provision_task_id=str(uuid.uuid4()),
    )


def _placement_request(input: PlaceInput) -> placement_sql.PlacementRequest:
    return placement_sql.PlacementRequest(
        allocation_id=uuid.UUID(input.allocation_id),
        project_id=uuid.UUID(input.project_id),
        idempotency_key=input.idempotency_key,
        sku=input.sku,
        region=input.region,
        shape=SkuShape.GPU_SLICE,
        gpus=input.gpus,
        ssh_key_ids=[],
        workflow_id=input.workflow_id,
        task_id=uuid.UUID(input.provision_task_id),
        task_kind=SLICE_VM_PROVISION,
    )


def _execution_ms(plan: list[str]) -> float:
    return float(plan[-1].split(":")[1].split()[0])  # "Execution Time: 1.190 ms"


def _cluster_cpu(cluster: PostgresCluster) -> dict[int, float]:
    """CPU seconds used so far by each process of this cluster (the postmaster and its children:
    backends, autovacuum, writers), not by the other PostgreSQL servers on the machine."""
    postmaster = int((cluster.datadir / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == postmaster:
            pids.append(int(entry.name))
    used = cpu_seconds({str(pid): pid for pid in pids})
    return {pid: used[str(pid)] for pid in pids}


def _client_cpu() -> float:
    return cpu_seconds({})["bench-client"]


async def fill_half(url: str, project_id: uuid.UUID) -> int:
    """Reserve the first half of the region's slots, one-GPU allocations in placement order."""
    engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        async with driver_connection(engine) as pg:
            total = await pg.fetchval(
                "SELECT count(*) FROM gpu_slots s JOIN nodes n ON n.id = s.node_id "
                "WHERE n.region = $1",
                REGION,
            )
            slots = await pg.fetch(_FILL_ORDER, REGION, SLICE_SKU, total // 2)
            for start in range(0, len(slots), FILL_BATCH):
                await placement_sql.reserve_given_slots(
                    pg,
                    [
                        (_placement_request(_request(project_id)), node_id, [slot_id])
                        for node_id, slot_id in slots[start : start + FILL_BATCH]
                    ],
                )
            await pg.execute("VACUUM ANALYZE")
    finally:
        await engine.dispose()
    return len(slots)


@dataclass
class Fleet:
    """One fleet size in a cluster of its own, filled and warmed, and what its placements took."""

    nodes: int
    cluster: PostgresCluster
    engine: AsyncEngine
    project_id: uuid.UUID
    filled: int
    fill_seconds: float
    activities: AllocationActivities
    walls: list[float] = field(default_factory=list)
    postgres_cpu: float = 0.0
    client_cpu: float = 0.0


async def prepare(cluster: PostgresCluster, nodes: int, *, gpus: int, concurrency: int) -> Fleet:
    cluster.create_database("placement", recreate=True)
    url = cluster.url("placement")
    await asyncio.to_thread(upgrade, url)
    seed_engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        async with session_factory(seed_engine)() as session, session.begin():
            await seed_fleet(session, build_fleet(nodes, GPUS_PER_NODE, region=REGION))
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
        async with seed_engine.connect() as connection:
            await connection.execute(text("ANALYZE"))
    finally:
        await seed_engine.dispose()
    fill_started = time.perf_counter()
    filled = await fill_half(url, project_id)
    engine = create_engine(url, pool_size=concurrency, max_overflow=0)
    fleet = Fleet(
        nodes=nodes,
        cluster=cluster,
        engine=engine,
        activities=AllocationActivities(engine),
        project_id=project_id,
        filled=filled,
        fill_seconds=time.perf_counter() - fill_started,
    )
    # Warm the pool's connections and their prepared statements; not counted.
    for _ in range(WARM_UP):
        await asyncio.gather(
            *(fleet.activities.place(_request(project_id, gpus)) for _ in range(concurrency))
        )
    return fleet


async def time_placements(fleet: Fleet, placements: int, *, gpus: int, concurrency: int) -> None:
    """Time `placements` placements on `fleet`, adding to its figures."""
    activities = fleet.activities
    pending = iter(range(placements))

    async def placer() -> None:
        for _ in pending:
            started = time.perf_counter()
            await activities.place(_request(fleet.project_id, gpus))
            fleet.walls.append(time.perf_counter() - started)

    # This process's CPU is read inside the reads of /proc, which cost it more than placements.
    postgres_before = _cluster_cpu(fleet.cluster)
    client_before = _client_cpu()
    await asyncio.gather(*(placer() for _ in range(concurrency)))
    client_after = _client_cpu()
    postgres_after = _cluster_cpu(fleet.cluster)
    # A process that exited meanwhile counts for nothing; one that started, for all it used.
    fleet.postgres_cpu += sum(
        used - postgres_before.get(pid, 0.0) for pid, used in postgres_after.items()
    )
    fleet.client_cpu += client_after - client_before


async def explain(fleet: Fleet, gpus: int) -> list[str]:
    async with driver_connection(fleet.engine) as pg:
        plans = [
            await placement_sql.explain_place_slice(
                pg, _placement_request(_request(fleet.project_id, gpus))
            )
            for _ in range(EXPLAINED)
        ]
    return min(plans, key=_execution_ms)


def figures(fleet: Fleet) -> str:
    walls = sorted(fleet.walls)
    placements = len(walls)
    return (
        f"{fleet.nodes:6d} nodes ({fleet.filled} GPUs filled in {fleet.fill_seconds:.1f} s), "
        f"{placements} placements: wall p50 {statistics.median(walls) * 1000:.2f} ms "
        f"p99 {walls[min(placements - 1, int(placements * 0.99))] * 1000:.2f} ms; CPU per "
        f"placement: PostgreSQL {fleet.postgres_cpu / placements * 1000:.2f} ms, "
        f"this process {fleet.client_cpu / placements * 1000:.2f} ms"
    )


# Issue 27's target: placement p50 on the largest fleet at most this many times the smallest's.
P50_GROWTH_TARGET = 1.5


def growth_verdict(fleets: list[Fleet]) -> tuple[str, bool]:
    """The largest fleet's p50 over the smallest's, against P50_GROWTH_TARGET."""
    smallest = min(fleets, key=lambda fleet: fleet.nodes)
    largest = max(fleets, key=lambda fleet: fleet.nodes)
    ratio = statistics.median(largest.walls) / statistics.median(smallest.walls)
    met = ratio <= P50_GROWTH_TARGET
    return (
        f"p50 at {largest.nodes} nodes / p50 at {smallest.nodes} nodes = {ratio:.2f}x "
        f"(target <= {P50_GROWTH_TARGET}x): {'met' if met else 'NOT MET'}",
        met,
    )


async def main_async(args: argparse.Namespace) -> bool:
    """Prints the figures; answers whether the growth target was met (or not judged)."""
    print(
        f"{args.placements} slice placements of {args.gpus} GPUs, {args.concurrency} at a time, "
        f"on each fleet half full (of one-GPU allocations), in {ROUNDS} rounds taking turns"
    )
    with contextlib.ExitStack() as clusters:
        fleets = []
        for nodes in args.nodes:
            cluster = clusters.enter_context(private_postgres())
            fleets.append(
                await prepare(cluster, nodes, gpus=args.gpus, concurrency=args.concurrency)
            )
        try:
            # The sizes take turns, so that each meets the same machine: on a shared one the
            # noise comes and goes within a minute.
            for turn in range(ROUNDS):
                for fleet in fleets:
                    share = args.placements * (turn + 1) // ROUNDS
                    share -= args.placements * turn // ROUNDS
                    await time_placements(
                        fleet, share, gpus=args.gpus, concurrency=args.concurrency
                    )
            for fleet in fleets:
                print(figures(fleet), flush=True)
                if args.explain:
                    print("\n".join(f"    {line}" for line in await explain(fleet, args.gpus)))
            if len({fleet.nodes for fleet in fleets}) < 2:
                return True
            verdict, met = growth_verdict(fleets)
            print(verdict, flush=True)
            return met
        finally:
            for fleet in fleets:
                await fleet.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[150, 2000, 10000])
    parser.add_argument("--placements", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per timed placement")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--explain", action="store_true", help="print EXPLAIN (ANALYZE, BUFFERS) of a placement"
    )
    args = parser.parse_args()
    # Exit 1 when the growth target is missed, so a script run can hold it.
    sys.exit(0 if asyncio.run(main_async(args)) else 1)


if __name__ == "__main__":
    main()
