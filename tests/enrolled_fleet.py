"""The enrolled fleet: GPU nodes made the way production makes them, for tests that need a node.

    async def test_x(enrolled_fleet, tenant):
        (node,) = await enrolled_fleet.create(slice_nodes=1)
        node.agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.VFIO_ERROR)
        await node.agent.stop()                        # a dead agent: its tasks stay unclaimed

`create(slice_nodes=, baremetal_nodes=)` puts one Ready machine per node in the MAAS simulator
and submits each node's onboarding through the admin API (POST /api/v1/admin/onboardings, on the
full control-plane worker of the `onboarding` rig), all at once. MAAS commissions and deploys
each machine with the cloud-init the worker rendered; the machine boots (sim/first_boot.py
writes that cloud-init onto its disk) and its agent enrolls with the single-use token the
cloud-init carries, reports its GPU inventory in its first heartbeat, and the onboarding moves
the node enrolling -> active (a `node.status_changed` event) with GPU slots made from that
inventory. No row is written here.

The agent is the production one, `agent.main.run`, run in this process on the machine's disk
with the simulated host backend the stack's fleet uses (`--backend simulated`: a SimulatedHost
for allocation tasks, the production maintenance backend on the disk): the machine's own agent
process is held back (`FirstBootSimulator.hold`), so one agent serves the node and the test can
inject host faults into it (`node.agent.host`). Two seams only: the host root `run` reads from
GPUCLOUD_AGENT_ROOT comes from a context variable (agents share this process's environment),
and the services `run` builds are recorded so the test can reach the SimulatedHost.

Every simulated machine has the machine image's 8 GPUs, 4 per NUMA node (sim/machine_image.py),
so a node's SKU allows up to 8 (its largest allowed count is the node's GPU count).

The SKUs are catalog rows written with `create_sku`: the admin API has no route for SKUs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import agent.main
from agent.backends.system_root import SystemRoot
from agent.enrollment import EnrollmentError
from agent.node_worker import NodeServices
from contracts.node_files import DEFAULT_CONFIG_PATH
from contracts.states import SkuShape
from core.config import Settings
from sim.first_boot import BootRecord
from sim.host import SimulatedHost
from tests.factories import BAREMETAL_SKU, SLICE_SKU, create_sku
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig

# The machine image's GPUs (sim/machine_image.py DEFAULT_GPU_COUNT).
MACHINE_GPUS = 8
# Heartbeats as often as the rig's machine agents send them.
HEARTBEAT_SECONDS = 2.0
# The agent unit's RestartSec, capped as the rig caps it for the machine agents.
RESTART_SECONDS = 0.5

log = logging.getLogger("tests.enrolled_fleet")

_agent_root: contextvars.ContextVar[Path] = contextvars.ContextVar("enrolled_agent_root")


@dataclass
class EnrolledAgent:
    """The node's agent (agent.main.run in this process). `host` is its SimulatedHost."""

    node_id: str
    hostname: str
    root: Path
    host: SimulatedHost
    _run: asyncio.Task[None] = field(repr=False)

    @property
    def running(self) -> bool:
        return not self._run.done()

    async def stop(self) -> None:
        """The agent dies (as `systemctl stop`): it stops polling the node's queue and sending
        heartbeats; running host tasks are cancelled. Idempotent."""
        self._run.cancel()
        await asyncio.gather(self._run, return_exceptions=True)


@dataclass
class EnrolledNode:
    """An active node made by onboarding; `id`, `hostname` and `gpu_count` as FleetNode has."""

    id: uuid.UUID
    hostname: str
    gpu_count: int
    sku: str
    onboarding_id: str
    agent: EnrolledAgent


