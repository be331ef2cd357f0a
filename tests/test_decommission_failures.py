"""The failure and recovery rows of
docs/lifecycles/decommission.md#failures-and-recommended-actions, one by one, with the simulators'
faults: an unreachable agent while MAAS is mutable, erase failing with the no-erase fallback on and
off, a validation that finds residue (quarantine + alert), uninstall failing after retirement, MAAS
changed out of band, allocations force-released through their own workflows (and one whose release
fails), and resume's idempotency under a live and a stale task
(docs/lifecycles/decommission.md#actions)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client
from temporalio.worker import Worker

from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import BAREMETAL_DEPROVISION_USER, NODE_STORAGE_CLEANUP, HostErrorType
from contracts.states import SkuShape
from schema.models import (
    Allocation,
    DomainEvent,
    Node,
    NodeDecommission,
    NodeDriftEvent,
    NodeMaasState,
    NodeTask,
)
from tests.decommission_fixtures import DecommissionRig
from tests.factories import BAREMETAL_SKU, create_node, create_sku
from tests.histories import record_history
from tests.lifecycle_support import Tenant, baremetal_request, eventually, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig, control_plane_worker, operator_action_admitted
from tests.workflow_probes import activity_completed

MACHINES = sim_scenario(
    sim_machine("fail-a", "10.176.18.10"),
    sim_machine("fail-b", "10.176.18.11"),
    sim_machine("fail-c", "10.176.18.12"),
)


async def _node_status(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        status = await session.scalar(select(Node.status).where(Node.id == uuid.UUID(node_id)))
        assert status is not None
        return str(status)


async def _tasks(rig: DecommissionRig, node_id: str, kind: str) -> list[NodeTask]:
    async with rig.sessions() as session:
        return list(
            await session.scalars(
                select(NodeTask)
                .where(NodeTask.node_id == uuid.UUID(node_id), NodeTask.kind == kind)
                .order_by(NodeTask.created_at)
            )
        )


async def _system_id(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        return binding.maas_system_id


@pytest.mark.maas_scenario(MACHINES)
async def test_agent_unreachable_while_maas_is_mutable_needs_an_operator(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("fail-a", "10.176.18.10")
    system_id = await _system_id(decommission, node_id)
    await decommission.onboarding.first_boot.stop_agent("fail-a")  # the node's agent is down
    job = await decommission.start(node_id, "full_decommission")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert row.current_stage == "drain_node"
    assert row.error_code == "agent_unreachable_maas_mutable"
    assert row.failure_class == "state_ambiguity"
    assert row.recommended_action == "resume"
    # Nothing was released: MAAS still holds the machine deployed.
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Deployed"
    assert await _node_status(decommission, node_id) == "draining"

    await decommission.agent(node_id)  # the agent comes back
    answer = await decommission.action(job, "resume")
    assert answer.accepted
    assert answer.prior_status == "failed_manual_intervention"
    await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "agent_unreachable_resumed")
    drains = [(t.status, t.error_type) for t in await _tasks(decommission, node_id, "node.drain")]
    assert drains == [("failed", "agent_unreachable_maas_mutable"), ("completed", None)]
    assert await _node_status(decommission, node_id) == "deleted"
    async with decommission.sessions() as session:
        kinds = list(
            await session.scalars(
                select(DomainEvent.type)
                .where(DomainEvent.subject_id == job.decommission_id)
                .order_by(DomainEvent.id)
            )
        )
    assert kinds == [
        "node.decommission.started",
        "node.decommission.manual_intervention_required",
        "node.decommission.completed",
    ]


@pytest.mark.maas_scenario(MACHINES)
async def test_erase_failure_falls_back_to_no_erase_when_the_site_allows(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("fail-b", "10.176.18.11")
    await decommission.agent(node_id)
    system_id = await _system_id(decommission, node_id)
    await decommission.onboarding.maas_sim.set_fault(system_id, "erase_fails")
    await decommission.onboarding.set_policy(release_fallback_no_erase=True)
    job = await decommission.start(node_id, "full_decommission", erase="secure")
    row = await decommission.wait_status(job, "completed")
    kinds = [f["kind"] for f in row.followups]
    assert kinds == ["agent_drained", "erase_fallback", "disk_disposition"]
    # Where the disks went, said once: not erased, because the erase failed and the site allows
    # releasing without it.
    disposition = row.followups[-1]
    assert (disposition["disposition"], disposition["reason"]) == (
        "not_erased",
        "erase_failed_fallback",
    )
    assert disposition["requested"] == "secure"
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Ready"
    counters = await decommission.onboarding.maas_sim.counters()
    assert counters["machines"][system_id].get("machine.release") == 2  # erase, then none


@pytest.mark.maas_scenario(MACHINES)
async def test_erase_failure_stops_for_an_operator_when_the_site_forbids_the_fallback(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("fail-c", "10.176.18.12")
    await decommission.agent(node_id)
    system_id = await _system_id(decommission, node_id)
    await decommission.onboarding.maas_sim.set_fault(system_id, "erase_fails")
    await decommission.onboarding.set_policy(release_fallback_no_erase=False)
    job = await decommission.start(node_id, "full_decommission", erase="quick")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("release_maas_node", "erase_failed")
    assert row.last_maas_status == "Failed disk erasing"
    assert await _node_status(decommission, node_id) == "draining"  # never retired early
    # The operator fixed the disks: retry erases again, without the fallback.
    await decommission.onboarding.maas_sim.clear_faults(system_id)
    answer = await decommission.action(job, "retry_stage")
    assert answer.accepted
    row = await decommission.wait_status(job, "completed")
    assert not any(f["kind"] == "erase_fallback" for f in row.followups)
    assert await _node_status(decommission, node_id) == "deleted"


async def test_failed_validation_quarantines_the_node_and_alerts(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    agent.add_tenant_user("mallory")  # residue the cleanup does not remove
    job = await decommission.start(node_id, "soft_reset", storage_cleanup="local")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("validate_clean_node", "validation_residue")
    assert await _node_status(decommission, node_id) == "quarantined"
    async with decommission.sessions() as session:
        alert = await session.scalar(
            select(DomainEvent).where(
                DomainEvent.type == "node.decommission.validation_failed",
                DomainEvent.subject_id == node_id,
            )
        )
    assert alert is not None
    assert alert.payload["severity"] == "CRITICAL"
    assert alert.payload["checks"][0]["checks"][0]["check"] == "tenant_users"

    # The operator adopts without cleaning: the workflow runs validate_clean again, still finds
    # the tenant's account, and refuses. The node stays quarantined, and the refusal does not
    # recommend the adopt it just refused.
    validations = agent.maintenance.calls["validate_clean"]
    answer = await decommission.action(job, "adopt_observed_state")
    assert answer.accepted
    row = await _refused_adopt(decommission, job)
    assert agent.maintenance.calls["validate_clean"] == validations + 1  # observed again, now
    assert (row.current_stage, row.failure_class) == ("validate_clean_node", "state_ambiguity")
    assert "tenant residue" in (row.error_message or "")
    assert row.recommended_action == "retry_stage"
    assert await _node_status(decommission, node_id) == "quarantined"
    assert "mallory" in (agent.root / "etc/passwd").read_text()

    # The operator removes the account by hand and adopts again: a fresh validate_clean passes,
    # and only then does the node return to service.
    passwd = agent.root / "etc/passwd"
    passwd.write_text(
        "".join(line for line in passwd.read_text().splitlines(True) if "mallory" not in line)
    )
    answer = await decommission.action(job, "adopt_observed_state", reason="account removed")
    assert answer.expected_status == "reconciled"
    await decommission.wait_status(job, "reconciled")
    await record_history(decommission.handle(job), "decommission", "validation_adopted_observed")
    assert agent.maintenance.calls["validate_clean"] == validations + 2
    assert await _node_status(decommission, node_id) == "active"


async def _refused_adopt(rig: DecommissionRig, job: Any, timeout: float = 30.0) -> Any:
    """The job's row once an adopt was refused (error_code cannot_adopt)."""
    deadline = time.monotonic() + timeout
    while True:
        row = await rig.row(job)
        if row.status == "failed_manual_intervention" and row.error_code == "cannot_adopt":
            return row
        assert time.monotonic() < deadline, (row.status, row.error_code, row.error_message)
        await asyncio.sleep(0.05)


