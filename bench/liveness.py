"""What an idle node costs the control plane, before and after issue 27 item 2, on the real stack
(devstack.up.Stack in a private state folder: PostgreSQL, Temporal dev server, worker, gateway).

One stack, three windows of `--window` seconds in a row, in the same minutes:
  baseline  no agents: the control plane's own periodic work (liveness sweep, billing meter);
  before    `--nodes` idle agents as they were (bench/idle_fleet.py --mode before: a presence
            signal with the full inventory every 30 s);
  after     the same agents as they are now (agent/heartbeat.py: a signal at start, on an
            inventory change and every half hour; liveness read from their polls).
For each window it counts the Temporal work from the histories (workflow starts, signals,
activities and local activities: what a metered Temporal service bills as actions; workflow
tasks; the node queues the liveness sweeps described) and the CPU of the control plane's
processes (worker, Temporal server, PostgreSQL, gateway), and prints them per idle node per
hour. The agents' own process is not the control plane and is not counted.

    .venv/bin/python -m bench.liveness                       # 500 nodes, 5-minute windows
    .venv/bin/python -m bench.liveness --nodes 50 --window 40
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from agent.heartbeat import DEFAULT_REFRESH_SECONDS
from bench.idle_fleet import idle_fleet_child, seed_idle_fleet
from bench.stack import (
    bench_stack_options,
    cpu_seconds,
    machine_cpu_shares,
    machine_cpu_ticks,
    private_state_dir,
)
from contracts.node_liveness import LivenessResult
from contracts.node_presence import node_presence_workflow_id
from core.config import Settings
from core.temporal import connect
from devstack.up import Stack
from workflows.node_liveness import WORKFLOW_NAME as LIVENESS_WORKFLOW

CONTROL_PLANE = ("worker", "temporal", "postgres", "gateway")
ACTIVITY_EVENTS = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    EventType.EVENT_TYPE_MARKER_RECORDED,  # a local activity
}


@dataclass
class Window:
    name: str
    seconds: float = 0.0
    starts: int = 0
    signals: int = 0
    activities: int = 0
    workflow_tasks: int = 0
    queues_described: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0

    @property
    def actions(self) -> int:
        return self.starts + self.signals + self.activities

    @property
    def control_plane_cpu(self) -> float:
        return sum(self.cpu.get(name, 0.0) for name in CONTROL_PLANE)


async def count_events(
    client: Client, workflow_ids: list[str], window: Window, since: dt.datetime, until: dt.datetime
) -> None:
    """Add the events of these workflows' current runs that happened inside the window."""
    for workflow_id in workflow_ids:
        try:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
        except RPCError as err:  # a node whose agent never signalled has no presence workflow
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            continue
        for event in history.events:
            at = event.event_time.ToDatetime(dt.UTC)
            if not since <= at < until:
                continue
            kind = event.event_type
            if kind in (
                EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED,
                EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
            ):
                window.starts += kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                window.signals += 1
            elif kind in ACTIVITY_EVENTS:
                window.activities += 1
            elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                window.workflow_tasks += 1


async def count_sweeps(
    client: Client, window: Window, since: dt.datetime, until: dt.datetime
) -> None:
    query = (
        f"WorkflowType = '{LIVENESS_WORKFLOW}' AND StartTime >= '{since.isoformat()}' "
        f"AND StartTime < '{until.isoformat()}'"
    )
    ids = [w.id async for w in client.list_workflows(query)]
    await count_events(client, ids, window, since, until)
    for workflow_id in ids:
        handle = client.get_workflow_handle(workflow_id, result_type=LivenessResult)
        result = await handle.result()
        window.queues_described += result.queues_described


