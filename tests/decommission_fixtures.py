"""Decommission fixtures, on top of the onboarding rig (a MAAS site on the MAAS simulator, its
secrets in the Vault simulator, the control-plane worker, the gateway on uvicorn for agent
enrollment, and the simulated deployed OS): node agents that answer the maintenance activities
(agent/maintenance.py's FileMaintenanceBackend over a temporary system root, wrapped so a test
can make a task fail or hang), MAAS-managed nodes made by a real onboarding, and helpers to start
decommission jobs and wait for their read model.

    async def test_x(decommission):
        node_id = await decommission.maas_node("dec-a", "10.176.17.10")
        agent = await decommission.agent(node_id)
        job = await decommission.start(node_id, "full_decommission", erase="quick")
        row = await decommission.wait_status(job, "completed")
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from agent.backend import HostCancelled, HostError, Progress
from agent.backends.baremetal_users import UserAccountConfig
from agent.maintenance import (
    DrainOutcome,
    FileMaintenanceBackend,
    GpuMemoryUse,
    HwSyncOutcome,
    MaintenanceConfig,
    ProcessInfo,
    RunningTaskCounter,
    StorageOutcome,
    UninstallOutcome,
    ValidateOutcome,
)
from agent.node_worker import NodeServices, build_node_worker
from contracts.decommission import (
    STAGES_BY_MODE,
    WORKFLOW_NAME,
    ActionResult,
    DecommissionInput,
    DecommissionPolicy,
    DecommissionResult,
    Mode,
    decommission_workflow_id,
)
from contracts.host_tasks import (
    GpuScrubOutcome,
    HostErrorType,
    HwSyncReseedInput,
    NodeMaintenanceInput,
    StorageCleanupInput,
)
from contracts.states import NodeStatus
from core import search_attributes as sa
from schema.models import Node, NodeDecommission, NodeDecommissionEvent
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.factories import create_node
from tests.onboarding_fixtures import ONBOARD_SKU, OnboardingRig, operator_action
from tests.workflow_probes import terminate_quietly

TENANT_UID = 20000
PASSWD = "root:x:0:0:root:/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n"
MOUNTS = "/dev/sda1 / ext4 rw 0 0\nproc /proc proc rw 0 0\n"
# Short waits: host tasks not picked up in 2 s mean an unreachable agent.
TEST_POLICY = DecommissionPolicy(
    node_schedule_to_start_seconds=2.0,
    node_task_timeout_seconds=30.0,
    node_heartbeat_timeout_seconds=10.0,
    node_task_attempts=2,
    allocation_release_timeout_seconds=20.0,
    poll_interval_ms=20,
    power_off_timeout_seconds=5.0,
    drain_wait_seconds=5.0,
)


class _Scrubber:
    def scrub_each(self) -> list[GpuScrubOutcome]:
        return [GpuScrubOutcome(gpu=str(i), scrubbed=True, message="reset") for i in range(8)]


class _IdleGpus:
    def usage(self) -> list[GpuMemoryUse]:
        return [GpuMemoryUse(str(i), 0, 0) for i in range(8)]


class _Processes:
    def __init__(self) -> None:
        self.tenant: list[ProcessInfo] = []

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo(1, 0), *self.tenant]


class FaultyMaintenance:
    """The real file backend, with faults: `fail[name] = n` makes the next n calls of that
    operation fail (HostError maintenance_error); `hang[name]` blocks it until the event is set
    or the task is cancelled. `calls` counts every call."""

    def __init__(self, inner: FileMaintenanceBackend) -> None:
        self.inner = inner
        self.fail: dict[str, int] = {}
        self.hang: dict[str, threading.Event] = {}
        self.calls: dict[str, int] = {}

    def _enter(self, name: str, progress: Progress) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        gate = self.hang.get(name)
        while gate is not None and not gate.is_set():
            if progress.cancelled:
                raise HostCancelled(f"{name} cancelled")
            gate.wait(0.05)
        if self.fail.get(name, 0) > 0:
            self.fail[name] -= 1
            raise HostError(HostErrorType.MAINTENANCE_ERROR, f"{name} failed (injected)")

    def gpu_scrub(self, spec: NodeMaintenanceInput, progress: Progress) -> list[GpuScrubOutcome]:
        self._enter("gpu_scrub", progress)
        return self.inner.gpu_scrub(spec, progress)

    def storage_cleanup(self, spec: StorageCleanupInput, progress: Progress) -> StorageOutcome:
        self._enter("storage_cleanup", progress)
        return self.inner.storage_cleanup(spec, progress)

    def validate_clean(self, spec: NodeMaintenanceInput, progress: Progress) -> ValidateOutcome:
        self._enter("validate_clean", progress)
        return self.inner.validate_clean(spec, progress)

    def drain(
        self,
        spec: NodeMaintenanceInput,
        progress: Progress,
        tasks: RunningTaskCounter | None = None,
    ) -> DrainOutcome:
        self._enter("drain", progress)
        return self.inner.drain(spec, progress, tasks)

    def undrain(self, spec: NodeMaintenanceInput, progress: Progress) -> DrainOutcome:
        self._enter("undrain", progress)
        return self.inner.undrain(spec, progress)

    def uninstall(self, spec: NodeMaintenanceInput, progress: Progress) -> UninstallOutcome:
        self._enter("uninstall", progress)
        return self.inner.uninstall(spec, progress)

    def hw_sync_reseed(self, spec: HwSyncReseedInput, progress: Progress) -> HwSyncOutcome:
        self._enter("hw_sync_reseed", progress)
        return self.inner.hw_sync_reseed(spec, progress)

    def is_draining(self) -> bool:
        return self.inner.is_draining()

    def sanitise_root(self) -> Any:
        return self.inner.sanitise_root()


@dataclass
class Agent:
    node_id: str
    root: Path
    maintenance: FaultyMaintenance
    processes: _Processes
    host: SimulatedHost
    worker: Worker
    _run: asyncio.Task[None] = field(repr=False)

    async def stop(self) -> None:
        if not self._run.done():
            await self.worker.shutdown()
        await asyncio.gather(self._run, return_exceptions=True)

    def add_tenant_user(self, name: str = "alice") -> None:
        with (self.root / "etc/passwd").open("a") as f:
            f.write(f"{name}:x:{TENANT_UID}:{TENANT_UID}::/home/{name}:/bin/bash\n")


@dataclass(frozen=True)
class Job:
    decommission_id: str
    node_id: str
    mode: str

    @property
    def workflow_id(self) -> str:
        return decommission_workflow_id(self.decommission_id)


@dataclass
class DecommissionRig:
    onboarding: OnboardingRig
    client: Client
    tmp: Path
    agents: list[Agent] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)

    @property
    def sessions(self) -> Any:
        return self.onboarding.sessions

    async def close(self) -> None:
        """End what a test left running: its jobs, and host tasks hung at their gates."""
        await terminate_quietly(self.client, [job.workflow_id for job in self.jobs])
        for gate in (g for a in self.agents for g in a.maintenance.hang.values()):
            gate.set()
        await asyncio.gather(*(a.stop() for a in self.agents), return_exceptions=True)

    # --- nodes and agents ---

    async def maas_node(self, hostname: str, ipmi_ip: str) -> str:
        """A MAAS-managed active node, made by a real onboarding (machine Deployed in MAAS)."""
        job = await self.onboarding.start(hostname, ipmi_ip)
        row = await self.onboarding.wait_status(job, "completed")
        assert row.node_id is not None
        return str(row.node_id)

    async def plain_node(self, status: NodeStatus = NodeStatus.ACTIVE) -> str:
        """A manually registered node (no MAAS binding)."""
        node = await create_node(self.sessions, sku=ONBOARD_SKU, status=status)
        return str(node.id)

    async def agent(self, node_id: str) -> Agent:
        """An instrumented agent for the node (faults and hangs on demand): the machine's own
        agent, started by its first boot, is stopped first (`systemctl stop`), so one agent
        polls the node's queue. Both register through agent.node_worker.node_activities."""
        async with self.sessions() as session:
            hostname = await session.scalar(
                select(Node.hostname).where(Node.id == uuid.UUID(node_id))
            )
        if hostname is not None:
            await self.onboarding.first_boot.stop_agent(hostname)
        root = self.tmp / f"root-{node_id[:8]}-{len(self.agents)}"
        for d in ("etc", "proc/self", "home", "scratch", "tmp", "var/tmp", "var/lib"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "etc/passwd").write_text(PASSWD)
        (root / "proc/self/mounts").write_text(MOUNTS)
        (root / "scratch/tenant-job").mkdir()
        (root / "scratch/tenant-job/checkpoint.bin").write_bytes(b"x" * 64)
        (root / "var/lib/gpucloud-agent").mkdir(parents=True)
        (root / "var/lib/gpucloud-agent/identity.json").write_text("{}")
        processes = _Processes()
        inner = FileMaintenanceBackend(
            root,
            scrubber=_Scrubber(),
            gpu_probe=_IdleGpus(),
            processes=processes,
            config=MaintenanceConfig(
                users=UserAccountConfig(uid_min=TENANT_UID, uid_max=TENANT_UID + 9999)
            ),
        )
        maintenance = FaultyMaintenance(inner)
        host = SimulatedHost(node_id, config=SimHostConfig())
        worker = build_node_worker(self.client, node_id, NodeServices(host, maintenance))
        agent = Agent(
            node_id, root, maintenance, processes, host, worker, asyncio.create_task(worker.run())
        )
        self.agents.append(agent)
        return agent

    # --- jobs ---

    async def start(
        self,
        node_id: str,
        mode: str,
        *,
        erase: str = "none",
        storage_cleanup: str = "none",
        remove_maas_record: bool = False,
        force_release_allocations: bool = False,
        policy: DecommissionPolicy = TEST_POLICY,
    ) -> Job:
        job = Job(str(uuid.uuid4()), node_id, mode)
        async with self.sessions() as session, session.begin():
            session.add(
                NodeDecommission(
                    decommission_id=uuid.UUID(job.decommission_id),
                    node_id=uuid.UUID(node_id),
                    mode=mode,
                    erase=erase,
                    storage_cleanup=storage_cleanup,
                    remove_maas_record=remove_maas_record,
                    force_release_allocations=force_release_allocations,
                    reason="test",
                    status="pending",
                    current_stage=STAGES_BY_MODE[Mode(mode)][0].value,
                    workflow_id=job.workflow_id,
                    requested_by="test",
                )
            )
        await self.client.start_workflow(
            WORKFLOW_NAME,
            DecommissionInput(
                decommission_id=job.decommission_id,
                node_id=node_id,
                mode=mode,
                erase=erase,
                storage_cleanup=storage_cleanup,
                remove_maas_record=remove_maas_record,
                force_release_allocations=force_release_allocations,
                reason="test",
                requested_by="test",
                policy=policy,
            ),
            id=job.workflow_id,
            task_queue=self.onboarding.settings.control_plane_task_queue,
            result_type=DecommissionResult,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.NODE_ID, node_id)]),
        )
        self.jobs.append(job)
        return job

    def track(self, decommission_id: str, node_id: str, mode: str) -> Job:
        job = Job(decommission_id, node_id, mode)
        self.jobs.append(job)
        return job

    def handle(self, job: Job) -> WorkflowHandle[Any, DecommissionResult]:
        return self.client.get_workflow_handle(job.workflow_id, result_type=DecommissionResult)

    async def row(self, job: Job) -> NodeDecommission:
        async with self.sessions() as session:
            row = await session.get(NodeDecommission, uuid.UUID(job.decommission_id))
            assert row is not None
            return row

    async def events(self, job: Job) -> list[NodeDecommissionEvent]:
        async with self.sessions() as session:
            return list(
                await session.scalars(
                    select(NodeDecommissionEvent)
                    .where(NodeDecommissionEvent.decommission_id == uuid.UUID(job.decommission_id))
                    .order_by(NodeDecommissionEvent.occurred_at)
                )
            )

    async def wait_status(self, job: Job, *statuses: str, timeout: float = 45.0) -> Any:
        deadline = time.monotonic() + timeout
        row = await self.row(job)
        while row.status not in statuses:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{job.mode}: still {row.status} at {row.current_stage} "
                    f"({row.error_code}: {row.error_message}); wanted {statuses}"
                )
            await asyncio.sleep(0.05)
            row = await self.row(job)
        return row

    async def wait_stage(self, job: Job, stage: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (await self.row(job)).current_stage != stage:
            if time.monotonic() > deadline:
                raise AssertionError(f"never reached {stage}")
            await asyncio.sleep(0.05)

    async def action(self, job: Job, action: str, reason: str = "test") -> ActionResult:
        return await operator_action(self.handle(job), action, reason)


@pytest.fixture
async def decommission(
    onboarding: OnboardingRig, temporal_client: Client, tmp_path: Path
) -> AsyncIterator[DecommissionRig]:
    rig = DecommissionRig(onboarding=onboarding, client=temporal_client, tmp=tmp_path)
    try:
        yield rig
    finally:
        await rig.close()
