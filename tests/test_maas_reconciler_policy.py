"""Issue 35, the site reconciler's own steps held to what it observed and to the site's policy:

- retire leaves the MAAS machine alone; only the site policy `release_retired_machines` lets the
  reconciler release and power off a retired node's machine, after a fresh look agrees, and what
  it did it records as its own (the status its action left), so no later run quarantines the node
  for it;
- a run that would quarantine more nodes than the site's `reconcile_max_quarantine` quarantines
  none and is a refused reconcile, which `/reconciliation/status` shows with its reason and time;
- the reconciler is the one writer of MAAS's site-wide hardware_sync_interval, from the site's
  current policy on each run."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio.client import Client

from activities.maas.client import MaasClient
from activities.maas.types import MachineStatus, PowerState
from activities.node_admin import DRAIN_POLL_ENV
from contracts.maas_reconciler import ReconcileInput, ReconcileResult
from core.config import Settings
from schema.models import NodeDriftEvent
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_maas_reconciler import (
    NODES,
    SCENARIO,
    bind_nodes,
    make_site,
    node_status,
    reconciler,  # noqa: F401 - the fixture
    run_once,
    snapshot,
    state_of,
    suspect_alerts,
)
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow

REASON = "rack 12 out of service; ticket OPS-35"
RETIRE = sim_scenario(sim_machine("retire-a", "10.176.19.40"))


async def _reconcile(rig: OnboardingRig) -> ReconcileResult:
    handle = await rig.client.start_workflow(
        MaasSiteReconcilerWorkflow.run,
        ReconcileInput(str(rig.site_id)),
        id=f"maas-reconciler-test-{uuid.uuid4()}",
        task_queue=rig.settings.control_plane_task_queue,
    )
    result: ReconcileResult = await handle.result()
    return result


async def _machine(maas_sim: Any, system_id: str) -> Any:
    async with MaasClient(maas_sim.base_url, maas_sim.api_key, timeout=10) as maas:
        return await maas.get_machine(system_id)


async def _critical_drift(
    sessions: async_sessionmaker[AsyncSession], node_id: uuid.UUID
) -> list[str]:
    async with sessions() as session:
        return list(
            await session.scalars(
                select(NodeDriftEvent.rule).where(
                    NodeDriftEvent.node_id == node_id, NodeDriftEvent.severity == "CRITICAL"
                )
            )
        )


@pytest.mark.maas_scenario(RETIRE)
async def test_retire_leaves_the_machine_alone_unless_the_policy_releases_it(
    onboarding: OnboardingRig, api: Any, make_token: Any, monkeypatch: Any
) -> None:
    """A node made by a real onboarding is retired through the admin API. The reconciler leaves
    its Deployed machine alone (no release, no power-off) while the site policy says nothing;
    once the policy releases retired machines, it releases and powers it off, records the
    status its own action left and marks the release as its own; later runs neither quarantine
    the node nor raise a CRITICAL drift for it."""
    monkeypatch.setenv(DRAIN_POLL_ENV, "0.5")
    admin = await api(token=await make_token("admin"))
    job = await onboarding.start("retire-a", "10.176.19.40")
    row = await onboarding.wait_status(job, "completed")
    assert row.node_id is not None
    assert row.maas_system_id is not None
    node_id, system_id = uuid.UUID(str(row.node_id)), row.maas_system_id

    retired = await admin.post(f"/api/v1/admin/nodes/{node_id}/retire", json={"reason": REASON})
    assert retired.status_code == 202, retired.text

    async def is_retired() -> bool:
        return await node_status(onboarding.sessions, node_id) == "retired"

    await eventually(is_retired, timeout=60)
    await onboarding.maas_sim.reset_counters()

    # Default policy: the retired node's machine is observed, never touched.
    left = await _reconcile(onboarding)
    assert not [a for a in left.actions if a.endswith(f":{node_id}")], left.actions
    ops = (await onboarding.maas_sim.counters())["machines"].get(system_id, {})
    assert not {op for op in ops if op.endswith((".release", ".power_off"))}
    machine = await _machine(onboarding.maas_sim, system_id)
    assert (machine.status, machine.power_state) == (MachineStatus.DEPLOYED, PowerState.ON)
    state = await state_of(onboarding.sessions, node_id)
    assert (state.last_maas_status, state.drift_detected) == ("Deployed", False)

    # The site's policy now releases retired machines (an audited site change).
    patched = await admin.patch(
        f"/api/v1/admin/maas-sites/{onboarding.site_id}",
        json={"policy": {"release_retired_machines": True}, "reason": REASON},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["policy"]["release_retired_machines"] is True
    released = await _reconcile(onboarding)
    assert f"released:{node_id}" in released.actions
    assert f"powered_off:{node_id}" in released.actions
    ops = (await onboarding.maas_sim.counters())["machines"][system_id]
    assert (ops.get("machine.release"), ops.get("machine.power_off")) == (1, 1)
    state = await state_of(onboarding.sessions, node_id)
    # Recorded as its own, with the status after its action (not the Deployed it listed).
    assert state.last_maas_status in ("Releasing", "Ready")
    assert state.drift_rule == "retired_cleanup"
    assert state.drift_details["released_by"] == "maas_reconciler"
    assert state.drift_details["maas_status"] in ("Releasing", "Ready")

    # Later runs: the release is the product's own; nothing is quarantined or raised.
    for _ in range(2):
        again = await _reconcile(onboarding)
        assert not [a for a in again.actions if a.startswith(("quarantined", "released"))]
    assert await node_status(onboarding.sessions, node_id) == "retired"
    assert await _critical_drift(onboarding.sessions, node_id) == []
    state = await state_of(onboarding.sessions, node_id)
    assert state.last_maas_status == "Ready"
    assert not state.drift_detected
    assert state.drift_details["released_by"] == "maas_reconciler"


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_run_over_the_quarantine_cap_quarantines_none_and_shows_as_refused(
    reconciler: None,  # noqa: F811 - the fixture
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
    api: Any,
    make_token: Any,
) -> None:
    """Three bound machines go bad at once on a site whose cap is two quarantines a run: the
    run quarantines none, changes nothing, records a refused reconcile (quarantine_cap,
    CRITICAL), and /reconciliation/status shows it with its reason and time. With the cap
    raised through the admin API, the next run quarantines all three and the refusal is gone
    from the status."""
    site_id = await make_site(db_sessions, secret_store, maas_sim, reconcile_max_quarantine=2)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    admin = await api(token=await make_token("admin"))
    status_url = "/api/v1/admin/reconciliation/status"
    await run_once(temporal_client, settings, site_id)  # the baseline: nothing to quarantine
    assert (await admin.get(status_url, params={"site_id": str(site_id)})).json()["refused"] == []

    await maas_sim.release("rec-released")
    await maas_sim.mark_broken("rec-broken")
    await maas_sim.delete("rec-deleted")
    before = await snapshot(db_sessions, site_id)
    await maas_sim.reset_counters()

    refused = await run_once(temporal_client, settings, site_id)
    assert refused.actions == ["suspect:quarantine_cap"]
    assert await snapshot(db_sessions, site_id) == before
    assert [await node_status(db_sessions, ids[n]) for n in NODES] == list(NODES.values())
    ops = (await maas_sim.counters())["ops"]
    assert not {op for op in ops if op.endswith((".release", ".power_off"))}
    (alert,) = await suspect_alerts(db_sessions, site_id)
    assert (alert["reason"], alert["severity"]) == ("quarantine_cap", "CRITICAL")
    assert (alert["would_quarantine"], alert["max_quarantine"]) == (3, 2)
    assert sorted(alert["node_ids"]) == sorted(
        str(ids[n]) for n in ("released", "broken", "deleted")
    )

    status = (await admin.get(status_url, params={"site_id": str(site_id)})).json()
    (shown,) = status["refused"]
    assert (shown["site_id"], shown["reason"], shown["severity"]) == (
        str(site_id),
        "quarantine_cap",
        "CRITICAL",
    )
    assert shown["at"]
    assert "3 nodes would be quarantined" in shown["message"]
    assert shown["details"]["would_quarantine"] == 3
    everywhere = (await admin.get(status_url)).json()["refused"]
    assert str(site_id) in {r["site_id"] for r in everywhere}

    raised = await admin.patch(
        f"/api/v1/admin/maas-sites/{site_id}",
        json={"policy": {"reconcile_max_quarantine": 10}, "reason": REASON},
    )
    assert raised.status_code == 200, raised.text
    accepted = await run_once(temporal_client, settings, site_id)
    assert {f"quarantined:{ids[n]}" for n in ("released", "broken", "deleted")} <= set(
        accepted.actions
    )
    assert (await admin.get(status_url, params={"site_id": str(site_id)})).json()["refused"] == []


@pytest.mark.maas_scenario(SCENARIO)
async def test_the_reconciler_writes_the_sites_current_hw_sync_interval(
    reconciler: None,  # noqa: F811 - the fixture
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
    api: Any,
    make_token: Any,
) -> None:
    """MAAS has one hardware_sync_interval: the site's interval changed through the admin API
    is what MAAS holds after the next reconcile, and a later change likewise (one owner)."""
    site_id = await make_site(db_sessions, secret_store, maas_sim, hardware_sync_interval="10m")
    admin = await api(token=await make_token("admin"))

    async def maas_interval() -> str:
        async with MaasClient(maas_sim.base_url, maas_sim.api_key, timeout=10) as maas:
            return str(await maas.get_config("hardware_sync_interval"))

    first = await run_once(temporal_client, settings, site_id)
    assert "site_setting:hardware_sync_interval=10m" in first.actions
    assert await maas_interval() == "10m"
    for value in ("20m", "1h"):
        patched = await admin.patch(
            f"/api/v1/admin/maas-sites/{site_id}",
            json={"policy": {"hardware_sync_interval": value}, "reason": REASON},
        )
        assert patched.status_code == 200, patched.text
        result = await run_once(temporal_client, settings, site_id)
        assert f"site_setting:hardware_sync_interval={value}" in result.actions
        assert await maas_interval() == value
    unchanged = await run_once(temporal_client, settings, site_id)
    assert not [a for a in unchanged.actions if a.startswith("site_setting")]
