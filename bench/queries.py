"""Allocation list and timeline queries at 100,000 allocations (issue 27): the real gateway routes,
served in-process (the app over httpx's ASGI transport, as the tests serve it) against a private
PostgreSQL filled in bulk, one request at a time; p50/p99 per query, target p99 < 50 ms.

    .venv/bin/python -m bench.queries [--allocations 100000] [--requests 200] [--explain]

The fill is plain SQL, here only (a running system writes these rows through its workflows): 200
projects and one large one holding a tenth of the allocations, a 500-node slice fleet, and the
allocations spread over 180 days, newest in flight (requested, provisioning, releasing), the rest
mostly released, then active, failed and release_failed; each with its lifecycle events, its host
tasks (provision, and release once released) and their phases, as the workflows record them.
Then VACUUM ANALYZE, as a running system's autovacuum would have.

Timed, each `--requests` times with a random project, allocation or node (tenant routes with
that project's token, admin routes with an admin token): a project's first page, its third page
(following next_cursor), a status filter (a common and a rare status), the same for the large
project, a timeline, and the admin list (first page, each status, by node) and admin timeline.
Timelines are of allocations with no host task in flight: a live task's phases are also asked of
Temporal (gateway/timeline.py), which is not what is measured here.

With `--explain`, the server logs the EXPLAIN (ANALYZE, BUFFERS) of every statement that takes
longer than the target (auto_explain), and the script prints those plans after the figures;
timings taken with it on include auto_explain's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from litestar import Litestar

from bench.stack import machine_cpu_shares, machine_cpu_ticks, p50_p99, percentile, private_postgres
from contracts.host_tasks import SLICE_VM_PROVISION, SLICE_VM_RELEASE
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

REGION = "bench-queries"
PROJECTS = 200
NODES = 500
TARGET_MS = 50.0
# The newest allocations are the ones still in flight.
IN_FLIGHT = 400
# One project holds this share of all allocations: a large tenant's lists and filters.
LARGE_PROJECT_SHARE = 0.1

# Allocations, oldest first by g (g = 1 is the newest): in flight for the newest IN_FLIGHT, then
# by g % 100: released 80 %, active 12 %, failed 6 %, release_failed 2 %. $1 count, $2 region,
# $3 sku, $4 the large project's share in per mille, $5 IN_FLIGHT.
_FILL_ALLOCATIONS = """
WITH p AS (SELECT array_agg(id ORDER BY name) AS ids FROM projects WHERE name LIKE 'bench-%'),
big AS (SELECT id FROM projects WHERE name = 'large'),
n AS (SELECT array_agg(id ORDER BY id) AS ids FROM nodes WHERE region = $2),
a AS (
  SELECT gen_random_uuid() AS id, g,
         CASE WHEN g % 1000 < $4 THEN big.id ELSE p.ids[1 + g % cardinality(p.ids)] END
           AS project_id,
         n.ids[1 + (g * 7919) % cardinality(n.ids)] AS node_id,
         now() - g * (interval '180 days' / $1) AS created_at,
         CASE
           WHEN g <= $5 THEN (ARRAY['requested', 'provisioning', 'releasing'])[1 + g % 3]
           WHEN g % 100 < 80 THEN 'released'
           WHEN g % 100 < 92 THEN 'active'
           WHEN g % 100 < 98 THEN 'failed'
           ELSE 'release_failed'
         END AS status
  FROM generate_series(1, $1) AS g, p, n, big
)
INSERT INTO allocations (id, project_id, sku, region, shape, gpu_count, node_id, status,
                         workflow_id, created_at, provisioning_started_at, active_at,
                         releasing_at, released_at, failed_at, release_failed_at, updated_at,
                         failure_reason)
SELECT a.id, a.project_id, $3, $2, 'gpu_slice', 1, a.node_id, a.status,
       'allocation-' || a.id, a.created_at,
       CASE WHEN a.status <> 'requested' THEN a.created_at + interval '1 second' END,
       CASE WHEN a.status IN ('active', 'releasing', 'released', 'release_failed')
            THEN a.created_at + interval '40 seconds' END,
       CASE WHEN a.status IN ('releasing', 'released', 'release_failed')
            THEN a.created_at + interval '6 hours' END,
       CASE WHEN a.status = 'released' THEN a.created_at + interval '6 hours 20 seconds' END,
       CASE WHEN a.status = 'failed' THEN a.created_at + interval '5 minutes' END,
       CASE WHEN a.status = 'release_failed' THEN a.created_at + interval '6 hours 5 minutes' END,
       a.created_at,
       CASE WHEN a.status = 'failed' THEN 'host_provision_failed' END
