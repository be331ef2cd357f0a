"""The `protected` flag per node (Ironic-style; issue 35): set and cleared by audited admin calls,
shown in the inventory and the node view; while set, decommission (every mode) and retire are
refused with 409 node_protected, and a decommission already running re-checks it before its
destructive MAAS steps (release, erase, power-off, delete) and stops with node_protected."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from schema.models import AuditEntry, NodeMaasState
from tests.decommission_fixtures import DecommissionRig
from tests.lifecycle_support import Tenant, slice_request, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU

MACHINES = sim_scenario(
    sim_machine("prot-a", "10.176.18.50"),
    sim_machine("prot-b", "10.176.18.51"),
    sim_machine("prot-c", "10.176.18.52"),
)
REASON = {"reason": "customer escrow hold; ticket OPS-12"}


async def _system_id(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        return str(binding.maas_system_id)


@pytest.mark.maas_scenario(MACHINES)
async def test_protected_node_refuses_decommission_and_retire_until_unprotected(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("prot-a", "10.176.18.50")
    system_id = await _system_id(decommission, node_id)
    base = f"/api/v1/admin/nodes/{node_id}"

    blank = await admin.post(f"{base}/protect", json={"reason": " "})
    assert blank.status_code == 400, blank.text
    protected = await admin.post(f"{base}/protect", json=REASON)
    assert protected.status_code == 200, protected.text
    assert (protected.json()["protected"], protected.json()["changed"]) == (True, True)
    again = await admin.post(f"{base}/protect", json=REASON)
    assert (again.json()["protected"], again.json()["changed"]) == (True, False)
    view = (await admin.get(base)).json()
    assert (view["protected"], view["protected_reason"]) == (True, REASON["reason"])
    listed = (await admin.get("/api/v1/admin/nodes")).json()["items"]
    assert [i["protected"] for i in listed if i["id"] == node_id] == [True]

    for body in (
        {"mode": "full_decommission", "reason": "hardware_removal"},
        {"mode": "reimage", "reason": "x"},
        {"mode": "soft_reset", "reason": "x"},
    ):
        refused = await admin.post(f"{base}/decommission", json=body)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "node_protected"
    storage = await admin.post(f"{base}/storage-cleanup", json={"scope": "local", "reason": "x"})
    assert storage.status_code == 409
    assert storage.json()["error"]["code"] == "node_protected"
    retire = await admin.post(f"{base}/retire", json=REASON)
    assert retire.status_code == 409, retire.text
    assert retire.json()["error"]["code"] == "node_protected"
    assert (await admin.get(base)).json()["status"] == "active"
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Deployed"

    cleared = await admin.post(f"{base}/unprotect", json={"reason": "hold lifted"})
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["protected"] is False
    assert (await admin.get(base)).json()["protected"] is False
    async with decommission.sessions() as session:
        actions = list(
            await session.scalars(
                select(AuditEntry.action)
                .where(AuditEntry.target_id == node_id)
                .order_by(AuditEntry.id)
            )
        )
    assert actions.count("node.protect") == 2
    assert actions.count("node.unprotect") == 1
    retired = await admin.post(f"{base}/retire", json=REASON)
    assert retired.status_code == 202, retired.text


@pytest.mark.maas_scenario(MACHINES)
async def test_a_running_decommission_rechecks_protection_before_releasing(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    """Protected while its drain runs: the full decommission stops at release_maas_node with
    node_protected, and MAAS still holds the machine Deployed and powered on."""
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("prot-b", "10.176.18.51")
    system_id = await _system_id(decommission, node_id)
    agent = await decommission.agent(node_id)
    gate = threading.Event()
    agent.maintenance.hang["drain"] = gate
    created = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "full_decommission", "erase": "quick", "reason": "hardware_removal"},
    )
    assert created.status_code == 201, created.text
    job = decommission.track(created.json()["decommission_id"], node_id, "full_decommission")
    await decommission.wait_stage(job, "drain_node")
    protected = await admin.post(f"/api/v1/admin/nodes/{node_id}/protect", json=REASON)
    assert protected.status_code == 200, protected.text
    gate.set()
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("release_maas_node", "node_protected")
    assert row.failure_class == "node_protected"
    assert row.recommended_action == "retry_stage"  # after unprotecting; never adopt
    machine = await decommission.onboarding.maas_sim.machine(system_id)
    assert machine["status_name"] == "Deployed"
    counters = await decommission.onboarding.maas_sim.counters()
    assert not counters["machines"][system_id].get("machine.release")

    # Retried while still protected: refused again, MAAS untouched.
    path = f"/api/v1/admin/decommissions/{job.decommission_id}"
    retried = await admin.post(f"{path}/retry", json={"reason": "try again"})
    assert retried.status_code == 200, retried.text
    row = await _failed_again(decommission, job, attempt=row.current_attempt)
    assert row.error_code == "node_protected"
    counters = await decommission.onboarding.maas_sim.counters()
    assert not counters["machines"][system_id].get("machine.release")

    # The recommended path: unprotect (audited), then retry the stage; the decommission ends.
    cleared = await admin.post(f"/api/v1/admin/nodes/{node_id}/unprotect", json=REASON)
    assert cleared.status_code == 200, cleared.text
    retried = await admin.post(f"{path}/retry", json={"reason": "hold lifted"})
    assert retried.status_code == 200, retried.text
    await decommission.wait_status(job, "completed", timeout=90)
    counters = await decommission.onboarding.maas_sim.counters()
    assert counters["machines"][system_id].get("machine.release")


async def _failed_again(rig: DecommissionRig, job: Any, *, attempt: int) -> Any:
    """The job's row once it failed again after `attempt`."""
    deadline = time.monotonic() + 30
    while True:
        row = await rig.row(job)
        if row.status == "failed_manual_intervention" and row.current_attempt > attempt:
            return row
        assert time.monotonic() < deadline, (row.status, row.current_attempt, row.error_code)
        await asyncio.sleep(0.05)


@pytest.mark.maas_scenario(MACHINES)
async def test_a_protected_nodes_allocation_is_not_force_released(
    api: Any, make_token: Any, tenant: Tenant, decommission: DecommissionRig
) -> None:
    """A tenant's bare-metal allocation on a protected MAAS node (a real onboarding, its real
    agent): the admin force-release answers 409 node_protected and the allocation stays
    active; once unprotected, the force-release goes through."""
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("prot-c", "10.176.18.52")
    created = await tenant.client.post(
        "/api/v1/allocations", json=slice_request(8, tenant.ssh_key_id, sku=ONBOARD_SKU)
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    assert created.json()["node_id"] == node_id
    await wait_status(tenant.client, allocation_id, "active", timeout=60)

    protected = await admin.post(f"/api/v1/admin/nodes/{node_id}/protect", json=REASON)
    assert protected.status_code == 200, protected.text
    path = f"/api/v1/admin/allocations/{allocation_id}/force-release"
    refused = await admin.post(path, json={"reason": "capacity"})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "node_protected"
    live = await tenant.client.get(f"/api/v1/allocations/{allocation_id}")
    assert live.json()["status"] == "active"

    cleared = await admin.post(f"/api/v1/admin/nodes/{node_id}/unprotect", json=REASON)
    assert cleared.status_code == 200, cleared.text
    released = await admin.post(path, json={"reason": "capacity"})
    assert released.status_code == 202, released.text
    await wait_status(tenant.client, allocation_id, "released", timeout=60)
