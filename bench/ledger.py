"""The ledger at scale (issue 37 item 5): balance read, meter run and usage export against a ledger
of one entry per allocation per minute, at two ledger ages (1 day and 30 days of minute windows by
default), and the ratio of each figure between them: flat means the ratio stays near 1.

    .venv/bin/python -m bench.ledger [--allocations 32] [--days 1 30] [--requests 40]

Scaled honestly: the issue's 10,000 allocations x 30 days is 432 million entries, beyond a
benchmark run on a 2-core machine in minutes. What grows between the two sizes here is what grew
in production, the ledger's age (30x the entries per allocation and per project); the number of
allocations is a parameter (`--allocations 10000 --days 1` is the 1-day ledger of the issue's
fleet, 14.4 million entries).

Each size gets a private PostgreSQL database, migrated, filled in bulk with plain SQL (here only:
a running system writes these rows through its workflows): a 4-node slice fleet, 4 projects, the
allocations active and spread over them, each with its usage record opened `--days` ago, billed
through the current minute, its ledger entries (one per minute window, the amounts the meter
posts) and a credit per project; the running totals set as the migration backfills them. Then
VACUUM ANALYZE.

Timed, one at a time, `--requests` times each (after warm-up): GET /api/v1/billing/balance (the
real gateway route, in-process over httpx's ASGI transport), the first page of GET
/api/v1/billing/usage as JSON and as CSV, and a meter run (the activity's code, billing one more
window of every open record in batches; `--meter-runs` times). For contrast, the balance as it was
read before issue 37: a SUM over the project's ledger.

Exit 1 when a figure's 30-day / 1-day ratio of medians is above TARGET_RATIO (not the SUM's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from litestar import Litestar

from activities.billing.metering import BillingActivities
from bench.stack import machine_cpu_shares, machine_cpu_ticks, p50_p99, private_postgres
from contracts.billing_meter import MeterInput
from contracts.states import TokenRole
from core.config import Settings
from devstack.postgres import PostgresCluster
from devstack.processes import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tokens import create_token
from schema.db import create_engine, driver_connection, session_factory
from schema.migrate import upgrade
from sim.demo_fleet import SLICE_SKU, build_fleet, seed_fleet

REGION = "bench-ledger"
PROJECTS = 4
NODES = 4
PRICE = 250  # minor units per GPU-hour
CREDIT = 10**12
# A figure "stays flat" when its median at the larger ledger is at most this many times the
# smaller one's.
TARGET_RATIO = 2.0
# The bulk fill's statements run longer than the application's 30 s command timeout.
FILL_TIMEOUT_S = 1800

_FILL_ALLOCATIONS = """
WITH p AS (SELECT array_agg(id ORDER BY name) AS ids FROM projects WHERE name LIKE 'bench-%'),
n AS (SELECT array_agg(id ORDER BY id) AS ids FROM nodes WHERE region = $2),
a AS (SELECT gen_random_uuid() AS id, g FROM generate_series(1, $1) AS g)
INSERT INTO allocations (id, project_id, sku, region, shape, gpu_count, node_id, status,
                         workflow_id, created_at, active_at, updated_at)
SELECT a.id, p.ids[1 + a.g % cardinality(p.ids)], $3, $2, 'gpu_slice', 1,
       n.ids[1 + a.g % cardinality(n.ids)], 'active', 'allocation-' || a.id,
       $4::timestamptz - make_interval(days => $5::int),
       $4::timestamptz - make_interval(days => $5::int), $4::timestamptz
FROM a, p, n
"""

# Opened `days` ago, billed through $1 (a whole number of minute windows).
_FILL_USAGE = """
INSERT INTO usage_records (id, allocation_id, project_id, sku, gpu_count,
                           price_per_gpu_hour_minor, started_at, billed_until)
SELECT gen_random_uuid(), a.id, a.project_id, a.sku, 1, $2::bigint, a.active_at, $1::timestamptz
FROM allocations a WHERE a.region = $3
"""

# One entry per minute window k, the meter's amount: cum(k + 1) - cum(k), cum(k) = ⌊price·k/60⌋.
_FILL_LEDGER = """
INSERT INTO ledger_entries (id, project_id, amount_minor, currency, kind, idempotency_key,
                            usage_record_id, description, created_at)
