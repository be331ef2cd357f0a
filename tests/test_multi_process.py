"""Two control-plane workers and two gateways at once, all real processes (`worker.main`,
`gateway.serve.main`, started as bin/stack starts them) on one task queue, as a production
deployment with more than one of each runs. One worker is killed (SIGKILL) mid-provision,
mid-onboarding and mid-decommission:

- mid-onboarding and mid-decommission, the worker RUNNING the in-flight control-plane activity
  (the MAAS deploy wait, the MAAS release wait; Temporal's pending activity names the worker):
  it stops heartbeating, the activity's heartbeat timeout (the workflow's, as production sets
  it) expires and a survivor runs the next attempt, which has to pick the MAAS wait up where it
  stands rather than deploy or release again;
- mid-provision, the in-flight activity is the host task, run by the node's agent (its node
  queue), not by a control-plane worker: the worker killed is the one that holds the workflow
  (it completed the last workflow task, so the workflow sits in its sticky cache), so Temporal
  has to move the workflow to the survivor while the host works.

Every lifecycle still ends exactly once:

- in SQL: one allocation row in its final state with one usage window, one onboarding and one
  node record per machine, one MAAS deploy and one MAAS release per machine (the MAAS
  simulator's own request counters), one final job state and its domain event; the host ran
  the provision once;
- in Temporal's history: the workflow completed once, by a survivor; each side effect's
  activity completed once; the killed activity's attempt was lost to its heartbeat timeout and
  the attempt that completed ran on a survivor; a killed workflow holder had run workflow tasks.

Requests alternate between the two gateways (a tenant's POST on one, its reads on the other).
Each process logs in to Vault by AppRole with its component's policy (devstack/vault_auth.py), as
under bin/stack: the lifecycles need no more than those policies grant."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text
from temporalio.api.enums.v1 import (
    EventType,
    PendingActivityState,
    TaskQueueType,
    TimeoutType,
)
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle

from contracts.decommission import decommission_workflow_id
from contracts.host_tasks import SLICE_VM_PROVISION
from contracts.onboarding import onboarding_workflow_id
from core.config import Settings
from core.temporal import process_identity
from core.vault_policies import GATEWAY, WORKER
from devstack.processes import Child, free_port, python_entry, tail
from devstack.vault_auth import provision
from schema.models import DomainEvent, Node, NodeOnboardingEvent
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.gateway_fixtures import bearer, ed25519_public_key
from tests.lifecycle_support import create_fleet, events_of, eventually, slice_request
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU, OnboardingRig
from tests.vault_fixtures import VaultServer

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 90.0
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
    """The control-plane processes of one test, each started as bin/stack starts it
    (devstack.processes.Child: its own log, dies with the test process); each is stopped at
    the fixture's teardown."""

    env: dict[str, str]
    logs: Path
    # Each component logs in to Vault by AppRole with its own policy, as under bin/stack.
    vault_auth: dict[str, dict[str, str]]
    workers: dict[int, Child] = field(default_factory=dict)
    gateways: list[tuple[str, Child]] = field(default_factory=list)

    async def _spawn(self, name: str, module: str, env: dict[str, str]) -> Child:
        child = Child(name, python_entry(module), self.logs / f"{name}.log", env, REPO)
        await child.start()
        return child

    async def start_worker(self, **extra_env: str) -> None:
        env = {**self.env, **self.vault_auth[WORKER.role], **extra_env}
        child = await self._spawn(f"worker-{len(self.workers)}", "worker", env)
        assert child.pid is not None
        self.workers[child.pid] = child

    async def start_gateway(self) -> str:
        port = free_port()
        env = {
            **self.env,
            **self.vault_auth[GATEWAY.role],
            "GPUCLOUD_GATEWAY_HOST": "127.0.0.1",
            "GPUCLOUD_GATEWAY_PORT": str(port),
        }
        child = await self._spawn(f"gateway-{len(self.gateways)}", "gateway.serve", env)
        url = f"http://127.0.0.1:{port}"
        self.gateways.append((url, child))
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                assert child.running, tail(child.log_path)
                try:
                    if (await client.get(f"{url}/healthz")).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"gateway {url} never answered:\n{tail(child.log_path)}")

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

        await eventually(polled_by_all, timeout=READY_TIMEOUT_S)

    def live_workers(self) -> list[int]:
        return [pid for pid, child in self.workers.items() if child.running]

    async def kill(self, pid: int) -> None:
        """SIGKILL: the worker gets no chance to fail its tasks or leave its sticky queue."""
        child = self.workers[pid]
        child.kill()
        await asyncio.wait_for(child.wait(), 10)

    async def stop(self) -> None:
        children = [*self.workers.values(), *(child for _, child in self.gateways)]
        await asyncio.gather(*(child.stop(grace_s=20) for child in children))


@pytest.fixture
async def deployment(
    settings: Settings, vault_server: VaultServer, tmp_path: Path
) -> AsyncIterator[Deployment]:
    vault_auth = provision(vault_server.addr, vault_server.token_file, tmp_path / "approle")
    running = Deployment(settings_env(settings, vault_server), tmp_path, vault_auth)
    try:
        yield running
    finally:
        await running.stop()


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


