"""NodeDecommissionWorkflow end to end, one test per mode: real Temporal, real PostgreSQL, the
MAAS simulator over HTTP, the Vault simulator, node agents running the real maintenance
activities over a temporary system root, and MAAS nodes made by a real onboarding. Assertions
read what an operator would: the read model, node_tasks, the node record, MAAS."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from activities.enrollment_tokens import issue_enrollment_token, redeem_enrollment_token
from contracts.enrollment import RedeemFailure
from contracts.maas_reconciler import ReconcileInput
from core.enrollment_token import hash_enrollment_token
from schema.models import (
    DomainEvent,
    Node,
    NodeDriftEvent,
    NodeEnrollmentToken,
    NodeMaasState,
    NodeTask,
)
from tests.decommission_fixtures import DecommissionRig
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow

MACHINES = sim_scenario(
    sim_machine("dec-a", "10.176.17.10"),
    sim_machine("dec-b", "10.176.17.11"),
    sim_machine("dec-c", "10.176.17.12"),
)


async def _node(rig: DecommissionRig, node_id: str) -> Node:
    async with rig.sessions() as session:
        node = await session.get(Node, uuid.UUID(node_id))
        assert node is not None
        return node


async def _domain_events(rig: DecommissionRig, subject_id: str) -> list[str]:
    async with rig.sessions() as session:
        return list(
            await session.scalars(
                select(DomainEvent.type)
                .where(DomainEvent.subject_id == subject_id)
                .order_by(DomainEvent.id)
            )
        )


async def _tasks(rig: DecommissionRig, node_id: str) -> list[NodeTask]:
    async with rig.sessions() as session:
        return list(
            await session.scalars(
                select(NodeTask)
                .where(NodeTask.node_id == uuid.UUID(node_id))
                .order_by(NodeTask.created_at)
            )
        )


def _done_stages(events: list[Any]) -> list[str]:
    seen: list[str] = []
    for e in events:
        if e.status in ("succeeded", "skipped") and e.stage not in seen:
            seen.append(e.stage)
    return seen


async def test_soft_reset_cleans_the_node_and_returns_it_to_service(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    job = await decommission.start(node_id, "soft_reset", storage_cleanup="local")
    row = await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "soft_reset")

    assert (await _node(decommission, node_id)).status == "active"
    assert row.completed_at is not None
    assert row.failure_class is None
    assert _done_stages(await decommission.events(job)) == [
        "disable_node",
        "force_release_allocations",
        "drain_node",
        "cleanup_storage",
        "scrub_gpu",
        "validate_clean_node",
        "enable_node",
    ]
    assert not (agent.root / "scratch/tenant-job").exists(), "scratch was cleaned"
    # The agent refused tenant work while the node was cleaned, and takes it again now.
    assert not agent.maintenance.inner.is_draining()
    assert agent.maintenance.calls.get("drain") == 1
    assert agent.maintenance.calls.get("undrain") == 1
    kinds = [(t.kind, t.status) for t in await _tasks(decommission, node_id)]
    assert kinds == [
        ("node.drain", "completed"),
        ("node.storage_cleanup", "completed"),
        ("node.gpu_scrub", "completed"),
        ("node.validate_clean", "completed"),
        ("node.undrain", "completed"),
    ]
    assert await _domain_events(decommission, job.decommission_id) == [
        "node.decommission.started",
        "node.decommission.completed",
    ]
    # The node went draining -> offline -> active through the transition table: a soft reset
    # stops the drain short of retirement and never passes through `retired`.
    async with decommission.sessions() as session:
        moves = [
            (p["from"], p["to"])
            for p in await session.scalars(
                select(DomainEvent.payload)
                .where(
                    DomainEvent.subject_id == node_id,
                    DomainEvent.type == "node.status_changed",
                )
                .order_by(DomainEvent.id)
            )
        ]
    assert moves == [("active", "draining"), ("draining", "offline"), ("offline", "active")]
    result = await decommission.handle(job).result()
    assert result.status == "completed"
    assert result.node_status == "active"


@pytest.mark.maas_scenario(MACHINES)
async def test_full_decommission_releases_erases_powers_off_and_deletes(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("dec-a", "10.176.17.10")
    agent = await decommission.agent(node_id)
    async with decommission.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        system_id = binding.maas_system_id

    job = await decommission.start(node_id, "full_decommission", erase="quick")
    row = await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "full_decommission")

    assert _done_stages(await decommission.events(job)) == [
        "disable_node",
        "force_release_allocations",
        "drain_node",
        "load_site_config",
        "release_maas_node",
        "power_off_maas_node",
        "retire_gpuaas_node",
        "remove_gpuaas_node_record",
        "cleanup_secrets",
        "remove_maas_record",
    ]
    node = await _node(decommission, node_id)
    assert node.status == "deleted"
    assert agent.maintenance.calls.get("drain") == 1
    # MAAS released the machine (its OS, and the agent with it, are gone): no uninstall task.
    assert agent.maintenance.calls.get("uninstall") is None
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Ready"
    assert machine["power_state"] == "off"
    assert row.maas_system_id == system_id
    assert row.last_maas_status == "Ready"
    counters = await decommission.onboarding.maas_sim.counters()
    assert counters["machines"][system_id].get("machine.release") == 1
    assert counters["machines"][system_id].get("machine.delete", 0) == 0  # kept by default

    async with decommission.sessions() as session:
        unused = await session.scalar(
            select(func.count())
            .select_from(NodeEnrollmentToken)
            .where(
                NodeEnrollmentToken.node_id == uuid.UUID(node_id),
                NodeEnrollmentToken.used_at.is_(None),
            )
        )
    assert unused == 0  # cleanup_secrets consumed them
    # A deleted node never enrolls again, and re-onboarding makes a new node record.
    async with decommission.sessions() as session, session.begin():
        _, token = await issue_enrollment_token(session, uuid.UUID(node_id), created_by="test")
    async with decommission.sessions() as session, session.begin():
        redeemed = await redeem_enrollment_token(session, hash_enrollment_token(token))
    assert redeemed.failure == RedeemFailure.NODE_DELETED
    again = await decommission.maas_node("dec-a", "10.176.17.10")
    assert again != node_id
    assert (await _node(decommission, again)).status == "active"
    async with decommission.sessions() as session:
        live = await session.scalar(
            select(func.count()).select_from(Node).where(Node.hostname == "dec-a")
        )
    assert live == 2  # the deleted record stays as history, beside the new one
    assert await _domain_events(decommission, job.decommission_id) == [
        "node.decommission.started",
        "node.decommission.completed",
    ]


@pytest.mark.maas_scenario(MACHINES)
async def test_full_decommission_removes_the_maas_record_only_when_asked(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.maas_node("dec-b", "10.176.17.11")
    await decommission.agent(node_id)
    job = await decommission.start(node_id, "full_decommission", remove_maas_record=True)
    row = await decommission.wait_status(job, "completed")
    state = await decommission.onboarding.maas_sim.state()
    assert row.maas_system_id not in {m["system_id"] for m in state["machines"]}
    assert (await _node(decommission, node_id)).status == "deleted"


@pytest.mark.maas_scenario(MACHINES)
async def test_reimage_keeps_the_node_identity(decommission: DecommissionRig) -> None:
    node_id = await decommission.maas_node("dec-c", "10.176.17.12")
    await decommission.agent(node_id)
    before = await _node(decommission, node_id)
    assert before.enrolled_at is not None

    job = await decommission.start(node_id, "reimage", erase="quick", storage_cleanup="local")
    row = await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "reimage")

    assert _done_stages(await decommission.events(job)) == [
        "disable_node",
        "force_release_allocations",
        "drain_node",
        "cleanup_storage",
        "load_site_config",
        "release_maas_node",
        "configure_storage",
        "apply_roce_phase2",
        "ensure_pxe_interface_auto",
        "render_cloud_init",
        "deploy_via_maas",
        "wait_for_deployed",
        "ensure_hardware_sync_configured",
        "wait_for_hardware_sync_healthy",
        "wait_for_agent_enrollment",
        "enable_node",
    ]
    after = await _node(decommission, node_id)
    assert after.id == before.id
    assert after.status == "active"
    assert after.enrolled_at is not None
    assert after.enrolled_at > before.enrolled_at
    machine = await decommission.onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["status_name"] == "Deployed"
    counters = await decommission.onboarding.maas_sim.counters()
    assert counters["machines"][row.maas_system_id].get("machine.deploy") == 2
    async with decommission.sessions() as session:
        nodes = await session.scalar(
            select(func.count()).select_from(Node).where(Node.hostname == "dec-c")
        )
    assert nodes == 1


async def test_storage_cleanup_mode_disables_cleans_validates_and_enables(
    decommission: DecommissionRig,
) -> None:
    node_id = await decommission.plain_node()
    agent = await decommission.agent(node_id)
    job = await decommission.start(node_id, "storage_cleanup", storage_cleanup="local")
    await decommission.wait_status(job, "completed")
    await record_history(decommission.handle(job), "decommission", "storage_cleanup_guarded")
    assert _done_stages(await decommission.events(job)) == [
        "disable_node",
        "force_release_allocations",  # skipped: nothing live on the node
        "cleanup_storage",
        "validate_clean_node",
        "enable_node",
    ]
    assert not (agent.root / "scratch/tenant-job").exists()
    assert "drain" not in agent.maintenance.calls  # the OS and the agent are left as they are
    node = await _node(decommission, node_id)
    assert node.status == "active"  # back in service


@pytest.mark.maas_scenario(MACHINES)
async def test_reimage_moves_the_host_to_the_redeployed_address(
    decommission: DecommissionRig,
) -> None:
    """MAAS hands the reimaged machine another address (AUTO addresses are given back on
    release): the reimage sets the node's host from the new deployed IPs, so the next
    reconcile finds no ip_changed drift."""
    node_id = await decommission.maas_node("dec-b", "10.176.17.11")
    await decommission.agent(node_id)
    sim = decommission.onboarding.maas_sim
    first_ip = (await sim.machine("dec-b"))["ip_addresses"][0]
    assert (await _node(decommission, node_id)).host_address == first_ip
    next_ip = "10.176.46.99"
    assert next_ip != first_ip
    await sim.set_planned_ip("dec-b", next_ip)

    job = await decommission.start(node_id, "reimage")
    row = await decommission.wait_status(job, "completed")
    assert (await sim.machine(row.maas_system_id))["ip_addresses"] == [next_ip]
    after = await _node(decommission, node_id)
    assert (after.status, after.host_address) == ("active", next_ip)
    deployed = [e for e in await decommission.events(job) if e.stage == "wait_for_deployed"]
    assert (deployed[-1].details["previous_host"], deployed[-1].details["host"]) == (
        first_ip,
        next_ip,
    )

    rig = decommission.onboarding
    result = await rig.client.execute_workflow(
        MaasSiteReconcilerWorkflow.run,
        ReconcileInput(str(rig.site_id)),
        id=f"maas-reconciler-test-{uuid.uuid4()}",
        task_queue=rig.settings.control_plane_task_queue,
    )
    assert (result.nodes_checked, result.drift_detected, result.actions) == (1, 0, [])
    async with decommission.sessions() as session:
        drift = await session.scalar(
            select(func.count())
            .select_from(NodeDriftEvent)
            .where(NodeDriftEvent.node_id == uuid.UUID(node_id))
        )
    assert drift == 0
