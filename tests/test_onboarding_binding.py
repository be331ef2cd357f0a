"""A MAAS machine is claimed by one live node or job (issue 35): onboarding refuses, with
state_ambiguity naming both, a candidate bound to another live node or held by another live
onboarding job, and touches nothing on it; compensation releases only what the job deployed.

Everything goes through the production path: jobs submitted through the admin API, run by the
real MaasNodeOnboardWorkflow against the MAAS simulator over HTTP, nodes enrolled by the real
agent the deployed OS boots (tests/onboarding_fixtures.py)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from schema.models import Node, NodeMaasState
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_onboarding_api import submit_through_api, wait_shown

MISTYPED = sim_machine("bind-a", "10.176.19.10")


def _behind_nat(hostname: str, address: str, detected: str) -> dict[str, Any]:
    """A dark machine MAAS enlists as another New record (a petname) when it PXE-boots."""
    machine = sim_machine(hostname, address, enlisted=False)
    machine["bmc"]["detected_address"] = detected
    return machine


SCENARIO = sim_scenario(
    MISTYPED,
    _behind_nat("bind-dark", "10.176.19.11", "10.176.99.11"),
    # Deployed by someone else, by hand in MAAS; it never posts hardware sync.
    sim_machine(
        "bind-found",
        "10.176.19.12",
        status="Deployed",
        owner="ops-alice",
        faults=[{"kind": "hw_sync_never_healthy"}],
    ),
)
# MAAS operations that read; anything else on a machine is a change.
SETTLED = ("completed", "failed_manual_intervention", "failed_retryable")
READS = ("read", "get", "list", "details", "query")


def _changes(counters: dict[str, Any], system_id: str) -> dict[str, int]:
    ops = counters["machines"].get(system_id, {})
    return {k: v for k, v in ops.items() if not any(r in k for r in READS)}


async def _admin(rig: OnboardingRig, api: Any, make_token: Any) -> Any:
    return await api(token=await make_token("admin"), settings=rig.settings)


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_mistyped_bmc_of_a_live_node_is_refused_and_its_machine_untouched(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    admin = await _admin(onboarding, api, make_token)
    a = await submit_through_api(onboarding, admin, "bind-a", "10.176.19.10")
    shown_a = await wait_shown(admin, a, "completed", timeout=90)
    system_id = shown_a["maas_system_id"]
    machine_before = await onboarding.maas_sim.machine(system_id)
    counters_before = await onboarding.maas_sim.counters()
    seeds_before = list(onboarding.seeder.seeds)

    # B, with A's BMC address typed in by mistake.
    b = await submit_through_api(onboarding, admin, "bind-b", "10.176.19.10")
    shown_b = await wait_shown(admin, b, "failed_manual_intervention", "failed_retryable")
    assert (shown_b["failure_class"], shown_b["error_code"]) == (
        "state_ambiguity",
        "machine_bound_to_node",
    ), shown_b
    assert shown_b["current_stage"] == "create_or_find_in_maas"
    assert system_id in shown_b["error_message"]
    assert a.node_id in shown_b["error_message"]
    details = shown_b["error_details"]
    assert details["bound_node_id"] == a.node_id
    assert details["system_id"] == system_id
    assert shown_b["maas_system_id"] is None

    # A's machine: untouched (same state, owner, power; no operation but reads).
    machine_after = await onboarding.maas_sim.machine(system_id)
    for key in ("status_name", "owner", "power_state", "hostname", "user_data_text"):
        assert machine_after.get(key) == machine_before.get(key), key
    counters_after = await onboarding.maas_sim.counters()
    assert _changes(counters_after, system_id) == _changes(counters_before, system_id)
    assert onboarding.seeder.seeds == seeds_before  # no hardware-sync push onto A
    async with onboarding.sessions() as session:
        node_a = await session.get(Node, uuid.UUID(a.node_id))
        assert node_a is not None
        assert node_a.status == "active"
        binding = await session.get(NodeMaasState, uuid.UUID(a.node_id))
        assert binding is not None
        assert binding.maas_system_id == system_id
        assert await session.scalar(select(Node).where(Node.hostname == "bind-b")) is None

    # Cancelling B leaves A's machine alone too.
    cancelled = await admin.post(
        f"/api/v1/admin/onboardings/{b.onboarding_id}/cancel", json={"reason": "typo"}
    )
    assert cancelled.status_code == 200, cancelled.text
    await wait_shown(admin, b, "cancelled")
    assert (await onboarding.maas_sim.machine(system_id))["status_name"] == "Deployed"
    counters_end = await onboarding.maas_sim.counters()
    assert _changes(counters_end, system_id) == _changes(counters_before, system_id)


@pytest.mark.maas_scenario(SCENARIO)
async def test_two_concurrent_discoveries_of_one_new_machine_one_claims_it(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """Two jobs discover at one BMC (the operator submitted the machine twice under two names):
    the machine that enlists is claimed by exactly one; the other fails state_ambiguity."""
    admin = await _admin(onboarding, api, make_token)
    first, second = await asyncio.gather(
        submit_through_api(onboarding, admin, "bind-c1", "10.176.19.11"),
        submit_through_api(onboarding, admin, "bind-c2", "10.176.19.11"),
    )
    settled = await asyncio.gather(
        *(wait_shown(admin, j, *SETTLED, timeout=120) for j in (first, second))
    )
    winners = [s for s in settled if s["status"] == "completed"]
    losers = [s for s in settled if s["status"] != "completed"]
    outcomes = [(s["status"], s["error_code"]) for s in settled]
    assert len(winners) == 1, outcomes
    assert len(losers) == 1, outcomes
    (winner,), (loser,) = winners, losers
    assert loser["failure_class"] == "state_ambiguity", loser
    # The loser lost at the claim (naming the winner), or one step earlier, at the discovery
    # placeholder the winner had already deleted (machine_deleted): either way it stopped as
    # state_ambiguity and touched nothing, as the rest of this test checks.
    assert loser["error_code"] in (
        "machine_held_by_job",
        "machine_bound_to_node",
        "machine_deleted",
        # Or before its own BMC cycle: the winner's record already at the BMC, or the chassis
        # already on from the winner's cycle (issue 35: a BMC is not cycled twice at once).
        "bmc_in_use",
        "bmc_chassis_on",
    ), loser
    if loser["error_code"] not in ("machine_deleted", "bmc_in_use", "bmc_chassis_on"):
        assert winner["maas_system_id"] in loser["error_message"]
        assert winner["onboarding_id"] in loser["error_message"] or (
            winner["node_id"] in loser["error_message"]
        )
    assert loser["maas_system_id"] is None
    machine = await onboarding.maas_sim.machine(winner["maas_system_id"])
    assert machine["status_name"] == "Deployed"
    assert machine["hostname"] == winner["hostname"]


@pytest.mark.maas_scenario(SCENARIO)
async def test_compensation_never_releases_a_machine_the_job_found_deployed(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """The job found the machine Deployed (someone else's): restart_clean and cancel leave it
    Deployed with its owner; only a machine this job deployed is released."""
    admin = await _admin(onboarding, api, make_token)
    job = await submit_through_api(onboarding, admin, "bind-found", "10.176.19.12")
    shown = await wait_shown(admin, job, "failed_manual_intervention", "failed_retryable")
    system_id = shown["maas_system_id"]
    assert system_id, shown
    path = f"/api/v1/admin/onboardings/{job.onboarding_id}"

    restarted = await admin.post(f"{path}/restart-clean", json={"reason": "start over"})
    assert restarted.status_code == 200, restarted.text
    # It runs again from the top, finds the machine Deployed again and fails again.
    await wait_shown(admin, job, "running")
    shown = await wait_shown(admin, job, "failed_manual_intervention", "failed_retryable")
    machine = await onboarding.maas_sim.machine(system_id)
    assert (machine["status_name"], machine["owner"]) == ("Deployed", "ops-alice")

    cancelled = await admin.post(f"{path}/cancel", json={"reason": "not ours"})
    assert cancelled.status_code == 200, cancelled.text
    await wait_shown(admin, job, "cancelled")
    machine = await onboarding.maas_sim.machine(system_id)
    assert (machine["status_name"], machine["owner"]) == ("Deployed", "ops-alice")
    counters = await onboarding.maas_sim.counters()
    changes = _changes(counters, system_id)
    assert not any("release" in k or "deploy" in k or "abort" in k for k in changes), changes
