"""`gpucloud-agent [--config /etc/gpucloud/agent.toml] [--backend simulated]`: the node agent, a
Temporal worker on the node's own task queue `node-{node_id}` running the host activities.

On a real node the agent starts from the config file cloud-init wrote (agent/enrollment.py
documents it), enrolls once with its single-use token and keeps the identity it got; from then on
it talks to Temporal only. `--node-id` skips enrollment (the simulated fleet and development).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path

from agent.backend import HostBackend
from agent.enrollment import DEFAULT_CONFIG_PATH, AgentConfig, ensure_enrolled
from agent.heartbeat import DEFAULT_INTERVAL_SECONDS, run_heartbeats
from agent.node_worker import build_node_worker, run_until_signalled
from core.config import Settings
from core.temporal import connect

__all__ = ["build_node_worker", "main"]

BACKENDS = ("simulated", "host")
AGENT_VERSION = "0.1.0"
# On SIGTERM, running host tasks get this long to finish before they are cancelled.
SHUTDOWN_GRACE = timedelta(seconds=10)


def make_backend(
    kind: str, node_id: str, hostname: str | None, config_path: Path | None = None
) -> HostBackend:
    if kind == "host":
        # libvirt on this node, configured in the agent config's [libvirt] table.
        from agent.backends.from_config import host_backend_from_config

        return host_backend_from_config(config_path or DEFAULT_CONFIG_PATH)
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
    parser.add_argument(
        "--node-id", type=uuid.UUID, help="this node's UUID (skips enrollment; development only)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("GPUCLOUD_AGENT_CONFIG", DEFAULT_CONFIG_PATH)),
        help="agent config written by cloud-init (default: %(default)s)",
    )
    parser.add_argument("--backend", choices=BACKENDS, default="simulated")
    parser.add_argument("--hostname", default=None, help="node hostname (default: this host's)")
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=float(os.environ.get("GPUCLOUD_AGENT_HEARTBEAT_S", DEFAULT_INTERVAL_SECONDS)),
        help="how often liveness and GPU inventory are reported (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, settings: Settings) -> None:
    if args.node_id is not None:
        node_id = str(args.node_id)
    else:
        identity = await ensure_enrolled(AgentConfig.load(args.config), agent_version=AGENT_VERSION)
        node_id = identity.node_id
        settings = dataclasses.replace(
            settings,
            temporal_address=identity.temporal_address,
            temporal_namespace=identity.temporal_namespace,
        )
    hostname = args.hostname or socket.gethostname()
    backend = make_backend(args.backend, node_id, hostname, args.config)
    client = await connect(settings, identity=f"agent-{node_id}@{hostname}")
    worker = build_node_worker(client, node_id, backend, graceful_shutdown=SHUTDOWN_GRACE)
    logging.getLogger("agent").info("agent for node %s polling %s", node_id, worker.task_queue)
    stop = asyncio.Event()
    heartbeats = asyncio.create_task(
        run_heartbeats(
            client,
            node_id,
            control_plane_queue=settings.control_plane_task_queue,
            stop=stop,
            interval=args.heartbeat_seconds,
            agent_version=AGENT_VERSION,
        )
    )
    try:
        await run_until_signalled([worker], stop)
    finally:
        stop.set()
        await heartbeats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(args, Settings.from_env()))


if __name__ == "__main__":
    main()
