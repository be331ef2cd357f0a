"""Discovery never power-cycles a BMC on its address alone (issue 35): before the cycle the
onboarding obtains and records its evidence (what MAAS has at the address, the power address of
the record found for the hostname, the chassis power the BMC reports), and refuses with
state_ambiguity when the address is another machine's, when the hostname's record names another
BMC, or when the chassis is running a host MAAS does not know there.

Production path: jobs submitted through the admin API, the real MaasNodeOnboardWorkflow and its
activities on Temporal, the real ipmitool code path (activities/onboarding/ipmi.py) driving the
simulator's ipmitool, the MAAS simulator over HTTP. Faults are set up the way they happen: a host
outside MAAS left running, a record someone made by hand in MAAS. What the BMCs were asked is the
simulator's BMC log, never the product's word."""

from __future__ import annotations

from typing import Any

import pytest

from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_onboarding_api import submit_through_api, wait_shown

DARK = "10.176.21.10"  # a new machine, unknown to MAAS, powered off
STRANGER = "10.176.21.11"  # a host outside MAAS, running
OWNED = "10.176.21.12"  # Deployed by someone else, by hand in MAAS
NOWHERE = "10.176.21.99"  # no BMC answers here

SCENARIO = sim_scenario(
    sim_machine("disc-dark", DARK, enlisted=False),
    sim_machine("disc-stranger", STRANGER, enlisted=False, power="on"),
    sim_machine("disc-owned", OWNED, status="Deployed", owner="ops-alice"),
)
FAILED = ("failed_manual_intervention", "failed_retryable")
POWER_ACTIONS = ("cycle", "on")
# What each refusal recommends: nothing was created or powered, so never adopt. A request that
# names another machine's BMC is fixed (cancel, resubmit); a running host is powered off first.
RECOMMENDED = {
    "bmc_in_use": "cancel",
    "bmc_address_mismatch": "cancel",
    "bmc_chassis_on": "retry_stage",
}


async def _admin(rig: OnboardingRig, api: Any, make_token: Any) -> Any:
    return await api(token=await make_token("admin"), settings=rig.settings)


async def _bmc_actions(sim: MaasSim, address: str) -> list[str]:
    return [r["action"] for r in await sim.bmc_log() if r["address"] == address]


async def _record_by_hand(sim: MaasSim, hostname: str, bmc: str) -> str:
    """An IPMI-only machine someone added in MAAS (the UI's "Add hardware"), through the MAAS
    API as that admin would."""
    async with sim.client() as maas:
        response = await maas.post(
            "machines/",
            data={
                "hostname": hostname,
                "power_type": "ipmi",
                "power_parameters_power_address": bmc,
                "power_parameters_power_user": "root",
                "power_parameters_power_pass": "calvin",
            },
        )
    assert response.status_code == 200, response.text
    return str(response.json()["system_id"])


def _refusal(shown: dict[str, Any], code: str) -> dict[str, Any]:
    assert (shown["failure_class"], shown["error_code"]) == ("state_ambiguity", code), shown
    assert shown["current_stage"] == "create_or_find_in_maas", shown
    check: dict[str, Any] = shown["error_details"]["bmc_check"]
    assert check["verdict"] == f"refused: {code}", check
    # The API says what to do about it, and the hint says how (the runbook: what to check).
    assert shown["status"] == "failed_manual_intervention", shown
    assert shown["recommended_action"] == RECOMMENDED[code], shown
    assert "bmc_check" in shown["error_details"]["hint"], shown
    return check


