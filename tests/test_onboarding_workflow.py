"""MaasNodeOnboardWorkflow end to end: real Temporal, real PostgreSQL, the MAAS simulator over
HTTP, the Vault simulator, and a simulated deployed OS that enrolls its agent over HTTP.
Every assertion reads what an operator would: the read model, MAAS (the simulator's state and
request counters), the node record."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from contracts.maas_reconciler import ReconcileInput
from core.secret_paths import site_api_token_path
from schema.models import DomainEvent, Node, NodeDriftEvent, NodeMaasState
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import DEPLOY_PASSWORD, TEST_POLICY, OnboardingRig
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow

HAPPY = sim_scenario(
    sim_machine("onb-ready", "10.176.16.40"),
    sim_machine("onb-new", "10.176.16.41", status="New"),
    sim_machine("onb-dark", "10.176.16.42", enlisted=False),
    sim_machine("onb-noboss", "10.176.16.43", boss=False),
)


async def _node(rig: OnboardingRig, node_id: str) -> Node | None:
    async with rig.sessions() as session:
        return await session.get(Node, uuid.UUID(node_id))


async def _count(rig: OnboardingRig, model: Any, *where: Any) -> int:
    async with rig.sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


@pytest.mark.maas_scenario(HAPPY)
async def test_ready_machine_onboards_to_an_active_node(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("onb-ready", "10.176.16.40")
    row = await onboarding.wait_status(job, "completed")

    node = await _node(onboarding, job.node_id)
    assert node is not None
    assert node.status == "active"
    assert node.onboarding_mode == "maas"
    assert node.enrolled_at is not None
    assert row.maas_system_id
    assert row.last_maas_status == "Deployed"
    assert row.cloud_init_version
    assert row.cloud_init_version.startswith("gpucloud-cloud-init/1/")
    assert row.boss_disk_id is not None
    assert row.completed_at is not None
    assert row.failure_class is None
    assert row.deploy_attempts == 1

    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["status_name"] == "Deployed"
    assert machine["enable_hw_sync"] is True
    assert machine["boot_disk"] == "sda"
    # The deployed user data carries the agent bootstrap, never the plain deploy password.
    assert "/etc/gpucloud/agent.toml" in machine["user_data_text"]
    assert DEPLOY_PASSWORD not in machine["user_data_text"]
    assert onboarding.seeder.seeds, "hardware sync was seeded over (simulated) SSH"

    async with onboarding.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(job.node_id))
        assert binding is not None
        assert binding.maas_system_id == row.maas_system_id
        kinds = list(
            await session.scalars(
                select(DomainEvent.type).where(DomainEvent.subject_id == job.onboarding_id)
            )
        )
    assert kinds == ["node.onboarding.started", "node.onboarding.completed"]

    stages = [(e.stage, e.status) for e in await onboarding.events(job)]
    succeeded = [s for s, status in stages if status in ("succeeded", "skipped")]
    assert succeeded == [
        "load_site_config",
        "resolve_power_credentials",
        "create_or_find_in_maas",
        "commission_node",
        "wait_for_ready",
        "configure_storage",
        "apply_roce_phase2",
        "ensure_pxe_interface_auto",
        "render_cloud_init",
        "deploy_via_maas",
        "wait_for_deployed",
        "ensure_hardware_sync_configured",
        "wait_for_hardware_sync_healthy",
        "wait_for_agent_enrollment",
    ]
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][row.maas_system_id].get("machine.deploy") == 1
    assert counters["ops"].get("machines.create", 0) == 0  # found by hostname, not created

    # Nothing secret in the read model.
    for event in await onboarding.events(job):
        assert DEPLOY_PASSWORD not in str(event.details)
        assert "gpe_" not in str(event.details)
    handle = onboarding.client.get_workflow_handle(job.workflow_id)
    await record_history(handle, "onboarding", "happy_path")
    # Nor in the workflow's history: the payload codec encrypts what little there is.
    history = (await handle.fetch_history()).to_json()
    assert DEPLOY_PASSWORD not in history
    assert "gpe_" not in history


@pytest.mark.maas_scenario(HAPPY)
async def test_new_and_undiscovered_machines_are_commissioned_and_onboarded(
    onboarding: OnboardingRig,
) -> None:
    new = await onboarding.start("onb-new", "10.176.16.41")
    dark = await onboarding.start("onb-dark", "10.176.16.42")
    for job in (new, dark):
        row = await onboarding.wait_status(job, "completed")
        node = await _node(onboarding, job.node_id)
        assert node is not None, row.error_message
        assert node.status == "active", row.error_message
    dark_row = await onboarding.row(dark)
    machine = await onboarding.maas_sim.machine(dark_row.maas_system_id)
    # The IPMI-only record the workflow created is the one the machine PXE-booted into.
    assert machine["hostname"] == "onb-dark"
    counters = await onboarding.maas_sim.counters()
    assert counters["ops"].get("machines.create", 0) == 1


@pytest.mark.maas_scenario(HAPPY)
async def test_missing_boss_disk_blocks_for_manual_intervention(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("onb-noboss", "10.176.16.43")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert (row.failure_class, row.error_code) == ("hardware_mismatch", "boss_disk_missing")
    assert row.current_stage == "configure_storage"
    assert row.recommended_action == "rerun"
    assert await _node(onboarding, job.node_id) is None  # no node record before render
    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["status_name"] == "Ready"  # pre-deploy failure: the machine stays Ready
    result = await onboarding.action(job, "cancel")
    assert result.accepted
    assert result.expected_status == "cancelled"
    await onboarding.wait_status(job, "cancelled")


@pytest.mark.maas_scenario(HAPPY)
async def test_a_non_admin_maas_key_fails_the_preflight_before_any_maas_change(
    onboarding: OnboardingRig, secret_store: Any
) -> None:
    """The site's key is valid but its user is no MAAS administrator: the preflight asks
    users/?op=whoami and stops the job there (site_capability_missing, maas_token_not_admin),
    instead of failing later at the first accept or commission."""
    viewer_key = await onboarding.maas_sim.add_user("viewer")
    await secret_store.write(site_api_token_path(onboarding.site_id), {"token": viewer_key})
    await onboarding.maas_sim.reset_counters()

    job = await onboarding.start("onb-new", "10.176.16.41")
    row = await onboarding.wait_status(job, "failed_retryable")
    assert (row.failure_class, row.error_code) == (
        "site_capability_missing",
        "maas_token_not_admin",
    )
    assert row.current_stage == "load_site_config"
    assert row.recommended_action == "resume"
    assert row.error_message is not None
    assert "viewer" in row.error_message
    ops = (await onboarding.maas_sim.counters())["ops"]
    assert ops.get("users.whoami") == 1
    assert set(ops) <= {"version.read", "users.whoami"}, ops  # nothing else was asked
    assert (await onboarding.maas_sim.machine("onb-new"))["status_name"] == "New"
    assert await _node(onboarding, job.node_id) is None
    assert (await onboarding.action(job, "cancel")).accepted
    await onboarding.wait_status(job, "cancelled")


@pytest.mark.maas_scenario(HAPPY)
async def test_an_onboarded_node_has_its_deployed_address_and_no_drift_on_first_reconcile(
    onboarding: OnboardingRig,
) -> None:
    """Onboarding gives the node its host address from the machine's deployed IPs, so the
    site's first reconcile finds nothing drifted (no spurious ip_changed)."""
    job = await onboarding.start("onb-ready", "10.176.16.40")
    row = await onboarding.wait_status(job, "completed")
    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    node = await _node(onboarding, job.node_id)
    assert node is not None
    assert machine["ip_addresses"]
    assert node.host_address == machine["ip_addresses"][0]
    deployed = [e for e in await onboarding.events(job) if e.stage == "wait_for_deployed"]
    assert deployed[-1].details["host"] == node.host_address

    result = await onboarding.client.execute_workflow(
        MaasSiteReconcilerWorkflow.run,
        ReconcileInput(str(onboarding.site_id)),
        id=f"maas-reconciler-test-{uuid.uuid4()}",
        task_queue=onboarding.settings.control_plane_task_queue,
    )
    assert result.nodes_checked == 1
    assert (result.drift_detected, result.actions) == (0, [])
    assert await _count(onboarding, NodeDriftEvent, NodeDriftEvent.node_id == node.id) == 0
    node = await _node(onboarding, job.node_id)
    assert node is not None
    assert node.host_address == machine["ip_addresses"][0]


