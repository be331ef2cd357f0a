"""Onboarding fixtures: a MAAS site on the MAAS simulator with its secrets in the Vault simulator,
the control-plane worker with simulated host access (sim/first_boot.py: the BMC is the
simulator's, the deployed OS enrolls its agent over real HTTP against the gateway served by
uvicorn on a free port), and helpers to start jobs and wait for their read model.

    async def test_x(onboarding):
        job = await onboarding.start("node-a", "10.176.16.10")
        row = await onboarding.wait_status(job, "completed")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker, WorkerConfig

from contracts.onboarding import (
    BATCH_WORKFLOW_NAME,
    OPERATOR_ACTION_UPDATE,
    WORKFLOW_NAME,
    ActionResult,
    BatchInput,
    BatchNode,
    BatchSummary,
    OnboardInput,
    OnboardResult,
    OperatorRequest,
    batch_workflow_id,
    onboarding_workflow_id,
)
from contracts.states import SkuShape
from core import search_attributes as sa
from core.config import Settings
from core.secret_paths import (
    site_api_token_path,
    site_default_power_path,
    site_deploy_password_path,
)
from devstack.processes import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from schema.models import (
    MaasSite,
    MaasSitePolicy,
    MaasSiteProfile,
    NodeOnboarding,
    NodeOnboardingEvent,
)
from sim.first_boot import FirstBootSimulator, SimulatedHostSeeder
from sim.host_access import simulated_host_access
from tests.factories import REGION, create_sku
from tests.lifecycle_support import eventually, server_started
from tests.workflow_probes import terminate_quietly, update_admitted

ONBOARD_SKU = "mi300x.192g.8gpu"
DEPLOY_PASSWORD = "hunter2-deploy"
# Fast policy for tests: waits poll every 20 ms; the simulator runs at TEST_TIME_SCALE.
TEST_POLICY: dict[str, Any] = {
    "maas_poll_interval_ms": 20,
    "discovery_timeout_seconds": 8,
    "commission_timeout_seconds": 15,
    "deploy_timeout_seconds": 15,
    "hw_sync_seed_timeout_seconds": 5,
    "hw_sync_health_timeout_seconds": 6,
    # Each deployed machine starts a real gpucloud-agent process; on a loaded 2-core CI machine
    # a dozen of them importing the Temporal SDK at once take longer than a few seconds.
    "enrollment_timeout_seconds": 30,
}


async def operator_action(
    handle: WorkflowHandle[Any, Any],
    action: str,
    reason: str = "test",
    *,
    update_id: str | None = None,
) -> ActionResult:
    """An operator's action on a lifecycle job (onboarding or decommission), as the admin API
    sends it."""
    result: ActionResult = await handle.execute_update(
        OPERATOR_ACTION_UPDATE,
        OperatorRequest(action=action, actor="test-admin", reason=reason),
        id=update_id,
        result_type=ActionResult,
    )
    return result


async def operator_action_admitted(
    client: Client, workflow_id: str, action: str, reason: str
) -> asyncio.Task[ActionResult]:
    """The action sent in the background, returned once Temporal has admitted it: it then waits
    for the job's next workflow task (which a test holding the workflow worker back decides)."""
    update_id = f"{action}-{uuid.uuid4()}"
    sent = asyncio.create_task(
        operator_action(
            client.get_workflow_handle(workflow_id), action, reason, update_id=update_id
        )
    )
    try:
        await eventually(lambda: update_admitted(client, workflow_id, update_id))
    except BaseException:
        sent.cancel()
        raise
    return sent


@dataclass
class Job:
    onboarding_id: str
    node_id: str
    hostname: str

    @property
    def workflow_id(self) -> str:
        return onboarding_workflow_id(self.onboarding_id)


