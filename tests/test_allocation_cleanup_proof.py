"""A failed provision frees what it held only once the node's agent proves the cleanup
(docs/lifecycles/allocation.md: released after cleanup proof). Without proof — the cleanup release
failed, or could not run — the slice's GPU slots (or the bare-metal node) are quarantined as
`provision_cleanup_unconfirmed` and placement never hands them out, until an operator finishes
the cleanup and returns them to service. Plus the host failure classes an allocation reads:
`vfio_error`, and `agent_capability_missing` for a host task an (older) agent does not offer,
failed at once instead of retried. Real Temporal, PostgreSQL and agent workers; the simulated
hosts inject the faults."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.worker import Worker

from agent.backend import PhaseStatus
from agent.host_activities import HostActivities
from contracts.allocation import (
    AGENT_CAPABILITY_MISSING,
    PROVISION_CLEANUP_UNCONFIRMED,
    allocation_workflow_id,
)
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
    HostReleaseInput,
)
from core.task_queues import node_task_queue
from schema.models import DomainEvent, GpuSlot, Node, NodeTask
from sim.host import SimulatedHost
from tests.histories import record_history
from tests.lifecycle_support import (
    Tenant,
    baremetal_request,
    create_fleet,
    events_of,
    held_claims,
    reserved_slots,
    slice_request,
    wait_status,
)

pytestmark = pytest.mark.usefixtures("control_plane")


async def allocate(tenant: Tenant, body: dict[str, Any]) -> str:
    response = await tenant.client.post("/api/v1/allocations", json=body)
    assert response.status_code == 201, response.text
    allocation_id: str = response.json()["allocation_id"]
    return allocation_id


async def slots_of(admin: Any, node_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    response = await admin.get(f"/api/v1/admin/nodes/{node_id}/gpu-slots")
    assert response.status_code == 200, response.text
    return {s["pci_address"]: s for s in response.json()["items"]}


async def tasks_of(db_sessions: Any, allocation_id: str) -> list[tuple[str, str, str | None]]:
    async with db_sessions() as session:
        rows = await session.execute(
            select(NodeTask.kind, NodeTask.status, NodeTask.error_type)
            .where(NodeTask.allocation_id == uuid.UUID(allocation_id))
            .order_by(NodeTask.created_at)
        )
        return [(kind, status, error) for kind, status, error in rows.all()]


async def node_alerts(db_sessions: Any, node_id: uuid.UUID) -> list[dict[str, Any]]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(DomainEvent.payload).where(
                DomainEvent.type == f"node.{PROVISION_CLEANUP_UNCONFIRMED}",
                DomainEvent.subject_id == str(node_id),
            )
        )
        return list(rows)


async def started_attempts(client: Client, allocation_id: str, kind: str) -> list[int]:
    """The attempt of each host task of `kind` the workflow's history shows started (a retried
    task records only its last attempt)."""
    events = (
        await client.get_workflow_handle(allocation_workflow_id(allocation_id)).fetch_history()
    ).events
    scheduled = {
        e.event_id
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == kind
    }
    return [
        e.activity_task_started_event_attributes.attempt
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id in scheduled
    ]


class _ByHand:
    """Progress for a backend call an operator makes by hand on the host (no Temporal task)."""

    cancelled = False

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        pass

    def wait(self, seconds: float | None) -> None:
        pass

    def suspend_heartbeats(self) -> None:
        pass


async def old_agent(
    client: Client, node_id: uuid.UUID, host: SimulatedHost, offered: list[str]
) -> tuple[Worker, asyncio.Task[None]]:
    """An agent from before some host tasks existed: a worker on the node's queue that
    registers only the activities named in `offered` (a subset of the node activities)."""
    activities = HostActivities(host, node_id=str(node_id))
    registered = [
        fn
        for fn in activities.activities()
        if fn.__temporal_activity_definition.name in offered  # type: ignore[attr-defined]
    ]
    assert len(registered) == len(offered)
    worker = Worker(
        client,
        task_queue=node_task_queue(node_id),
        activities=registered,
        identity=f"old-agent-{node_id}",
    )
    return worker, asyncio.create_task(worker.run())


async def stop(worker: Worker, run: asyncio.Task[None]) -> None:
    await worker.shutdown()
    await asyncio.gather(run, return_exceptions=True)


# ---------------------------------------------------------------------- slices


async def test_unproven_cleanup_quarantines_the_slots_until_an_operator_returns_them(
    tenant: Tenant,
    admin: Any,
    db_sessions: Any,
    start_node_agent: Any,
    temporal_client: Client,
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    # The guest never reports its driver (the last phase: the VM is built and running), and
    # the cleanup release fails at every attempt the workflow makes.
    agent.host.faults.inject(
        SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT, phase="driver_ready"
    )
    agent.host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)

    allocation_id = await allocate(tenant, slice_request(4, tenant.ssh_key_id))
    failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == HostErrorType.READINESS_TIMEOUT.value
    assert agent.host.domain(allocation_id) is not None  # the half-built VM is still there
    assert await tasks_of(db_sessions, allocation_id) == [
        (SLICE_VM_PROVISION, "failed", HostErrorType.READINESS_TIMEOUT.value),
        (SLICE_VM_RELEASE, "failed", HostErrorType.RELEASE_ERROR.value),
    ]

    slots = await slots_of(admin, node.id)
    quarantined = sorted(a for a, s in slots.items() if s["status"] == "disabled")
    assert sorted(agent.host.gpu_leases) == quarantined
    assert len(quarantined) == 4
    for address in quarantined:
        assert slots[address]["quarantine_reason"] == PROVISION_CLEANUP_UNCONFIRMED
        assert slots[address]["quarantined_at"] is not None
        assert slots[address]["allocation_id"] is None
    assert sum(1 for s in slots.values() if s["status"] == "free") == 4
    assert await reserved_slots(db_sessions) == 0
    events = await events_of(db_sessions, allocation_id)
    assert events.count("gpu_quarantined") == 4
    assert events[-1] == "cleanup_unconfirmed"
    (alert,) = await node_alerts(db_sessions, node.id)
    assert alert["severity"] == "CRITICAL"
    assert alert["allocation_id"] == allocation_id
    assert sorted(alert["pci_addresses"]) == quarantined
    assert alert["cleanup_error"].startswith(HostErrorType.RELEASE_ERROR.value)
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "provision_failed_cleanup_unconfirmed",
    )

    # The half-built VM's GPUs are never placed: only the other 4 are.
    whole = await tenant.client.post("/api/v1/allocations", json=slice_request(8))
    assert whole.status_code == 409
    assert whole.json()["error"]["code"] == "sku_unavailable"

    # The operator finishes the cleanup on the host, then returns the slots to service.
    agent.host.release_slice_vm(
        HostReleaseInput(
            task_id=str(uuid.uuid4()),
            allocation_id=allocation_id,
            node_id=str(node.id),
            shape="gpu_slice",
            username="",
        ),
        _ByHand(),
    )
    assert agent.host.gpu_leases == {}
    for address in quarantined:
        url = f"/api/v1/admin/nodes/{node.id}/gpu-slots/{slots[address]['id']}/return-to-service"
        returned = await admin.post(url, json={"reason": "half-built VM removed by hand"})
        assert returned.status_code == 200, returned.text
        assert returned.json()["status"] == "free"
    again = await allocate(tenant, slice_request(8))
    await wait_status(tenant.client, again, "active")


async def test_proven_cleanup_frees_the_slots(
    tenant: Tenant, admin: Any, db_sessions: Any, start_node_agent: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    agent.host.faults.inject(
        SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT, phase="driver_ready"
    )

    allocation_id = await allocate(tenant, slice_request(4))
    failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == HostErrorType.READINESS_TIMEOUT.value
    assert agent.host.domain(allocation_id) is None
    # The cleanup is recorded as the success it was (its proof is the release result).
    assert await tasks_of(db_sessions, allocation_id) == [
        (SLICE_VM_PROVISION, "failed", HostErrorType.READINESS_TIMEOUT.value),
        (SLICE_VM_RELEASE, "completed", None),
    ]
    slots = await slots_of(admin, node.id)
    assert all(s["status"] == "free" for s in slots.values()), slots
    assert all(s["quarantine_reason"] is None for s in slots.values())
    assert await held_claims(db_sessions, allocation_id) == 0
    assert "cleanup_unconfirmed" not in await events_of(db_sessions, allocation_id)
    assert await node_alerts(db_sessions, node.id) == []

    whole = await allocate(tenant, slice_request(8))
    await wait_status(tenant.client, whole, "active")


async def test_vfio_fault_fails_as_vfio_error(
    tenant: Tenant, admin: Any, db_sessions: Any, start_node_agent: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.VFIO_ERROR)

    allocation_id = await allocate(tenant, slice_request(2))
    failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == "vfio_error"
    assert "vfio-pci" in failed["failure_message"]
    assert agent.host.attempts(SLICE_VM_PROVISION, allocation_id) == 1  # not retried
    slots = await slots_of(admin, node.id)
    assert all(s["status"] == "free" for s in slots.values()), slots


# ---------------------------------------------------------------------- an older agent


async def test_task_the_agent_does_not_offer_fails_fast_as_agent_capability_missing(
    tenant: Tenant, admin: Any, db_sessions: Any, sim_hosts: Any, temporal_client: Client
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    # An agent from before GPU slices: it serves the node's queue, bare-metal tasks only.
    worker, run = await old_agent(
        temporal_client,
        node.id,
        sim_hosts[node.id],
        [BAREMETAL_PROVISION_USER, BAREMETAL_DEPROVISION_USER],
    )
    try:
        started = time.monotonic()
        allocation_id = await allocate(tenant, slice_request(2))
        failed = await wait_status(tenant.client, allocation_id, "failed")
        elapsed = time.monotonic() - started
    finally:
        await stop(worker, run)
    assert failed["failure_reason"] == AGENT_CAPABILITY_MISSING
    assert SLICE_VM_PROVISION in failed["failure_message"]
    # One attempt each, not retried (a retried task records its last attempt's start).
    assert await started_attempts(temporal_client, allocation_id, SLICE_VM_PROVISION) == [1]
    assert await started_attempts(temporal_client, allocation_id, SLICE_VM_RELEASE) == [1]
    assert elapsed < 10, elapsed
    # The cleanup could not run either, so nothing proves the host clean: quarantined.
    assert await tasks_of(db_sessions, allocation_id) == [
        (SLICE_VM_PROVISION, "failed", AGENT_CAPABILITY_MISSING),
        (SLICE_VM_RELEASE, "failed", AGENT_CAPABILITY_MISSING),
    ]
    slots = await slots_of(admin, node.id)
    reasons = [s["quarantine_reason"] for s in slots.values() if s["status"] == "disabled"]
    assert reasons == [PROVISION_CLEANUP_UNCONFIRMED] * 2
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id)),
        "allocation",
        "provision_failed_agent_capability_missing",
    )


async def test_release_the_agent_does_not_offer_is_release_failed_as_agent_capability_missing(
    tenant: Tenant,
    db_sessions: Any,
    start_node_agent: Any,
    sim_hosts: Any,
    temporal_client: Client,
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    allocation_id = await allocate(tenant, slice_request(1))
    await wait_status(tenant.client, allocation_id, "active")
    await agent.stop()
    # Rolled back to an agent that cannot release slices.
    worker, run = await old_agent(
        temporal_client, node.id, sim_hosts[node.id], [SLICE_VM_PROVISION]
    )
    try:
        await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
        failed = await wait_status(tenant.client, allocation_id, "release_failed")
    finally:
        await stop(worker, run)
    assert failed["failure_reason"] == AGENT_CAPABILITY_MISSING
    assert await started_attempts(temporal_client, allocation_id, SLICE_VM_RELEASE) == [1]
    assert await held_claims(db_sessions, allocation_id) == 1  # still the tenant's VM


# ---------------------------------------------------------------------- bare metal


async def test_unproven_baremetal_cleanup_quarantines_the_node(
    tenant: Tenant, db_sessions: Any, start_node_agent: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=0, baremetal_nodes=1)
    agent = await start_node_agent(node.id)
    agent.host.faults.inject(BAREMETAL_PROVISION_USER, HostErrorType.READINESS_TIMEOUT)
    agent.host.faults.inject(BAREMETAL_DEPROVISION_USER, HostErrorType.RELEASE_ERROR, times=3)

    allocation_id = await allocate(tenant, baremetal_request(tenant.ssh_key_id))
    failed = await wait_status(tenant.client, allocation_id, "failed")
    assert failed["failure_reason"] == HostErrorType.READINESS_TIMEOUT.value
    assert agent.host.user(allocation_id) is not None  # the tenant's user is still there
    async with db_sessions() as session:
        status = await session.scalar(select(Node.status).where(Node.id == node.id))
        slots = (
            await session.scalars(select(GpuSlot.status).where(GpuSlot.node_id == node.id))
        ).all()
    assert status == "quarantined"
    assert set(slots) == {"free"}  # a bare-metal claim is the node, not its slots
    assert await held_claims(db_sessions, allocation_id) == 0
    (alert,) = await node_alerts(db_sessions, node.id)
    assert alert["node_status"] == "quarantined"
    assert (await events_of(db_sessions, allocation_id))[-1] == "cleanup_unconfirmed"

    refused = await tenant.client.post("/api/v1/allocations", json=baremetal_request())
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "sku_unavailable"
