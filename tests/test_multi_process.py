"""Two control-plane workers and two gateways at once, all real processes (`python -m worker`,
`python -m gateway.serve`) on one task queue, as a production deployment with more than one of
each runs. One worker is killed (SIGKILL) mid-provision, mid-onboarding and mid-decommission: the
one that holds the lifecycle's workflow (it completed the last workflow task, so the workflow
sits in its sticky cache), so Temporal has to move the workflow to the survivor. Every lifecycle
still ends exactly once:

- in SQL: one allocation row in its final state with one usage window, one onboarding and one
  node record per machine, one MAAS deploy and one MAAS release per machine (the MAAS
  simulator's own request counters), one final job state and its domain event;
- in Temporal's history: the workflow completed once, each side effect's activity completed
  once, and workflow tasks ran on both the killed worker and the survivor.

Requests alternate between the two gateways (a tenant's POST on one, its reads on the other).
Each process logs in to Vault by AppRole with its component's policy (devstack/vault_auth.py), as
under bin/stack: the lifecycles need no more than those policies grant."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle

from contracts.decommission import decommission_workflow_id
from contracts.host_tasks import SLICE_VM_PROVISION
from contracts.onboarding import onboarding_workflow_id
from core.config import Settings
from core.temporal import process_identity
from core.vault_policies import GATEWAY, WORKER
from devstack.processes import free_port
from devstack.vault_auth import provision
from schema.models import DomainEvent, Node, NodeOnboardingEvent
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.gateway_fixtures import bearer, ed25519_public_key
from tests.lifecycle_support import create_fleet, events_of, slice_request
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU, OnboardingRig
from tests.vault_fixtures import VaultServer

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
WORKER_IDENTITY = "gpucloud-control-plane@"


def settings_env(settings: Settings, vault: VaultServer) -> dict[str, str]:
    """What every control-plane process of one test reads: the same database, Temporal, codec
    key, task queue, Vault address and the test's short host timeouts."""
    return {
        **os.environ,
        "GPUCLOUD_DATABASE_URL": settings.database_url,
        "GPUCLOUD_TEMPORAL_ADDRESS": settings.temporal_address,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
        "GPUCLOUD_TASK_QUEUE": settings.control_plane_task_queue,
        "GPUCLOUD_VAULT_ADDR": vault.addr,
        "GPUCLOUD_NODE_SCHEDULE_TO_START_S": str(settings.node_schedule_to_start_seconds),
        "GPUCLOUD_HOST_PROVISION_TIMEOUT_S": str(settings.host_provision_timeout_seconds),
        "GPUCLOUD_HOST_HEARTBEAT_TIMEOUT_S": str(settings.host_heartbeat_timeout_seconds),
        "GPUCLOUD_RELEASE_RETRY_INITIAL_S": str(settings.release_retry_initial_seconds),
    }


def worker_identity(pid: int) -> str:
    """The identity a control-plane worker process shows Temporal (core.temporal)."""
    return process_identity("gpucloud-control-plane").rpartition(":")[0] + f":{pid}"


