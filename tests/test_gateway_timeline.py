"""The allocation timeline (docs/lifecycles/allocation.md#task-timeline) as the gateway reads it:
lifecycle events and node tasks merged in time order, phases from node_task_events, phases only a
pending activity's heartbeat has yet, and sanitising by allow-list. How production writes a running
task (the agent's reports, recorded by the workflow) is tested end to end in
tests/test_allocation_timeline.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import httpx
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from contracts.host_tasks import SLICE_VM_PROVISION, TASK_SUMMARIES, HostPhase
from contracts.states import AllocationStatus, NodeTaskStatus
from core.config import Settings
from gateway import timeline
from gateway.allocations import get_row
from gateway.temporal import TemporalOps
from schema.models import AllocationEvent, NodeTask, NodeTaskEvent
from tests.lifecycle_support import eventually
from tests.test_gateway_auth import assert_error

T0 = dt.datetime(2026, 4, 18, 1, 31, 57, tzinfo=dt.UTC)
SECRET_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
SECRETS = [SECRET_KEY, "#cloud-config", "sig-4f2a9b", "vault-token-s3cr3t"]


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


async def seed_history(db_sessions, allocation, *, live: bool = False) -> uuid.UUID:
    """The rows the allocation activities write for the slice in
    docs/lifecycles/allocation.md#task-timeline's example; `live`: the provision task still queued,
    the agent's first report not recorded yet."""
    task_id = uuid.uuid4()
    async with db_sessions() as session, session.begin():
        for seconds, event, src, dst in [
            (0, "requested", None, "requested"),
            (0.5, "placement_reserved", "requested", "requested"),
            (1, "provisioning_started", "requested", "provisioning"),
        ]:
            session.add(
                AllocationEvent(
                    allocation_id=allocation.id,
                    event=event,
                    from_status=src,
                    to_status=dst,
                    actor="system",
                    details={"node_id": str(allocation.node_id), "ssh_public_keys": [SECRET_KEY]},
                    occurred_at=at(seconds),
                )
            )
        if not live:
            session.add(
                AllocationEvent(
                    allocation_id=allocation.id,
                    event="active",
                    from_status="provisioning",
                    to_status="active",
                    details={"cloud_init": "#cloud-config\nusers: []"},
                    occurred_at=at(281),
                )
            )
        session.add(
            NodeTask(
                id=task_id,
                node_id=allocation.node_id,
                allocation_id=allocation.id,
                kind=SLICE_VM_PROVISION,
                status=(NodeTaskStatus.QUEUED if live else NodeTaskStatus.COMPLETED).value,
                workflow_id=allocation.workflow_id,
                attempts=0 if live else 1,
                created_at=at(1),
                dispatched_at=None if live else at(2),
                completed_at=None if live else at(281),
                output={
                    "hard_stopped": False,
                    "signature": "sig-4f2a9b",
                    "cloud_init": "#cloud-config",
                    "token": "vault-token-s3cr3t",
                },
            )
        )
        await session.flush()
        for seconds, phase in [(5, "image_prepared"), (20, "cloud_init_seed"), (40, "vm_started")]:
            if live:
                break
            session.add(
                NodeTaskEvent(
                    node_task_id=task_id,
                    allocation_id=allocation.id,
                    phase=phase,
                    status="succeeded",
                    message=f"{phase} done",
                    details={"user_data": "#cloud-config"},
                    occurred_at=at(seconds),
                )
            )
    return task_id