def _behind_nat(hostname: str, address: str, detected: str) -> dict[str, Any]:
    """A dark machine whose BMC detection reports another address than operators reach it at:
    when it PXE-boots, MAAS cannot match it to a record made with `address` and enlists it as
    another New machine with a petname (docs/lifecycles/onboarding.md#discovery-ambiguity "a machine
    that appears")."""
    machine = sim_machine(hostname, address, enlisted=False)
    machine["bmc"]["detected_address"] = detected
    return machine


DISCOVERY = sim_scenario(
    _behind_nat("onb-nat", "10.176.16.44", "10.176.99.44"),
    _behind_nat("onb-early", "10.176.16.45", "10.176.99.45"),
)


async def _create_or_find(rig: OnboardingRig, job: Any) -> Any:
    (event,) = [
        e
        for e in await rig.events(job)
        if e.stage == "create_or_find_in_maas" and e.status == "succeeded"
    ]
    return event


async def _maas_hostnames(rig: OnboardingRig) -> list[str]:
    return sorted(m["hostname"] for m in (await rig.maas_sim.state())["machines"])


@pytest.mark.maas_scenario(DISCOVERY)
async def test_discovery_claims_the_machine_that_appears_without_a_hostname_collision(
    onboarding: OnboardingRig,
) -> None:
    """Our IPMI-only record stays unusable; the machine enlists as another New record. It is
    claimed, and our record (which holds the hostname) is deleted, so commissioning can name
    the claimed machine. Discovery polls with MAAS filters, never the whole machine list."""
    await onboarding.maas_sim.reset_counters()
    job = await onboarding.start("onb-nat", "10.176.16.44")
    row = await onboarding.wait_status(job, "completed")
    event = await _create_or_find(onboarding, job)
    assert event.details["how"] == "discovery"
    placeholder = event.details["placeholder_deleted"]
    assert placeholder != row.maas_system_id
    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["hostname"] == "onb-nat"
    assert await _maas_hostnames(onboarding) == ["onb-nat"]  # one record, no placeholder
    counters = await onboarding.maas_sim.counters()
    assert counters["ops"].get("machines.create", 0) == 1
    assert counters["ops"].get("machines.read", 0) >= 2  # the polls, each filtered
    assert counters["ops"].get("machines.read_unfiltered", 0) == 0


