"""Onboarding benchmark on the real stack (devstack.up.Stack in a private state folder: PostgreSQL,
Temporal dev server, Vault and MAAS simulators, worker, gateway, first-boot simulator as
separate processes): one batch of N simulated nodes through POST /api/v1/admin/onboardings/batch
with zero simulator delays (only the deployed OS's hardware-sync timer ticks, every 10 ms) and
batch_max_parallel 10, until every node has settled.

Reports the wall time from the POST to the last node settled, the highest number of nodes in
flight (the batch workflow's own count, and the read model sampled every 250 ms), the
outcome counts, and the batch workflow's history per run (bounded by its continue-as-new).

    .venv/bin/python -m bench.onboarding [--nodes 200] [--parallel 10] [--max-agents 150]

Target on a 2-core machine (issue 4): 200 nodes in under 120 s, never more than 10 in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import time
from collections import Counter
from typing import Any

import httpx
from sqlalchemy import text

from bench.stack import bench_stack_options, cpu_seconds, private_state_dir
from contracts.onboarding import BATCH_CHILDREN_PER_RUN, BatchSummary, batch_workflow_id
from core.config import Settings
from core.temporal import connect, run_histories
from devstack.up import Stack
from schema.db import create_engine
from sim.demo_fleet import BAREMETAL_SKU
from sim.first_boot import MAX_RUNNING_AGENTS_ENV

SETTLED = {"completed", "reconciled", "cancelled", "failed_retryable", "failed_manual_intervention"}


def scenario(n: int) -> dict[str, Any]:
    machines = []
    for i in range(n):
        octets = f"{i // 250}.{i % 250 + 1}"
        machines.append(
            {
                "hostname": f"bench-{i:04d}",
                "status": "New" if i % 2 else "Ready",
                "bmc": {"address": f"10.200.{octets}", "user": "root", "password": "calvin"},
                "interfaces": [
                    {
                        "name": "eno8303",
                        "mac": f"02:00:00:{i // 65536:02x}:{i // 256 % 256:02x}:{i % 256:02x}",
                        "subnet": "pxe",
                        "pxe": True,
                    },
                ],
                "block_devices": [
                    {
                        "name": "sda",
                        "model": "Dell BOSS-N1",
                        "serial": f"B{i}",
                        "size": 480103981056,
                    },
                    {"name": "nvme0n1", "model": "NVMe", "serial": f"N{i}", "size": 3840755982336},
                ],
            }
        )
    zero = {k: 0 for k in ("commissioning", "testing", "deploying", "disk_erasing", "releasing",
                           "enlistment")}  # fmt: skip
    return {
        "seed": 1,
        "time_scale": 0.01,
        "site": {},
        "timings": {**zero, "hw_sync": 1},
        "subnets": [
            {
                "name": "pxe",
                "cidr": "10.176.0.0/16",
                "vid": 46,
                "dynamic_range": ["10.176.200.1", "10.176.250.250"],
            }
        ],
        "machines": machines,
        "faults": [],
    }


async def main(args: argparse.Namespace) -> None:
    # Each deployed node's agent is a real process of about 60 MB: a 500-node batch would hold
    # 500 of them (the OOM killer stopped such a run at ~350). The first-boot simulator keeps at
    # most --max-agents, stopping those enrolled longest ago: nothing of the batch needs them.
    os.environ[MAX_RUNNING_AGENTS_ENV] = str(args.max_agents)
    state = private_state_dir()
    options = bench_stack_options(state)
    stack = Stack(options)
    samples: list[int] = []
    stage_times: list[tuple[str, float]] = []
    cpu: dict[str, float] = {}
    statuses: Counter[str] = Counter()
    try:
        tokens = await stack.start()
        control_token = options.maas_control_token_file.read_text().strip()
        control_url = options.maas_url.removesuffix("/MAAS")
        async with httpx.AsyncClient(
            base_url=control_url, headers={"Authorization": f"Bearer {control_token}"}, timeout=60
        ) as control:
            reset = await control.post("/_sim/reset", json={"scenario": scenario(args.nodes)})
            reset.raise_for_status()
        admin = {"Authorization": f"Bearer {tokens['admin_token']}"}
        async with httpx.AsyncClient(
            base_url=options.gateway_probe_url, headers=admin, timeout=120
        ) as api:
            site_id = tokens["maas_site_id"]
            patched = await api.patch(
                f"/api/v1/admin/maas-sites/{site_id}",
                json={"policy": {"batch_max_parallel": args.parallel,
                                 "maas_poll_interval_ms": args.poll_ms},
                      "reason": "bench"},
            )  # fmt: skip
            patched.raise_for_status()
            profiles = (await api.get(f"/api/v1/admin/maas-sites/{site_id}/profiles")).json()
            profile_id = profiles["items"][0]["id"]
            nodes = [
                {"hostname": f"bench-{i:04d}", "ipmi_ip": f"10.200.{i // 250}.{i % 250 + 1}"}
                for i in range(args.nodes)
            ]
            pids = {c.name: c.pid for c in stack.children if c.pid is not None}
            cpu_before = cpu_seconds(pids)
            started = time.monotonic()
            created = await api.post(
                "/api/v1/admin/onboardings/batch",
                json={"site_id": site_id, "profile_id": profile_id, "sku_id": BAREMETAL_SKU,
                      "nodes": nodes},
            )  # fmt: skip
            if created.status_code != 201:
                raise SystemExit(f"batch refused: {created.status_code} {created.text[:500]}")
            batch_id = created.json()["batch_id"]
            while True:
                rows = await _rows(api, batch_id)
                statuses = Counter(r["status"] for r in rows)
                samples.append(statuses["running"] + statuses["compensating"])
                if sum(statuses[s] for s in SETTLED) >= args.nodes:
                    break
                if time.monotonic() - started > args.timeout:
                    raise SystemExit(f"not settled after {args.timeout} s: {dict(statuses)}")
                await asyncio.sleep(0.25)
            wall = time.monotonic() - started
            cpu_after = cpu_seconds(pids)
            cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
        assert stack.cluster is not None
        stage_times = await _stage_seconds(stack.cluster.url("gpucloud"))
        settings = Settings.from_env({"GPUCLOUD_TEMPORAL_ADDRESS": options.temporal_address})
        client = await connect(settings)
        handle = client.get_workflow_handle(batch_workflow_id(batch_id), result_type=BatchSummary)
        summary = await handle.result()
        # The parent's history per run is bounded (issue 27): it continues as new every
        # BATCH_CHILDREN_PER_RUN children, so its largest run, not the batch, sets the size.
        runs = await run_histories(client, handle.id)
        run_events = [len(run.events) for run in runs]
        run_bytes = [sum(event.ByteSize() for event in run.events) for run in runs]
    finally:
        await stack.shutdown()
        shutil.rmtree(state, ignore_errors=True)

    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.platform()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(
        f"onboarding: {args.nodes} nodes, batch_max_parallel {args.parallel}, "
        f"poll {args.poll_ms} ms: all settled in {wall:.1f} s "
        f"({args.nodes / wall:.1f} nodes/s; target < 120 s for 200)"
    )
    print(f"outcomes: {dict(statuses)}")
    print(f"agent processes: at most {args.max_agents} running (the longest-enrolled stopped)")
    print(
        "CPU seconds during the batch: "
        + ", ".join(f"{name} {used:.1f}" for name, used in sorted(cpu.items(), key=lambda x: -x[1]))
    )
    print(
        "mean seconds per stage (started -> finished): "
        + ", ".join(f"{stage} {mean:.2f}" for stage, mean in stage_times)
    )
    print(
        f"in flight: max {max(samples) if samples else 0} sampled from the read model"
        + f", {summary.max_in_flight} by the batch workflow"
        + f" (limit {args.parallel})"
    )
    print(
        f"batch workflow history: {len(runs)} runs of at most {BATCH_CHILDREN_PER_RUN} children, "
        f"events per run {run_events} (max {max(run_events)}), largest run "
        f"{max(run_bytes) / 1024:.0f} KiB; {sum(run_events) / args.nodes:.1f} events per node "
        f"over all runs (Temporal warns at 10,240 events / 10 MiB per run and stops one at "
        f"51,200 / 50 MiB)"
    )


async def _stage_seconds(database_url: str) -> list[tuple[str, float]]:
    """Where a node's time goes: each stage's mean duration over the batch, slowest first."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT s.stage, avg(EXTRACT(EPOCH FROM f.occurred_at - s.occurred_at)) "
                    "FROM node_onboarding_events s JOIN LATERAL ("
                    "  SELECT occurred_at FROM node_onboarding_events f"
                    "  WHERE f.onboarding_id = s.onboarding_id AND f.stage = s.stage"
                    "    AND f.attempt = s.attempt AND f.status <> 'started'"
                    "    AND f.occurred_at >= s.occurred_at"
                    "  ORDER BY f.occurred_at LIMIT 1) f ON true "
                    "WHERE s.status = 'started' GROUP BY s.stage ORDER BY 2 DESC"
                )
            )
            return [(str(stage), float(mean)) for stage, mean in rows.all()]
    finally:
        await engine.dispose()


async def _rows(api: httpx.AsyncClient, batch_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, str | int] = {"batch_id": batch_id, "limit": 200}
        if cursor:
            params["cursor"] = cursor
        page = (await api.get("/api/v1/admin/onboardings", params=params)).json()
        rows += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=10)
    parser.add_argument("--poll-ms", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--max-agents", type=int, default=150, help="agent processes running at once, at most"
    )
    asyncio.run(main(parser.parse_args()))