async def test_timeline_merges_events_and_tasks(
    api, make_project, make_token, make_allocation, db_sessions
):
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.ACTIVE)
    task_id = await seed_history(db_sessions, allocation)
    tenant = await api(token=await make_token("tenant", project))

    response = await tenant.get(f"/api/v1/allocations/{allocation.id}/timeline")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["allocation_id"] == str(allocation.id)
    assert body["status"] == "active"
    assert body["warnings"] == []
    names = [(i["kind"], i["name"]) for i in body["items"]]
    assert names == [
        ("allocation_state", "requested"),
        ("allocation_state", "placement_reserved"),
        ("allocation_state", "provisioning_started"),
        ("node_task", SLICE_VM_PROVISION),
        ("allocation_state", "active"),
    ]
    state = body["items"][2]
    assert state["status"] == "succeeded"
    assert state["state"] == "provisioning"
    assert state["details"] == {"node_id": str(allocation.node_id)}
    task = body["items"][3]
    assert task["task_id"] == str(task_id)
    assert task["status"] == "succeeded"
    assert task["summary"] == TASK_SUMMARIES[SLICE_VM_PROVISION]
    assert task["duration_seconds"] == 279.0  # dispatched 01:31:59, completed 01:36:38
    assert task["phases_source"] == "database"
    assert [p["phase"] for p in task["phases"]] == [
        "image_prepared",
        "cloud_init_seed",
        "vm_started",
    ]
    assert task["phases"][0] == {
        "phase": "image_prepared",
        "status": "succeeded",
        "at": "2026-04-18T01:32:02Z",
        "message": "image_prepared done",
        "attempt": None,  # recorded before attempts were
    }
    assert task["details"] == {"hard_stopped": False}
    for secret in SECRETS:
        assert secret not in response.text

    admin = await api(token=await make_token("admin"))
    as_admin = await admin.get(f"/api/v1/admin/allocations/{allocation.id}/timeline")
    assert as_admin.json() == body


async def test_failed_task_and_failed_state(
    api, make_project, make_token, make_allocation, db_sessions
):
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.FAILED)
    async with db_sessions() as session, session.begin():
        session.add(
            AllocationEvent(
                allocation_id=allocation.id, event="provisioning_failed",
                from_status="provisioning", to_status="failed", reason="vfio_error",
                occurred_at=at(30),
            )
        )  # fmt: skip
        session.add(
            NodeTask(
                id=uuid.uuid4(), node_id=allocation.node_id, allocation_id=allocation.id,
                kind=SLICE_VM_PROVISION, status="failed", workflow_id=allocation.workflow_id,
                created_at=at(1), completed_at=at(29), error_type="vfio_error",
                error_message="host has no IOMMU group for 0000:17:00.0",
            )
        )  # fmt: skip
    client = await api(token=await make_token("tenant", project))
    items = (await client.get(f"/api/v1/allocations/{allocation.id}/timeline")).json()["items"]
    task, state = items
    assert task["status"] == "failed"
    assert task["error_type"] == "vfio_error"
    assert task["duration_seconds"] == 28.0
    assert state["status"] == "failed"
    assert state["reason"] == "vfio_error"


async def test_timeline_of_unknown_allocation_is_404(api, make_token):
    client = await api(token=await make_token("tenant"))
    assert_error(await client.get(f"/api/v1/allocations/{uuid.uuid4()}/timeline"), 404, "not_found")


# --- live phases: a running host activity's heartbeat, read through Temporal ---


@activity.defn(name=SLICE_VM_PROVISION)
async def provisioning_in_progress() -> None:
    now = dt.datetime.now(dt.UTC).isoformat()
    activity.heartbeat(
        [
            HostPhase("image_prepared", "succeeded", now, "reused cached image"),
            HostPhase("cloud_init_seed", "succeeded", now),
            HostPhase("domain_defined", "succeeded", now),
            HostPhase("vm_started", "started", now, f"booting with {SECRET_KEY}"),
        ]
    )
    await asyncio.Event().wait()  # until the test cancels it


@workflow.defn(name="GatewayTimelineProbe")
class HostTaskProbe:
    """Holds one host activity open on the allocation's workflow id, as provisioning does."""

    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(
            SLICE_VM_PROVISION,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(minutes=1),
        )