@pytest.mark.maas_scenario(DISCOVERY)
async def test_auto_claim_takes_the_sole_new_machine_at_once(onboarding: OnboardingRig) -> None:
    """The site opted in (auto_claim_single_new_machine) and the machine had enlisted before,
    under a BMC address we do not know: it is claimed at once (not after the discovery timeout),
    without creating a record of ours that it would collide with on hostname."""
    sim = onboarding.maas_sim
    assert await sim.power_cycle_bmc("10.176.16.45") == "enlisting"
    async with sim.client() as maas:

        async def enlisted() -> list[Any] | None:
            found = (await maas.get("machines/", params={"status": "new"})).json()
            return found or None

        (early,) = await eventually(enlisted)
    assert early["hostname"] != "onb-early"  # a petname
    await onboarding.set_policy(auto_claim_single_new_machine=True)
    await sim.reset_counters()

    job = await onboarding.start("onb-early", "10.176.16.45")
    row = await onboarding.wait_status(job, "completed")
    assert row.maas_system_id == early["system_id"]
    event = await _create_or_find(onboarding, job)
    assert event.details["how"] == "auto_claim"
    started = min(e.occurred_at for e in await onboarding.events(job))
    discovery_timeout = TEST_POLICY["discovery_timeout_seconds"]
    assert (event.occurred_at - started).total_seconds() < discovery_timeout / 2
    assert await _maas_hostnames(onboarding) == ["onb-early"]
    counters = await sim.counters()
    assert counters["ops"].get("machines.create", 0) == 0
    assert counters["ops"].get("machines.read_unfiltered", 0) == 0