FROM a
"""

# Each allocation's lifecycle events, as the workflow writes them, up to its status.
_FILL_EVENTS = """
INSERT INTO allocation_events (allocation_id, event, from_status, to_status, details, occurred_at)
SELECT a.id, e.event, e.from_status, e.to_status, e.details, a.created_at + e.after
FROM allocations a
CROSS JOIN LATERAL (VALUES
    (1, 'requested', NULL, 'requested', '{}'::jsonb, interval '0'),
    (2, 'placement_reserved', NULL, NULL, '{"claim": "slots", "gpu_count": 1}', interval '0'),
    (3, 'provisioning_started', 'requested', 'provisioning', '{}', interval '1 second'),
    (4, 'active', 'provisioning', 'active', '{}', interval '40 seconds'),
    (4, 'failed', 'provisioning', 'failed', '{}', interval '5 minutes'),
    (5, 'releasing', 'active', 'releasing', '{}', interval '6 hours'),
    (6, 'released', 'releasing', 'released', '{}', interval '6 hours 20 seconds'),
    (6, 'release_failed', 'releasing', 'release_failed', '{}', interval '6 hours 5 minutes')
) AS e(step, event, from_status, to_status, details, after)
WHERE a.region = $1 AND e.step <= CASE a.status
    WHEN 'requested' THEN 2 WHEN 'provisioning' THEN 3 WHEN 'active' THEN 4
    WHEN 'failed' THEN 4 WHEN 'releasing' THEN 5 ELSE 6 END
  AND (e.step <> 4 OR e.event = CASE WHEN a.status = 'failed' THEN 'failed' ELSE 'active' END)
  AND (e.step <> 6 OR e.event = a.status)
ORDER BY a.created_at, e.step
"""

# Host tasks: the provision task of every allocation (queued while requested, dispatched while
# provisioning), and a release task for those that reached releasing. $1 region, $2 the
# provision task's kind, $3 the release task's.
_FILL_TASKS = """
INSERT INTO node_tasks (id, node_id, allocation_id, kind, status, workflow_id, attempts,
                        created_at, dispatched_at, completed_at)
SELECT gen_random_uuid(), a.node_id, a.id, t.kind,
       CASE
         WHEN t.kind = $2 AND a.status = 'requested' THEN 'queued'
         WHEN t.kind = $2 AND a.status = 'provisioning' THEN 'dispatched'
         WHEN t.kind = $2 AND a.status = 'failed' THEN 'failed'
         WHEN t.kind = $3 AND a.status = 'releasing' THEN 'dispatched'
         WHEN t.kind = $3 AND a.status = 'release_failed' THEN 'failed'
         ELSE 'completed'
       END,
       a.workflow_id, 1, a.created_at + t.after, a.created_at + t.after + interval '1 second',
       CASE WHEN a.status NOT IN ('requested', 'provisioning', 'releasing')
            THEN a.created_at + t.after + interval '35 seconds' END
FROM allocations a
CROSS JOIN LATERAL (VALUES
    ($2::text, interval '1 second'),
    ($3::text, interval '6 hours')
) AS t(kind, after)
WHERE a.region = $1
  AND (t.kind = $2
       OR a.status IN ('releasing', 'released', 'release_failed'))
"""

# Four phases per started task, each started and succeeded (failed tasks: the last one failed).
_FILL_PHASES = """
INSERT INTO node_task_events (node_task_id, allocation_id, phase, status, message, occurred_at,
                              attempt)
SELECT t.id, t.allocation_id, p.phase, s.status, NULL,
       t.dispatched_at + p.n * interval '8 seconds' + s.n * interval '7 seconds', 1
FROM node_tasks t
CROSS JOIN LATERAL (VALUES (0, 'prepare'), (1, 'image'), (2, 'boot'), (3, 'ready'))
  AS p(n, phase)
CROSS JOIN LATERAL (VALUES (0, 'started'), (1, 'succeeded')) AS s(n, status)
WHERE t.status <> 'queued'
  AND (t.status <> 'dispatched' OR p.n = 0)
  AND (s.n = 0 OR t.status = 'completed' OR p.n < 3)
