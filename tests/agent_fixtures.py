"""Node-agent fixtures: simulated hosts and real agent workers on the session Temporal server.

    async def test_x(start_node_agent, sim_hosts):
        agent = await start_node_agent(node.id)          # worker on node-{id}, zero-delay host
        agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.VFIO_ERROR)
        ...
        await agent.stop()                               # a dead node: tasks stay unclaimed

Every agent started in a test is stopped at its teardown.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from agent.node_worker import NodeServices, build_node_worker
from core.task_queues import node_task_queue
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from sim.node_services import machine_maintenance


class SimHosts:
    """Node id -> SimulatedHost, created on first use with zero delays and no faults."""

    def __init__(self) -> None:
        self._hosts: dict[str, SimulatedHost] = {}

    def __getitem__(self, node_id: uuid.UUID | str) -> SimulatedHost:
        key = str(node_id)
        if key not in self._hosts:
            self._hosts[key] = SimulatedHost(key, config=SimHostConfig())
        return self._hosts[key]

    def __setitem__(self, node_id: uuid.UUID | str, host: SimulatedHost) -> None:
        self._hosts[str(node_id)] = host

    def __contains__(self, node_id: object) -> bool:
        return str(node_id) in self._hosts

    def __iter__(self) -> Iterator[str]:
        return iter(self._hosts)

    def __len__(self) -> int:
        return len(self._hosts)


@dataclass
class NodeAgent:
    """A running agent: its node, simulated host, worker and the task running the worker."""

    node_id: str
    host: SimulatedHost
    worker: Worker
    _run: asyncio.Task[None] = field(repr=False)

    @property
    def task_queue(self) -> str:
        return node_task_queue(self.node_id)

    @property
    def running(self) -> bool:
        return not self._run.done()

    async def stop(self) -> None:
        """Stop polling, cancel running host tasks (idempotent)."""
        if not self._run.done():
            await self.worker.shutdown()
        await asyncio.gather(self._run, return_exceptions=True)


StartNodeAgent = Callable[..., Awaitable[NodeAgent]]


@pytest.fixture
def sim_hosts() -> SimHosts:
    return SimHosts()


@pytest.fixture
async def start_node_agent(
    temporal_client: Client, sim_hosts: SimHosts, tmp_path: Path
) -> AsyncIterator[StartNodeAgent]:
    agents: list[NodeAgent] = []

    async def start(node_id: uuid.UUID | str, host: SimulatedHost | None = None) -> NodeAgent:
        key = str(node_id)
        if host is not None:
            sim_hosts[key] = host
        sim_host = sim_hosts[key]
        worker = build_node_worker(
            temporal_client, key, NodeServices(sim_host, machine_maintenance(tmp_path / key))
        )
        agent = NodeAgent(key, sim_host, worker, asyncio.create_task(worker.run()))
        agents.append(agent)
        return agent

    yield start
    await asyncio.gather(*(agent.stop() for agent in agents))
