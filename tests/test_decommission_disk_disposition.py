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
import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from schema.models import AuditEntry, Node
from tests.decommission_fixtures import DecommissionRig
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.test_onboarding_api import submit_through_api, wait_shown

SCENARIO = sim_scenario(
    sim_machine("disp-quick", "10.176.22.10"),
    sim_machine("disp-none", "10.176.22.11"),
    sim_machine("disp-fails", "10.176.22.12"),
    sim_machine("disp-gone", "10.176.22.13"),
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


async def _shown_when(admin: Any, did: str, done: Any, timeout: float = 60) -> dict[str, Any]:
    path = f"/api/v1/admin/decommissions/{did}"
    shown: dict[str, Any] = {}
    for _ in range(int(timeout / 0.1)):
        shown = (await admin.get(path)).json()
        if done(shown):
            return shown
        await asyncio.sleep(0.1)
    raise AssertionError(f"decommission {did}: {shown}")


async def _audits(rig: DecommissionRig, did: str) -> list[AuditEntry]:
    async with rig.sessions() as session:
        found = await session.scalars(
            select(AuditEntry)
            .where(AuditEntry.action == "node.decommission.record_disk_disposition")
            .where(AuditEntry.target_id == did)
            .order_by(AuditEntry.id)
        )
        return list(found)


async def _node_status(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        return str(await session.scalar(select(Node.status).where(Node.id == uuid.UUID(node_id))))


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_vanished_machine_ends_only_with_the_operators_disk_record(
    decommission: DecommissionRig, admin: Any, maas_sim: Any
) -> None:
    """Issue 35: a full decommission whose machine someone deleted from MAAS before it was
    released stops with host_not_wiped; the operator records where the disks went
    (record-disk-disposition: disposition, reason, reference), refused and audited at any other
    state or failure. Only with the record does the job go on, retire and delete the node and
    end reconciled; the record is on the job, in its timeline and in the audit, as the
    operator's word (never as an erase this job observed)."""
    node_id, system_id = await _node(decommission, admin, "disp-gone", "10.176.22.13")
    agent = await decommission.agent(node_id)
    gate = threading.Event()
    agent.maintenance.hang["drain"] = gate
    response = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "full_decommission", "erase": "quick", "reason": "hardware refresh"},
    )
    assert response.status_code == 201, response.text
    did = response.json()["decommission_id"]
    job = decommission.track(did, node_id, "full_decommission")
    base = f"/api/v1/admin/decommissions/{did}"
    record = f"{base}/record-disk-disposition"
    body = {"disposition": "destroyed", "reason": "drives shredded", "reference": "COD-4711"}

    await _shown_when(admin, did, lambda s: s["current_stage"] == "drain_node")
    running = await admin.post(record, json=body)  # the job runs: nothing to record yet
    assert running.status_code == 409, running.text
    assert running.json()["error"]["code"] == "action_not_allowed"

    await maas_sim.delete(system_id)  # someone deletes the machine in MAAS
    gate.set()
    shown = await _shown_when(admin, did, lambda s: s["status"] == "failed_manual_intervention")
    assert shown["error_code"] == "machine_deleted", shown
    not_yet = await admin.post(record, json=body)  # not host_not_wiped: adopt decides first
    assert not_yet.status_code == 409, not_yet.text
    assert "host_not_wiped" in not_yet.json()["error"]["message"]

    adopted = await admin.post(f"{base}/adopt", json={"reason": "it is gone"})
    assert adopted.status_code == 200, adopted.text
    shown = await _shown_when(admin, did, lambda s: s["error_code"] == "host_not_wiped")
    assert shown["status"] == "failed_manual_intervention"
    assert "record-disk-disposition" in shown["error_details"]["hint"]
    vanished = shown["error_details"]["disk_disposition"]
    assert (vanished["disposition"], vanished["reason"]) == ("not_erased", "machine_vanished")
    assert await _node_status(decommission, node_id) != "deleted"

    for bad in (
        {**body, "disposition": "probably_fine"},
        {"disposition": "destroyed", "reason": ""},
        {"disposition": "destroyed"},
    ):
        refused = await admin.post(record, json=bad)
        assert refused.status_code in (400, 422), refused.text
        assert refused.json()["error"]["code"], refused.text

    taken = await admin.post(record, json=body)
    assert taken.status_code == 200, taken.text
    assert (taken.json()["accepted"], taken.json()["expected_status"]) == (True, "reconciled")
    shown = await _shown_when(admin, did, lambda s: s["status"] not in ("running", "pending"))
    assert shown["status"] == "reconciled", shown
    assert await _node_status(decommission, node_id) == "deleted"
    assert agent.maintenance.calls.get("uninstall", 0) == 0  # nothing told the host anything
    assert [e for e in await maas_sim.erasures() if e["system_id"] == system_id] == []

    (kept,) = [f for f in shown["followups"] if f.get("kind") == "disk_disposition"]
    assert kept["disposition"] == "destroyed"
    assert kept["source"] == "operator"
    assert kept["reason"] == "machine_vanished"  # why the job could not erase
    assert (kept["recorded_reason"], kept["reference"]) == ("drives shredded", "COD-4711")
    assert kept["recorded_by"]
    assert kept["system_id"] == system_id
    on_release = [
        e["details"]["disk_disposition"]
        for e in shown["events"]
        if e["stage"] == "release_maas_node" and "disk_disposition" in e["details"]
    ]
    # Newest first: the operator's record, after the refusal that said the disks were not
    # erased (the timeline keeps both).
    assert on_release[0] == kept, shown["events"]
    assert all(d in (kept, vanished) for d in on_release), shown["events"]
    assert vanished in on_release, shown["events"]

    closed = await admin.post(record, json={**body, "reason": "again"})
    assert closed.status_code == 409, closed.text
    assert closed.json()["error"]["code"] == "decommission_closed"

    audited = await _audits(decommission, did)
    assert [a.details["accepted"] for a in audited] == [False, False, True, False]
    taken_audit = audited[2]
    assert taken_audit.actor == kept["recorded_by"]
    assert taken_audit.reason == "drives shredded"
    assert taken_audit.details["request"] == {"disposition": "destroyed", "reference": "COD-4711"}
    assert taken_audit.expected_state == "reconciled"
    await record_history(
        decommission.handle(job), "decommission", "vanished_machine_disk_disposition_recorded"
    )