"""

_EXPLAIN_SETTINGS = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": f"{TARGET_MS:.0f}ms",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
}


@dataclasses.dataclass(frozen=True)
class Fixture:
    projects: list[uuid.UUID]
    large_project: uuid.UUID
    tokens: dict[uuid.UUID, str]  # tenant token by project
    admin_token: str
    done_allocations: dict[uuid.UUID, list[uuid.UUID]]  # no task in flight, by project
    nodes: list[uuid.UUID]


async def fill(url: str, allocations: int) -> Fixture:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    try:
        sessions = session_factory(engine)
        async with sessions() as session, session.begin():
            await seed_fleet(session, build_fleet(NODES, region=REGION, hostname_prefix="q"))
        async with driver_connection(engine) as pg:
            await pg.execute(
                "INSERT INTO projects (id, name) SELECT gen_random_uuid(), 'bench-' || g"
                " FROM generate_series(1, $1) AS g",
                PROJECTS,
            )
            await pg.execute("INSERT INTO projects (id, name) VALUES (gen_random_uuid(), 'large')")
            for label, sql, args in (
                (
                    "allocations",
                    _FILL_ALLOCATIONS,
                    (allocations, REGION, SLICE_SKU, round(LARGE_PROJECT_SHARE * 1000), IN_FLIGHT),
                ),
                ("allocation events", _FILL_EVENTS, (REGION,)),
                ("host tasks", _FILL_TASKS, (REGION, SLICE_VM_PROVISION, SLICE_VM_RELEASE)),
                ("host task phases", _FILL_PHASES, ()),
            ):
                start = time.perf_counter()
                status = await pg.execute(sql, *args)
                print(
                    f"  {label}: {status.split()[-1]} rows in {time.perf_counter() - start:.1f} s"
                )
            await pg.execute("VACUUM ANALYZE")
            projects = [r["id"] for r in await pg.fetch("SELECT id FROM projects ORDER BY name")]
            large = await pg.fetchval("SELECT id FROM projects WHERE name = 'large'")
            done: dict[uuid.UUID, list[uuid.UUID]] = {}
            for row in await pg.fetch(
                "SELECT a.project_id, a.id FROM allocations a TABLESAMPLE SYSTEM (5)"
                " WHERE NOT EXISTS (SELECT 1 FROM node_tasks t WHERE t.allocation_id = a.id"
                "   AND t.status IN ('queued', 'dispatched'))"
            ):
                done.setdefault(row["project_id"], []).append(row["id"])
            nodes = [
                r["id"] for r in await pg.fetch("SELECT id FROM nodes WHERE region = $1", REGION)
            ]
        tokens: dict[uuid.UUID, str] = {}
        async with sessions() as session, session.begin():
            _, admin = await create_token(
                session, name="bench-admin", role=TokenRole.ADMIN, project_id=None
            )
            for project in projects:
                _, tokens[project] = await create_token(
                    session, name="bench", role=TokenRole.TENANT, project_id=project
                )
        return Fixture(projects, large, tokens, admin, done, nodes)
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
            timeout=30,
        ) as client,
    ):
        yield client


Request = Callable[[random.Random], tuple[str, str, dict[str, Any]]]  # token, path, params


def queries(f: Fixture) -> dict[str, Request]:
    small = [p for p in f.projects if p != f.large_project]
    with_done = [p for p in small if f.done_allocations.get(p)]

    def tenant(
        project: uuid.UUID, path: str = "", **params: Any
    ) -> tuple[str, str, dict[str, Any]]:
        return f.tokens[project], f"/api/v1/allocations{path}", params

    def admin(path: str = "", **params: Any) -> tuple[str, str, dict[str, Any]]:
        return f.admin_token, f"/api/v1/admin/allocations{path}", params

    def timeline(r: random.Random) -> tuple[str, str, dict[str, Any]]:
        project = r.choice(with_done)
        return tenant(project, f"/{r.choice(f.done_allocations[project])}/timeline")

    def admin_timeline(r: random.Random) -> tuple[str, str, dict[str, Any]]:
        project = r.choice(with_done)
        return admin(f"/{r.choice(f.done_allocations[project])}/timeline")

    return {
        "tenant list, first page": lambda r: tenant(r.choice(small)),
        "tenant list, third page": lambda r: tenant(r.choice(small), pages=3),
        "tenant list, status=active": lambda r: tenant(r.choice(small), status="active"),
        "tenant list, status=release_failed": lambda r: tenant(
            r.choice(small), status="release_failed"
        ),
        "large tenant, first page": lambda r: tenant(f.large_project),
        "large tenant, third page": lambda r: tenant(f.large_project, pages=3),
        "large tenant, status=active": lambda r: tenant(f.large_project, status="active"),
        "large tenant, status=release_failed": lambda r: tenant(
            f.large_project, status="release_failed"
        ),
        "tenant timeline": timeline,
        "admin list, first page": lambda r: admin(),
        "admin list, third page": lambda r: admin(pages=3),
        "admin list, status=released": lambda r: admin(status="released"),
        "admin list, status=active": lambda r: admin(status="active"),
        "admin list, status=provisioning": lambda r: admin(status="provisioning"),
        "admin list, status=release_failed": lambda r: admin(status="release_failed"),
        "admin list, by node": lambda r: admin(node_id=str(r.choice(f.nodes))),
        "admin list, by node, status=active": lambda r: admin(
            node_id=str(r.choice(f.nodes)), status="active"
        ),
        "admin timeline": admin_timeline,
    }


async def timed(client: httpx.AsyncClient, request: Request, r: random.Random) -> float:
    """Milliseconds for the request's last page (earlier pages only give it its cursor)."""
    token, path, params = request(r)
    pages = params.pop("pages", 1)
    headers = {"Authorization": f"Bearer {token}"}
    for _ in range(pages):
        start = time.perf_counter()
        answer = await client.get(path, params=params, headers=headers)
        elapsed = (time.perf_counter() - start) * 1000
        if answer.status_code != 200:
            raise RuntimeError(f"GET {path} {params}: {answer.status_code} {answer.text[:300]}")
        cursor = answer.json().get("next_cursor")
        if cursor is None:
            break
        params = {**params, "cursor": cursor}
    return elapsed


