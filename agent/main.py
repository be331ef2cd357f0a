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

The payload key: an enrolled agent holds only its node's own key, which enrollment wrote to its
payload key file (core/codec.py: derived for this node from the control plane's cluster key; it
opens only this node's payloads). GPUCLOUD_CODEC_KEY (development, tests) or a `payload_key_file`
written by a cloud-init from before node keys is the cluster key, used as before. Without any
key the agent refuses to start, unless `--dev` says this is a development run (then the embedded
stack's public development key is used). `--node-id` skips enrollment (development).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
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
from agent.enrollment import AgentConfig, AgentIdentity, EnrollmentError, ensure_enrolled
from agent.heartbeat import DEFAULT_INTERVAL_SECONDS, probe_local_gpus, run_heartbeats
from agent.node_worker import NodeServices, build_node_worker, run_until_signalled
from contracts.node_files import DEFAULT_CONFIG_PATH
from core.codec import key_id
from core.config import DEV_CODEC_KEY_B64, Settings
from core.crash_traces import enable_crash_traces
from core.temporal import connect, with_node_payload_key

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


@dataclasses.dataclass(frozen=True)
class PayloadKey:
    key_b64: str = dataclasses.field(repr=False)
    # Set: the node's own derived key (it opens this node's payloads only); None: the cluster key.
    node_id: str | None = None


def _read_key_file(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the payload key file: {err.strerror}") from None


def payload_key(
    config: dict[str, Any],
    root: SystemRoot,
    *,
    dev: bool,
    identity: AgentIdentity | None = None,
    key_path: Path | None = None,
) -> PayloadKey:
    """The payload codec key: the environment's (the cluster key, as given); else the node key
    enrollment stored at `key_path` (the identity names its key id); else the config's key file
    (a cloud-init from before node keys wrote the cluster key there); the development key only
    with --dev."""
    if os.environ.get(CODEC_KEY_ENV):
        return PayloadKey(os.environ[CODEC_KEY_ENV])
    if identity is not None and identity.payload_key_id and key_path is not None:
        key_b64 = _read_key_file(key_path)
        try:
            stored_id = key_id(base64.b64decode(key_b64, validate=True))
        except (binascii.Error, ValueError):
            stored_id = ""
        if stored_id != identity.payload_key_id:
            raise ConfigError(
                "the payload key file does not hold the key this node enrolled with "
                "(re-enroll: a fresh enrollment token and an empty state dir)"
            )
        return PayloadKey(key_b64, identity.node_id)
    key_file = config.get("payload_key_file")
    if isinstance(key_file, str) and key_file:
        return PayloadKey(_read_key_file(root.host_path(key_file)))
    if dev:
        return PayloadKey(DEV_CODEC_KEY_B64)
    raise ConfigError(
        f"no payload key: enroll, or set {CODEC_KEY_ENV} or payload_key_file in the agent "
        "config (--dev uses the public development key)"
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
    if os.environ.get(CODEC_KEY_ENV):
        # A malformed key fails here, before enrollment spends the token.
        _ = dataclasses.replace(settings, codec_key_b64=os.environ[CODEC_KEY_ENV]).codec_key
    if args.node_id is not None:
        node_id = str(args.node_id)
        key = payload_key(config, root, dev=args.dev)
    else:
        agent_config = AgentConfig.from_data(config, source=config_path)
        agent_config = dataclasses.replace(
            agent_config,
            state_dir=root.host_path(str(agent_config.state_dir)),
            payload_key_file=root.host_path(str(agent_config.payload_key_file))
            if agent_config.payload_key_file is not None
            else None,
        )
        identity = await ensure_enrolled(agent_config, agent_version=AGENT_VERSION)
        node_id = identity.node_id
        key = payload_key(
            config,
            root,
            dev=args.dev,
            identity=identity,
            key_path=agent_config.payload_key_path,
        )
        settings = dataclasses.replace(
            settings,
            temporal_address=identity.temporal_address,
            temporal_namespace=identity.temporal_namespace,
            control_plane_task_queue=identity.control_plane_task_queue
            or settings.control_plane_task_queue,
        )
    settings = dataclasses.replace(settings, codec_key_b64=key.key_b64)
    hostname = args.hostname or socket.gethostname()
    services = make_services(args.backend, BackendContext(config, root, node_id, hostname))
    client = await connect(settings, identity=f"agent-{node_id}@{hostname}")
    if key.node_id is not None:
        client = with_node_payload_key(client, settings.codec_key, key.node_id)
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