async def test_adopt_never_skips_storage_cleanup_or_gpu_scrub(
    decommission: DecommissionRig,
) -> None:
    """Wiped scratch and scrubbed GPUs cannot be observed afterwards: adopting a failed
    cleanup_storage or scrub_gpu is refused (retry_stage recommended), and the host work runs
    when retried."""
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    agent.maintenance.fail["storage_cleanup"] = 2  # both attempts of the task
    job = await decommission.start(node_id, "soft_reset", storage_cleanup="local")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("cleanup_storage", "host_task_failed")
    await decommission.action(job, "adopt_observed_state", reason="I wiped it myself")
    row = await _refused_adopt(decommission, job)
    assert row.current_stage == "cleanup_storage"
    assert row.recommended_action == "retry_stage"
    assert (agent.root / "scratch/tenant-job/checkpoint.bin").exists()  # nothing was skipped
    assert await _node_status(decommission, node_id) != "active"

    agent.maintenance.fail["gpu_scrub"] = 2
    await decommission.action(job, "retry_stage")
    row = await decommission.wait_status(job, "failed_manual_intervention", "completed")
    assert not (agent.root / "scratch/tenant-job/checkpoint.bin").exists()
    assert (row.status, row.current_stage) == ("failed_manual_intervention", "scrub_gpu")
    await decommission.action(job, "adopt_observed_state", reason="GPUs look fine")
    row = await _refused_adopt(decommission, job)
    assert row.current_stage == "scrub_gpu"
    await decommission.action(job, "retry_stage", reason="scrub again")
    await decommission.wait_status(job, "completed")
    assert await _node_status(decommission, node_id) == "active"