async def test_phases_only_the_heartbeat_has_are_added(
    api, make_project, make_token, make_allocation, db_sessions, temporal_client: Client
):
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.PROVISIONING)
    await seed_history(db_sessions, allocation, live=True)
    client = await api(token=await make_token("tenant", project))
    task_queue = f"timeline-probe-{uuid.uuid4()}"
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[HostTaskProbe],
        activities=[provisioning_in_progress],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        handle = await temporal_client.start_workflow(
            HostTaskProbe.run,
            id=allocation.workflow_id,
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.TERMINATE_EXISTING,
        )
        try:

            def node_task(response: httpx.Response) -> Any:
                return next(i for i in response.json()["items"] if i["kind"] == "node_task")

            async def from_temporal() -> httpx.Response | None:
                response = await client.get(f"/api/v1/allocations/{allocation.id}/timeline")
                assert response.status_code == 200, response.text
                return response if node_task(response)["phases_source"] == "temporal" else None

            response = await eventually(from_temporal, timeout=20, interval=0.2)
            task = node_task(response)
            assert task["status"] == "queued"
            assert task["completed_at"] is None
            assert task["duration_seconds"] > 0
            assert [p["phase"] for p in task["phases"]] == [
                "image_prepared", "cloud_init_seed", "domain_defined", "vm_started"
            ]  # fmt: skip
            assert task["phases"][-1]["status"] == "started"
            # A heartbeat is no record: its text passes the sanitiser here.
            assert task["phases"][-1]["message"] == "booting with [redacted]"
            assert SECRET_KEY not in response.text
            assert response.json()["warnings"] == []
        finally:
            await handle.terminate("test over")


async def test_live_task_without_a_workflow_keeps_database_phases(
    api, make_project, make_token, make_allocation, db_sessions
):
    status = NodeTaskStatus.QUEUED
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.PROVISIONING)
    async with db_sessions() as session, session.begin():
        session.add(
            NodeTask(
                id=uuid.uuid4(), node_id=allocation.node_id, allocation_id=allocation.id,
                kind=SLICE_VM_PROVISION, status=status.value, workflow_id=allocation.workflow_id,
            )
        )  # fmt: skip
    client = await api(token=await make_token("tenant", project))
    body = (await client.get(f"/api/v1/allocations/{allocation.id}/timeline")).json()
    (task,) = body["items"]
    assert task["status"] == "queued"
    assert task["phases"] == []
    assert task["phases_source"] == "database"
    assert body["warnings"] == ["live_phases_unavailable"]


async def test_timelines_built_together_are_each_as_built_alone(
    make_project, make_allocation, db_sessions
):
    """build_many (a group's members) reads each table once for all of them: no allocation's
    rows leak into another's timeline, each keeps its own order and warnings."""
    project = await make_project()
    done = [await make_allocation(project, status=AllocationStatus.ACTIVE) for _ in range(2)]
    for allocation in done:
        await seed_history(db_sessions, allocation)  # the same instants: interleaved rows
    live = await make_allocation(project, status=AllocationStatus.PROVISIONING)
    await seed_history(db_sessions, live, live=True)
    settings = cast(Settings, SimpleNamespace(temporal_rpc_timeout_seconds=1.0))
    no_temporal = TemporalOps(None, settings)  # a live task's heartbeat: unavailable
    order = [live, *done]

    async with db_sessions() as db:
        rows = [await get_row(db, a.id, None) for a in order]
        together = await timeline.build_many(db, no_temporal, rows)
    alone = []
    for allocation in order:
        async with db_sessions() as db:
            alone.append(
                await timeline.build(db, no_temporal, allocation_id=allocation.id, project_id=None)
            )

    assert [t.allocation_id for t in together] == [a.id for a in order]
    assert together[1:] == alone[1:]
    assert [len(t.items) for t in together] == [4, 5, 5]
    assert together[0].warnings == alone[0].warnings == ["live_phases_unavailable"]
    assert [i.name for i in together[0].items] == [i.name for i in alone[0].items]
    assert [t.warnings for t in together[1:]] == [[], []]
