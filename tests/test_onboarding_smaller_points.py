"""Issue 20's smaller onboarding points, each against the MAAS simulator over HTTP with real
Temporal, PostgreSQL and the real agent process: a power override written to a machine already
Ready, the datasource redeploy allowance counted from the operator's last action, no operator
action recommended for a cancelled job, last_maas_status after a failed commissioning, and the
node's access fields (docs/lifecycles/node.md#access-fields)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from schema.models import Node
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig

SCENARIO = sim_scenario(
    sim_machine("sp-power", "10.176.20.10"),
    sim_machine("sp-ds", "10.176.20.11", faults=[{"kind": "deploy_fails_datasource", "times": 3}]),
    sim_machine("sp-noboss", "10.176.20.12", boss=False),
    sim_machine(
        "sp-commission",
        "10.176.20.13",
        status="New",
        faults=[{"kind": "commissioning_fails", "message": "memory test failed"}],
    ),
)


@pytest.fixture
async def admin(api: Any, make_token: Any, onboarding: OnboardingRig) -> Any:
    return await api(token=await make_token("admin"))


async def _power_parameters(rig: OnboardingRig, system_id: str) -> dict[str, Any]:
    async with rig.maas_sim.client() as maas:
        response = await maas.get(f"machines/{system_id}/", params={"op": "power_parameters"})
        assert response.status_code == 200, response.text
        parameters: dict[str, Any] = response.json()
        return parameters


@pytest.mark.maas_scenario(SCENARIO)
async def test_power_override_is_written_to_a_machine_already_ready(
    admin: Any, onboarding: OnboardingRig
) -> None:
    created = await admin.post(
        f"/api/v1/admin/maas-sites/{onboarding.site_id}/power-overrides",
        json={
            "selector_type": "ipmi_ip",
            "selector_value": "10.176.20.10",
            "user": "bmc-admin",
            "password": "per-node-secret",
        },
    )
    assert created.status_code == 201, created.text
    job = await onboarding.start("sp-power", "10.176.20.10")
    row = await onboarding.wait_status(job, "completed")
    parameters = await _power_parameters(onboarding, row.maas_system_id)
    assert (parameters["power_address"], parameters["power_user"]) == (
        "10.176.20.10",
        "bmc-admin",
    )
    assert parameters["power_pass"] == "per-node-secret"
    commission = [e for e in await onboarding.events(job) if e.stage == "commission_node"]
    assert commission[-1].status == "skipped"
    assert "override:ipmi_ip" in (commission[-1].message or "")
    assert "per-node-secret" not in str([e.details for e in await onboarding.events(job)])


@pytest.mark.maas_scenario(SCENARIO)
async def test_datasource_allowance_counts_deploys_since_the_operators_resume(
    onboarding: OnboardingRig,
) -> None:
    """The site allows one datasource redeploy. Deploys 1 and 2 fail: the allowance is spent.
    After the operator's resume, deploy 3 fails the same way and gets its redeploy again."""
    job = await onboarding.start("sp-ds", "10.176.20.11")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "deploy_datasource_retries_exhausted"
    assert row.deploy_attempts == 2
    assert (await onboarding.action(job, "resume")).accepted
    # Only "completed": the resume is accepted before the workflow writes the row, so the row
    # may still read failed_manual_intervention from before it for a moment. A job that fails
    # again stays there, and the wait's message then names its error.
    row = await onboarding.wait_status(job, "completed", timeout=90)
    assert row.deploy_attempts == 4
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][row.maas_system_id]["machine.deploy"] == 4
    await record_history(
        onboarding.client.get_workflow_handle(job.workflow_id),
        "onboarding",
        "datasource_redeploy_after_resume",
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_cancelled_job_recommends_no_action(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("sp-noboss", "10.176.20.12")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert row.recommended_action == "rerun"
    assert (await onboarding.action(job, "cancel")).accepted
    row = await onboarding.wait_status(job, "cancelled")
    # A cancelled job is closed: it takes no operator action
    # (docs/lifecycles/decommission.md#actions).
    assert row.recommended_action is None
    assert row.error_code == "boss_disk_missing"  # what it was cancelled from stays readable


@pytest.mark.maas_scenario(SCENARIO)
async def test_failed_commissioning_refreshes_last_maas_status(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("sp-commission", "10.176.20.13")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("wait_for_ready", "failed_commission")
    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["status_name"] == "Failed commissioning"
    assert row.last_maas_status == "Failed commissioning"


@pytest.mark.maas_scenario(SCENARIO)
async def test_onboarded_node_has_its_access_fields(admin: Any, onboarding: OnboardingRig) -> None:
    job = await onboarding.start("sp-power", "10.176.20.10")
    row = await onboarding.wait_status(job, "completed")
    async with onboarding.sessions() as session:
        node = await session.get(Node, uuid.UUID(job.node_id))
        assert node is not None
    assert node.host_address in (row.last_maas_ips or [])
    # The site's deploy user (created by the node's cloud-init), over SSH's port, the agent.
    assert (node.port, node.ssh_username, node.access_method) == (22, "hpcadmin", "node_agent")
    detail = (await admin.get(f"/api/v1/admin/nodes/{job.node_id}")).json()
    assert {k: detail[k] for k in ("host", "port", "ssh_username", "access_method")} == {
        "host": node.host_address,
        "port": 22,
        "ssh_username": "hpcadmin",
        "access_method": "node_agent",
    }