SELECT gen_random_uuid(), u.project_id,
       -((u.price_per_gpu_hour_minor * (k + 1)) / 60 - (u.price_per_gpu_hour_minor * k) / 60),
       'usd', 'usage_debit', 'usage:' || u.id || ':' || k, u.id,
       '1x ' || u.sku || ', window ' || k, u.started_at + make_interval(mins => k + 1)
FROM usage_records u,
     generate_series(0, (extract(epoch FROM u.billed_until - u.started_at) / 60)::int - 1) AS k
"""

_FILL_CREDITS = """
INSERT INTO ledger_entries (id, project_id, amount_minor, currency, kind, idempotency_key,
                            created_at)
SELECT gen_random_uuid(), id, $1, 'usd', 'admin_credit', 'bench-credit:' || id,
       $2::timestamptz - interval '31 days'
FROM projects WHERE name LIKE 'bench-%'
"""

# As migration 0033 backfills them.
_FILL_TOTALS = [
    "INSERT INTO billing_accounts (project_id, state) SELECT id, 'healthy' FROM projects"
    " WHERE name LIKE 'bench-%'",
    "UPDATE billing_accounts a SET balance_minor = l.total FROM (SELECT project_id,"
    " sum(amount_minor) AS total FROM ledger_entries GROUP BY project_id) l"
    " WHERE a.project_id = l.project_id",
    "UPDATE usage_records u SET charged_minor = l.total FROM (SELECT usage_record_id,"
    " -sum(amount_minor) AS total FROM ledger_entries WHERE usage_record_id IS NOT NULL"
    " GROUP BY usage_record_id) l WHERE u.id = l.usage_record_id",
]


@dataclasses.dataclass(frozen=True)
class Fixture:
    now: dt.datetime  # the minute the usage is billed through
    projects: list[uuid.UUID]
    tokens: dict[uuid.UUID, str]
    entries: int
    entries_per_project: int


async def fill(url: str, allocations: int, days: int) -> Fixture:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        sessions = session_factory(engine)
        async with sessions() as session, session.begin():
            await seed_fleet(session, build_fleet(NODES, region=REGION, hostname_prefix="l"))
        async with driver_connection(engine) as pg:
            now = await pg.fetchval("SELECT date_trunc('minute', now())")
            await pg.execute(
                "INSERT INTO projects (id, name) SELECT gen_random_uuid(), 'bench-' || g"
                " FROM generate_series(1, $1) AS g",
                PROJECTS,
            )
            for label, sql, args in (
                ("allocations", _FILL_ALLOCATIONS, (allocations, REGION, SLICE_SKU, now, days)),
                ("usage records", _FILL_USAGE, (now, PRICE, REGION)),
                ("ledger entries", _FILL_LEDGER, ()),
                ("credits", _FILL_CREDITS, (CREDIT, now)),
            ):
                start = time.perf_counter()
                status = await pg.execute(sql, *args, timeout=FILL_TIMEOUT_S)
                print(
                    f"  {label}: {status.split()[-1]} rows in {time.perf_counter() - start:.1f} s"
                )
            for sql in _FILL_TOTALS:
                await pg.execute(sql, timeout=FILL_TIMEOUT_S)
            await pg.execute("VACUUM ANALYZE", timeout=FILL_TIMEOUT_S)
            projects = [
                r["id"]
                for r in await pg.fetch(
                    "SELECT id FROM projects WHERE name LIKE 'bench-%' ORDER BY name"
                )
            ]
            entries = await pg.fetchval("SELECT count(*) FROM ledger_entries")
            largest = await pg.fetchval(
                "SELECT max(c) FROM (SELECT count(*) AS c FROM ledger_entries"
                " GROUP BY project_id) s"
            )
        tokens: dict[uuid.UUID, str] = {}
        async with sessions() as session, session.begin():
            for project in projects:
                _, tokens[project] = await create_token(
                    session, name="bench", role=TokenRole.TENANT, project_id=project
                )
        return Fixture(now, projects, tokens, int(entries), int(largest))
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def served(app: Litestar) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        app.lifespan(),
        httpx.AsyncClient(
            # Litestar's ASGI types are narrower than httpx's; the app is a plain ASGI app.
            transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
            base_url="http://bench.local",
            timeout=60,
        ) as client,
    ):
        yield client


async def timed(call: Callable[[], Awaitable[object]], times: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


async def measure(
    cluster: PostgresCluster, allocations: int, days: int, requests: int, meter_runs: int
) -> dict[str, list[float]]:
    database = f"bench_ledger_{days}"
    cluster.create_database(database, recreate=True)
    url = cluster.url(database)
    await asyncio.to_thread(upgrade, url)
    print(f"\nfilling {allocations} allocations x {days} day(s) of minute windows:")
    start = time.perf_counter()
    f = await fill(url, allocations, days)
    print(f"filled in {time.perf_counter() - start:.0f} s")
    settings = dataclasses.replace(
        Settings.from_env({}),
        database_url=url,
        temporal_address=f"127.0.0.1:{free_port()}",  # nothing timed here asks Temporal
    )
    app = create_app(settings, config=GatewayConfig())
    project = f.projects[0]
    headers = {"Authorization": f"Bearer {f.tokens[project]}"}
    figures: dict[str, list[float]] = {}
    async with served(app) as client:

        async def get(path: str, **params: str) -> None:
            answer = await client.get(path, params=params, headers=headers)
            if answer.status_code != 200:
                raise RuntimeError(f"GET {path}: {answer.status_code} {answer.text[:300]}")

        figures["balance read (GET /billing/balance)"] = await timed(
            lambda: get("/api/v1/billing/balance"), requests
        )
        figures["usage export, first page (JSON)"] = await timed(
            lambda: get("/api/v1/billing/usage"), requests
        )
        figures["usage export, first page (CSV)"] = await timed(
            lambda: get("/api/v1/billing/usage", format="csv"), requests
        )
    engine = create_engine(url, pool_size=2, max_overflow=0)
    try:
        sessions = session_factory(engine)
        async with driver_connection(engine) as pg:
            figures["ledger SUM (the balance read before issue 37)"] = await timed(
                lambda: pg.fetchval(
                    "SELECT coalesce(sum(amount_minor), 0) FROM ledger_entries"
                    " WHERE project_id = $1",
                    project,
                ),
                requests,
            )
        meter = BillingActivities(sessions)
        runs = iter(range(1, meter_runs + 4))

        async def meter_run() -> None:
            # Each run bills one more minute window of every open record.
            until = f.now + dt.timedelta(minutes=next(runs), seconds=1)
            result = await meter.meter(MeterInput(until=until.isoformat()))
            if result.debits_posted != allocations:
                raise RuntimeError(f"a meter run posted {result.debits_posted}, not {allocations}")

        figures[f"meter run ({allocations} records, one window each)"] = await timed(
            meter_run, meter_runs
        )
    finally:
        await engine.dispose()
    print(
        f"{days} day(s): {f.entries:,} ledger entries, {f.entries_per_project:,} in the largest"
        " project"
    )
    for name, values in figures.items():
        print(f"  {name:50s} {p50_p99(values)}")
    return figures


async def run(allocations: int, days: list[int], requests: int, meter_runs: int) -> int:
    ticks = machine_cpu_ticks()
    results: dict[int, dict[str, list[float]]] = {}
    with private_postgres() as cluster:
        for d in days:
            results[d] = await measure(cluster, allocations, d, requests, meter_runs)
    shares = machine_cpu_shares(ticks, machine_cpu_ticks())
    small, large = min(days), max(days)
    print(
        f"\n{large} days / {small} day(s), ratio of p50s (target ≤ {TARGET_RATIO:.1f}; cores "
        f"busy {shares['busy']:.0%}, stolen {shares['steal']:.0%}):"
    )
    over = 0
    for name in results[small]:
        ratio = statistics.median(results[large][name]) / max(
            statistics.median(results[small][name]), 1e-6
        )
        judged = not name.startswith("ledger SUM")
        missed = judged and ratio > TARGET_RATIO
        over += missed
        print(
            f"  {name:50s} {ratio:6.2f}x"
            + ("  OVER" if missed else "" if judged else "  (for contrast: not judged)")
        )
    return over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=32)
    parser.add_argument("--days", type=int, nargs=2, default=[1, 30])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--meter-runs", type=int, default=10)
    args = parser.parse_args()
    over = asyncio.run(run(args.allocations, args.days, args.requests, args.meter_runs))
    raise SystemExit(1 if over else 0)


if __name__ == "__main__":
    main()