async def worker_running(
    handle: WorkflowHandle[Any, Any], activity: str, deployment: Deployment
) -> int:
    """The pid of the live worker running the first attempt of the workflow's pending
    `activity`: Temporal names the worker that polled it (last_worker_identity)."""
    live = {worker_identity(pid): pid for pid in deployment.live_workers()}

    async def started() -> int | None:
        description = await handle.describe()
        for pending in description.raw_description.pending_activities:
            if (
                pending.activity_type.name == activity
                and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
            ):
                assert pending.attempt == 1, pending
                assert pending.last_worker_identity in live, (pending, sorted(live))
                return live[pending.last_worker_identity]
        return None

    return await eventually(started, timeout=WAIT_TIMEOUT_S)


def pid_of(identity: str) -> int:
    assert identity.startswith(WORKER_IDENTITY), identity
    return int(identity.rpartition(":")[2])


async def assert_completed_once(
    handle: WorkflowHandle[Any, Any], killed: int, *, retried: str | None = None
) -> Counter[str]:
    """The workflow closed once, as completed, its last workflow task on a survivor. With
    `retried`, the killed worker ran that activity: its attempt was lost to the heartbeat
    timeout and the one that completed ran on a survivor. Without, the killed worker held the
    workflow: workflow tasks ran on it and on a survivor. Returns how many times each activity
    type completed."""
    # The lifecycle's row says released a moment before the workflow's completion is written:
    # wait for the close (it must come, and be a completion) before reading the history.
    async with asyncio.timeout(60):
        await handle.result()
    history = await history_of(handle)
    closes = [e for e in history if e.event_type in CLOSE_EVENTS]
    assert [e.event_type for e in closes] == [EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED]
    assert history[-1] is closes[0]
    workflow_tasks = [
        pid_of(e.workflow_task_completed_event_attributes.identity)
        for e in history
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    ]
    assert workflow_tasks[-1] != killed, workflow_tasks
    scheduled = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    if retried is None:
        assert killed in workflow_tasks, workflow_tasks
        assert len(set(workflow_tasks)) >= 2, workflow_tasks
    else:
        (started,) = [
            e.activity_task_started_event_attributes
            for e in history
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
            and scheduled[e.activity_task_started_event_attributes.scheduled_event_id] == retried
        ]
        assert started.attempt >= 2, started
        assert pid_of(started.identity) != killed, started
        timeout = started.last_failure.timeout_failure_info.timeout_type
        assert timeout == TimeoutType.TIMEOUT_TYPE_HEARTBEAT, started.last_failure
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
        return await eventually(check, timeout=WAIT_TIMEOUT_S)
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
        await deployment.start_worker()
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

        await eventually(host_provisioning, timeout=WAIT_TIMEOUT_S)

        handle = temporal_client.get_workflow_handle(f"allocation-{allocation_id}")
        killed = await worker_holding(handle, deployment)
        await deployment.kill(killed)

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
# Long enough (simulated seconds, at TEST_TIME_SCALE) for the deploy and the release waits to be
# caught running and their worker killed; both are over when the next attempt starts, after the
# heartbeat timeout (15 s for onboarding's stages, 60 s for decommission's), which then finds
# the machine Deployed, or Ready with its disks erased (adopted), and issues nothing again.
SLOW_MAAS = {"deploying": 8_000, "disk_erasing": 8_000}


@pytest.mark.maas_scenario(sim_scenario(sim_machine(*MACHINE, status="New", timings=SLOW_MAAS)))
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

    async def start_worker(n: int) -> None:
        await deployment.start_worker(GPUCLOUD_PUBLIC_API_URL=gateways[n % 2], **simulated_hosts)

    for n in range(2):
        await start_worker(n)
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

        await eventually(deployed, timeout=WAIT_TIMEOUT_S)
        onboarding = temporal_client.get_workflow_handle(onboarding_workflow_id(onboarding_id))
        killed_onboarding = await worker_running(
            onboarding, "onboarding.wait_for_deployed", deployment
        )
        await deployment.kill(killed_onboarding)
        await start_worker(2)  # two workers again before the next lifecycle
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
        await eventually(
            lambda: _at_stage(first, path, "release_maas_node"), timeout=WAIT_TIMEOUT_S
        )
        decommission = temporal_client.get_workflow_handle(
            decommission_workflow_id(decommission_id)
        )
        killed_decommission = await worker_running(
            decommission, "decommission.release_maas_node", deployment
        )
        await deployment.kill(killed_decommission)
        final = await api_status(
            first, path, "completed", "failed_retryable", "failed_manual_intervention"
        )
        assert final["status"] == "completed", final

    onboarded = await assert_completed_once(
        onboarding, killed_onboarding, retried="onboarding.wait_for_deployed"
    )
    assert onboarded["onboarding.deploy_via_maas"] == 1, onboarded
    decommissioned = await assert_completed_once(
        decommission, killed_decommission, retried="decommission.release_maas_node"
    )
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