@pytest.mark.maas_scenario(MACHINES)
async def test_adopting_an_agent_enrollment_that_never_happened_is_refused(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    """A reimage (through the API) whose redeployed OS's agent never comes up (its network is
    down: the first boot holds it) stops at wait_for_agent_enrollment. Adopt waits for the
    enrollment again, sees none, and is refused (cannot_adopt, retry_stage recommended): the
    node is not made active. Once the agent enrolls, adopt observes it and the node returns."""
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("fail-b", "10.176.18.11")
    system_id = await _system_id(decommission, node_id)
    await decommission.agent(node_id)  # serves the host tasks before the redeploy
    await decommission.onboarding.set_policy(enrollment_timeout_seconds=2)  # fail fast
    decommission.onboarding.first_boot.hold("fail-b")  # the reimaged OS's agent stays down
    created = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission", json={"mode": "reimage", "reason": "x"}
    )
    assert created.status_code == 201, created.text
    job = decommission.track(created.json()["decommission_id"], node_id, "reimage")
    row = await decommission.wait_status(job, "failed_manual_intervention", timeout=120)
    assert (row.current_stage, row.failure_class) == (
        "wait_for_agent_enrollment",
        "agent_enrollment_failure",
    )
    assert (await decommission.onboarding.maas_sim.machine(system_id))["status_name"] == (
        "Deployed"
    )
    assert await _node_status(decommission, node_id) == "draining"

    path = f"/api/v1/admin/decommissions/{job.decommission_id}"
    adopted = await admin.post(f"{path}/adopt", json={"reason": "it is up, trust me"})
    assert adopted.status_code == 200, adopted.text
    row = await _refused_adopt(decommission, job, timeout=90)
    assert row.current_stage == "wait_for_agent_enrollment"
    assert "enrollment was not observed" in (row.error_message or "")
    assert row.recommended_action == "retry_stage"
    assert await _node_status(decommission, node_id) == "draining"  # never made active
    assert not decommission.onboarding.first_boot.booted["fail-b"].enrolled

    # The agent comes up and enrolls: adopt observes the enrollment and the node returns.
    decommission.onboarding.first_boot.release("fail-b")
    await decommission.onboarding.first_boot.wait_for("fail-b", enrolled=True, timeout=30)
    await decommission.onboarding.set_policy(enrollment_timeout_seconds=30)

    async def inventory_reported() -> bool | None:
        # Enrolled is half of it: the adopt's fresh look also wants the agent's first GPU
        # inventory, which follows the enrollment by a heartbeat (slower on a busy machine).
        async with decommission.sessions() as session:
            matches = await session.scalar(
                select(Node.inventory_matches).where(Node.id == uuid.UUID(node_id))
            )
        return True if matches is not None else None

    await eventually(inventory_reported, timeout=60)
    adopted = await admin.post(f"{path}/adopt", json={"reason": "the agent enrolled"})
    assert adopted.status_code == 200, adopted.text
    await decommission.wait_status(job, "reconciled", timeout=60)
    await record_history(decommission.handle(job), "decommission", "adopt_enrollment_observed")
    assert await _node_status(decommission, node_id) == "active"