@dataclass
class OnboardingRig:
    site_id: uuid.UUID
    profile_id: uuid.UUID
    sessions: async_sessionmaker[AsyncSession]
    client: Client
    settings: Settings
    maas_sim: Any
    first_boot: FirstBootSimulator
    seeder: SimulatedHostSeeder
    jobs: list[Job] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)

    async def terminate_workflows(self) -> None:
        """End the rig's jobs and batches, so that workers can stop."""
        await terminate_quietly(
            self.client,
            [j.workflow_id for j in self.jobs] + [batch_workflow_id(b) for b in self.batches],
        )

    async def insert_job(self, hostname: str, ipmi_ip: str, *, batch_id: str | None = None) -> Job:
        job = Job(str(uuid.uuid4()), str(uuid.uuid4()), hostname)
        async with self.sessions() as session, session.begin():
            session.add(
                NodeOnboarding(
                    onboarding_id=uuid.UUID(job.onboarding_id),
                    batch_id=uuid.UUID(batch_id) if batch_id else None,
                    node_id=uuid.UUID(job.node_id),
                    site_id=self.site_id,
                    profile_id=self.profile_id,
                    sku_id=ONBOARD_SKU,
                    hostname=hostname,
                    ipmi_ip=ipmi_ip,
                    current_stage="load_site_config",
                    status="pending",
                    workflow_id=job.workflow_id,
                    requested_by="test",
                )
            )
        self.jobs.append(job)
        return job

    def input_for(self, job: Job, ipmi_ip: str) -> OnboardInput:
        return OnboardInput(
            onboarding_id=job.onboarding_id,
            site_id=str(self.site_id),
            profile_id=str(self.profile_id),
            sku_id=ONBOARD_SKU,
            hostname=job.hostname,
            ipmi_ip=ipmi_ip,
            node_id=job.node_id,
            requested_by="test",
        )

    async def start(self, hostname: str, ipmi_ip: str) -> Job:
        job = await self.insert_job(hostname, ipmi_ip)
        await self.client.start_workflow(
            WORKFLOW_NAME,
            self.input_for(job, ipmi_ip),
            id=job.workflow_id,
            task_queue=self.settings.control_plane_task_queue,
            result_type=OnboardResult,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(sa.SITE_ID, str(self.site_id)),
                    SearchAttributePair(sa.HOSTNAME, hostname),
                ]
            ),
        )
        return job

    async def start_batch(
        self, nodes: list[tuple[str, str]], *, max_parallel: int = 10, children_per_run: int = 0
    ) -> tuple[str, list[Job], WorkflowHandle[Any, BatchSummary]]:
        batch_id = str(uuid.uuid4())
        self.batches.append(batch_id)
        jobs = [await self.insert_job(h, ip, batch_id=batch_id) for h, ip in nodes]
        handle = await self.client.start_workflow(
            BATCH_WORKFLOW_NAME,
            BatchInput(
                batch_id=batch_id,
                site_id=str(self.site_id),
                profile_id=str(self.profile_id),
                sku_id=ONBOARD_SKU,
                nodes=[
                    BatchNode(j.hostname, ip, j.onboarding_id, j.node_id)
                    for j, (_, ip) in zip(jobs, nodes, strict=True)
                ],
                max_parallel=max_parallel,
                requested_by="test",
                children_per_run=children_per_run,
            ),
            id=batch_workflow_id(batch_id),
            task_queue=self.settings.control_plane_task_queue,
            result_type=BatchSummary,
        )
        return batch_id, jobs, handle

    async def row(self, job: Job) -> NodeOnboarding:
        async with self.sessions() as session:
            row = await session.get(NodeOnboarding, uuid.UUID(job.onboarding_id))
            assert row is not None
            return row

    async def events(self, job: Job) -> list[NodeOnboardingEvent]:
        async with self.sessions() as session:
            return list(
                await session.scalars(
                    select(NodeOnboardingEvent)
                    .where(NodeOnboardingEvent.onboarding_id == uuid.UUID(job.onboarding_id))
                    .order_by(NodeOnboardingEvent.occurred_at)
                )
            )

    async def wait_status(
        self, job: Job, *statuses: str, stage: str | None = None, timeout: float = 60.0
    ) -> NodeOnboarding:
        """The job's row once its status is one of `statuses` (and, if given, at `stage`)."""
        deadline = time.monotonic() + timeout
        row = await self.row(job)
        while row.status not in statuses or stage not in (None, row.current_stage):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{job.hostname}: still {row.status} at {row.current_stage} "
                    f"({row.error_code}: {row.error_message}); wanted {statuses}"
                )
            await asyncio.sleep(0.1)
            row = await self.row(job)
        return row

    async def action(self, job: Job, action: str, reason: str = "test") -> ActionResult:
        return await operator_action(
            self.client.get_workflow_handle(job.workflow_id), action, reason
        )

    async def set_policy(self, **values: Any) -> None:
        async with self.sessions() as session, session.begin():
            policy = await session.get(MaasSitePolicy, self.site_id)
            assert policy is not None
            for key, value in values.items():
                setattr(policy, key, value)


