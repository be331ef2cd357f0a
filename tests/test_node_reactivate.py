"""`reactivate` asks MAAS and the agent now (issue 35): a MAAS-onboarded node (a real onboarding on
the MAAS simulator, its agent booted from the rendered cloud-init) is retired through the admin
API; while retired, its machine is released out of band (Ready, powered off, as MAAS leaves it
after a release from its UI) or its agent is stopped, and the reactivation is refused with what
was observed, whatever MAAS status and agent contact the control plane had stored before. Healthy
again (Deployed and on, an agent answering on the node's queue), it is reactivated."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import select

from activities.node_admin import DRAIN_POLL_ENV
from contracts.node_drain import NodeDrainResult, node_drain_workflow_id
from schema.models import AuditEntry, Node, NodeMaasState
from tests.decommission_fixtures import DecommissionRig
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario

REASON = {"reason": "back to service; ticket OPS-35"}
SCENARIO = sim_scenario(sim_machine("nra-a", "10.176.19.10"))


async def _retired(admin: Any, rig: DecommissionRig, node_id: str) -> None:
    retired = await admin.post(f"/api/v1/admin/nodes/{node_id}/retire", json=REASON)
    assert retired.status_code == 202, retired.text
    handle = rig.client.get_workflow_handle(
        node_drain_workflow_id(node_id), result_type=NodeDrainResult
    )
    assert (await handle.result()).status == "completed"


async def _status(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        node = await session.get(Node, uuid.UUID(node_id))
        assert node is not None
        return str(node.status)


async def _probe_histories(rig: DecommissionRig, node_id: str, name: str) -> None:
    """The newest health-probe run of the node, recorded for the replay suite."""
    probes = [
        w
        async for w in rig.client.list_workflows(
            f"WorkflowType = 'NodeHealthProbeWorkflow' AND WorkflowId STARTS_WITH "
            f"'node-health-probe-{node_id}'"
        )
    ]
    if probes:
        newest = max(probes, key=lambda w: w.start_time)
        await record_history(rig.client.get_workflow_handle(newest.id), "node_health_probe", name)


@pytest.mark.maas_scenario(SCENARIO)
async def test_reactivate_observes_maas_and_the_agent_now(
    decommission: DecommissionRig,
    api: Any,
    make_token: Any,
    maas_sim: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DRAIN_POLL_ENV, "0.2")
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("nra-a", "10.176.19.10")
    await _retired(admin, decommission, node_id)
    assert await _status(decommission, node_id) == "retired"
    async with decommission.sessions() as session:
        stored = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert stored is not None
        assert stored.last_maas_status == "Deployed"  # what was stored before the release

    # Its agent is stopped (the machine stays Deployed and on): the agent is asked now, and its
    # recorded contact is not taken for an answer.
    await decommission.onboarding.first_boot.stop_agent("nra-a")
    silent = await admin.post(f"/api/v1/admin/nodes/{node_id}/reactivate", json=REASON)
    assert silent.status_code == 409, silent.text
    details = silent.json()["error"]["details"]
    assert details["failed"] == ["agent_answered"]
    assert details["agent_seen_at"] is None
    assert (details["maas_status"], details["power_state"]) == ("Deployed", "on")
    assert details["agent_last_contact_at"] is not None
    assert await _status(decommission, node_id) == "retired"
    await _probe_histories(decommission, node_id, "agent_silent")

    # MAAS releases the machine out of band: Ready, powered off (its OS, and agent, gone). The
    # stored "Deployed" proves nothing: MAAS is asked now.
    await maas_sim.release("nra-a")

    async def released() -> bool:
        machine = await maas_sim.machine("nra-a")
        return bool(machine["status_name"] == "Ready" and machine["power_state"] == "off")

    await eventually(released)
    refused = await admin.post(f"/api/v1/admin/nodes/{node_id}/reactivate", json=REASON)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "node_not_proven_healthy"
    assert set(error["details"]["failed"]) == {"maas_deployed", "maas_power_on", "agent_answered"}
    assert (error["details"]["maas_status"], error["details"]["power_state"]) == ("Ready", "off")
    assert await _status(decommission, node_id) == "retired"

    # Deployed and on again, an agent answering on the node's queue: reactivated, with what was
    # observed audited.
    await maas_sim.set_status("nra-a", "Deployed")
    await maas_sim.set_power("nra-a", "on")
    await decommission.agent(node_id)
    back = await admin.post(f"/api/v1/admin/nodes/{node_id}/reactivate", json=REASON)
    assert back.status_code == 200, back.text
    assert (back.json()["prior_status"], back.json()["status"]) == ("retired", "active")
    assert all(c["passed"] for c in back.json()["health"])
    assert await _status(decommission, node_id) == "active"
    await _probe_histories(decommission, node_id, "agent_answered")
    async with decommission.sessions() as session:
        audit = (
            await session.scalars(
                select(AuditEntry).where(
                    AuditEntry.target_id == node_id, AuditEntry.action == "node.reactivate"
                )
            )
        ).one()
    assert audit.details is not None
    assert (audit.details["maas_status"], audit.details["power_state"]) == ("Deployed", "on")
    assert audit.details["agent_seen_at"] is not None