@pytest.mark.maas_scenario(MACHINES)
async def test_failed_validation_on_a_maas_node_writes_a_drift_alert(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("fail-a", "10.176.18.10")
    agent = await decommission.agent(node_id)
    agent.add_tenant_user()
    job = await decommission.start(node_id, "storage_cleanup", storage_cleanup="local")
    await decommission.wait_status(job, "failed_manual_intervention")
    assert await _node_status(decommission, node_id) == "quarantined"  # active -> quarantined
    async with decommission.sessions() as session:
        drift = await session.scalar(
            select(NodeDriftEvent).where(NodeDriftEvent.node_id == uuid.UUID(node_id))
        )
    assert drift is not None
    assert (drift.rule, drift.severity) == ("decommission_validation_failed", "CRITICAL")


async def test_uninstall_failure_after_retirement_keeps_the_node_retired(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    agent.maintenance.fail["uninstall"] = 2  # both automatic attempts
    job = await decommission.start(node_id, "full_decommission")
    row = await decommission.wait_status(job, "failed_retryable")
    assert (row.current_stage, row.error_code) == ("remove_gpuaas_node_record", "uninstall_failed")
    assert row.recommended_action == "resume"
    assert await _node_status(decommission, node_id) == "retired"  # not deleted prematurely

    await decommission.action(job, "resume")
    await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "uninstall_failed_resumed")
    assert await _node_status(decommission, node_id) == "deleted"
    assert not (agent.root / "var/lib/gpucloud-agent").exists()  # the agent removed itself
    uninstalls = [t.status for t in await _tasks(decommission, node_id, "node.uninstall")]
    assert uninstalls == ["failed", "completed"]


async def test_resume_while_the_drain_task_is_live_does_not_duplicate_it(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    gate = threading.Event()
    agent.maintenance.hang["drain"] = gate
    job = await decommission.start(node_id, "full_decommission")
    await decommission.wait_stage(job, "drain_node")
    for _ in range(200):
        if agent.maintenance.calls.get("drain"):
            break
        await asyncio.sleep(0.02)
    assert await _node_status(decommission, node_id) == "draining"

    first = await decommission.action(job, "resume", reason="is it stuck?")
    second = await decommission.action(job, "resume", reason="again")
    for answer in (first, second):
        assert not answer.accepted
        assert answer.expected_status == "running"
        assert "is live" in answer.message
    live = await _tasks(decommission, node_id, "node.drain")
    assert [t.status for t in live] == ["queued"]

    gate.set()
    await decommission.wait_status(job, "completed")
    assert agent.maintenance.calls["drain"] == 1
    assert [t.status for t in await _tasks(decommission, node_id, "node.drain")] == ["completed"]


async def test_resume_requeues_a_stale_drain_task(decommission: DecommissionRig) -> None:
    node_id = await decommission.plain_node()
    job = await decommission.start(node_id, "full_decommission")  # no agent: the task expires
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "agent_unreachable"  # not MAAS-managed: no MAAS ambiguity
    # A stale drain row left by a lost run (its lease long gone) is still "dispatched".
    async with decommission.sessions() as session, session.begin():
        session.add(
            NodeTask(
                id=uuid.uuid4(),
                node_id=uuid.UUID(node_id),
                kind="node.drain",
                status="dispatched",
                workflow_id="decommission-lost",
                created_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=2),
                dispatched_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=2),
            )
        )
    agent = await decommission.agent(node_id)
    answer = await decommission.action(job, "resume")
    assert answer.accepted
    await decommission.wait_status(job, "completed")
    drains = await _tasks(decommission, node_id, "node.drain")
    statuses = sorted(
        (t.workflow_id == "decommission-lost", t.status, t.error_type) for t in drains
    )
    assert statuses == [
        (False, "completed", None),
        (False, "failed", "agent_unreachable"),
        (True, "failed", "superseded"),
    ]
    assert agent.maintenance.calls["drain"] == 1


