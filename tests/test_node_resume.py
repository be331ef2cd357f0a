"""Node-level resume (docs/lifecycles/decommission.md#actions): `POST
/api/v1/admin/nodes/{id}/resume` goes to the operation that owns the node's in-progress state and
only to it. A node a retire put in `draining` gets its drain re-issued (`node.drain`), never a new
decommission (which would force-release its tenants, release the machine and delete the node); a
node whose decommission failed gets that job's resume. Idempotent: a live owner answers, nothing is
duplicated."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select
from temporalio.client import Client, WorkflowExecutionStatus

from activities.node_admin import DRAIN_POLL_ENV
from contracts.node_drain import NodeDrainResult, node_drain_workflow_id
from schema.models import AuditEntry, Node, NodeDecommission, NodeMaasState
from tests.decommission_fixtures import DecommissionRig
from tests.lifecycle_support import Tenant, slice_request, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU

REASON = {"reason": "drain stalled after the worker move; ticket OPS-11"}
MACHINES = sim_scenario(
    sim_machine("resume-a", "10.176.18.40"),
    sim_machine("resume-b", "10.176.18.41"),
)


async def _status(sessions: Any, node_id: Any) -> str:
    async with sessions() as session:
        node = await session.get(Node, node_id)
        assert node is not None
        return str(node.status)


async def _decommissions(sessions: Any, node_id: Any) -> int:
    async with sessions() as session:
        count = await session.scalar(
            select(func.count())
            .select_from(NodeDecommission)
            .where(NodeDecommission.node_id == node_id)
        )
        return int(count or 0)


async def _system_id(rig: DecommissionRig, node_id: uuid.UUID) -> str:
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, node_id)
        assert binding is not None
        assert binding.maas_system_id is not None
        return str(binding.maas_system_id)


async def _running(client: Client, workflow_id: str) -> bool:
    described = await client.get_workflow_handle(workflow_id).describe()
    return described.status == WorkflowExecutionStatus.RUNNING


@pytest.mark.maas_scenario(MACHINES)
async def test_resume_of_a_retire_drain_reissues_the_drain_and_nothing_else(
    api: Any,
    make_token: Any,
    tenant: Tenant,
    decommission: DecommissionRig,
    monkeypatch: Any,
) -> None:
    """A MAAS node (a real onboarding, its real agent) holding a tenant's bare-metal allocation
    is retired; the drain's workflow is lost. Node resume re-issues the drain, once, and does
    nothing destructive: no decommission, the allocation untouched, MAAS not called."""
    monkeypatch.setenv(DRAIN_POLL_ENV, "0.5")
    temporal_client = decommission.client
    admin = await api(token=await make_token("admin"))
    node_id = uuid.UUID(await decommission.maas_node("resume-b", "10.176.18.41"))
    system_id = await _system_id(decommission, node_id)
    created = await tenant.client.post(
        "/api/v1/allocations", json=slice_request(8, tenant.ssh_key_id, sku=ONBOARD_SKU)
    )
    assert created.status_code == 201, created.text
    allocation = created.json()
    assert uuid.UUID(allocation["node_id"]) == node_id
    await wait_status(tenant.client, allocation["allocation_id"], "active", timeout=60)

    retired = await admin.post(f"/api/v1/admin/nodes/{node_id}/retire", json=REASON)
    assert retired.status_code == 202, retired.text
    drain_id = retired.json()["drain_id"]
    drain_wf = node_drain_workflow_id(str(node_id))
    assert await _status(decommission.sessions, node_id) == "draining"

    # The drain's owning workflow is lost (terminated); the node sits in draining.
    await temporal_client.get_workflow_handle(drain_wf).terminate("lost in a test")
    assert not await _running(temporal_client, drain_wf)

    resumed = await admin.post(f"/api/v1/admin/nodes/{node_id}/resume", json=REASON)
    assert resumed.status_code == 200, resumed.text
    body = resumed.json()
    assert (body["owner"], body["drain_id"], body["requeued"]) == ("drain", drain_id, True)
    assert body["status"] == "draining"
    assert await _running(temporal_client, drain_wf)  # node.drain re-issued

    # Resume again: the live drain answers; nothing is duplicated.
    again = await admin.post(f"/api/v1/admin/nodes/{node_id}/resume", json=REASON)
    assert again.status_code == 200, again.text
    assert (again.json()["drain_id"], again.json()["requeued"]) == (drain_id, False)
    runs = [
        w
        async for w in temporal_client.list_workflows(
            f"WorkflowId = '{drain_wf}' AND ExecutionStatus = 'Running'"
        )
    ]
    assert len(runs) <= 1

    # Nothing destructive: no decommission, the tenant's allocation untouched, still draining.
    assert await _decommissions(decommission.sessions, node_id) == 0
    live = await tenant.client.get(f"/api/v1/allocations/{allocation['allocation_id']}")
    assert live.json()["status"] == "active"
    assert await _status(decommission.sessions, node_id) == "draining"
    async with decommission.sessions() as session:
        audited = list(
            await session.scalars(
                select(AuditEntry).where(
                    AuditEntry.action == "node.resume", AuditEntry.target_id == str(node_id)
                )
            )
        )
    assert len(audited) == 2
    assert sorted(a.details["requeued"] for a in audited) == [False, True]
    # MAAS was not asked to do anything: the machine is still Deployed, never released.
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Deployed"
    counters = await decommission.onboarding.maas_sim.counters()
    assert not counters["machines"][system_id].get("machine.release")

    # The re-issued drain finishes the retire once the tenant is gone.
    released = await tenant.client.post(
        f"/api/v1/allocations/{allocation['allocation_id']}/release"
    )
    assert released.status_code == 202, released.text
    handle = temporal_client.get_workflow_handle(drain_wf, result_type=NodeDrainResult)
    assert (await handle.result()).status == "completed"
    assert await _status(decommission.sessions, node_id) == "retired"

    # Retired is not in progress: nothing to resume.
    idle = await admin.post(f"/api/v1/admin/nodes/{node_id}/resume", json=REASON)
    assert idle.status_code == 409
    assert idle.json()["error"]["code"] == "node_not_in_progress"
    assert await _decommissions(decommission.sessions, node_id) == 0


@pytest.mark.maas_scenario(MACHINES)
async def test_resume_of_a_failed_decommission_resumes_that_job_and_releases_nothing(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    """A MAAS node (a real onboarding) whose full decommission stopped at drain_node (its agent
    is down): node resume goes to that job (one job, no second one), twice without
    duplication, and MAAS still holds the machine Deployed."""
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("resume-a", "10.176.18.40")
    async with decommission.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        assert binding.maas_system_id is not None
        system_id = binding.maas_system_id
    await decommission.onboarding.first_boot.stop_agent("resume-a")
    created = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "full_decommission", "reason": "hardware_removal"},
    )
    assert created.status_code == 201, created.text
    job = decommission.track(created.json()["decommission_id"], node_id, "full_decommission")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "agent_unreachable_maas_mutable"
    assert await _status(decommission.sessions, uuid.UUID(node_id)) == "draining"

    for _ in range(2):
        resumed = await admin.post(f"/api/v1/admin/nodes/{node_id}/resume", json=REASON)
        assert resumed.status_code in (200, 409), resumed.text
        if resumed.status_code == 200:
            assert resumed.json()["decommission_id"] == job.decommission_id
        else:  # the first resume is still being acted on
            assert resumed.json()["error"]["code"] == "action_not_allowed"
    assert await _decommissions(decommission.sessions, uuid.UUID(node_id)) == 1
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Deployed"
    counters = await decommission.onboarding.maas_sim.counters()
    assert not counters["machines"][system_id].get("machine.release")
