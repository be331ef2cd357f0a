"""The same workload on the Temporal dev server (SQLite) and on the Temporal cluster (the server
on PostgreSQL, devstack/temporal_cluster.py), in the same minutes, side by side (issue 26 item 2).

For each server, in turn, the whole embedded stack starts in a fresh state folder (a fresh
cluster database each time, so history shards can change) and three measures run:

(i) the CPU the idle server uses (Temporal and PostgreSQL, `--idle-seconds` with nothing to do
    but the stack's own schedules): what shards and pools cost before any load;
(e) an empty update-with-start workflow, `--clients` concurrent clients straight on Temporal
    (a worker in this process, no database of ours): what the server itself sustains;
(a) POST /api/v1/allocations as bench/allocations.py (a) measures it (same fleet, clients and
    warm-up, fewer requests by default): the control plane's hot path on each server.

    .venv/bin/python -m bench.temporal_servers                       # dev, then cluster
    .venv/bin/python -m bench.temporal_servers --server dev --server cluster:shards=16 ...

A server is `dev`, `cluster` (the defaults of devstack.temporal_cluster.TUNING), or
`cluster:KEY=VALUE,...` with KEY one of shards, conns, idle-conns, vis-conns, vis-idle-conns,
partitions (read and write partitions per task queue), or any dynamic config key (with a dot,
e.g. history.cacheMaxSize=2048). `--rounds N` runs the whole list N times, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import time
import uuid
from typing import Any

from temporalio import workflow
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench.allocations import fund_tenant, seed_bench_fleets, throughput
from bench.stack import (
    bench_stack_options,
    cpu_seconds,
    machine_speed_seconds,
    percentile,
    private_state_dir,
)
from devstack.temporal_cluster import TUNING, ClusterTuning
from devstack.up import Stack

# What each key of a `cluster:` spec sets on ClusterTuning.
TUNING_KEYS = {
    "shards": "history_shards",
    "conns": "max_conns",
    "idle-conns": "max_idle_conns",
    "vis-conns": "visibility_max_conns",
    "vis-idle-conns": "visibility_max_idle_conns",
    "partitions": "task_queue_partitions",
}


@dataclasses.dataclass(frozen=True)
class Server:
    label: str
    mode: str  # "dev" | "cluster"
    tuning: ClusterTuning


def parse_server(spec: str) -> Server:
    mode, _, settings = spec.partition(":")
    if mode not in ("dev", "cluster") or (mode == "dev" and settings):
        raise argparse.ArgumentTypeError(f"{spec!r}: dev, cluster or cluster:KEY=VALUE,...")
    changes: dict[str, Any] = {}
    extra: list[tuple[str, Any]] = []
    for setting in filter(None, settings.split(",")):
        key, _, value = setting.partition("=")
        parsed = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
        if key in TUNING_KEYS:
            changes[TUNING_KEYS[key]] = int(parsed)
        elif "." in key:
            extra.append((key, parsed))
        else:
            raise argparse.ArgumentTypeError(f"{key!r}: one of {', '.join(TUNING_KEYS)}")
    if extra:
        changes["extra_dynamic_config"] = tuple(extra)
    return Server(spec, mode, dataclasses.replace(TUNING, **changes))


@workflow.defn(name="BenchEmptyUpdateWithStart")
class EmptyUpdateWithStart:
    """Starts, takes one update and ends: what update-with-start costs the server alone."""

    def __init__(self) -> None:
        self.updated = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self.updated)

    @workflow.update
    def begin(self) -> str:
        self.updated = True
        return "begun"


async def empty_update_with_start(
    address: str, requests: int, clients: int, warmup: int
) -> dict[str, Any]:
    client = await Client.connect(address)
    queue = f"bench-empty-{uuid.uuid4()}"
    latencies: list[float] = []
    failures: dict[str, int] = {}
    pending: asyncio.Queue[bool] = asyncio.Queue()
    for measured in [False] * warmup + [True] * requests:
        pending.put_nowait(measured)
    window: dict[str, float] = {}

    async def client_loop() -> None:
        while True:
            try:
                measured = pending.get_nowait()
            except asyncio.QueueEmpty:
                return
            if measured and not window:
                window["started"] = time.perf_counter()
            start: WithStartWorkflowOperation[EmptyUpdateWithStart, None] = (
                WithStartWorkflowOperation(
                    EmptyUpdateWithStart.run,
                    id=f"bench-empty-{uuid.uuid4()}",
                    id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                    task_queue=queue,
                )
            )
            t0 = time.perf_counter()
            try:
                await client.execute_update_with_start_workflow(
                    EmptyUpdateWithStart.begin, start_workflow_operation=start
                )
            except Exception as err:  # counted and shown: a failed call is a figure too
                failures[type(err).__name__] = failures.get(type(err).__name__, 0) + 1
                continue
            if measured:
                latencies.append(time.perf_counter() - t0)

    # Unsandboxed: the sandbox would re-import this module and the stack it imports.
    async with Worker(
        client,
        task_queue=queue,
        workflows=[EmptyUpdateWithStart],
        workflow_runner=UnsandboxedWorkflowRunner(),
        max_concurrent_workflow_task_polls=4,
    ):
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        wall = time.perf_counter() - window["started"]
    return {
        "done": len(latencies),
        "failures": failures,
        "wall_s": wall,
        "throughput_per_s": len(latencies) / wall,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }


async def measure(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    state = private_state_dir()
    options = dataclasses.replace(
        bench_stack_options(state), temporal=server.mode, temporal_tuning=server.tuning
    )
    stack = Stack(options)
    try:
        tokens = await stack.start()
        assert stack.cluster is not None
        database_url = stack.cluster.url("gpucloud")
        await seed_bench_fleets(database_url, 1)
        await fund_tenant(options.gateway_probe_url, tokens["tenant_token"], tokens["admin_token"])
        pids = {c.name: c.pid for c in stack.children if c.pid is not None}
        server_pids = {"temporal": pids["temporal"]}
        before = cpu_seconds(server_pids, stack.cluster.datadir)
        await asyncio.sleep(args.idle_seconds)
        after = cpu_seconds(server_pids, stack.cluster.datadir)
        idle_cpu = (
            sum(after[name] - before[name] for name in ("temporal", "postgres")) / args.idle_seconds
        )
        empty = await empty_update_with_start(
            options.temporal_address, args.empty_requests, args.clients, args.warmup
        )
        allocations = await throughput(
            options.gateway_probe_url,
            tokens["tenant_token"],
            args.requests,
            args.clients,
            args.warmup,
            pids,
            0,
            stack.cluster.datadir,
        )
    finally:
        await stack.shutdown()
        shutil.rmtree(state, ignore_errors=True)
    return {"idle": {"cpu_percent": 100 * idle_cpu}, "empty": empty, "allocations": allocations}


def report(server: Server, run: dict[str, Any]) -> str:
    e, a = run["empty"], run["allocations"]
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(a["cpu"].items(), key=lambda x: -x[1]))
    return (
        f"{server.label}: (i) idle {run['idle']['cpu_percent']:.1f} % of a core; "
        f"(e) {e['throughput_per_s']:.1f}/s, p50 {e['p50_ms']:.0f} ms, "
        f"p99 {e['p99_ms']:.0f} ms{' failed ' + str(e['failures']) if e['failures'] else ''}; "
        f"(a) {a['created']} created, {a['other_statuses']} other {a['errors'] or ''}, "
        f"{a['throughput_per_s']:.1f}/s, p50 {a['p50_ms']:.0f} ms, p99 {a['p99_ms']:.0f} ms; "
        f"machine {a['machine']['busy']:.0%} busy, {a['machine']['steal']:.0%} steal; "
        f"CPU s during (a): {cpu}"
    )


def table(servers: list[Server], runs: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown, one column per server; each cell has that server's runs in the order they ran."""
    rows = [
        ("(i) idle Temporal + PostgreSQL, % of a core", "idle", ("cpu_percent",)),
        ("(e) empty update-with-start, /s", "empty", ("throughput_per_s",)),
        ("(e) p50 / p99 ms", "empty", ("p50_ms", "p99_ms")),
        ("(a) POST /allocations, /s", "allocations", ("throughput_per_s",)),
        ("(a) p50 / p99 ms", "allocations", ("p50_ms", "p99_ms")),
    ]

    def cell(label: str, measure: str, keys: tuple[str, ...]) -> str:
        digits = ".0f" if keys[0].endswith("_ms") else ".1f"
        return ", ".join(
            " / ".join(format(run[measure][key], digits) for key in keys) for run in runs[label]
        )

    labels = [s.label for s in servers]
    lines = ["| | " + " | ".join(f"`{label}`" for label in labels) + " |"]
    lines.append("|---" * (len(labels) + 1) + "|")
    for title, measure, keys in rows:
        cells = [cell(label, measure, keys) for label in labels]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    # The throughput fleet has no agents on purpose: its host work must not time out meanwhile.
    os.environ["GPUCLOUD_NODE_SCHEDULE_TO_START_S"] = "900"
    servers: list[Server] = args.server or [parse_server("dev"), parse_server("cluster")]
    speed_before = machine_speed_seconds()
    runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in servers}
    lines: list[str] = []
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    for _ in range(args.rounds):
        for server in servers:
            run = await measure(server, args)
            runs[server.label].append(run)
            lines.append(report(server, run))
            print(lines[-1], flush=True)
    speed_after = machine_speed_seconds()
    print()
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.platform()}")
    print(f"started {started}, ended {time.strftime('%H:%M %Z')}")
    print(
        f"machine speed: a 10M-iteration Python loop took {speed_before:.2f} s before and "
        f"{speed_after:.2f} s after (lower is faster)"
    )
    print(
        f"(e) {args.empty_requests} and (a) {args.requests} requests from {args.clients} "
        f"clients after {args.warmup} warm-up each; cluster defaults: {TUNING}"
    )
    print(*lines, sep="\n")
    print(table(servers, runs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        action="append",
        type=parse_server,
        help="dev, cluster or cluster:KEY=VALUE,... (repeat; default: dev, then cluster)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=600, help="(a)'s measured requests")
    parser.add_argument("--empty-requests", type=int, default=600, help="(e)'s measured requests")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="(i)'s window")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=40)
    asyncio.run(main(parser.parse_args()))