@pytest.mark.maas_scenario(MACHINES)
async def test_machine_deleted_out_of_band_is_not_adopted_as_wiped(
    decommission: DecommissionRig,
) -> None:
    """Issue 35 / docs/lifecycles/decommission.md#failures-and-recommended-actions: a full
    decommission whose machine vanished from MAAS before it was released never ends reconciled with
    the node deleted: its disks were not erased, it was not powered off and its agent not removed.
    The adopt is refused with host_not_wiped."""
    node_id = await decommission.maas_node("fail-b", "10.176.18.11")
    agent = await decommission.agent(node_id)
    system_id = await _system_id(decommission, node_id)
    gate = threading.Event()
    agent.maintenance.hang["drain"] = gate
    job = await decommission.start(node_id, "full_decommission")
    await decommission.wait_stage(job, "drain_node")
    await decommission.onboarding.maas_sim.delete(system_id)  # someone deletes it in MAAS
    gate.set()
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "machine_deleted"
    assert row.recommended_action == "adopt_observed_state"
    await decommission.action(job, "adopt_observed_state")

    async def refused() -> Any:
        row = await decommission.row(job)
        return row if row.error_code == "host_not_wiped" else None

    row = await eventually(refused)
    assert row.status == "failed_manual_intervention"
    assert "not erased" in (row.error_message or "")
    assert row.recommended_action == "retry_stage"
    assert await _node_status(decommission, node_id) != "deleted"
    assert agent.maintenance.calls.get("uninstall", 0) == 0
    assert row.error_details.get("host_not_wiped") is True
    await record_history(decommission.handle(job), "decommission", "vanished_machine_not_wiped")


# --------------------------------------------------------------------------- allocations


async def _allocate_baremetal(rig: DecommissionRig, tenant: Tenant) -> tuple[str, str]:
    await create_sku(rig.sessions, BAREMETAL_SKU, shape=SkuShape.BAREMETAL, allowed=(8,))
    node = await create_node(rig.sessions, sku=BAREMETAL_SKU)
    await rig.agent(str(node.id))
    response = await tenant.client.post(
        "/api/v1/allocations", json=baremetal_request(tenant.ssh_key_id)
    )
    assert response.status_code == 201, response.text
    allocation_id = response.json()["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")
    return str(node.id), allocation_id


async def test_force_release_ends_allocations_through_their_workflows(
    decommission: DecommissionRig, tenant: Tenant
) -> None:
    node_id, allocation_id = await _allocate_baremetal(decommission, tenant)
    job = await decommission.start(node_id, "full_decommission")
    await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "force_release")
    async with decommission.sessions() as session:
        allocation = await session.get(Allocation, uuid.UUID(allocation_id))
        assert allocation is not None
    assert allocation.status == "released"
    assert allocation.release_requested_by == "admin"
    # The allocation's own workflow did the release (its history has the update), and ended.
    handle = decommission.client.get_workflow_handle(allocation_workflow_id(allocation_id))
    history = await handle.fetch_history()
    updates = [
        e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
        for e in history.events
        if e.HasField("workflow_execution_update_accepted_event_attributes")
    ]
    assert "request_release" in updates
    await asyncio.wait_for(handle.result(), 10.0)  # raises unless the workflow completed
    assert await _node_status(decommission, node_id) == "deleted"


