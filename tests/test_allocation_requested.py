"""docs/lifecycles/allocation.md's `requested`: placement creates the allocation `requested`
(reserved, the workflow not yet provisioning) and the workflow moves it on to `provisioning`; a
reserved node that leaves service before that fails the allocation from `requested`. And
docs/lifecycles/allocation.md's admin force-release while a release runs: queued behind it, not
dropped. Real Temporal, PostgreSQL and agents; the nodes of the last two come from the enrolled
fleet (tests/enrolled_fleet.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select, update
from temporalio.worker import Worker

from activities.node_liveness import NodeLivenessActivities
from contracts.allocation import NODE_UNAVAILABLE, allocation_workflow_id
from contracts.host_tasks import SLICE_VM_PROVISION, SLICE_VM_RELEASE, HostErrorType
from contracts.node_liveness import LivenessInput
from contracts.states import NodeTaskStatus
from schema.models import AuditEntry, Node, NodeTask
from sim.config import SimHostConfig
from tests.enrolled_fleet import EnrolledFleet
from tests.histories import record_history
from tests.lifecycle_support import (
    Tenant,
    create_fleet,
    events_of,
    held_claims,
    reserved_slots,
    slice_request,
    wait_status,
)


async def test_a_reserved_node_that_leaves_service_before_provisioning_fails_it_from_requested(
    tenant: Tenant, db_sessions: Any, settings: Any, temporal_client: Any, db_engine: Any
) -> None:
    """The control plane's activity worker is away after the POST (its workflow worker answered
    it): the allocation is `requested` for POST and GET alike. The node's agent goes silent and
    the liveness sweep takes the node offline; when the worker is back, provisioning does not
    start on it: requested → failed, nothing dispatched, every claim freed at once."""
    from worker import worker_config

    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    config = worker_config(temporal_client, settings, db_engine)
    async with Worker(**{**config, "no_remote_activities": True}):  # and their local activities
        created = await tenant.client.post("/api/v1/allocations", json=slice_request(2))
        assert created.status_code == 201, created.text
        assert created.json()["status"] == "requested"
        allocation_id = created.json()["allocation_id"]
        read = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}")).json()
        assert read["status"] == "requested"
        assert read["provisioning_started_at"] is None
        assert await held_claims(db_sessions, allocation_id) == 2

        async with db_sessions() as session, session.begin():
            await session.execute(
                update(Node)
                .where(Node.id == node.id)
                .values(last_agent_contact_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10))
            )
        liveness = NodeLivenessActivities(db_sessions, temporal_client)
        swept = await liveness.check_liveness(LivenessInput())
        assert swept.went_offline == [str(node.id)]

        async with Worker(**{**config, "workflows": []}):
            failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == NODE_UNAVAILABLE
    assert failed["provisioning_started_at"] is None
    assert await held_claims(db_sessions, allocation_id) == 0
    assert await reserved_slots(db_sessions) == 0
    assert await events_of(db_sessions, allocation_id) == [
        "requested",
        "placement_reserved",
        "failed",
    ]
    async with db_sessions() as session:
        tasks = (
            await session.execute(select(NodeTask.kind, NodeTask.status, NodeTask.error_type))
        ).all()
    assert [tuple(t) for t in tasks] == [
        (SLICE_VM_PROVISION, NodeTaskStatus.FAILED, NODE_UNAVAILABLE)
    ]
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "requested_then_failed_node_unavailable",
    )


async def test_requested_then_provisioning_in_the_event_log(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=1)
    created = await tenant.client.post("/api/v1/allocations", json=slice_request(1))
    assert created.json()["status"] == "requested"
    active = await wait_status(tenant.client, created.json()["allocation_id"], "active")
    assert active["created_at"] < active["provisioning_started_at"] <= active["active_at"]
    assert (await events_of(db_sessions, active["allocation_id"]))[:4] == [
        "requested",
        "placement_reserved",
        "provisioning_started",
        "active",
    ]


async def test_admin_force_release_during_a_running_release_runs_after_it_fails(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    admin: Any,
    temporal_client: Any,
) -> None:
    (node,) = await enrolled_fleet.create(slice_nodes=1)
    agent = node.agent
    agent.host.config = SimHostConfig(phase_delay_s=0.3)  # each phase takes 0.3 s
    allocation_id = (await tenant.client.post("/api/v1/allocations", json=slice_request(1))).json()[
        "allocation_id"
    ]
    await wait_status(tenant.client, allocation_id, "active")

    agent.host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
    await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(tenant.client, allocation_id, "releasing")
    forced = await admin.post(
        f"/api/v1/admin/allocations/{allocation_id}/force-release",
        json={"reason": "INC-7 stuck release"},
    )
    assert forced.status_code == 202, forced.text
    assert forced.json()["prior_status"] == "releasing"
    assert forced.json()["release_pending"] is True

    final = await wait_status(tenant.client, allocation_id, "released", timeout=60)
    assert final["release_requested_by"] == "admin"
    assert final["release_attempts"] == 2
    assert await held_claims(db_sessions, allocation_id) == 0
    assert (await events_of(db_sessions, allocation_id))[-4:] == [
        "releasing",
        "release_failed",
        "releasing",
        "released",
    ]
    async with db_sessions() as session:
        audit = await session.scalar(
            select(AuditEntry).where(AuditEntry.action == "allocation.force_release")
        )
    assert audit is not None
    assert (audit.prior_state, audit.reason) == ("releasing", "INC-7 stuck release")
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "force_release_queued_during_release",
    )