@contextlib.asynccontextmanager
async def onboarding_rig(
    settings: Settings,
    temporal_client: Client,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> AsyncIterator[OnboardingRig]:
    """The site, its secrets, the gateway over HTTP and the first-boot simulator; no worker."""
    port = free_port()
    settings = dataclasses.replace(settings, public_api_url=f"http://127.0.0.1:{port}")
    site_id, profile_id = uuid.uuid4(), uuid.uuid4()
    async with db_sessions() as session, session.begin():
        session.add(
            MaasSite(
                id=site_id,
                name=f"onb-{site_id.hex[:8]}",
                region_code=REGION,
                api_base_url=maas_sim.base_url,
                api_token_vault_path=site_api_token_path(site_id),
                default_power_creds_vault_path=site_default_power_path(site_id),
                deploy_password_vault_path=site_deploy_password_path(site_id),
                pxe_iface="ens19",
                pxe_vlan_vid=46,
                node_pxe_iface="eno8303",
                distro_series="noble",
            )
        )
        await session.flush()
        session.add(MaasSitePolicy(site_id=site_id, **TEST_POLICY))
        session.add(MaasSiteProfile(id=profile_id, site_id=site_id, name="default"))
    await create_sku(db_sessions, ONBOARD_SKU, shape=SkuShape.BAREMETAL, allowed=(8,))
    await secret_store.write(site_api_token_path(site_id), {"token": maas_sim.api_key})
    await secret_store.write(site_default_power_path(site_id), {"user": "root", "pass": "calvin"})
    await secret_store.write(site_deploy_password_path(site_id), {"password": DEPLOY_PASSWORD})

    app = create_app(settings, temporal_client=temporal_client, config=GatewayConfig())
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await server_started(server, serving)
    # Each deployed machine runs the real gpucloud-agent from its rendered cloud-init.
    first_boot = FirstBootSimulator(
        maas_sim.base_url,
        maas_sim.control_token,
        machines_dir=Path(tempfile.mkdtemp(prefix="gpucloud-machines-")),
        poll_interval=0.05,
        # The agents learn this test's control-plane queue (where their heartbeats, with the GPU
        # inventory onboarding waits for, go) from the gateway's enrollment answer.
        agent_env={"GPUCLOUD_AGENT_HEARTBEAT_S": "2"},
        max_restart_delay_s=0.5,
    )
    seeder = SimulatedHostSeeder(first_boot=first_boot)
    await first_boot.start()
    rig = OnboardingRig(
        site_id=site_id,
        profile_id=profile_id,
        sessions=db_sessions,
        client=temporal_client,
        settings=settings,
        maas_sim=maas_sim,
        first_boot=first_boot,
        seeder=seeder,
    )
    try:
        yield rig
    finally:
        await rig.terminate_workflows()
        await first_boot.stop()
        server.should_exit = True
        await serving


@pytest.fixture
async def onboarding_without_worker(
    settings: Settings,
    temporal_client: Client,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> AsyncIterator[OnboardingRig]:
    async with onboarding_rig(
        settings, temporal_client, db_sessions, secret_store, maas_sim
    ) as rig:
        yield rig


def control_plane_worker(
    rig: OnboardingRig, client: Client, engine: AsyncEngine, secret_store: Any, maas_sim: Any
) -> Worker:
    """The control-plane worker with the rig's simulated host access (the BMC is the MAAS
    simulator's, SSH the seeder's), to run as `async with`; a test may start it more than once."""
    return Worker(**control_plane_worker_config(rig, client, engine, secret_store, maas_sim))


def control_plane_worker_config(
    rig: OnboardingRig, client: Client, engine: AsyncEngine, secret_store: Any, maas_sim: Any
) -> WorkerConfig:
    """control_plane_worker's arguments, for a test that splits them over two workers."""
    from worker import worker_config

    # The worker's real BMC path (ipmitool) with the simulator's ipmitool, as under bin/stack.
    host_access = simulated_host_access(
        {
            **os.environ,
            "GPUCLOUD_SIM_MAAS_URL": maas_sim.base_url,
            "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": maas_sim.control_token,
        },
        seeder=rig.seeder,
    )
    return worker_config(
        client, rig.settings, engine, secret_store=secret_store, host_access=host_access
    )


@pytest.fixture
async def onboarding(
    settings: Settings,
    temporal_client: Client,
    db_engine: AsyncEngine,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> AsyncIterator[OnboardingRig]:
    """The rig plus the control-plane worker in-process with the rig's simulated host access."""
    async with (
        onboarding_rig(settings, temporal_client, db_sessions, secret_store, maas_sim) as rig,
        control_plane_worker(rig, temporal_client, db_engine, secret_store, maas_sim),
    ):
        try:
            yield rig
        finally:
            await rig.terminate_workflows()  # before the worker stops