async def test_allocation_whose_release_fails_stays_attached_for_an_operator(
    decommission: DecommissionRig, tenant: Tenant
) -> None:
    node_id, allocation_id = await _allocate_baremetal(decommission, tenant)
    (agent,) = [a for a in decommission.agents if a.node_id == node_id]
    agent.host.faults.inject(BAREMETAL_DEPROVISION_USER, HostErrorType.RELEASE_ERROR, times=10)
    job = await decommission.start(node_id, "full_decommission")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == (
        "force_release_allocations",
        "allocations_release_failed",
    )
    assert allocation_id in row.error_details["allocations"]
    assert await _node_status(decommission, node_id) == "draining"


@pytest.mark.maas_scenario(MACHINES)
async def test_maas_record_delete_that_fails_completes_with_a_follow_up(
    decommission: DecommissionRig,
) -> None:
    """§5.8 RemoveMaasRecord: best effort; the record stays and a follow-up is recorded."""
    node_id = await decommission.maas_node("fail-b", "10.176.18.11")
    await decommission.agent(node_id)
    system_id = await _system_id(decommission, node_id)
    await decommission.onboarding.maas_sim.add_request_fault(
        "http_error", op=["machine.delete"], machine=system_id, status=503
    )
    job = await decommission.start(node_id, "full_decommission", remove_maas_record=True)
    row = await decommission.wait_status(job, "completed", timeout=90)
    assert "maas_record_retained" in [f["kind"] for f in row.followups]
    assert (await decommission.onboarding.maas_sim.machine(system_id))["system_id"] == system_id
    assert await _node_status(decommission, node_id) == "deleted"


@pytest.mark.maas_scenario(MACHINES)
async def test_release_that_does_not_converge_stops_for_an_operator(
    decommission: DecommissionRig,
) -> None:
    """§5.8 ReleaseMaasNode / "MAAS release/power-off does not converge": the BMC never powers
    the machine off, MAAS ends in Releasing failed; automation stops (never retired or deleted)
    until an operator fixes the BMC and resumes."""
    node_id = await decommission.maas_node("fail-a", "10.176.18.10")
    await decommission.agent(node_id)
    system_id = await _system_id(decommission, node_id)
    await decommission.onboarding.maas_sim.set_fault(system_id, "power_stuck_on")
    job = await decommission.start(node_id, "full_decommission")
    row = await decommission.wait_status(
        job, "failed_manual_intervention", "failed_retryable", timeout=60
    )
    assert row.status == "failed_manual_intervention", (row.error_code, row.error_message)
    assert row.current_stage == "release_maas_node"
    assert row.last_maas_status == "Releasing failed"
    assert await _node_status(decommission, node_id) == "draining"
    await decommission.onboarding.maas_sim.clear_faults(system_id)
    assert (await decommission.action(job, "resume")).accepted
    await decommission.wait_status(job, "completed", timeout=60)
    assert await _node_status(decommission, node_id) == "deleted"
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["power_state"] == "off"


async def _soft_reset_held_at_storage_cleanup(
    rig: DecommissionRig, storage_cleanup: str = "local"
) -> tuple[str, Any, threading.Event, Any]:
    """A soft reset whose agent drained and now hangs in storage cleanup until `gate` is set."""
    node_id = await rig.plain_node()
    agent = await rig.agent(node_id)
    gate = threading.Event()
    agent.maintenance.hang["storage_cleanup"] = gate
    job = await rig.start(node_id, "soft_reset", storage_cleanup=storage_cleanup)
    await rig.wait_stage(job, "cleanup_storage")
    assert agent.maintenance.inner.is_draining()
    return node_id, agent, gate, job


async def test_cancelled_soft_reset_undrains_the_agent_and_hands_the_node_back(
    decommission: DecommissionRig,
) -> None:
    """docs/lifecycles/decommission.md#actions, cancel: a soft reset keeps its node, so compensation
    undoes the agent's drain; the node goes offline (the liveness loop's to return), not
    quarantined."""
    node_id, agent, gate, job = await _soft_reset_held_at_storage_cleanup(decommission)

    assert (await decommission.action(job, "cancel", reason="wrong node")).accepted
    gate.set()  # the interrupted host task may finish; its result is no longer wanted
    await decommission.wait_status(job, "cancelled")
    await record_history(decommission.handle(job), "decommission", "soft_reset_cancelled")

    assert not agent.maintenance.inner.is_draining(), "the agent takes tenant work again"
    assert agent.maintenance.calls.get("undrain") == 1
    assert await _node_status(decommission, node_id) == "offline"
    undrains = await _tasks(decommission, node_id, "node.undrain")
    assert [t.status for t in undrains] == ["completed"]


