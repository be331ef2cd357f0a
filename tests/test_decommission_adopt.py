"""adopt_observed_state on a decommission accepts only what the workflow saw in MAAS and on the
node ("Adopt only what was observed"). A job that failed before its site configuration was loaded
has never looked at MAAS: adopt must observe first (load the site, ask MAAS) or refuse
(`cannot_adopt`), and never take "unknown" for "gone", which would skip release, erase and
power-off and delete a node MAAS still holds deployed, powered on, its disks intact.

Assertions read MAAS as an operator would, over HTTP: the simulator's machine snapshot and the
MAAS events API."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import select

from core.secret_paths import site_api_token_path
from schema.models import Node, NodeMaasState
from tests.decommission_fixtures import DecommissionRig, Job
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario

MACHINES = sim_scenario(
    sim_machine("adopt-a", "10.176.19.10"),
    sim_machine("adopt-b", "10.176.19.11"),
    sim_machine("adopt-c", "10.176.19.12"),
    sim_machine("adopt-d", "10.176.19.13"),
)


async def _node_status(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        status = await session.scalar(select(Node.status).where(Node.id == uuid.UUID(node_id)))
        assert status is not None
        return str(status)


async def _system_id(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        return binding.maas_system_id


async def _maas_machine(rig: DecommissionRig, system_id: str) -> dict[str, Any]:
    """The machine as the MAAS API answers it."""
    async with rig.onboarding.maas_sim.client() as maas:
        response = await maas.get(f"machines/{system_id}/")
        response.raise_for_status()
        machine: dict[str, Any] = response.json()
        return machine


async def _maas_event_types(rig: DecommissionRig, system_id: str) -> list[str]:
    """The machine's MAAS event log (newest first), as the MAAS events API answers it."""
    async with rig.onboarding.maas_sim.client() as maas:
        response = await maas.get(
            "events/", params={"op": "query", "id": system_id, "level": "DEBUG", "limit": "100"}
        )
        response.raise_for_status()
        return [str(e["type"]) for e in response.json()["events"]]


async def _adopt(rig: DecommissionRig, job: Job) -> Any:
    """Adopt, then the job's row once the adopt has played out: adopted (and run to its end),
    or failed again for an operator, for another reason than before."""
    before = await rig.row(job)
    prior = (before.status, before.error_code, before.current_stage)
    answer = await rig.action(job, "adopt_observed_state", reason="the machine is gone, I think")
    assert answer.accepted, answer.message

    async def settled() -> Any:
        row = await rig.row(job)
        done = row.status in ("reconciled", "completed")
        failed_again = row.status.startswith("failed") and (
            (row.status, row.error_code, row.current_stage) != prior
        )
        return row if done or failed_again else None

    return await eventually(settled, timeout=60, interval=0.05)


async def _start_with_a_failing_drain(rig: DecommissionRig, node_id: str) -> Job:
    """A full decommission with erase whose node.drain keeps failing on the agent: the job
    stops at drain_node, before load_site_config, while MAAS still holds the machine."""
    agent = await rig.agent(node_id)
    agent.maintenance.fail["drain"] = 100
    job = await rig.start(node_id, "full_decommission", erase="quick")
    row = await rig.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("drain_node", "host_task_failed")
    return job


async def _assert_untouched(rig: DecommissionRig, node_id: str, system_id: str) -> None:
    machine = await _maas_machine(rig, system_id)
    assert (machine["status_name"], machine["power_state"]) == ("Deployed", "on")
    assert "Disks erased" not in await _maas_event_types(rig, system_id)
    assert await _node_status(rig, node_id) == "draining"  # not retired, not deleted


async def _assert_released_erased_off(rig: DecommissionRig, node_id: str, system_id: str) -> None:
    machine = await _maas_machine(rig, system_id)
    assert (machine["status_name"], machine["power_state"]) == ("Ready", "off")
    events = await _maas_event_types(rig, system_id)
    assert "User erasing disk" in events
    assert "Disks erased" in events
    assert await _node_status(rig, node_id) == "deleted"


@pytest.mark.maas_scenario(MACHINES)
@pytest.mark.parametrize("outage", ["vault_token_missing", "maas_unreachable"])
async def test_adopt_before_the_site_is_loaded_observes_maas_or_refuses(
    outage: str, decommission: DecommissionRig, secret_store: Any
) -> None:
    """The first MAAS stage (load_site_config) fails: the site's MAAS token is gone from Vault,
    or MAAS does not answer. Adopt while that lasts cannot see MAAS and refuses; once MAAS can be
    seen, adopt loads the site, finds the machine Deployed, and the job goes on to release it
    with the requested erase and power it off before the node record is deleted."""
    rig = decommission
    maas_sim = rig.onboarding.maas_sim
    node_id = await rig.maas_node("adopt-a", "10.176.19.10")
    await rig.agent(node_id)
    system_id = await _system_id(rig, node_id)
    token_path = site_api_token_path(rig.onboarding.site_id)
    token = await secret_store.read(token_path)
    if outage == "vault_token_missing":
        await secret_store.delete(token_path)
    else:
        await maas_sim.add_request_fault("http_error", status=503)

    job = await rig.start(node_id, "full_decommission", erase="quick")
    row = await rig.wait_status(job, "failed_retryable", "failed_manual_intervention", timeout=90)
    assert row.current_stage == "load_site_config", (row.error_code, row.error_message)

    # Adopt while MAAS cannot be seen: refused, nothing skipped, MAAS untouched.
    row = await _adopt(rig, job)
    assert (row.status, row.error_code) == ("failed_manual_intervention", "cannot_adopt"), (
        row.status,
        row.error_message,
    )
    if outage == "maas_unreachable":
        await maas_sim.clear_request_faults()
    await _assert_untouched(rig, node_id, system_id)

    # MAAS can be seen again: adopt observes it (Deployed) and skips none of its steps.
    if outage == "vault_token_missing":
        await secret_store.write(token_path, token)
    row = await _adopt(rig, job)
    assert row.status == "reconciled", (row.error_code, row.error_message)
    if outage == "vault_token_missing":
        await record_history(rig.handle(job), "decommission", "adopt_before_site_loaded")
    await _assert_released_erased_off(rig, node_id, system_id)
    assert row.last_maas_status == "Ready"


