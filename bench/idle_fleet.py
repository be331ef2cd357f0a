"""`python -m bench.idle_fleet`: many idle node agents in one process, for the benchmarks that
measure what an idle fleet costs the control plane (bench/liveness.py) and what it leaves of
its capacity (bench/allocations.py --idle-agents).

Each node runs what a real agent runs for an idle node: its worker polling `node-{id}`
(agent.node_worker.build_node_worker, a simulated host behind it that never gets work) and its
presence signals (agent.heartbeat.run_heartbeats, reporting the node's GPU slots as its
inventory). `--mode before` replaces the latter with the agent loop as it was before issue 27:
a signal with the full inventory every 30 s. Nodes are the ones seed_idle_fleet seeds (ids
derive from hostnames), and their agents start spread over `--start-over` seconds, as a fleet's
agents are not synchronised.

    python -m bench.idle_fleet --nodes 2000 [--mode before]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import tempfile
from pathlib import Path

from sqlalchemy import text
from temporalio.client import Client
from temporalio.worker import Worker

from agent.heartbeat import run_heartbeats, send_heartbeat
from agent.node_worker import NodeServices, build_node_worker, stop_on_signals
from contracts.node_presence import ReportedGpu
from core.config import Settings
from core.temporal import connect
from devstack.processes import Child, python_entry
from devstack.up import REPO_ROOT, Stack
from schema.db import create_engine, session_factory
from sim.config import SimHostConfig
from sim.demo_fleet import NodeSpec, build_fleet, seed_fleet
from sim.fleet import POLLERS_PER_NODE
from sim.host import SimulatedHost
from sim.node_services import machine_maintenance

log = logging.getLogger("bench.idle_fleet")
# The agent loop before issue 27: every 30 s, a presence signal with the full inventory.
BEFORE_INTERVAL_SECONDS = 30.0

# Where the benchmarks seed their idle fleet (a region of its own: no placement lands there).
REGION = "bench-idle"
PREFIX = "idle"


async def seed_idle_fleet(database_url: str, nodes: int) -> list[str]:
    """The idle fleet's nodes, as `build_fleet` makes them; their ids."""
    fleet = build_fleet(nodes, 8, region=REGION, hostname_prefix=PREFIX)
    engine = create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        async with session_factory(engine)() as session, session.begin():
            await seed_fleet(session, fleet)
        async with engine.connect() as connection:
            await connection.execute(text("ANALYZE nodes, gpu_slots"))
            await connection.commit()
    finally:
        await engine.dispose()
    return [str(node.id) for node in fleet.nodes]


def idle_fleet_child(
    stack: Stack,
    database_url: str,
    nodes: int,
    mode: str = "after",
    start_over: float = 30.0,
    nice: int = 0,
) -> Child:
    """This module as a child process of `stack`, serving the nodes `seed_idle_fleet` made."""
    argv = [*python_entry("bench.idle_fleet"), "--nodes", str(nodes), "--region", REGION]
    argv += ["--prefix", PREFIX, "--mode", mode, "--start-over", str(start_over)]
    argv += ["--nice", str(nice)]
    return Child(
        f"idle-fleet-{mode}",
        argv,
        stack.o.logs_dir / f"idle-fleet-{mode}.log",
        stack._child_env(database_url),
        REPO_ROOT,
    )


async def heartbeats_before(
    client: Client, node_id: str, queue: str, gpus: list[ReportedGpu], stop: asyncio.Event
) -> None:
    """agent/heartbeat.py's run_heartbeats as it was (git show 81d5cd0:agent/heartbeat.py)."""
    while not stop.is_set():
        try:
            await send_heartbeat(client, node_id, control_plane_queue=queue, gpus=gpus)
        except Exception as err:
            log.warning("heartbeat for node %s failed: %s", node_id, type(err).__name__)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=BEFORE_INTERVAL_SECONDS)


async def run_agent(
    client: Client,
    node: NodeSpec,
    services: NodeServices,
    args: argparse.Namespace,
    queue: str,
    stop: asyncio.Event,
) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=random.uniform(0, args.start_over))
        return  # stopped before this agent's turn came
    node_id = str(node.id)
    worker: Worker = build_node_worker(
        client, node_id, services, identity=f"idle-agent-{node_id}", pollers=args.pollers
    )
    gpus = [ReportedGpu(s.pci_address, s.numa_node) for s in node.slots]
    if args.mode == "before":
        beats = heartbeats_before(client, node_id, queue, gpus, stop)
    else:
        beats = run_heartbeats(
            client,
            node_id,
            control_plane_queue=queue,
            stop=stop,
            inventory=lambda: gpus,
            agent_version="idle",
        )
    polling = asyncio.create_task(worker.run())
    try:
        await beats
    finally:
        await worker.shutdown()
        await asyncio.gather(polling, return_exceptions=True)


async def run(args: argparse.Namespace) -> None:
    settings = Settings.from_env()
    client = await connect(settings, identity="bench-idle-fleet")
    fleet = build_fleet(args.nodes, 8, region=args.region, hostname_prefix=args.prefix)
    # Idle agents never get maintenance work: one simulated machine's backend serves them all.
    maintenance = machine_maintenance(Path(tempfile.mkdtemp(prefix="gpucloud-idle-fleet-")))
    stop = asyncio.Event()
    with stop_on_signals(stop):
        agents = [
            run_agent(
                client,
                node,
                NodeServices(SimulatedHost(str(node.id), config=SimHostConfig()), maintenance),
                args,
                settings.control_plane_task_queue,
                stop,
            )
            for node in fleet.nodes
        ]
        log.info(
            "%d idle agents (%s), starting over %.0f s", len(agents), args.mode, args.start_over
        )
        await asyncio.gather(*agents)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--region", default=REGION)
    parser.add_argument("--prefix", default=PREFIX, help="the fleet's hostname prefix")
    parser.add_argument("--mode", choices=("after", "before"), default="after")
    parser.add_argument("--start-over", type=float, default=30.0, help="seconds (default: 30)")
    parser.add_argument(
        "--pollers", type=int, default=POLLERS_PER_NODE, help="pollers per node worker"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower this process's CPU priority: agents run on their own machines, and a "
        "benchmark that shares one with the control plane should not give them its cores",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.nice(args.nice)
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