@dataclass
class Deployment:
    """The control-plane processes of one test; each is stopped at the fixture's teardown."""

    env: dict[str, str]
    logs: Path
    # Each component logs in to Vault by AppRole with its own policy, as under bin/stack.
    vault_auth: dict[str, dict[str, str]]
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    gateways: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def _spawn(
        self, argv: list[str], env: dict[str, str], log_name: str
    ) -> subprocess.Popen[bytes]:
        with (self.logs / log_name).open("ab") as log:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self, **extra_env: str) -> subprocess.Popen[bytes]:
        env = {**self.env, **self.vault_auth[WORKER.role], **extra_env}
        process = self._spawn([sys.executable, "-m", "worker"], env, "workers.log")
        self.workers[process.pid] = process
        return process

    async def start_gateway(self) -> str:
        port = free_port()
        env = {
            **self.env,
            **self.vault_auth[GATEWAY.role],
            "GPUCLOUD_GATEWAY_HOST": "127.0.0.1",
            "GPUCLOUD_GATEWAY_PORT": str(port),
        }
        process = self._spawn([sys.executable, "-m", "gateway.serve"], env, "gateways.log")
        url = f"http://127.0.0.1:{port}"
        self.gateways.append((url, process))
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                assert process.poll() is None, self.log_tail("gateways.log")
                try:
                    if (await client.get(f"{url}/healthz")).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"gateway {url} never answered:\n{self.log_tail('gateways.log')}")

    async def wait_polling(self, client: Client, queue: str) -> None:
        """Until every live worker polls the queue for workflow and activity tasks: a request
        that starts a workflow before any worker polls waits past the gateway's Temporal bound."""

        async def polled_by_all() -> bool:
            for kind in (
                TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
                TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            ):
                response = await client.workflow_service.describe_task_queue(
                    DescribeTaskQueueRequest(
                        namespace=client.namespace,
                        task_queue=TaskQueue(name=queue),
                        task_queue_type=kind,
                    )
                )
                polling = {p.identity for p in response.pollers}
                if not all(worker_identity(pid) in polling for pid in self.live_workers()):
                    return False
            return True

        await until(polled_by_all, "the workers to poll", timeout=READY_TIMEOUT_S)

    def live_workers(self) -> list[int]:
        return [pid for pid, p in self.workers.items() if p.poll() is None]

    def kill(self, pid: int) -> None:
        process = self.workers[pid]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def log_tail(self, name: str) -> str:
        path = self.logs / name
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        processes = [*self.workers.values(), *(p for _, p in self.gateways)]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
async def deployment(
    settings: Settings, vault_server: VaultServer, tmp_path: Path
) -> AsyncIterator[Deployment]:
    vault_auth = provision(vault_server.addr, vault_server.token_file, tmp_path / "approle")
    running = Deployment(settings_env(settings, vault_server), tmp_path, vault_auth)
    try:
        yield running
    finally:
        running.stop()


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def history_of(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return [event async for event in handle.fetch_history_events()]


async def worker_holding(handle: WorkflowHandle[Any, Any], deployment: Deployment) -> int:
    """The pid of the live worker that completed the workflow's last workflow task: it keeps the
    workflow in its sticky cache, so its next workflow task goes there first; killed, Temporal
    has to time that out and hand the workflow to another worker, which replays its history."""
    live = {worker_identity(pid): pid for pid in deployment.live_workers()}
    for event in reversed(await history_of(handle)):
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            identity = event.workflow_task_completed_event_attributes.identity
            if identity in live:
                return live[identity]
    raise AssertionError(f"no live worker has run {handle.id} yet: {sorted(live)}")


async def assert_completed_once(handle: WorkflowHandle[Any, Any], killed: int) -> Counter[str]:
    """The workflow closed once, as completed; its workflow tasks ran on the killed worker and on
    a survivor. Returns how many times each activity type completed."""
    history = await history_of(handle)
    closes = [e for e in history if e.event_type in CLOSE_EVENTS]
    assert [e.event_type for e in closes] == [EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED]
    assert history[-1] is closes[0]
    pids = {
        int(e.workflow_task_completed_event_attributes.identity.rpartition(":")[2])
        for e in history
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        and e.workflow_task_completed_event_attributes.identity.startswith(WORKER_IDENTITY)
    }
    assert killed in pids, pids
    assert len(pids) >= 2, pids
    scheduled = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    return Counter(
        scheduled[e.activity_task_completed_event_attributes.scheduled_event_id]
        for e in history
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    )


CLOSE_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
}


