"""AllocationWorkflow end to end through the HTTP API: every transition and every row of seed
000's failure→state table, on real Temporal, real PostgreSQL and nodes of the enrolled fleet
(tests/enrolled_fleet.py: onboarded through the admin API, each agent enrolled with its token and
active by its first inventory), whose agents' simulated hosts inject the faults."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import Client, Interceptor, OutboundInterceptor
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
)
from core import search_attributes as sa
from core.build_id import BUILD_IDS
from gateway.allocations import allocation_id_for
from schema.models import Allocation, AuditEntry, NodeTask
from sim.config import SimHostConfig
from tests.enrolled_fleet import EnrolledFleet
from tests.factories import SLICE_SKU
from tests.histories import record_history
from tests.lifecycle_support import (
    Tenant,
    baremetal_request,
    events_of,
    eventually,
    held_claims,
    reserved_slots,
    slice_request,
    wait_status,
)


async def allocate(tenant: Tenant, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    headers = {"X-Idempotency-Key": key} if key else {}
    response = await tenant.client.post("/api/v1/allocations", json=body, headers=headers)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    assert created["status"] == "requested"
    return created


async def test_slice_allocation_full_lifecycle(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)

    created = await allocate(tenant, slice_request(2, tenant.ssh_key_id))
    allocation_id = created["allocation_id"]
    assert created["node_id"] == str(node.id)
    assert await held_claims(db_sessions, allocation_id) == 2

    active = await wait_status(tenant.client, allocation_id, "active")
    assert active["connect_host"]
    assert active["created_at"] <= active["provisioning_started_at"] <= active["active_at"]

    timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    names = [item["name"] for item in timeline["items"]]
    assert names[:3] == ["requested", "placement_reserved", "provisioning_started"]
    task = next(i for i in timeline["items"] if i["kind"] == "node_task")
    assert task["name"] == SLICE_VM_PROVISION
    assert task["status"] == "succeeded"
    assert [p["phase"] for p in task["phases"] if p["status"] == "succeeded"] == [
        "image_prepared",
        "cloud_init_seed_generated",
        "domain_defined",
        "vm_started",
        "guest_reachable",
        "driver_ready",
    ]
    assert tenant.ssh_public_key.split()[1] not in json.dumps(timeline)

    released = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202, released.text
    assert released.json()["expected_status"] == "releasing"
    final = await wait_status(tenant.client, allocation_id, "released")
    assert final["hard_stopped"] is False
    assert final["active_at"] <= final["releasing_at"] <= final["released_at"]
    assert await held_claims(db_sessions, allocation_id) == 0
    assert await reserved_slots(db_sessions) == 0
    assert await events_of(db_sessions, allocation_id) == [
        "requested",
        "placement_reserved",
        "provisioning_started",
        "active",
        "releasing",
        "released",
    ]

    handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
    history = (await handle.fetch_history()).to_json()
    assert tenant.ssh_public_key.split()[1] not in history, "SSH key in plaintext history"
    await record_history(handle, "allocation", "slice_happy_path")


async def test_search_attributes_follow_the_allocation_without_an_upsert_on_the_post_path(
    tenant: Tenant, enrolled_fleet: EnrolledFleet, temporal_client: Any, settings: Any
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    await node.agent.stop()  # the node's agent is down: the allocation waits in provisioning
    created = await allocate(tenant, slice_request(2, tenant.ssh_key_id))
    handle = temporal_client.get_workflow_handle(allocation_workflow_id(created["allocation_id"]))

    async def attributes() -> dict[str, Any]:
        described = (await handle.describe()).typed_search_attributes
        return {
            key.name: described.get(key)
            for key in (sa.ALLOCATION_STATUS, sa.NODE_ID, sa.PROJECT_ID, sa.SKU)
        }

    assert await attributes() == {
        "AllocationStatus": "provisioning",
        "NodeId": None,  # comes with the next status: the POST's workflow task upserts nothing
        "ProjectId": str(tenant.project_id),
        "Sku": SLICE_SKU,
    }
    history = await handle.fetch_history()
    assert not [
        e
        for e in history.events
        if e.HasField("upsert_workflow_search_attributes_event_attributes")
    ]
    # Nor does Temporal itself: the worker that completed the first workflow task reported the
    # build id the workflow started with, so BuildIds is what the gateway set (a third entry if
    # the two disagreed, and a visibility write for it).
    described = await handle.describe()
    info = described.raw_description.workflow_execution_info
    assert info.most_recent_worker_version_stamp.build_id == settings.build_id
    assert described.typed_search_attributes.get(BUILD_IDS) == [
        "unversioned",
        f"unversioned:{settings.build_id}",
    ]

    await enrolled_fleet.restart_agent(node)  # back before the task's schedule-to-start ends
    await wait_status(tenant.client, created["allocation_id"], "active")
    # The row turns active inside the activity; the upsert is a command of the workflow task
    # that follows it, so the attributes may lag the row by one task.
    activated = {
        "AllocationStatus": "active",
        "NodeId": str(node.id),
        "ProjectId": str(tenant.project_id),
        "Sku": SLICE_SKU,
    }

    async def caught_up(expected: dict[str, Any]) -> bool:
        return await attributes() == expected

    await eventually(lambda: caught_up(activated), timeout=10.0)
    refused = await tenant.client.post(
        "/api/v1/allocations",
        json=slice_request(8, tenant.ssh_key_id),  # 6 of the node's 8 GPUs are free
        headers={"X-Idempotency-Key": "too-big"},
    )
    assert refused.status_code == 409, refused.text
    rejected = temporal_client.get_workflow_handle(
        allocation_workflow_id(str(allocation_id_for(tenant.project_id, "too-big")))
    )
    await rejected.result()
    described = (await rejected.describe()).typed_search_attributes
    assert described.get(sa.ALLOCATION_STATUS) == "rejected"

    await tenant.client.post(f"/api/v1/allocations/{created['allocation_id']}/release")
    await wait_status(tenant.client, created["allocation_id"], "released")
    await eventually(lambda: caught_up(activated | {"AllocationStatus": "released"}), timeout=10.0)


async def test_baremetal_allocation_claims_whole_node(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=0, baremetal_nodes=1)

    created = await allocate(tenant, baremetal_request(tenant.ssh_key_id))
    allocation_id = created["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")
    # The only node is taken: a second request has nowhere to go.
    second = await tenant.client.post("/api/v1/allocations", json=baremetal_request())
    assert second.status_code == 409
    assert second.json()["error"]["code"] == "sku_unavailable"

    await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(tenant.client, allocation_id, "released")
    async with db_sessions() as session:
        tasks = (
            await session.execute(
                select(NodeTask.kind, NodeTask.attempts)
                .where(NodeTask.allocation_id == uuid.UUID(allocation_id))
                .order_by(NodeTask.created_at)
            )
        ).all()
    kinds = [kind for kind, _ in tasks]
    assert kinds == [BAREMETAL_PROVISION_USER, BAREMETAL_DEPROVISION_USER]
    # Each ended once, and the timeline's task items say so.
    assert [attempts for _, attempts in tasks] == [1, 1]
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "baremetal_happy_path",
    )
    # The node is free again.
    again = await allocate(tenant, baremetal_request())
    assert again["node_id"] == str(node.id)


@pytest.mark.parametrize(
    ("fault", "times", "phase"),
    [
        (HostErrorType.IMAGE_ERROR, 1, None),  # image download / sha mismatch
        (HostErrorType.VFIO_ERROR, 1, None),  # VFIO bind required but host wrong
        (HostErrorType.READINESS_TIMEOUT, 1, "guest_reachable"),  # SSH readiness times out
        (HostErrorType.READINESS_TIMEOUT, 1, "driver_ready"),  # readiness marker never appears
        (HostErrorType.LEASE_CONFLICT, 10, None),  # lease conflict beyond the workflow's retries
    ],
)
async def test_provisioning_failures_land_in_failed_with_every_claim_freed(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    temporal_client: Any,
    fault: HostErrorType,
    times: int,
    phase: str | None,
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    node.agent.host.faults.inject(SLICE_VM_PROVISION, fault, times=times, phase=phase)

    allocation_id = (await allocate(tenant, slice_request(4)))["allocation_id"]
    failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == fault.value
    assert failed["failed_at"] is not None
    assert await held_claims(db_sessions, allocation_id) == 0
    assert await reserved_slots(db_sessions) == 0
    events = await events_of(db_sessions, allocation_id)
    assert events[-1] == "failed"
    assert "active" not in events

    # Failed is terminal: release is refused with a clear code.
    refused = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "allocation_not_releasable"
    if fault == HostErrorType.IMAGE_ERROR:
        await record_history(
            temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
            "allocation",
            "provision_failed_image",
        )


async def test_lease_conflict_is_retried_by_the_workflow(
    tenant: Tenant, enrolled_fleet: EnrolledFleet
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    node.agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.LEASE_CONFLICT, times=2)
    allocation_id = (await allocate(tenant, slice_request(1)))["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")


async def test_dead_node_fails_provisioning_as_node_unreachable(
    tenant: Tenant, db_sessions: Any, temporal_client: Any, enrolled_fleet: EnrolledFleet
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    await node.agent.stop()  # the agent dies; the node is still active (not yet offline)
    allocation_id = (await allocate(tenant, slice_request(1)))["allocation_id"]
    failed = await wait_status(tenant.client, allocation_id, "failed", timeout=30)
    assert failed["failure_reason"] == "node_unreachable"
    assert await held_claims(db_sessions, allocation_id) == 0
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "provision_failed_node_unreachable",
    )


async def test_release_hard_stop_still_counts_as_released(
    tenant: Tenant, enrolled_fleet: EnrolledFleet
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    agent = node.agent
    allocation_id = (await allocate(tenant, slice_request(1)))["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")
    agent.host.faults.fail_graceful_shutdown()
    await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    final = await wait_status(tenant.client, allocation_id, "released")
    assert final["hard_stopped"] is True


async def test_release_failed_then_user_retry_releases(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    temporal_client: Any,
    admin: Any,
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    agent = node.agent
    allocation_id = (await allocate(tenant, slice_request(2)))["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")

    agent.host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
    await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    failed = await wait_status(tenant.client, allocation_id, "release_failed")
    assert failed["failure_reason"] == HostErrorType.RELEASE_ERROR.value
    # The node stays assigned until cleanup is proven.
    assert await held_claims(db_sessions, allocation_id) == 2
    listed = (
        await admin.get("/api/v1/admin/allocations", params={"status": "release_failed"})
    ).json()
    assert [item["allocation_id"] for item in listed["items"]] == [allocation_id]

    retry = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert retry.status_code == 202
    assert retry.json()["prior_status"] == "release_failed"
    final = await wait_status(tenant.client, allocation_id, "released")
    assert final["release_attempts"] == 2
    assert await held_claims(db_sessions, allocation_id) == 0
    assert (await events_of(db_sessions, allocation_id))[-4:] == [
        "releasing",
        "release_failed",
        "releasing",
        "released",
    ]
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "release_failed_then_retry",
    )


async def test_admin_force_release_from_release_failed_and_from_active(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    admin: Any,
    temporal_client: Any,
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    agent = node.agent
    first = (await allocate(tenant, slice_request(1)))["allocation_id"]
    second = (await allocate(tenant, slice_request(1)))["allocation_id"]
    await wait_status(tenant.client, first, "active")
    await wait_status(tenant.client, second, "active")

    agent.host.faults.inject(
        SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3, allocation_id=first
    )
    await tenant.client.post(f"/api/v1/allocations/{first}/release")
    await wait_status(tenant.client, first, "release_failed")

    missing_reason = await admin.post(f"/api/v1/admin/allocations/{first}/force-release", json={})
    assert missing_reason.status_code == 400
    for allocation_id, prior in ((first, "release_failed"), (second, "active")):
        response = await admin.post(
            f"/api/v1/admin/allocations/{allocation_id}/force-release",
            json={"reason": "INC-42 node cleanup"},
        )
        assert response.status_code == 202, response.text
        assert response.json()["prior_status"] == prior
        final = await wait_status(tenant.client, allocation_id, "released")
        assert final["release_requested_by"] == "admin"

    async with db_sessions() as session:
        audits = (
            await session.scalars(
                select(AuditEntry).where(AuditEntry.action == "allocation.force_release")
            )
        ).all()
    assert {a.target_id for a in audits} == {first, second}
    assert all(a.reason == "INC-42 node cleanup" and a.role == "admin" for a in audits)
    assert all(a.workflow_ids == [allocation_workflow_id(a.target_id)] for a in audits)
    assert {a.prior_state for a in audits} == {"release_failed", "active"}
    for allocation_id, name in ((first, "release_failed"), (second, "active")):
        await record_history(
            temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
            "allocation",
            f"admin_force_release_from_{name}",
        )


@pytest.mark.usefixtures("control_plane")
async def test_tenant_cannot_force_release(tenant: Tenant, db_sessions: Any) -> None:
    response = await tenant.client.post(
        f"/api/v1/admin/allocations/{uuid.uuid4()}/force-release", json={"reason": "x"}
    )
    assert response.status_code == 403


async def test_idempotent_create_and_release(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=1)
    body = slice_request(2)
    first = await allocate(tenant, body, key="order-7")
    second = await allocate(tenant, body, key="order-7")
    assert first["allocation_id"] == second["allocation_id"]
    await wait_status(tenant.client, first["allocation_id"], "active")
    third = await allocate(tenant, body, key="order-7")
    assert third["allocation_id"] == first["allocation_id"]
    async with db_sessions() as session:
        rows = (await session.scalars(select(Allocation.id))).all()
    assert len(rows) == 1
    assert await reserved_slots(db_sessions) == 2

    reused = await tenant.client.post(
        "/api/v1/allocations", json=slice_request(4), headers={"X-Idempotency-Key": "order-7"}
    )
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"

    allocation_id = first["allocation_id"]
    answers = [
        await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release") for _ in range(3)
    ]
    assert all(a.status_code == 202 for a in answers)
    await wait_status(tenant.client, allocation_id, "released")
    after = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert after.status_code == 202
    assert after.json()["status"] == "released"
    assert (await events_of(db_sessions, allocation_id)).count("releasing") == 1


async def test_release_requested_while_provisioning_runs_after_activation(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    node.agent.host.config = SimHostConfig(phase_delay_s=0.3)  # each phase takes 0.3 s
    allocation_id = (await allocate(tenant, slice_request(1)))["allocation_id"]
    await wait_status(tenant.client, allocation_id, "provisioning")
    response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert response.status_code == 202
    assert response.json()["release_pending"] is True
    await wait_status(tenant.client, allocation_id, "released", timeout=30)
    events = await events_of(db_sessions, allocation_id)
    assert events[-3:] == ["active", "releasing", "released"]
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "release_requested_during_provisioning",
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"sku": "no-such-sku"},  # SKU not found
        {"gpus": 3},  # count not allowed
        {"region": "eu-nowhere-1"},  # no capacity in region
        {"sku": "h100.8x.baremetal", "gpus": 4},  # wrong shape/count for the SKU
        {"gpus": 8},  # no node with 8 free GPUs (another project holds 8 + 1 of the 16)
    ],
)
async def test_sku_unavailable_reserves_nothing(
    tenant: Tenant,
    db_sessions: Any,
    overrides: dict[str, Any],
    enrolled_fleet: EnrolledFleet,
    api: Any,
    make_project: Any,
    make_token: Any,
) -> None:
    await enrolled_fleet.create(slice_nodes=2)
    if overrides == {"gpus": 8}:
        # Best fit: the 8 take one node whole, the 1 lands on the other; neither has 8 free.
        other = await api(token=await make_token("tenant", await make_project()))
        for gpus in (8, 1):
            taken = await other.post("/api/v1/allocations", json=slice_request(gpus))
            assert taken.status_code == 201, taken.text
    reserved_before = await reserved_slots(db_sessions)
    response = await tenant.client.post(
        "/api/v1/allocations",
        json={**slice_request(1), **overrides},
        headers={"X-Idempotency-Key": "k"},
    )
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "sku_unavailable"
    async with db_sessions() as session:
        mine = select(Allocation.id).where(Allocation.project_id == tenant.project_id)
        assert (await session.scalars(mine)).all() == []
    assert await reserved_slots(db_sessions) == reserved_before
    # Replaying the same key answers the same rejection.
    again = await tenant.client.post(
        "/api/v1/allocations",
        json={**slice_request(1), **overrides},
        headers={"X-Idempotency-Key": "k"},
    )
    assert again.status_code == 409


async def test_unknown_ssh_key_is_rejected_before_anything_is_reserved(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=1)
    response = await tenant.client.post(
        "/api/v1/allocations", json=slice_request(1, str(uuid.uuid4()))
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "ssh_key_not_found"
    assert await reserved_slots(db_sessions) == 0


async def test_slice_placement_prefers_numa_fit_then_best_fit(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=2)
    first = await allocate(tenant, slice_request(2))
    # Best-fit: the second request lands on the node that already has fewer free GPUs.
    second = await allocate(tenant, slice_request(2))
    assert second["node_id"] == first["node_id"]
    async with db_sessions() as session:
        from schema.models import GpuSlot

        numa = (
            await session.scalars(
                select(GpuSlot.numa_node).where(
                    GpuSlot.allocation_id == uuid.UUID(first["allocation_id"])
                )
            )
        ).all()
    assert len(set(numa)) == 1, "a 2-GPU slice fits one NUMA node and must not straddle two"


async def test_post_that_times_out_names_the_allocation_it_may_have_started(
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    settings: Any,
    temporal_client: Any,
    db_engine: Any,
    enrolled_fleet: EnrolledFleet,
) -> None:
    """No worker answers (the control plane is down): the gateway answers 503 within its RPC
    bound and names the allocation id, which becomes real once a worker is back."""
    import dataclasses

    from worker import build_worker

    await enrolled_fleet.create(slice_nodes=1)
    quick = dataclasses.replace(
        settings, temporal_rpc_timeout_seconds=1.0, control_plane_task_queue=f"down-{uuid.uuid4()}"
    )
    client = await api(token=await make_token("tenant", await make_project()), settings=quick)
    response = await client.post("/api/v1/allocations", json=slice_request(1))
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "temporal_unavailable"
    allocation_id = error["details"]["allocation_id"]

    async with build_worker(temporal_client, quick, db_engine):
        await wait_status(client, allocation_id, "active")


class _AbortedUpdateWithStart(Interceptor):
    """Answers update-with-start the way the server does when it aborts the update (a quick
    UNAVAILABLE inside a multi-operation error), for the planned attempts: "before" without
    sending anything, "after" once the real call has reserved (the answer lost on its way)."""

    def __init__(self, plan: list[str]) -> None:
        self.plan = plan
        self.attempts = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        interceptor = self

        class Outbound(OutboundInterceptor):
            async def start_update_with_start_workflow(self, input: Any) -> Any:
                interceptor.attempts += 1
                fault = interceptor.plan.pop(0) if interceptor.plan else None
                aborted = RPCError("workflow update was aborted", RPCStatusCode.UNAVAILABLE, b"")
                if fault == "before":
                    raise aborted
                handle = await super().start_update_with_start_workflow(input)
                if fault == "after":
                    await handle.result()
                    raise aborted
                return handle

        return Outbound(next)


@pytest.mark.parametrize("plan", [["before", "before"], ["after"]])
async def test_post_retries_an_update_the_server_aborted_and_reserves_once(
    plan: list[str],
    api: Any,
    make_project: Any,
    make_token: Any,
    make_ssh_key: Any,
    db_sessions: Any,
    temporal_client: Any,
    enrolled_fleet: EnrolledFleet,
) -> None:
    await enrolled_fleet.create(slice_nodes=1)
    faults = _AbortedUpdateWithStart(list(plan))
    aborting = Client(**{**temporal_client.config(), "interceptors": [faults]})
    project = await make_project()
    key = await make_ssh_key(project)
    client = await api(token=await make_token("tenant", project), temporal_client=aborting)

    response = await client.post("/api/v1/allocations", json=slice_request(1, str(key.id)))

    assert response.status_code == 201, response.text
    assert faults.attempts == len(plan) + 1
    allocation_id = response.json()["allocation_id"]
    await wait_status(client, allocation_id, "active")
    assert await held_claims(db_sessions, allocation_id) == 1
    async with db_sessions() as session:
        assert len((await session.scalars(select(Allocation.id))).all()) == 1
    # One reservation in the workflow: a retry the server had already taken was answered from
    # that update's outcome (same update id), not reserved again.
    history = await temporal_client.get_workflow_handle(
        allocation_workflow_id(allocation_id)
    ).fetch_history()
    accepted = [
        e
        for e in history.events
        if e.HasField("workflow_execution_update_accepted_event_attributes")
    ]
    assert len(accepted) == 1