async def test_cancelled_soft_reset_with_an_unreachable_agent_quarantines_the_node(
    decommission: DecommissionRig,
) -> None:
    node_id, agent, gate, job = await _soft_reset_held_at_storage_cleanup(decommission)
    await agent.stop()  # the agent is gone with its drain marker in place

    assert (await decommission.action(job, "cancel", reason="wrong node")).accepted
    gate.set()
    await decommission.wait_status(job, "cancelled", timeout=60)

    assert agent.maintenance.inner.is_draining()
    assert await _node_status(decommission, node_id) == "quarantined"


@pytest.mark.parametrize("storage_cleanup", ["local", "all"])
async def test_a_cancel_that_lands_with_a_host_task_result_still_stops_the_job(
    storage_cleanup: str,
    onboarding_without_worker: OnboardingRig,
    temporal_client: Client,
    db_engine: AsyncEngine,
    secret_store: Any,
    maas_sim: Any,
    tmp_path: Path,
) -> None:
    """The cancel and a host task's completion reach the workflow in one workflow task (the
    control-plane worker is away while both happen). The update runs first and cancels the
    stage, but the task's result is already there and wins the await, so the cancel is only
    seen afterwards. With one storage scope that result ends the stage: the next stage must
    not start. With two, it is the first scope's: the second scope must not be wiped. Either
    way the job compensates."""
    rig = DecommissionRig(
        onboarding=onboarding_without_worker, client=temporal_client, tmp=tmp_path
    )

    def control_plane() -> Worker:
        return control_plane_worker(
            onboarding_without_worker, temporal_client, db_engine, secret_store, maas_sim
        )

    try:
        async with control_plane():
            node_id, agent, gate, job = await _soft_reset_held_at_storage_cleanup(
                rig, storage_cleanup
            )
        # No control-plane worker: the host task finishes, and its workflow task waits; the
        # cancel is admitted to wait for that same workflow task.
        gate.set()
        await eventually(lambda: activity_completed(rig.handle(job), NODE_STORAGE_CLEANUP))
        cancel = await operator_action_admitted(
            temporal_client, job.workflow_id, "cancel", "wrong node"
        )
        async with control_plane():
            answer = await asyncio.wait_for(cancel, timeout=30)
            assert answer.accepted
            await rig.wait_status(job, "cancelled")
            history = {"local": "cancel_with_stage_result", "all": "cancel_with_host_task_result"}
            await record_history(rig.handle(job), "decommission", history[storage_cleanup])
    finally:
        await rig.close()

    assert agent.maintenance.calls.get("storage_cleanup") == 1, "no second scope was wiped"
    assert len(await _tasks(rig, node_id, NODE_STORAGE_CLEANUP)) == 1
    assert "gpu_scrub" not in agent.maintenance.calls, "the stage after the cancel never ran"
    assert not agent.maintenance.inner.is_draining(), "compensation undrained the agent"
    assert await _node_status(rig, node_id) == "offline"


@pytest.mark.maas_scenario(MACHINES)
async def test_an_agent_without_the_maintenance_tasks_is_agent_capability_missing(
    decommission: DecommissionRig,
) -> None:
    """An agent older than the control plane (it registers only the allocation tasks) fails the
    first host task at once, classified, instead of retrying into a connectivity failure."""
    from agent.host_activities import HostActivities
    from core.task_queues import node_task_queue
    from sim.config import SimHostConfig
    from sim.host import SimulatedHost

    node_id = await decommission.maas_node("fail-c", "10.176.18.12")
    await decommission.onboarding.first_boot.stop_agent("fail-c")
    old = HostActivities(SimulatedHost(node_id, config=SimHostConfig()), node_id=node_id)
    async with Worker(
        decommission.client, task_queue=node_task_queue(node_id), activities=old.activities()
    ):
        job = await decommission.start(node_id, "soft_reset")
        row = await decommission.wait_status(job, "failed_manual_intervention", timeout=20)
        await record_history(decommission.handle(job), "decommission", "agent_capability_missing")
    assert row.current_stage == "drain_node"
    assert row.error_code == "agent_capability_missing"
    assert row.failure_class == "site_capability_missing"
    assert row.recommended_action == "resume"
    drains = [t.status for t in await _tasks(decommission, node_id, "node.drain")]
    assert drains == ["failed"]