async def measure(
    name: str,
    seconds: float,
    client: Client,
    pids: dict[str, int],
    datadir: Path,
    node_ids: list[str],
) -> Window:
    window = Window(name)
    since = dt.datetime.now(dt.UTC)
    cpu0, machine0, t0 = cpu_seconds(pids, datadir), machine_cpu_ticks(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu1, machine1 = cpu_seconds(pids, datadir), machine_cpu_ticks()
    window.seconds = time.perf_counter() - t0
    until = dt.datetime.now(dt.UTC)
    window.cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    window.busy = machine_cpu_shares(machine0, machine1)["busy"]
    await asyncio.sleep(2)  # let the last workflow tasks of the window land in their histories
    await count_events(
        client, [node_presence_workflow_id(n) for n in node_ids], window, since, until
    )
    await count_sweeps(client, window, since, until)
    return window


def per_node_hour(value: float, window: Window, nodes: int) -> float:
    return value / nodes * 3600 / window.seconds


async def main(args: argparse.Namespace) -> None:
    state = private_state_dir()
    options = bench_stack_options(state)
    stack = Stack(options)
    windows: list[Window] = []
    try:
        await stack.start()
        assert stack.cluster is not None
        database_url = stack.cluster.url("gpucloud")
        pg_dir = stack.cluster.datadir
        node_ids = await seed_idle_fleet(database_url, args.nodes)
        client = await connect(
            Settings.from_env(
                {
                    **os.environ,
                    "GPUCLOUD_TEMPORAL_ADDRESS": options.temporal_address,
                    "GPUCLOUD_TEMPORAL_NAMESPACE": options.namespace,
                }
            )
        )
        pids = {c.name: c.pid for c in stack.children if c.pid is not None}
        windows.append(await measure("baseline", args.window, client, pids, pg_dir, node_ids))
        for mode in ("before", "after"):
            fleet = idle_fleet_child(stack, database_url, args.nodes, mode, args.start_over)
            stack.children.append(fleet)
            await fleet.start()
            # Every agent started and past its first signal before the window opens.
            await asyncio.sleep(args.start_over + 10)
            windows.append(await measure(mode, args.window, client, pids, pg_dir, node_ids))
            await fleet.stop()
            stack.children.remove(fleet)
    finally:
        await stack.shutdown()
        shutil.rmtree(state, ignore_errors=True)

    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.platform()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"{args.nodes} idle nodes, windows of {args.window:.0f} s")
    for w in windows:
        print(
            f"{w.name:>8}: {w.starts} workflow starts, {w.signals} signals, {w.activities} "
            f"activities (local included), {w.workflow_tasks} workflow tasks, "
            f"{w.queues_described} node queues described; control-plane CPU "
            f"{w.control_plane_cpu:.1f} s ("
            + ", ".join(f"{k} {w.cpu.get(k, 0.0):.1f}" for k in CONTROL_PLANE)
            + f"); machine {w.busy:.0%} busy"
        )
    baseline = windows[0]
    figures = {}
    for w in windows[1:]:
        extra_cpu = w.control_plane_cpu - baseline.control_plane_cpu * w.seconds / baseline.seconds
        figures[w.name] = (
            per_node_hour(w.actions, w, args.nodes),
            per_node_hour(w.workflow_tasks, w, args.nodes),
            per_node_hour(w.queues_described, w, args.nodes),
            per_node_hour(extra_cpu, w, args.nodes),
        )
        actions, tasks, described, cpu = figures[w.name]
        print(
            f"{w.name:>8} per idle node per hour: {actions:.1f} Temporal actions, "
            f"{tasks:.1f} workflow tasks, {described:.1f} queue describes, "
            f"{cpu * 1000:.0f} ms control-plane CPU (above the baseline)"
        )
    before, after = figures["before"], figures["after"]
    # The after-agents' half-hourly refresh falls outside windows shorter than 30 minutes: count
    # it at what one signal cost in the before window (a signal, its local activity, its task).
    window = windows[1]
    signals = max(window.signals, 1)
    per_signal_cpu = (before[3] * args.nodes * window.seconds / 3600) / signals
    refresh = 3600 / DEFAULT_REFRESH_SECONDS
    with_refresh = (after[0] + 2 * refresh, after[1] + refresh, after[3] + refresh * per_signal_cpu)
    print(
        f"   after, with its refresh signal ({refresh:.0f} an hour, at the before cost of one): "
        f"{with_refresh[0]:.1f} actions, {with_refresh[1]:.1f} workflow tasks, "
        f"{with_refresh[2] * 1000:.0f} ms control-plane CPU per idle node per hour"
    )
    print(
        f"after / before: actions {with_refresh[0] / max(before[0], 1e-9):.1%}, workflow tasks "
        f"{with_refresh[1] / max(before[1], 1e-9):.1%}, control-plane CPU "
        f"{with_refresh[2] / max(before[3], 1e-9):.1%} (target: at most a tenth)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--window", type=float, default=300.0, help="seconds per window")
    parser.add_argument(
        "--start-over", type=float, default=30.0, help="agents' starts spread over this (s)"
    )
    asyncio.run(main(parser.parse_args()))
