"""`gpucloud-agent [--config /etc/gpucloud/agent.toml] [--backend host] [--dev]`: the node
agent, a Temporal worker on the node's own task queue `node-{node_id}` running every host task the
control plane schedules there (agent.node_worker.node_activities).

On a real node the agent starts from the config file cloud-init wrote (agent/enrollment.py
documents it; agent.d/*.toml drop-ins beside it are merged in), enrolls once with its single-use
token and keeps the identity it got; from then on it talks to Temporal only.

Backends: `host` (the default) is this machine: libvirt for slices, system accounts for bare
metal, pyroute2 for networks, sysfs/NVML and the vendor tool for GPUs
(agent/backends/from_config.py). Any other name is a plugin from the entry-point group
`gpucloud.agent.backends` (the simulator registers `simulated` from sim/): the agent never imports
a simulator itself.

The payload key (AES, base64) comes from GPUCLOUD_CODEC_KEY or the config's `payload_key_file`;
without one the agent refuses to start, unless `--dev` says this is a development run (then the
embedded stack's public development key is used). `--node-id` skips enrollment (development).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import sys
import uuid
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from agent.backends.system_root import SystemRoot
from agent.config_file import ConfigError, gpu_sysfs, host_root_from_env, read_agent_config
from agent.enrollment import AgentConfig, EnrollmentError, ensure_enrolled
from agent.heartbeat import DEFAULT_INTERVAL_SECONDS, probe_local_gpus, run_heartbeats
from agent.node_worker import NodeServices, build_node_worker, run_until_signalled
from contracts.node_files import DEFAULT_CONFIG_PATH
from core.config import DEV_CODEC_KEY_B64, Settings
from core.crash_traces import enable_crash_traces
from core.temporal import connect

__all__ = ["build_node_worker", "main"]

HOST_BACKEND = "host"
BACKEND_ENTRY_POINTS = "gpucloud.agent.backends"
AGENT_VERSION = "0.2.0"
CODEC_KEY_ENV = "GPUCLOUD_CODEC_KEY"
# On SIGTERM, running host tasks get this long to finish before they are cancelled.
SHUTDOWN_GRACE = timedelta(seconds=10)
# Exit status for a configuration the agent cannot start with (systemd: RestartPreventExitStatus).
EXIT_CONFIG = 78


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """What a backend factory gets: the merged agent config, the host root and the node."""

    config: dict[str, Any]
    root: SystemRoot
    node_id: str
    hostname: str


def backend_names() -> list[str]:
    return [HOST_BACKEND, *sorted(ep.name for ep in entry_points(group=BACKEND_ENTRY_POINTS))]


def make_services(kind: str, context: BackendContext) -> NodeServices:
    if kind == HOST_BACKEND:
        from agent.backends.from_config import node_services_from_config

        return node_services_from_config(context.config, context.root, hostname=context.hostname)
    for ep in entry_points(group=BACKEND_ENTRY_POINTS, name=kind):
        factory = ep.load()
        services = factory(context)
        if not isinstance(services, NodeServices):
            raise ConfigError(f"backend {kind!r} did not build NodeServices")
        return services
    raise ConfigError(f"unknown backend {kind!r}; choose one of {', '.join(backend_names())}")


def payload_key(config: dict[str, Any], root: SystemRoot, *, dev: bool) -> str:
    """The payload codec key (base64): the environment's, else the config's key file; the
    development key only with --dev."""
    if os.environ.get(CODEC_KEY_ENV):
        return os.environ[CODEC_KEY_ENV]
    key_file = config.get("payload_key_file")
    if isinstance(key_file, str) and key_file:
        try:
            return root.host_path(key_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"cannot read payload_key_file: {err.strerror}") from None
    if dev:
        return DEV_CODEC_KEY_B64
    raise ConfigError(
        f"no payload key: set {CODEC_KEY_ENV} or payload_key_file in the agent config "
        "(--dev uses the public development key)"
    )


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
    parser.add_argument(
        "--backend",
        default=HOST_BACKEND,
        help="host backend: 'host' (this machine) or a plugin's name (default: %(default)s)",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help="development run: allows the public development payload key",
    )
    parser.add_argument("--hostname", default=None, help="node hostname (default: this host's)")
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=float(os.environ.get("GPUCLOUD_AGENT_HEARTBEAT_S", DEFAULT_INTERVAL_SECONDS)),
        help="how often the GPU inventory is checked; a change is reported (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, settings: Settings) -> None:
    root = host_root_from_env()
    config_path = root.host_path(str(args.config))
    config = read_agent_config(config_path) if config_path.exists() or args.node_id is None else {}
    settings = dataclasses.replace(settings, codec_key_b64=payload_key(config, root, dev=args.dev))
    _ = settings.codec_key  # a malformed key fails here, before enrollment spends the token
    if args.node_id is not None:
        node_id = str(args.node_id)
    else:
        agent_config = AgentConfig.from_data(config, source=config_path)
        agent_config = dataclasses.replace(
            agent_config, state_dir=root.host_path(str(agent_config.state_dir))
        )
        identity = await ensure_enrolled(agent_config, agent_version=AGENT_VERSION)
        node_id = identity.node_id
        settings = dataclasses.replace(
            settings,
            temporal_address=identity.temporal_address,
            temporal_namespace=identity.temporal_namespace,
            control_plane_task_queue=identity.control_plane_task_queue
            or settings.control_plane_task_queue,
        )
    hostname = args.hostname or socket.gethostname()
    services = make_services(args.backend, BackendContext(config, root, node_id, hostname))
    client = await connect(settings, identity=f"agent-{node_id}@{hostname}")
    worker = build_node_worker(client, node_id, services, graceful_shutdown=SHUTDOWN_GRACE)
    logging.getLogger("agent").info(
        "agent %s (%s backend) for node %s polling %s",
        AGENT_VERSION,
        args.backend,
        node_id,
        worker.task_queue,
    )
    stop = asyncio.Event()
    sysfs = gpu_sysfs(config, root)
    heartbeats = asyncio.create_task(
        run_heartbeats(
            client,
            node_id,
            control_plane_queue=settings.control_plane_task_queue,
            stop=stop,
            # NVML reads the driver of the machine the process runs on: only on the real root.
            inventory=lambda: probe_local_gpus(sysfs, use_nvml=root.is_real_root),
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
    enable_crash_traces()
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(run(args, Settings.from_env()))
    except (ConfigError, ValueError) as err:
        logging.getLogger("agent").error("cannot start: %s", err)
        sys.exit(EXIT_CONFIG)
    except EnrollmentError as err:
        logging.getLogger("agent").error("enrollment failed (%s): %s", err.code, err)
        sys.exit(1)


if __name__ == "__main__":
    main()