# --------------------------------------------------------------------------- storage-only cleanup


async def test_storage_cleanup_with_force_releases_allocations_before_wiping(
    decommission: DecommissionRig, tenant: Tenant, api: Any, make_token: Any
) -> None:
    """docs/lifecycles/decommission.md#storage-only-cleanup inside soft reset's guard: the node is
    disabled (draining, so nothing new is placed on it) and its live allocation released through its
    own workflow before the tenant scratch is wiped; the node is back in service afterwards."""
    node_id, allocation_id = await _allocate_baremetal(decommission, tenant)
    (agent,) = [a for a in decommission.agents if a.node_id == node_id]
    gate = threading.Event()
    agent.maintenance.hang["storage_cleanup"] = gate
    admin = await api(token=await make_token("admin"))
    created = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/storage-cleanup",
        json={"scope": "local", "force_release_allocations": True, "reason": "tenant turnover"},
    )
    assert created.status_code == 201, created.text
    job = decommission.track(created.json()["decommission_id"], node_id, "storage_cleanup")

    await decommission.wait_stage(job, "cleanup_storage")

    async def wiping() -> int | None:
        return agent.maintenance.calls.get("storage_cleanup")

    await eventually(wiping)
    # The wipe has begun: the node takes no placements, and no allocation is live on it.
    assert await _node_status(decommission, node_id) == "draining"
    async with decommission.sessions() as session:
        allocation = await session.get(Allocation, uuid.UUID(allocation_id))
    assert allocation is not None
    assert (allocation.status, allocation.release_requested_by) == ("released", "admin")
    gate.set()
    await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "storage_cleanup_forced")
    stages = [e.stage for e in await decommission.events(job) if e.status == "succeeded"]
    assert stages[0] == "disable_node"
    assert stages.index("force_release_allocations") < stages.index("cleanup_storage")
    assert stages[-1] == "enable_node"
    assert not (agent.root / "scratch/tenant-job").exists()
    assert await _node_status(decommission, node_id) == "active"


async def test_storage_cleanup_never_wipes_scratch_under_a_live_allocation(
    decommission: DecommissionRig, tenant: Tenant, api: Any, make_token: Any
) -> None:
    """Without force_release_allocations: the API refuses (409 node_has_allocations) and writes
    nothing; a job that finds an allocation on the node once it is disabled (one placed after
    the API's check) stops before cleanup_storage, with the scratch and the allocation intact."""
    node_id, allocation_id = await _allocate_baremetal(decommission, tenant)
    (agent,) = [a for a in decommission.agents if a.node_id == node_id]
    admin = await api(token=await make_token("admin"))
    refused = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/storage-cleanup",
        json={"scope": "local", "reason": "tenant turnover"},
    )
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "node_has_allocations"
    async with decommission.sessions() as session:
        rows = await session.scalar(
            select(func.count())
            .select_from(NodeDecommission)
            .where(NodeDecommission.node_id == uuid.UUID(node_id))
        )
    assert rows == 0

    job = await decommission.start(node_id, "storage_cleanup", storage_cleanup="local")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    await record_history(decommission.handle(job), "decommission", "storage_cleanup_refused")
    assert (row.current_stage, row.error_code) == (
        "force_release_allocations",
        "allocations_attached",
    )
    assert "storage_cleanup" not in agent.maintenance.calls
    assert (agent.root / "scratch/tenant-job").exists()
    async with decommission.sessions() as session:
        allocation = await session.get(Allocation, uuid.UUID(allocation_id))
    assert allocation is not None
    assert allocation.status == "active"
    assert await _node_status(decommission, node_id) == "draining"