@pytest.mark.maas_scenario(MACHINES)
async def test_adopting_a_failed_drain_still_releases_erases_and_powers_off(
    decommission: DecommissionRig,
) -> None:
    """node.drain keeps failing (the job stops before load_site_config, while MAAS still holds
    the machine). The operator vouches for the drain and adopts: the host work is taken on
    their word, but MAAS is looked at, found Deployed, and released, erased and powered off by
    the stages that follow."""
    rig = decommission
    node_id = await rig.maas_node("adopt-b", "10.176.19.11")
    system_id = await _system_id(rig, node_id)
    job = await _start_with_a_failing_drain(rig, node_id)
    await _assert_untouched(rig, node_id, system_id)

    row = await _adopt(rig, job)
    assert row.status == "reconciled", (row.error_code, row.error_message)
    await record_history(rig.handle(job), "decommission", "adopt_drain_failed")
    await _assert_released_erased_off(rig, node_id, system_id)


@pytest.mark.maas_scenario(MACHINES)
async def test_a_ready_machine_is_taken_as_released_only_with_the_erase_seen_in_maas(
    decommission: DecommissionRig,
) -> None:
    """Someone releases the machine in MAAS by hand, without erasing, while the job waits for
    an operator. Ready is a release seen done, but not the erase the request asked for: neither
    the release stage nor adopt takes it. Once the disks are erased in MAAS, adopt does."""
    rig = decommission
    node_id = await rig.maas_node("adopt-c", "10.176.19.12")
    system_id = await _system_id(rig, node_id)
    job = await _start_with_a_failing_drain(rig, node_id)
    await rig.onboarding.maas_sim.release(system_id, erase=False, comment="by hand")
    await rig.onboarding.maas_sim.wait_for_status(system_id, "Ready")

    # The drain is taken on the operator's word; the release stage then finds Ready, unerased.
    row = await _adopt(rig, job)
    assert (row.status, row.current_stage, row.error_code) == (
        "failed_manual_intervention",
        "release_maas_node",
        "erase_not_observed",
    ), row.error_message
    # Adopting the release is refused for the same reason.
    row = await _adopt(rig, job)
    assert (row.status, row.error_code) == ("failed_manual_intervention", "cannot_adopt")
    assert "no disk erase" in (row.error_message or "")
    assert await _node_status(rig, node_id) == "draining"
    assert "Disks erased" not in await _maas_event_types(rig, system_id)

    # The operator erases the disks in MAAS (allocate, release with erase), then adopts.
    async with rig.onboarding.maas_sim.client() as maas:
        allocated = await maas.post(
            "machines/", params={"op": "allocate"}, data={"system_id": system_id}
        )
        assert allocated.status_code == 200, allocated.text
        released = await maas.post(
            f"machines/{system_id}/", params={"op": "release"}, data={"erase": "true"}
        )
        assert released.status_code == 200, released.text
    await rig.onboarding.maas_sim.wait_for_status(system_id, "Ready")
    row = await _adopt(rig, job)
    assert row.status == "reconciled", (row.error_code, row.error_message)
    await _assert_released_erased_off(rig, node_id, system_id)


@pytest.mark.maas_scenario(MACHINES)
async def test_cancel_after_a_failed_release_goes_by_what_maas_shows(
    decommission: DecommissionRig,
) -> None:
    """Cancel hands a node back to service only while MAAS is known untouched. Here the drain
    was adopted (the agent's drain failed) and the release stage failed after MAAS had begun it
    (the BMC does not power off: "Releasing failed"); the failed stage never told the run that
    MAAS changed the machine, but MAAS shows it, so the node is quarantined, not put back."""
    rig = decommission
    node_id = await rig.maas_node("adopt-d", "10.176.19.13")
    system_id = await _system_id(rig, node_id)
    await rig.onboarding.maas_sim.set_fault(system_id, "power_stuck_on")
    job = await _start_with_a_failing_drain(rig, node_id)
    row = await _adopt(rig, job)
    assert (row.current_stage, row.error_code) == ("release_maas_node", "release_failed")
    assert (await _maas_machine(rig, system_id))["status_name"] == "Releasing failed"

    assert (await rig.action(job, "cancel", reason="leave it")).accepted
    await rig.wait_status(job, "cancelled")
    assert await _node_status(rig, node_id) == "quarantined"
    assert (await _maas_machine(rig, system_id))["status_name"] == "Releasing failed"
