"""Where the disks went (issue 35): every decommission that releases a machine records its disk
disposition on the job (`followups`, kind `disk_disposition`, shown by the API) and on the
release stage's event (the job's timeline): `erased` with the method, only once MAAS's event log
shows the erase done; `not_erased` with why (the request asked for none: the operator accepted
the risk, named with the request's reason; the erase failed and the site allows the no-erase
release).

Production path: nodes onboarded and decommissions requested through the admin API, the real
workflows on Temporal, the MAAS simulator over HTTP; what MAAS really erased is the simulator's
erase log, compared with what the job says."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.decommission_fixtures import DecommissionRig
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.test_onboarding_api import submit_through_api, wait_shown

SCENARIO = sim_scenario(
    sim_machine("disp-quick", "10.176.22.10"),
    sim_machine("disp-none", "10.176.22.11"),
    sim_machine("disp-fails", "10.176.22.12"),
)
SETTLED = ("completed", "reconciled", "failed_retryable", "failed_manual_intervention")


async def _node(rig: DecommissionRig, admin: Any, hostname: str, bmc: str) -> tuple[str, str]:
    job = await submit_through_api(rig.onboarding, admin, hostname, bmc)
    shown = await wait_shown(admin, job, "completed", timeout=120)
    return str(shown["node_id"]), str(shown["maas_system_id"])


async def _decommission(
    rig: DecommissionRig, admin: Any, node_id: str, erase: str, reason: str
) -> dict[str, Any]:
    response = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "full_decommission", "erase": erase, "reason": reason},
    )
    assert response.status_code in (200, 201, 202), response.text
    did = response.json()["decommission_id"]
    rig.track(did, node_id, "full_decommission")
    path = f"/api/v1/admin/decommissions/{did}"
    for _ in range(900):
        shown = (await admin.get(path)).json()
        if shown["status"] in SETTLED:
            return dict(shown)
        await asyncio.sleep(0.2)
    raise AssertionError(f"decommission {did} did not settle: {shown}")


def _disposition(shown: dict[str, Any]) -> dict[str, Any]:
    found = [f for f in shown["followups"] if f.get("kind") == "disk_disposition"]
    assert len(found) == 1, shown["followups"]
    on_stage = [
        e["details"]["disk_disposition"]
        for e in shown["events"]
        if e["stage"] == "release_maas_node" and "disk_disposition" in e["details"]
    ]
    assert on_stage == [found[0]], shown["events"]  # the timeline says the same
    return dict(found[0])


@pytest.fixture
async def admin(decommission: DecommissionRig, api: Any, make_token: Any) -> Any:
    return await api(token=await make_token("admin"), settings=decommission.onboarding.settings)


@pytest.mark.maas_scenario(SCENARIO)
async def test_an_erase_is_recorded_only_as_maas_did_it(
    decommission: DecommissionRig, admin: Any, maas_sim: Any
) -> None:
    node_id, system_id = await _node(decommission, admin, "disp-quick", "10.176.22.10")
    shown = await _decommission(decommission, admin, node_id, "quick", "hardware refresh")
    assert shown["status"] == "completed", shown
    disposition = _disposition(shown)
    assert disposition["disposition"] == "erased"
    assert disposition["method"] == "quick"
    assert disposition["system_id"] == system_id
    assert "MAAS event log" in disposition["observed"]
    erased = [e for e in await maas_sim.erasures() if e["system_id"] == system_id]
    assert [(e["method"], e["outcome"]) for e in erased] == [("quick", "erased")]


@pytest.mark.maas_scenario(SCENARIO)
async def test_no_erase_asked_is_the_operators_accepted_risk(
    decommission: DecommissionRig, admin: Any, maas_sim: Any
) -> None:
    node_id, system_id = await _node(decommission, admin, "disp-none", "10.176.22.11")
    shown = await _decommission(decommission, admin, node_id, "none", "moving to lab, no data")
    assert shown["status"] == "completed", shown
    disposition = _disposition(shown)
    assert (disposition["disposition"], disposition["reason"]) == (
        "not_erased",
        "operator_accepted_risk",
    )
    assert disposition["accepted_reason"] == "moving to lab, no data"
    assert disposition["accepted_by"]
    assert [e for e in await maas_sim.erasures() if e["system_id"] == system_id] == []


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_failed_erase_released_under_the_site_fallback_says_so(
    decommission: DecommissionRig, admin: Any, maas_sim: Any
) -> None:
    node_id, system_id = await _node(decommission, admin, "disp-fails", "10.176.22.12")
    await maas_sim.set_fault(system_id, "erase_fails")
    shown = await _decommission(decommission, admin, node_id, "quick", "hardware refresh")
    assert shown["status"] == "completed", shown
    disposition = _disposition(shown)
    assert (disposition["disposition"], disposition["reason"]) == (
        "not_erased",
        "erase_failed_fallback",
    )
    assert disposition["requested"] == "quick"
    erased = [e for e in await maas_sim.erasures() if e["system_id"] == system_id]
    assert [e["outcome"] for e in erased] == ["failed"]
