"""docs/lifecycles/allocation.md's "admin removes the assignment": an admin detaches a
release_failed allocation whose node cannot clean up. It ends `released` (marked detached) through
the allocation workflow, and frees its claims only by quarantining what the node did not prove
clean: the GPU slots of a slice, the node of a bare-metal allocation. Billing stays closed from
release_failed on. Real Temporal, PostgreSQL, gateway and agents; the releases fail through the
simulated host's faults."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import select

from activities.node_lifecycle import STATUS_CHANGED
from contracts.allocation import NOT_DETACHABLE, RELEASE_CLEANUP_UNCONFIRMED, allocation_workflow_id
from contracts.host_tasks import BAREMETAL_DEPROVISION_USER, SLICE_VM_RELEASE, HostErrorType
from schema.models import AuditEntry, DomainEvent, GpuSlot, Node, ProjectSliceVlan, UsageRecord
from tests.histories import record_history
from tests.lifecycle_support import (
    Tenant,
    baremetal_request,
    create_fleet,
    events_of,
    held_claims,
    slice_request,
    wait_status,
)

pytestmark = pytest.mark.usefixtures("control_plane")

REASON = "node c07u46 unreachable since the failed release; OPS-311"


async def _allocate(tenant: Tenant, body: dict[str, Any]) -> str:
    response = await tenant.client.post("/api/v1/allocations", json=body)
    assert response.status_code == 201, response.text
    allocation_id: str = response.json()["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")
    return allocation_id


async def _usage_windows(db_sessions: Any, allocation_id: str) -> list[Any]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(UsageRecord.ended_at).where(
                UsageRecord.allocation_id == uuid.UUID(allocation_id)
            )
        )
        return list(rows)


async def _audits(db_sessions: Any) -> list[AuditEntry]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(AuditEntry)
            .where(AuditEntry.action == "allocation.detach")
            .order_by(AuditEntry.id)
        )
        return list(rows)


async def test_detach_a_slice_after_release_failed_quarantines_its_gpu_slots(
    tenant: Tenant,
    admin: Any,
    db_sessions: Any,
    start_node_agent: Any,
    temporal_client: Any,
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    stuck = await _allocate(tenant, slice_request(2))
    running = await _allocate(tenant, slice_request(1))
    async with db_sessions() as session:
        held = list(
            await session.scalars(
                select(GpuSlot.pci_address)
                .where(GpuSlot.allocation_id == uuid.UUID(stuck))
                .order_by(GpuSlot.gpu_index)
            )
        )
    agent.host.faults.inject(
        SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3, allocation_id=stuck
    )
    await tenant.client.post(f"/api/v1/allocations/{stuck}/release")
    failed = await wait_status(tenant.client, stuck, "release_failed")
    (window_end,) = await _usage_windows(db_sessions, stuck)
    assert window_end is not None  # billing stopped at release_failed
    # (docs/lifecycles/allocation.md)

    url = "/api/v1/admin/allocations/{}/detach"
    active = await admin.post(url.format(running), json={"reason": REASON})
    assert active.status_code == 409, active.text
    assert active.json()["error"]["code"] == NOT_DETACHABLE
    assert active.json()["error"]["details"]["status"] == "active"
    assert (await admin.post(url.format(stuck), json={})).status_code == 400
    tenant_try = await tenant.client.post(url.format(stuck), json={"reason": REASON})
    assert tenant_try.status_code == 403
    assert (await tenant.client.get(f"/api/v1/allocations/{stuck}")).json()["status"] == (
        "release_failed"
    )

    detached = await admin.post(url.format(stuck), json={"reason": REASON})
    assert detached.status_code == 200, detached.text
    answer = detached.json()
    assert answer["status"] == "released"
    assert answer["quarantined"] == "gpu_slots"
    assert answer["node_id"] == str(node.id)
    assert answer["node_status"] == "active"  # the node's other tenants run on
    again = await admin.post(url.format(stuck), json={"reason": REASON})
    assert again.status_code == 200, again.text
    assert again.json() == answer

    read = (await tenant.client.get(f"/api/v1/allocations/{stuck}")).json()
    assert read["status"] == "released"
    assert read["detached_at"] is not None
    assert read["released_at"] >= read["release_failed_at"]
    assert read["release_failed_at"] == failed["release_failed_at"]
    assert read["hard_stopped"] is None  # nothing claims the host stopped or cleaned it
    assert (await events_of(db_sessions, stuck))[-5:] == [
        "release_failed",
        "detached",
        "gpu_quarantined",
        "gpu_quarantined",
        "cleanup_unconfirmed",
    ]
    timeline = (await tenant.client.get(f"/api/v1/allocations/{stuck}/timeline")).json()
    (detach_item,) = [i for i in timeline["items"] if i.get("name") == "detached"]
    assert (detach_item["state"], detach_item["actor"]) == ("released", "admin")
    assert detach_item["reason"] == REASON

    # The claims are free, and the GPUs the release left behind are out of placement.
    assert await held_claims(db_sessions, stuck) == 0
    async with db_sessions() as session:
        slots = {
            s.pci_address: s
            for s in await session.scalars(select(GpuSlot).where(GpuSlot.node_id == node.id))
        }
    for pci_address in held:
        assert slots[pci_address].status == "disabled"
        assert slots[pci_address].allocation_id is None
        assert slots[pci_address].quarantine_reason == RELEASE_CLEANUP_UNCONFIRMED
    await tenant.client.post(f"/api/v1/allocations/{running}/release")
    await wait_status(tenant.client, running, "released")
    whole = await tenant.client.post("/api/v1/allocations", json=slice_request(8))
    assert whole.status_code == 409, whole.text
    # Its VM may live on: the project keeps its slice VLAN although nothing else of it runs.
    async with db_sessions() as session:
        vlan = await session.scalar(
            select(ProjectSliceVlan.vlan_id).where(ProjectSliceVlan.project_id == tenant.project_id)
        )
    assert vlan is not None

    # Billing closed once, at release_failed: the detach neither reopened nor moved the window.
    assert await _usage_windows(db_sessions, stuck) == [window_end]
    audits = await _audits(db_sessions)
    assert [(a.target_id, a.prior_state, a.expected_state) for a in audits] == [
        (stuck, "release_failed", "released"),
        (stuck, "released", "released"),
    ]
    assert all(a.reason == REASON and a.role == "admin" for a in audits)
    assert audits[0].workflow_ids == [allocation_workflow_id(stuck)]
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(stuck)),
        "allocation",
        "admin_detach_after_release_failed",
    )


async def test_detach_a_baremetal_allocation_quarantines_its_node(
    tenant: Tenant, admin: Any, db_sessions: Any, start_node_agent: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=0, baremetal_nodes=1)
    agent = await start_node_agent(node.id)
    stuck = await _allocate(tenant, baremetal_request())
    agent.host.faults.inject(BAREMETAL_DEPROVISION_USER, HostErrorType.RELEASE_ERROR, times=3)
    await tenant.client.post(f"/api/v1/allocations/{stuck}/release")
    await wait_status(tenant.client, stuck, "release_failed")

    detached = await admin.post(
        f"/api/v1/admin/allocations/{stuck}/detach", json={"reason": REASON}
    )
    assert detached.status_code == 200, detached.text
    assert detached.json()["quarantined"] == "node"
    assert detached.json()["node_status"] == "quarantined"
    assert (await wait_status(tenant.client, stuck, "released"))["detached_at"] is not None
    assert await held_claims(db_sessions, stuck) == 0

    async with db_sessions() as session:
        assert await session.scalar(select(Node.status).where(Node.id == node.id)) == "quarantined"
        events = list(
            await session.scalars(
                select(DomainEvent)
                .where(DomainEvent.subject_id == str(node.id))
                .order_by(DomainEvent.id)
            )
        )
    changed = [e.payload for e in events if e.type == STATUS_CHANGED]
    assert [(p["from"], p["to"]) for p in changed] == [("active", "quarantined")]
    assert RELEASE_CLEANUP_UNCONFIRMED in changed[0]["reason"]
    flagged = [e for e in events if e.type == f"node.{RELEASE_CLEANUP_UNCONFIRMED}"]
    assert [e.payload["allocation_id"] for e in flagged] == [stuck]
    assert flagged[0].payload["severity"] == "CRITICAL"

    # The node stays out of placement until an operator brings it back.
    again = await tenant.client.post("/api/v1/allocations", json=baremetal_request())
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "sku_unavailable"