async def api_status(client: httpx.AsyncClient, path: str, *wanted: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        body: dict[str, Any] = (await client.get(path)).json()
        return body if body.get("status") in wanted else None

    try:
        return await until(check, f"{path} to reach {wanted}")  # type: ignore[no-any-return]
    except AssertionError:
        current = (await client.get(path)).text
    raise AssertionError(f"{path} never reached {wanted}: {current}")


async def test_a_worker_killed_mid_provision_leaves_one_allocation_lifecycle(
    deployment: Deployment,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    temporal_client: Client,
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    host = SimulatedHost(str(node.id), config=SimHostConfig(phase_delay_s=1.0))
    await start_node_agent(node.id, host=host)
    for _ in range(2):
        deployment.start_worker()
    await deployment.wait_polling(temporal_client, deployment.env["GPUCLOUD_TASK_QUEUE"])
    first_url, second_url = [await deployment.start_gateway() for _ in range(2)]
    token = bearer(await make_token("tenant", await make_project()))
    async with (
        httpx.AsyncClient(base_url=first_url, headers=token, timeout=60) as first,
        httpx.AsyncClient(base_url=second_url, headers=token, timeout=60) as second,
    ):
        key = await first.post(
            "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
        )
        created = await first.post(
            "/api/v1/allocations",
            json=slice_request(2, key.json()["id"]),
            headers={"X-Idempotency-Key": f"mp-{uuid.uuid4()}"},
        )
        assert created.status_code == 201, created.text
        allocation_id = created.json()["allocation_id"]
        path = f"/api/v1/allocations/{allocation_id}"
        await api_status(second, path, "provisioning")

        async def host_provisioning() -> int:
            return host.attempts(SLICE_VM_PROVISION, allocation_id)

        await until(host_provisioning, "the host provisioning to start")

        handle = temporal_client.get_workflow_handle(f"allocation-{allocation_id}")
        killed = await worker_holding(handle, deployment)
        deployment.kill(killed)

        assert (await api_status(first, path, "active", "failed"))["status"] == "active"
        released = await second.post(f"{path}/release")
        assert released.status_code == 202, released.text
        await api_status(first, path, "released")

    completed = await assert_completed_once(handle, killed)
    assert completed[SLICE_VM_PROVISION] == 1
    events = Counter(await events_of(db_sessions, allocation_id))
    assert (events["placement_reserved"], events["active"], events["released"]) == (1, 1, 1)
    async with db_sessions() as session:
        rows = (
            await session.execute(
                text(
                    "SELECT a.status, count(u.id), count(u.ended_at) FROM allocations a "
                    "LEFT JOIN usage_records u ON u.allocation_id = a.id GROUP BY a.status"
                )
            )
        ).all()
        provisions = await session.scalar(
            text("SELECT count(*) FROM node_tasks WHERE kind = :kind"), {"kind": SLICE_VM_PROVISION}
        )
    assert [tuple(r) for r in rows] == [("released", 1, 1)]  # one row, one closed usage window
    assert provisions == 1
    assert host.attempts(SLICE_VM_PROVISION, allocation_id) == 1


MACHINE = ("mp-a", "10.176.21.10")


@pytest.mark.maas_scenario(sim_scenario(sim_machine(*MACHINE, status="New")))
async def test_a_worker_killed_mid_onboarding_and_mid_decommission_leaves_one_of_each(
    onboarding_without_worker: OnboardingRig,
    deployment: Deployment,
    make_token: Any,
    temporal_client: Client,
) -> None:
    rig = onboarding_without_worker
    # Each worker renders the cloud-init of the machines it deploys with one of the gateways as
    # the API their agent enrolls at.
    gateways = [await deployment.start_gateway() for _ in range(2)]
    simulated_hosts = {
        "GPUCLOUD_HOST_ACCESS": "simulated",
        "GPUCLOUD_SIM_MAAS_URL": rig.maas_sim.base_url,
        "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": rig.maas_sim.control_token,
        "GPUCLOUD_SIM_MACHINES_DIR": str(rig.first_boot.machines_dir),
    }

    def start_worker(n: int) -> None:
        deployment.start_worker(GPUCLOUD_PUBLIC_API_URL=gateways[n % 2], **simulated_hosts)

    for n in range(2):
        start_worker(n)
    queue = deployment.env["GPUCLOUD_TASK_QUEUE"]
    await deployment.wait_polling(temporal_client, queue)
    admin = bearer(await make_token("admin"))
    async with (
        httpx.AsyncClient(base_url=gateways[0], headers=admin, timeout=60) as first,
        httpx.AsyncClient(base_url=gateways[1], headers=admin, timeout=60) as second,
    ):
        hostname, ipmi_ip = MACHINE
        created = await first.post(
            "/api/v1/admin/onboardings",
            json={
                "site_id": str(rig.site_id),
                "profile_id": str(rig.profile_id),
                "sku_id": ONBOARD_SKU,
                "hostname": hostname,
                "ipmi_ip": ipmi_ip,
            },
        )
        assert created.status_code == 201, created.text
        onboarding_id = created.json()["onboarding_id"]

        async def deployed() -> bool:
            async with rig.sessions() as session:
                return bool(
                    await session.scalar(
                        select(func.count()).where(
                            NodeOnboardingEvent.onboarding_id == uuid.UUID(onboarding_id),
                            NodeOnboardingEvent.stage == "deploy_via_maas",
                            NodeOnboardingEvent.status == "succeeded",
                        )
                    )
                )

        await until(deployed, "the deploy to be issued")
        onboarding = temporal_client.get_workflow_handle(onboarding_workflow_id(onboarding_id))
        killed_onboarding = await worker_holding(onboarding, deployment)
        deployment.kill(killed_onboarding)
        start_worker(2)  # two workers again before the next lifecycle
        await deployment.wait_polling(temporal_client, queue)

        job = await api_status(
            second,
            f"/api/v1/admin/onboardings/{onboarding_id}",
            "completed",
            "failed_retryable",
            "failed_manual_intervention",
        )
        assert job["status"] == "completed", job
        node_id = job["node_id"]

        started = await second.post(
            f"/api/v1/admin/nodes/{node_id}/decommission",
            json={"mode": "full_decommission", "erase": "quick", "reason": "multi-process"},
        )
        assert started.status_code in (200, 201, 202), started.text
        decommission_id = started.json()["decommission_id"]
        path = f"/api/v1/admin/decommissions/{decommission_id}"
        await until(
            lambda: _at_stage(first, path, "release_maas_node", "power_off_maas_node"),
            "the MAAS release",
        )
        decommission = temporal_client.get_workflow_handle(
            decommission_workflow_id(decommission_id)
        )
        killed_decommission = await worker_holding(decommission, deployment)
        deployment.kill(killed_decommission)
        final = await api_status(
            first, path, "completed", "failed_retryable", "failed_manual_intervention"
        )
        assert final["status"] == "completed", final

    onboarded = await assert_completed_once(onboarding, killed_onboarding)
    assert onboarded["onboarding.deploy_via_maas"] == 1, onboarded
    decommissioned = await assert_completed_once(decommission, killed_decommission)
    assert decommissioned["decommission.release_maas_node"] == 1, decommissioned
    counters = await rig.maas_sim.counters()
    (machine,) = counters["machines"].values()
    assert (machine.get("machine.deploy"), machine.get("machine.release")) == (1, 1), machine
    async with rig.sessions() as session:
        nodes = (await session.execute(select(Node.hostname, Node.status))).all()
        closing_events = Counter(
            await session.scalars(
                select(DomainEvent.type).where(
                    DomainEvent.subject_id.in_([onboarding_id, decommission_id]),
                    DomainEvent.type.like("%.completed"),
                )
            )
        )
    assert [tuple(n) for n in nodes] == [(hostname, "deleted")]
    assert closing_events == {
        "node.onboarding.completed": 1,
        "node.decommission.completed": 1,
    }, closing_events


async def _at_stage(client: httpx.AsyncClient, path: str, *stages: str) -> bool:
    row = (await client.get(path)).json()
    assert row["status"] in ("pending", "running"), row
    return row["current_stage"] in stages
