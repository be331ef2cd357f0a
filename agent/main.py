"""`gpucloud-agent --node-id ID [--backend simulated]`: the node agent, a Temporal worker on the
node's own task queue `node-{node_id}` running the host activities.

Enrollment (a short-lived enrollment token exchanged for the node's identity, ARCHITECTURE rule 7)
is a later issue: for now the node id comes from the command line and the agent talks to Temporal
with the settings from the environment (core.config.Settings).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import uuid
from datetime import timedelta

from agent.backend import HostBackend
from agent.node_worker import build_node_worker, run_until_signalled
from core.config import Settings
from core.temporal import connect

__all__ = ["build_node_worker", "main"]

BACKENDS = ("simulated",)
# On SIGTERM, running host tasks get this long to finish before they are cancelled.
SHUTDOWN_GRACE = timedelta(seconds=10)


def make_backend(kind: str, node_id: str, hostname: str | None) -> HostBackend:
    if kind == "simulated":
        # Imported here: a real node's agent never loads the simulator.
        from sim.config import SimHostConfig
        from sim.host import SimulatedHost

        return SimulatedHost(node_id, hostname=hostname, config=SimHostConfig.from_env(node_id))
    raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpucloud-agent", description="Run the node agent: host activities on node-{node_id}."
    )
    parser.add_argument("--node-id", required=True, type=uuid.UUID, help="this node's UUID")
    parser.add_argument("--backend", choices=BACKENDS, default="simulated")
    parser.add_argument("--hostname", default=None, help="node hostname (default: this host's)")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, settings: Settings) -> None:
    node_id = str(args.node_id)
    hostname = args.hostname or socket.gethostname()
    backend = make_backend(args.backend, node_id, hostname)
    client = await connect(settings, identity=f"agent-{node_id}@{hostname}")
    worker = build_node_worker(client, node_id, backend, graceful_shutdown=SHUTDOWN_GRACE)
    logging.getLogger("agent").info("agent for node %s polling %s", node_id, worker.task_queue)
    await run_until_signalled([worker])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(args, Settings.from_env()))


if __name__ == "__main__":
    main()