@dataclass
class EnrolledFleet:
    rig: OnboardingRig
    admin: httpx.AsyncClient
    settings: Settings
    services: dict[str, NodeServices] = field(default_factory=dict)
    agents: list[EnrolledAgent] = field(default_factory=list)
    # Seconds from submission to an active node, per node, and for the whole create() call.
    timings: list[float] = field(default_factory=list)
    created_in: float = 0.0
    _created: bool = False

    async def create(self, *, slice_nodes: int = 1, baremetal_nodes: int = 0) -> list[EnrolledNode]:
        """Onboard `slice_nodes` GPU-slice nodes (SKU h100.slice: 1, 2, 4 or 8 GPUs) and
        `baremetal_nodes` bare-metal nodes (h100.8x.baremetal), concurrently; slice nodes first.
        Once per test: the MAAS simulator is reset to exactly these machines."""
        assert not self._created, "one fleet per test: create() resets the MAAS simulator"
        self._created = True
        started = time.monotonic()
        await create_sku(
            self.rig.sessions, SLICE_SKU, shape=SkuShape.GPU_SLICE, allowed=(1, 2, 4, 8)
        )
        await create_sku(self.rig.sessions, BAREMETAL_SKU, shape=SkuShape.BAREMETAL, allowed=(8,))
        wanted = [SLICE_SKU] * slice_nodes + [BAREMETAL_SKU] * baremetal_nodes
        machines = [(f"gpu-{i:02d}", f"10.176.30.{10 + i}", sku) for i, sku in enumerate(wanted)]
        await self.rig.maas_sim.reset(
            sim_scenario(*(sim_machine(hostname, bmc) for hostname, bmc, _ in machines))
        )
        # The operator's site setting: allocation tests need no MAAS hardware sync (seeding it
        # and waiting for MAAS to see a fresh one took 12 s of each node's 16 s).
        patched = await self.admin.patch(
            f"/api/v1/admin/maas-sites/{self.rig.site_id}",
            json={"policy": {"require_hw_sync": False}, "reason": "test fleet: no hw sync"},
        )
        assert patched.status_code == 200, patched.text
        for hostname, _, _ in machines:
            # The machine's own agent process stays down: the agent runs in this process.
            self.rig.first_boot.hold(hostname)
        nodes = await asyncio.gather(
            *(self._onboard(hostname, bmc, sku) for hostname, bmc, sku in machines)
        )
        self.created_in = time.monotonic() - started
        return list(nodes)

    async def _onboard(self, hostname: str, bmc: str, sku: str) -> EnrolledNode:
        started = time.monotonic()
        created = await self.admin.post(
            "/api/v1/admin/onboardings",
            json={
                "site_id": str(self.rig.site_id),
                "profile_id": str(self.rig.profile_id),
                "sku_id": sku,
                "hostname": hostname,
                "ipmi_ip": bmc,
            },
        )
        assert created.status_code == 201, created.text
        onboarding_id = created.json()["onboarding_id"]
        record = await self._booted(hostname)
        agent = await self.start_agent(record)
        job = await self._settled(onboarding_id)
        assert job["status"] == "completed", job
        self.timings.append(time.monotonic() - started)
        return EnrolledNode(
            uuid.UUID(str(job["node_id"])), hostname, MACHINE_GPUS, sku, onboarding_id, agent
        )

    async def _booted(self, hostname: str) -> BootRecord:
        """The machine's boot once MAAS deployed it and its cloud-init is on its disk."""

        async def installed() -> BootRecord | None:
            record = self.rig.first_boot.booted.get(hostname)
            if record is None or record.root is None or not record.unit_argv:
                return None
            return record

        return await eventually(installed, timeout=60.0)

    async def _settled(self, onboarding_id: str) -> dict[str, Any]:
        path = f"/api/v1/admin/onboardings/{onboarding_id}"

        async def settled() -> dict[str, Any] | None:
            row: dict[str, Any] = (await self.admin.get(path)).json()
            return row if row["status"] not in ("pending", "running") else None

        return await eventually(settled, timeout=90.0, interval=0.1)

    async def start_agent(self, record: BootRecord) -> EnrolledAgent:
        """`gpucloud-agent --backend simulated` on the machine's disk, as its systemd unit
        starts it: it enrolls with its config's token (or keeps the identity it stored), then
        serves the node's queue and heartbeats. Returns once the services are built."""
        assert record.root is not None
        root = record.root
        args = agent.main.parse_args(
            [
                "--config", str(DEFAULT_CONFIG_PATH),
                "--backend", "simulated",
                "--hostname", record.hostname,
                "--heartbeat-seconds", str(HEARTBEAT_SECONDS),
            ]
        )  # fmt: skip

        async def run() -> None:
            """systemd's part (Restart=always): an agent that exits is started again, unless
            its config cannot work (agent.main exits EXIT_CONFIG then: RestartPreventExitStatus)."""
            _agent_root.set(root)
            while True:
                try:
                    await agent.main.run(args, self.settings)
                    return
                except EnrollmentError as err:  # exit 1: e.g. the gateway answered 503
                    log.info("%s: enrollment failed (%s); restarting", record.hostname, err.code)
                await asyncio.sleep(RESTART_SECONDS)

        task = asyncio.create_task(run(), name=f"agent-{record.hostname}")

        async def built() -> NodeServices | None:
            if task.done():
                task.result()  # the agent could not start: its error here
            return self.services.get(str(root.resolve()))

        services = await eventually(built, timeout=30.0)
        assert isinstance(services.host, SimulatedHost)
        node_id = str(services.host.node_id)
        enrolled = EnrolledAgent(node_id, record.hostname, root, services.host, task)
        self.agents.append(enrolled)
        return enrolled

    async def restart_agent(self, node: EnrolledNode) -> EnrolledAgent:
        """`systemctl restart gpucloud-agent`: a fresh agent process on the same disk keeps its
        stored identity (no enrollment) and gets a fresh SimulatedHost."""
        await node.agent.stop()
        self.services.pop(str(node.agent.root.resolve()), None)
        node.agent = await self.start_agent(self.rig.first_boot.booted[node.hostname])
        return node.agent

    async def close(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.agents), return_exceptions=True)


def _root_from_context() -> SystemRoot:
    return SystemRoot(_agent_root.get())


@pytest.fixture
async def enrolled_fleet(
    onboarding: OnboardingRig,
    api: Any,
    make_token: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[EnrolledFleet]:
    """Nodes made by onboarding through the admin API, each with its agent enrolled."""
    admin = await api(token=await make_token("admin"))
    fleet = EnrolledFleet(onboarding, admin, onboarding.settings)
    make_services: Callable[[str, agent.main.BackendContext], NodeServices] = (
        agent.main.make_services
    )

    def recording(kind: str, context: agent.main.BackendContext) -> NodeServices:
        services = make_services(kind, context)
        fleet.services[str(context.root.path)] = services
        return services

    monkeypatch.setattr(agent.main, "host_root_from_env", _root_from_context)
    monkeypatch.setattr(agent.main, "make_services", recording)
    try:
        yield fleet
    finally:
        await fleet.close()
        if fleet.timings:
            # `pytest -s` shows what a fleet cost: per node (submission to active) and in all.
            per_node = ", ".join(f"{t:.1f}" for t in sorted(fleet.timings))
            print(f"\nenrolled fleet: {len(fleet.timings)} node(s) in {fleet.created_in:.1f} s "
                  f"(each {per_node} s)")  # fmt: skip
