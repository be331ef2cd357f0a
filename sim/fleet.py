"""`python -m sim.fleet`: the agents of many simulated nodes in one process.

One Temporal client, one worker per node queue `node-{id}`, one SimulatedHost per node (or, with
`--hosts libvirt-test`, the node's real backends on libvirt's test driver: sim.libvirt_hosts, with
each node's GPU slots read from the database). Nodes come
from `--node-id` arguments or from the database (nodes that are active or draining: a draining
node still has allocations to release); with the database, the list is re-read every
`--refresh-seconds`, so nodes onboarded while the fleet runs get an agent too. Phase delays and
faults come from the GPUCLOUD_SIM_* environment (sim.config) and the options below. SIGINT or
SIGTERM stops every worker cleanly.

    python -m sim.fleet                                 # every active node in the database
    python -m sim.fleet --node-id 3f0c... --phase-delay 2 --jitter 0.3
    python -m sim.fleet --faults '[{"activity": "slice.vm_provision", "kind": "vfio_error"}]'
    python -m sim.fleet --hosts libvirt-test --state-dir .state/libvirt-hosts
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client
from temporalio.worker import Worker

from agent.backend import HostBackend
from agent.backends.system_root import SystemRoot
from agent.heartbeat import DEFAULT_INTERVAL_SECONDS, run_heartbeats
from agent.node_worker import (
    NODE_QUEUE_POLLERS,
    NodeServices,
    build_node_worker,
    stop_on_signals,
)
from contracts.states import NodeStatus
from core.config import Settings
from core.crash_traces import enable_crash_traces
from core.temporal import connect
from schema.db import create_engine, session_factory
from schema.models import GpuSlot, Node, Sku
from sim.config import SimHostConfig
from sim.faults import FaultSpec
from sim.host import SimulatedHost
from sim.libvirt_hosts import GpuPlacement, LibvirtTestHost, build_libvirt_test_host
from sim.machine_image import build_machine
from sim.node_services import machine_services, simulated_services, simulated_storage

logger = logging.getLogger("sim.fleet")

# Nodes that need an agent: active ones take new work, draining ones still release old work.
AGENT_NODE_STATUSES = (NodeStatus.ACTIVE.value, NodeStatus.DRAINING.value)
# A simulated node polls as a real agent does.
POLLERS_PER_NODE = NODE_QUEUE_POLLERS
HOST_KINDS = ("simulated", "libvirt-test")
DEFAULT_LIBVIRT_STATE_DIR = Path(".state/libvirt-hosts")


@dataclass(frozen=True)
class AgentNode:
    node_id: str
    hostname: str | None = None


async def load_agent_nodes(
    session: AsyncSession, node_ids: Collection[str] | None = None
) -> list[AgentNode]:
    """Nodes that need an agent; with `node_ids`, only those (the fleet's own machines: a node
    booted elsewhere, e.g. by the MAAS simulator's first boot, runs its own agent)."""
    query = select(Node.id, Node.hostname).where(Node.status.in_(AGENT_NODE_STATUSES))
    if node_ids is not None:
        query = query.where(Node.id.in_([uuid.UUID(n) for n in node_ids]))
    rows = await session.execute(query.order_by(Node.id))
    return [AgentNode(str(node_id), hostname) for node_id, hostname in rows.all()]


@dataclass(frozen=True)
class NodeHardware:
    """What a libvirt-test host is generated from: the node's GPU slots (by gpu_index), its NUMA
    layout and its SKU's image."""

    gpus: tuple[GpuPlacement, ...]
    numa_layout: tuple[dict[str, object], ...] = ()
    image: str = ""


async def load_node_hardware(
    session: AsyncSession, node_ids: Iterable[str]
) -> dict[str, NodeHardware]:
    ids = [uuid.UUID(n) for n in node_ids]
    if not ids:
        return {}
    nodes = await session.execute(
        select(Node.id, Node.numa_layout, Sku.image)
        .outerjoin(Sku, (Sku.name == Node.sku) & (Sku.region == Node.region))
        .where(Node.id.in_(ids))
    )
    slots = await session.execute(
        select(GpuSlot.node_id, GpuSlot.pci_address, GpuSlot.numa_node)
        .where(GpuSlot.node_id.in_(ids))
        .order_by(GpuSlot.node_id, GpuSlot.gpu_index)
    )
    gpus: dict[str, list[GpuPlacement]] = {}
    for node_id, pci_address, numa_node in slots.all():
        gpus.setdefault(str(node_id), []).append(GpuPlacement(pci_address, numa_node))
    return {
        str(node_id): NodeHardware(
            tuple(gpus.get(str(node_id), ())), tuple(layout or ()), image or ""
        )
        for node_id, layout, image in nodes.all()
    }


class HostFactory(Protocol):
    """Builds the services of one node (instead of a SimulatedHost); `close()` at fleet stop."""

    def __call__(self, node: AgentNode) -> NodeServices: ...

    def close(self) -> None: ...


class LibvirtTestHosts:
    """`--hosts libvirt-test`: a libvirt test-driver host per node (sim.libvirt_hosts), its
    connection held open for the process lifetime (a test:/// connection keeps its domains only
    while open). `hardware` must be loaded (`load`) before a node is started."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.hardware: dict[str, NodeHardware] = {}
        self.hosts: dict[str, LibvirtTestHost] = {}

    async def load(self, session: AsyncSession, node_ids: Iterable[str]) -> None:
        missing = [n for n in node_ids if n not in self.hardware]
        self.hardware.update(await load_node_hardware(session, missing))

    def __call__(self, node: AgentNode) -> NodeServices:
        hardware = self.hardware.get(node.node_id)
        if hardware is None:
            raise LookupError(f"node {node.node_id} is not in the database")
        # One disk per node: the tenant accounts the bare-metal backend writes are the ones
        # validate_clean and storage_cleanup look at.
        machine = build_machine(
            self.state_dir.resolve() / node.node_id / "machine",
            address=node.hostname or node.node_id,
            gpus=hardware.gpus,
            machine_key=node.node_id,
        )
        host = build_libvirt_test_host(
            node.node_id,
            hardware.gpus,
            self.state_dir,
            numa_layout=hardware.numa_layout,
            images=[hardware.image],
            system_root=machine.root,
        )
        self.hosts[node.node_id] = host
        services = machine_services(machine)
        return NodeServices(
            host=host.backend,
            maintenance=services.maintenance,
            terminal=services.terminal,
            storage=simulated_storage(SystemRoot(machine.root), guests=host.slice_backend),
        )

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
        self.hosts.clear()


class SimFleet:
    """Simulated agents started on demand; `stop()` shuts every worker down."""

    def __init__(
        self,
        client: Client,
        config_for: Callable[[str], SimHostConfig] = lambda _node: SimHostConfig(),
        *,
        pollers_per_node: int = POLLERS_PER_NODE,
        host_factory: HostFactory | None = None,
        heartbeat_queue: str | None = None,
        heartbeat_seconds: float = DEFAULT_INTERVAL_SECONDS,
        machines_dir: Path | None = None,
    ) -> None:
        self._client = client
        # Each simulated node's disk (sim/machine_image.py): what its maintenance tasks work on.
        self._machines_dir = machines_dir or Path(tempfile.mkdtemp(prefix="gpucloud-fleet-"))
        # Simulated agents heartbeat like real ones (liveness only: no GPUs to probe here).
        self._heartbeat_queue = heartbeat_queue
        self._heartbeat_seconds = heartbeat_seconds
        self._heartbeat_stop = asyncio.Event()
        self._heartbeats: list[asyncio.Task[None]] = []
        self._config_for = config_for
        self._pollers = pollers_per_node
        self._host_factory = host_factory
        self.hosts: dict[str, SimulatedHost] = {}
        self.backends: dict[str, HostBackend] = {}
        self._workers: dict[str, Worker] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}

    def start(self, nodes: Iterable[AgentNode]) -> list[str]:
        """Start an agent for each node that has none yet; answers the ids started."""
        started = []
        for node in nodes:
            if node.node_id in self._workers:
                continue
            services: NodeServices
            try:
                if self._host_factory is None:
                    machine = build_machine(
                        self._machines_dir / node.node_id,
                        address=node.hostname or node.node_id,
                        machine_key=node.node_id,
                    )
                    simulated, services = simulated_services(
                        node.node_id,
                        machine,
                        hostname=node.hostname,
                        config=self._config_for(node.node_id),
                    )
                    self.hosts[node.node_id] = simulated
                else:
                    services = self._host_factory(node)
            except Exception as err:  # one bad node must not keep the others down
                logger.warning("no host for node %s: %s", node.node_id, err)
                continue
            self.backends[node.node_id] = services.host
            worker = build_node_worker(
                self._client,
                node.node_id,
                services,
                identity=f"sim-agent-{node.node_id}",
                pollers=self._pollers,
            )
            self._workers[node.node_id] = worker
            self._runs[node.node_id] = asyncio.create_task(
                worker.run(), name=f"sim-agent-{node.node_id}"
            )
            if self._heartbeat_queue is not None:
                self._heartbeats.append(
                    asyncio.create_task(
                        run_heartbeats(
                            self._client,
                            node.node_id,
                            control_plane_queue=self._heartbeat_queue,
                            stop=self._heartbeat_stop,
                            inventory=lambda: None,
                            interval=self._heartbeat_seconds,
                            agent_version="sim",
                        )
                    )
                )
            started.append(node.node_id)
        if started:
            logger.info(
                "started %d simulated agent(s), %d running", len(started), len(self._workers)
            )
        return started

    async def stop(self) -> None:
        self._heartbeat_stop.set()
        await asyncio.gather(*self._heartbeats, return_exceptions=True)
        self._heartbeats.clear()
        workers, runs = list(self._workers.values()), list(self._runs.values())
        await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        for result in await asyncio.gather(*runs, return_exceptions=True):
            if isinstance(result, BaseException):
                logger.warning("a simulated agent stopped with %s", type(result).__name__)
        self._workers.clear()
        self._runs.clear()
        if self._host_factory is not None:
            self._host_factory.close()

    async def run(
        self,
        stop: asyncio.Event,
        refresh: Callable[[], Awaitable[list[AgentNode]]] | None = None,
        refresh_seconds: float = 10.0,
    ) -> None:
        """Until `stop` is set: (re)load nodes with `refresh` and start agents for new ones."""
        try:
            while not stop.is_set():
                if refresh is not None:
                    try:
                        self.start(await refresh())
                    except Exception as err:  # the database may be restarting; try again later
                        logger.warning("could not refresh the node list: %s", type(err).__name__)
                timeout = refresh_seconds if refresh is not None and refresh_seconds > 0 else None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await stop.wait()
        finally:
            await self.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sim.fleet", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--node-id",
        action="append",
        type=uuid.UUID,
        default=[],
        help="serve this node (repeatable); default: nodes from the database",
    )
    parser.add_argument("--phase-delay", type=float, default=None, help="seconds per phase")
    parser.add_argument("--jitter", type=float, default=None, help="fraction, e.g. 0.2")
    parser.add_argument("--faults", default=None, help="JSON list of fault specs (sim.faults)")
    parser.add_argument(
        "--refresh-seconds",
        type=float,
        default=10.0,
        help="re-read the node list this often (0: read once)",
    )
    parser.add_argument(
        "--hosts",
        choices=HOST_KINDS,
        default=os.environ.get("GPUCLOUD_SIM_HOSTS") or "simulated",
        help="simulated hosts, or real backends on libvirt's test driver (default: %(default)s)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_LIBVIRT_STATE_DIR,
        help="libvirt-test hosts' files, one directory per node (default: %(default)s)",
    )
    parser.add_argument(
        "--machines-dir",
        type=Path,
        default=Path(".state/fleet-machines"),
        help="each simulated node's disk (default: %(default)s)",
    )
    parser.add_argument(
        "--all-nodes",
        action="store_true",
        help="serve every active node in the database, not only the demo fleet's (tests)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def fleet_node_ids(args: argparse.Namespace) -> list[str] | None:
    """The nodes this fleet boots: the demo fleet's (sim/demo_fleet.py), unless --all-nodes."""
    if args.all_nodes:
        return None
    from sim.demo_fleet import demo_fleet

    return [str(node.id) for node in demo_fleet().nodes]


class _ConfigChanges(TypedDict, total=False):
    """The SimHostConfig fields the command line may set."""

    phase_delay_s: float
    jitter: float
    faults: tuple[FaultSpec, ...]


def config_factory(args: argparse.Namespace) -> Callable[[str], SimHostConfig]:
    """Per-node settings: the environment's, with the command line's on top."""
    faults = None
    if args.faults:
        faults = tuple(FaultSpec.from_dict(f) for f in json.loads(args.faults))

    def config_for(node_id: str) -> SimHostConfig:
        config = SimHostConfig.from_env(node_id)
        changes: _ConfigChanges = {}
        if args.phase_delay is not None:
            changes["phase_delay_s"] = args.phase_delay
        if args.jitter is not None:
            changes["jitter"] = args.jitter
        if faults is not None:
            changes["faults"] = faults
        return dataclasses.replace(config, **changes).for_node(node_id)

    config_for("00000000-0000-0000-0000-000000000000")  # fail at start on a bad setting
    return config_for


async def run(args: argparse.Namespace, settings: Settings) -> None:
    if args.hosts not in HOST_KINDS:
        raise SystemExit(f"--hosts (GPUCLOUD_SIM_HOSTS) must be one of {', '.join(HOST_KINDS)}")
    libvirt_hosts = LibvirtTestHosts(args.state_dir) if args.hosts == "libvirt-test" else None
    client = await connect(settings, identity="sim-fleet")
    fleet = SimFleet(
        client,
        config_factory(args),
        host_factory=libvirt_hosts,
        heartbeat_queue=settings.control_plane_task_queue,
        heartbeat_seconds=float(
            os.environ.get("GPUCLOUD_AGENT_HEARTBEAT_S", DEFAULT_INTERVAL_SECONDS)
        ),
        machines_dir=args.machines_dir,
    )
    stop = asyncio.Event()
    with stop_on_signals(stop):
        if args.node_id and libvirt_hosts is None:
            fleet.start(AgentNode(str(n)) for n in args.node_id)
            await fleet.run(stop)
            return
        engine = create_engine(settings.database_url, pool_size=1, max_overflow=1)
        sessions = session_factory(engine)

        async def refresh() -> list[AgentNode]:
            async with sessions() as session:
                if args.node_id:
                    nodes = [AgentNode(str(n)) for n in args.node_id]
                else:
                    nodes = await load_agent_nodes(session, fleet_node_ids(args))
                if libvirt_hosts is not None:  # GPU slots of nodes not started yet
                    await libvirt_hosts.load(
                        session, [n.node_id for n in nodes if n.node_id not in fleet.backends]
                    )
                return nodes

        try:
            await fleet.run(stop, refresh, args.refresh_seconds)
        finally:
            await engine.dispose()


def main(argv: list[str] | None = None) -> None:
    enable_crash_traces()
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(args, Settings.from_env()))


if __name__ == "__main__":
    main()