@pytest.mark.maas_scenario(SCENARIO)
async def test_discovery_checks_and_records_the_bmc_before_it_powers_the_machine(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    admin = await _admin(onboarding, api, make_token)
    job = await submit_through_api(onboarding, admin, "disc-dark", DARK)
    shown = await wait_shown(admin, job, "completed", timeout=120)

    # The BMC was asked its chassis state before it was powered, and only that BMC.
    actions = await _bmc_actions(onboarding.maas_sim, DARK)
    assert actions[0] == "status", actions
    assert [a for a in actions if a in POWER_ACTIONS] == ["on"], actions  # it was off
    others = [r for r in await onboarding.maas_sim.bmc_log() if r["address"] != DARK]
    assert not others, others

    # The evidence is in the job's timeline: recorded before the cycle, and on the stage.
    events = [e for e in shown["events"] if e["stage"] == "create_or_find_in_maas"]
    checks = [e for e in events if "bmc_check" in e["details"]]
    before = [e for e in checks if e["status"] == "started"]
    assert len(before) == 1, events
    evidence = before[0]["details"]["bmc_check"]
    assert evidence["address"] == DARK
    assert evidence["power"] == "off"
    assert evidence["verdict"] == "ok"
    assert evidence["record"]  # the IPMI-only record this job made for the BMC
    assert [m["system_id"] for m in evidence["maas_at_address"]] == [evidence["record"]]
    done = [e for e in checks if e["status"] == "succeeded"]
    assert done, events
    assert done[0]["details"]["bmc_check"]["verdict"] == "ok", events


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_running_host_maas_does_not_know_is_never_power_cycled(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """The mistyped address answers, and its chassis is on: nothing is created in MAAS and the
    BMC is asked its state only."""
    admin = await _admin(onboarding, api, make_token)
    job = await submit_through_api(onboarding, admin, "disc-typo", STRANGER)
    shown = await wait_shown(admin, job, *FAILED, timeout=60)
    check = _refusal(shown, "bmc_chassis_on")
    assert check["power"] == "on"
    assert check["maas_at_address"] == []
    assert STRANGER in shown["error_message"]
    assert await _bmc_actions(onboarding.maas_sim, STRANGER) == ["status"]
    hardware = {h["bmc_address"]: h for h in (await onboarding.maas_sim.state())["hardware"]}
    assert hardware[STRANGER]["power"] == "on"
    assert hardware[STRANGER]["in_maas"] == []
    machines = (await onboarding.maas_sim.state())["machines"]
    assert "disc-typo" not in {m["hostname"] for m in machines}  # no record made for it

    # Retrying does not wear the check down.
    retried = await admin.post(
        f"/api/v1/admin/onboardings/{job.onboarding_id}/retry", json={"reason": "try again"}
    )
    assert retried.status_code == 200, retried.text
    await wait_shown(admin, job, "running", "pending", *FAILED)
    shown = await wait_shown(admin, job, *FAILED, timeout=60)
    _refusal(shown, "bmc_chassis_on")
    actions = await _bmc_actions(onboarding.maas_sim, STRANGER)
    assert not [a for a in actions if a in POWER_ACTIONS], actions


@pytest.mark.maas_scenario(SCENARIO)
async def test_the_bmc_of_a_deployed_machine_is_not_cycled_for_another_hostname(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """Someone added `disc-inuse` by hand in MAAS (IPMI-only, at a BMC that answers nowhere);
    the operator onboards it with the BMC address of a machine Deployed by someone else. The
    record found by hostname is not what sits at that address: refused, naming the Deployed
    machine, and its BMC is not even asked."""
    admin = await _admin(onboarding, api, make_token)
    by_hand = await _record_by_hand(onboarding.maas_sim, "disc-inuse", NOWHERE)
    owned = await onboarding.maas_sim.machine("disc-owned")
    job = await submit_through_api(onboarding, admin, "disc-inuse", OWNED)
    shown = await wait_shown(admin, job, *FAILED, timeout=60)
    check = _refusal(shown, "bmc_in_use")
    assert check["record"] == by_hand
    seen = {m["system_id"]: m for m in check["maas_at_address"]}
    assert seen[owned["system_id"]]["status"] == "Deployed"
    assert seen[owned["system_id"]]["owner"] == "ops-alice"
    assert owned["system_id"] in shown["error_message"]
    assert await _bmc_actions(onboarding.maas_sim, OWNED) == []
    assert await _bmc_actions(onboarding.maas_sim, NOWHERE) == []
    after = await onboarding.maas_sim.machine(owned["system_id"])
    assert (after["status_name"], after["owner"], after["power_state"]) == (
        "Deployed",
        "ops-alice",
        "on",
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_hostname_record_with_another_bmc_is_not_cycled_at_either(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """MAAS's record of the hostname says its BMC is elsewhere than the operator declared: which
    one is the machine is not the workflow's to guess."""
    admin = await _admin(onboarding, api, make_token)
    by_hand = await _record_by_hand(onboarding.maas_sim, "disc-moved", NOWHERE)
    job = await submit_through_api(onboarding, admin, "disc-moved", DARK)
    shown = await wait_shown(admin, job, *FAILED, timeout=60)
    check = _refusal(shown, "bmc_address_mismatch")
    assert (check["record"], check["record_power_address"]) == (by_hand, NOWHERE)
    assert await _bmc_actions(onboarding.maas_sim, DARK) == []
    assert await _bmc_actions(onboarding.maas_sim, NOWHERE) == []
    hardware = {h["bmc_address"]: h for h in (await onboarding.maas_sim.state())["hardware"]}
    assert (hardware[DARK]["power"], hardware[DARK]["in_maas"]) == ("off", [])


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_bmc_that_does_not_answer_is_a_power_failure_with_nothing_created(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    admin = await _admin(onboarding, api, make_token)
    job = await submit_through_api(onboarding, admin, "disc-nowhere", NOWHERE)
    shown = await wait_shown(admin, job, *FAILED, timeout=90)
    assert shown["failure_class"] == "bmc_power_failure", shown
    assert shown["current_stage"] == "create_or_find_in_maas"
    actions = await _bmc_actions(onboarding.maas_sim, NOWHERE)
    assert actions, actions
    assert set(actions) == {"status"}, actions
    machines = (await onboarding.maas_sim.state())["machines"]
    assert "disc-nowhere" not in {m["hostname"] for m in machines}


@pytest.mark.maas_scenario(SCENARIO)
async def test_each_refusals_recommended_action_gets_the_onboarding_through(
    onboarding: OnboardingRig, api: Any, make_token: Any
) -> None:
    """What the refusals recommend works: a running host powered off at its BMC, then the
    stage retried, is checked again, found off and onboarded; a request naming another
    machine's BMC is cancelled (nothing to compensate: nothing was created or powered) and
    resubmitted with the right address."""
    admin = await _admin(onboarding, api, make_token)
    running = await submit_through_api(onboarding, admin, "disc-later", STRANGER)
    shown = await wait_shown(admin, running, *FAILED, timeout=60)
    _refusal(shown, "bmc_chassis_on")
    await onboarding.maas_sim.set_power(STRANGER, "off")  # the operator, at the BMC
    retried = await admin.post(
        f"/api/v1/admin/onboardings/{running.onboarding_id}/retry",
        json={"reason": "powered off at the BMC: it is the machine to onboard"},
    )
    assert retried.status_code == 200, retried.text
    shown = await wait_shown(admin, running, "completed", timeout=120)
    assert shown["maas_system_id"], shown
    assert [a for a in await _bmc_actions(onboarding.maas_sim, STRANGER) if a in POWER_ACTIONS]

    owned = await onboarding.maas_sim.machine("disc-owned")
    await _record_by_hand(onboarding.maas_sim, "disc-typo2", NOWHERE)
    typo = await submit_through_api(onboarding, admin, "disc-typo2", OWNED)
    _refusal(await wait_shown(admin, typo, *FAILED, timeout=60), "bmc_in_use")
    cancelled = await admin.post(
        f"/api/v1/admin/onboardings/{typo.onboarding_id}/cancel",
        json={"reason": "mistyped ipmi_ip"},
    )
    assert cancelled.status_code == 200, cancelled.text
    await wait_shown(admin, typo, "cancelled", timeout=60)
    after = await onboarding.maas_sim.machine(owned["system_id"])
    assert (after["status_name"], after["owner"]) == ("Deployed", "ops-alice")
    assert await _bmc_actions(onboarding.maas_sim, OWNED) == []
