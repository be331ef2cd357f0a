"""Wiring a node's Temporal worker, shared by the agent's console script, the simulated fleet and
the tests."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from agent.backend import HostBackend
from agent.host_activities import HostActivities
from agent.maintenance import MaintenanceActivities, MaintenanceBackend
from agent.storage_mounts import StorageMountActivities, StorageMountBackend
from agent.terminal import ShellLauncher, TerminalActivities
from core.task_queues import node_task_queue

# Host tasks a node runs at once (each is mostly waiting on libvirt or a guest).
MAX_CONCURRENT_HOST_TASKS = 16


@dataclass(frozen=True)
class NodeServices:
    """Everything one node's agent serves: the allocation host tasks (`host`, both shapes) and
    the node maintenance tasks (`maintenance`, docs/lifecycles/decommission.md#node-tasks).
    Production builds it from the agent config (agent.backends.from_config), the simulator from sim/
    (a backend plugin)."""

    host: HostBackend
    maintenance: MaintenanceBackend
    # Storage attachment mounts (docs/lifecycles/storage-attachment.md); None: the node mounts no
    # storage (the tasks are still registered and answer `unsupported`).
    storage: StorageMountBackend | None = None
    # Terminal sessions (docs/lifecycles/terminal-session.md): the shell a `terminal.open` runs per
    # allocation shape; None: no terminals here (the tasks are still registered and answer
    # `unsupported`).
    terminal: ShellLauncher | None = None


def node_activities(
    services: NodeServices,
    node_id: uuid.UUID | str,
    *,
    max_concurrent: int = MAX_CONCURRENT_HOST_TASKS,
) -> list[Callable[..., Any]]:
    """The one registration of host activities: every activity the control plane schedules on
    `node-{id}`. The production agent, the simulated fleet and the tests all register through
    here, so a node never lacks a task one of them offers (tests/test_agent_registration.py
    checks it against the names the workflows schedule)."""
    node = str(node_id)
    host = HostActivities(
        services.host,
        node_id=node,
        max_concurrent=max_concurrent,
        is_draining=services.maintenance.is_draining,
    )
    maintenance = MaintenanceActivities(services.maintenance, node_id=node, tasks=host)
    storage = StorageMountActivities(services.storage, node_id=node, tasks=host)
    terminal = TerminalActivities(services.terminal, node_id=node)
    return [
        *host.activities(),
        *maintenance.activities(),
        *storage.activities(),
        *terminal.activities(),
    ]


# Long polls each agent keeps open on its node queue: one always waiting, one more while a task
# starts. Every poll of every node counts against the frontend's per-namespace limit
# (devstack/temporal.py LONG_POLLS_PER_NAMESPACE), so 5 (the SDK's default) would cost 50,000 open
# polls at 10,000 nodes for queues that see a few tasks a day.
NODE_QUEUE_POLLERS = 2


def build_node_worker(
    client: Client,
    node_id: uuid.UUID | str,
    services: NodeServices,
    *,
    max_concurrent: int = MAX_CONCURRENT_HOST_TASKS,
    graceful_shutdown: timedelta = timedelta(0),
    identity: str | None = None,
    pollers: int = NODE_QUEUE_POLLERS,
) -> Worker:
    """A worker polling `node-{node_id}` with every host activity bound to `services`.

    `graceful_shutdown` is how long running host tasks may finish after shutdown begins before
    they are cancelled (they stop at their next phase boundary either way).
    """
    node = str(node_id)
    return Worker(
        client,
        task_queue=node_task_queue(node),
        activities=node_activities(services, node, max_concurrent=max_concurrent),
        max_concurrent_activities=max_concurrent,
        graceful_shutdown_timeout=graceful_shutdown,
        # A fleet of simulated nodes shares one connection: fewer pollers per node keep it light.
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(maximum=pollers),
        identity=identity or f"agent-{node}",
    )


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """Set `stop` on SIGINT/SIGTERM while inside the block (main thread only; elsewhere a no-op)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def run_until_signalled(workers: Sequence[Worker], stop: asyncio.Event | None = None) -> None:
    """Run workers until SIGINT/SIGTERM (or `stop` is set), then shut them all down."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        runs = [asyncio.create_task(worker.run()) for worker in workers]
        stopped = asyncio.create_task(stop.wait())
        try:
            # A worker that dies on its own (e.g. Temporal unreachable for good) ends the process.
            await asyncio.wait([stopped, *runs], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
            results = await asyncio.gather(*runs, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