async def run(cluster: PostgresCluster, allocations: int, requests: int, explain: bool) -> int:
    cluster.create_database("bench", recreate=True)
    url = cluster.url("bench")
    await asyncio.to_thread(upgrade, url)
    start = time.perf_counter()
    print(f"filling {allocations} allocations over {PROJECTS} projects and one large one:")
    fixture = await fill(url, allocations)
    print(f"filled in {time.perf_counter() - start:.0f} s")
    log_offset = 0
    if explain:
        for key, value in _EXPLAIN_SETTINGS.items():
            cluster.psql(f"ALTER DATABASE bench SET {key} = '{value}'")
        log_offset = (cluster.datadir / "server.log").stat().st_size
    settings = dataclasses.replace(
        Settings.from_env({}),
        database_url=url,
        # Nothing listens: no route timed here asks Temporal (module docstring).
        temporal_address=f"127.0.0.1:{free_port()}",
    )
    app = create_app(settings, config=GatewayConfig())
    r = random.Random(27)
    named = queries(fixture)
    samples: dict[str, list[float]] = {name: [] for name in named}
    ticks = machine_cpu_ticks()
    async with served(app) as client:
        for request in named.values():  # warm the pool and the caches
            for _ in range(3):
                await timed(client, request, r)
        # In rounds, every query taking its turn: the noise of a shared machine meets them all.
        for _ in range(requests):
            for name, request in named.items():
                samples[name].append(await timed(client, request, r))
    shares = machine_cpu_shares(ticks, machine_cpu_ticks())
    print(
        f"\n{allocations} allocations, {requests} requests per query, one at a time "
        f"(cores busy {shares['busy']:.0%}, stolen {shares['steal']:.0%}):"
    )
    over = 0
    for name, values in samples.items():
        p99 = percentile(values, 99)
        within = p99 < TARGET_MS
        over += not within
        print(
            f"  {name:40s} {p50_p99(values, 6, 1)}  {'' if within else f'OVER {TARGET_MS:.0f} ms'}"
        )
    if explain:
        with (cluster.datadir / "server.log").open() as log:
            log.seek(log_offset)
            plans = slowest_plans(log.read())
        print(f"\nstatements over {TARGET_MS:.0f} ms, the slowest plan of each (auto_explain):")
        print("\n\n".join(plans) if plans else "  none")
    return over


def slowest_plans(server_log: str) -> list[str]:
    """auto_explain's entries in a server log, the slowest of each statement text (an entry:
    a "duration: N ms  plan:" line, then its "Query Text:" and the plan, indented)."""
    entries = re.split(r"\n(?=\S)", server_log)
    slowest: dict[str, tuple[float, str]] = {}
    for entry in entries:
        duration = re.search(r"duration: ([0-9.]+) ms  plan:", entry)
        if duration is None:
            continue
        statement = entry.split("Query Text:", 1)[-1].split("\n\t", 3)[:3]
        key, ms = "".join(statement), float(duration.group(1))
        if ms > slowest.get(key, (0.0, ""))[0]:
            slowest[key] = (ms, entry)
    return [entry for _, entry in sorted(slowest.values(), reverse=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args()

    async def go() -> int:
        with private_postgres() as cluster:
            return await run(cluster, args.allocations, args.requests, args.explain)

    raise SystemExit(1 if asyncio.run(go()) else 0)


if __name__ == "__main__":
    main()
