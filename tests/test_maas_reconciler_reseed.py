"""Issue 20 item 5 (docs/lifecycles/onboarding.md#hardware-sync "whenever reconciliation detects
sync drift on a deployed node"): the site reconciler re-seeds a node's hardware sync through its
agent.

A node onboarded through the MAAS simulator, whose deployed OS runs the real gpucloud-agent
(sim/first_boot.py), stops posting hardware sync; the reconciler finds the sync stale, runs
`node.hw_sync_reseed` on the node's queue, the agent rewrites the units and restarts the timer on
the simulated host (the simulated OS carries the restart out, and MAAS sees a fresh sync), and the
next reconcile heals the drift. Each drift event is re-seeded once: a failed or unreachable
re-seed is recorded on it and not tried again while it stays open."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import WorkflowHandle
from temporalio.testing import ActivityEnvironment

from activities.maas.client import MaasClient
from activities.maas.types import HardwareSync
from activities.maas_reconcile import MaasReconcileActivities
from contracts.maas_reconciler import (
    ReconcileInput,
    ReconcileResult,
    ReseedOutcome,
    ReseedOutcomes,
)
from schema.models import Node, NodeDriftEvent, NodeMaasState
from sim.first_boot import BootRecord
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_maas_reconciler import make_site
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow

HOSTNAME, BMC = "sync-node", "10.176.16.70"
SCENARIO = sim_scenario(sim_machine(HOSTNAME, BMC))
TIMER_UNIT = "maas_hardware_sync.timer"
# MAAS's sync interval once the test shortens it: a stopped timer is stale 1.5 s later.
SYNC_INTERVAL = "1s"


async def _reconcile(
    rig: OnboardingRig, **options: Any
) -> tuple[ReconcileResult, WorkflowHandle[Any, Any]]:
    """One reconcile run of the rig's site, as its schedule would start it."""
    handle = await rig.client.start_workflow(
        MaasSiteReconcilerWorkflow.run,
        ReconcileInput(str(rig.site_id), **options),
        id=f"maas-reconciler-test-{uuid.uuid4()}",
        task_queue=rig.settings.control_plane_task_queue,
    )
    return await handle.result(), handle


async def _sync_timer(rig: OnboardingRig, system_id: str, *, running: bool) -> Any:
    """The deployed OS's hardware-sync timer stopped (or restarted) behind the product's back."""
    response = await rig.maas_sim.control.post(
        f"/_sim/machines/{system_id}/hw-sync-timer", json={"running": running}
    )
    response.raise_for_status()
    return response.json()


async def _drift_events(rig: OnboardingRig, node_id: uuid.UUID) -> list[NodeDriftEvent]:
    return await _drift_events_of(rig.sessions, node_id)


async def _state(rig: OnboardingRig, node_id: uuid.UUID) -> NodeMaasState:
    async with rig.sessions() as session:
        state = await session.get(NodeMaasState, node_id)
        assert state is not None
        return state


async def _onboard_with_short_sync(rig: OnboardingRig) -> tuple[uuid.UUID, str, BootRecord]:
    """The node onboarded (its agent running on the simulated host), then MAAS's sync interval
    shortened to SYNC_INTERVAL (an operator's config change, picked up when the machine's
    enable_hw_sync is saved), so that a stopped timer goes stale within the test."""
    job = await rig.start(HOSTNAME, BMC)
    row = await rig.wait_status(job, "completed")
    assert row.maas_system_id is not None
    system_id = row.maas_system_id
    snapshot = await rig.maas_sim.machine(system_id)
    record = await rig.first_boot.wait_for(snapshot["hostname"])
    async with MaasClient(rig.maas_sim.base_url, rig.maas_sim.api_key, timeout=10) as maas:
        await maas.set_config("hardware_sync_interval", SYNC_INTERVAL)
        await maas.update_machine(system_id, enable_hw_sync=True)
    return uuid.UUID(job.node_id), system_id, record


async def wait_hw_sync_late(maas_sim: MaasSim, system_id: str) -> HardwareSync:
    """Until MAAS shows no sync of the machine in 1.5 x its sync_interval (what the reconciler
    calls stale), on MAAS's own timestamps; its hardware sync then."""
    async with MaasClient(maas_sim.base_url, maas_sim.api_key, timeout=10) as maas:

        async def late() -> HardwareSync | None:
            sync = (await maas.get_machine(system_id)).hardware_sync
            return None if sync.healthy(dt.datetime.now(dt.UTC)) else sync

        return await eventually(late, timeout=10)


async def _last_sync(rig: OnboardingRig, system_id: str) -> dt.datetime | None:
    async with MaasClient(rig.maas_sim.base_url, rig.maas_sim.api_key, timeout=10) as maas:
        return (await maas.get_machine(system_id)).hardware_sync.last_sync


@pytest.mark.maas_scenario(SCENARIO)
async def test_stale_sync_is_reseeded_through_the_agent_and_the_drift_heals(
    onboarding: OnboardingRig,
) -> None:
    node_id, system_id, record = await _onboard_with_short_sync(onboarding)
    healthy, _ = await _reconcile(onboarding)
    assert (healthy.drift_detected, healthy.reseeds) == (0, [])

    assert (await _sync_timer(onboarding, system_id, running=False))["running"] is False
    stale_since = (await wait_hw_sync_late(onboarding.maas_sim, system_id)).last_sync
    assert stale_since is not None

    result, handle = await _reconcile(onboarding)
    assert result.drift_detected == 1
    assert [r.node_id for r in result.reseeds] == [str(node_id)]
    # The timer is re-seeded at the interval MAAS judges this machine by (its sync_interval,
    # 1 s, rounded up to the timer's minimum), not the site policy's 15m.
    assert result.reseeds[0].interval_minutes == 1
    assert f"reseed_dispatched:{node_id}" in result.actions
    assert f"reseed_succeeded:{node_id}" in result.actions
    await record_history(handle, "maas_site_reconciler", "hw_sync_reseed")

    # On the simulated host: the agent restarted the timer, the simulated OS carried it out and
    # its service posted to MAAS, which now shows a sync newer than the stale one.
    await eventually(lambda: _async(TIMER_UNIT in record.unit_restarts))
    last_sync = await eventually(lambda: _fresh_sync(onboarding, system_id, stale_since))
    assert last_sync > stale_since

    (event,) = await _drift_events(onboarding, node_id)
    assert event.rule == "hw_sync_stale"
    reseed = event.details["reseed"]
    assert reseed["status"] == "succeeded"
    assert reseed["task_id"] == result.reseeds[0].task_id
    assert (reseed["restarted"], reseed["credentials_present"]) == (True, True)
    state = await _state(onboarding, node_id)
    assert state.drift_detected
    assert state.drift_details is not None
    assert state.drift_details["reseed"]["status"] == "succeeded"

    healed, _ = await _reconcile(onboarding)
    assert (healed.drift_resolved, healed.drift_detected, healed.reseeds) == (1, 0, [])
    state = await _state(onboarding, node_id)
    assert not state.drift_detected
    assert state.drift_resolved_at is not None
    assert len(await _drift_events(onboarding, node_id)) == 1
    assert record.unit_restarts == [TIMER_UNIT]  # re-seeded once


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_reseed_no_agent_picks_up_is_recorded_once_and_not_retried(
    onboarding: OnboardingRig,
) -> None:
    node_id, system_id, record = await _onboard_with_short_sync(onboarding)
    await onboarding.first_boot.stop_agent(record.hostname)
    await _sync_timer(onboarding, system_id, running=False)
    await wait_hw_sync_late(onboarding.maas_sim, system_id)

    result, _ = await _reconcile(onboarding, reseed_schedule_to_start_seconds=2.0)
    assert result.drift_detected == 1
    assert f"reseed_agent_unreachable:{node_id}" in result.actions
    (event,) = await _drift_events(onboarding, node_id)
    assert event.details["reseed"]["status"] == "agent_unreachable"
    state = await _state(onboarding, node_id)
    assert state.drift_detected
    assert state.drift_details is not None
    assert state.drift_details["reseed"]["status"] == "agent_unreachable"

    # The drift stays open; later runs neither record it again nor re-seed it again.
    again, _ = await _reconcile(onboarding, reseed_schedule_to_start_seconds=2.0)
    assert (again.drift_detected, again.reseeds) == (0, [])
    assert not [a for a in again.actions if a.startswith("reseed_")]
    assert len(await _drift_events(onboarding, node_id)) == 1
    assert record.unit_restarts == []


async def _async(value: bool) -> bool:
    return value


async def _fresh_sync(
    rig: OnboardingRig, system_id: str, stale_since: dt.datetime
) -> dt.datetime | None:
    last = await _last_sync(rig, system_id)
    return last if last is not None and last > stale_since else None


TIMERS = sim_scenario(
    sim_machine("timer-ok", "10.176.16.71", status="Deployed", enable_hw_sync=True),
    sim_machine("timer-broken", "10.176.16.72", status="Deployed", enable_hw_sync=True,
                faults=[{"kind": "hw_sync_never_healthy"}]),
    site={"hardware_sync_interval": SYNC_INTERVAL},
)  # fmt: skip


@pytest.mark.maas_scenario(TIMERS)
async def test_sim_hw_sync_timer_stops_and_a_restart_posts_unless_the_os_cannot(
    maas_sim: Any,
) -> None:
    """The simulator's side of a re-seed: a stopped timer leaves last_sync where it was; its
    restart posts at once, except on a machine whose OS never posts (hw_sync_never_healthy)."""
    ok = (await maas_sim.machine("timer-ok"))["system_id"]
    broken = (await maas_sim.machine("timer-broken"))["system_id"]
    async with MaasClient(maas_sim.base_url, maas_sim.api_key, timeout=10) as maas:

        async def last_sync(system_id: str) -> dt.datetime | None:
            return (await maas.get_machine(system_id)).hardware_sync.last_sync

        stopped = await maas_sim.control.post(
            f"/_sim/machines/{ok}/hw-sync-timer", json={"running": False}
        )
        assert stopped.json() == {"running": False, "posted": False}
        before = await last_sync(ok)
        await asyncio.sleep(0.2)  # must stay: a bounded window (the restart below posts at once)
        assert await last_sync(ok) == before
        restarted = await maas_sim.control.post(
            f"/_sim/machines/{ok}/hw-sync-timer", json={"running": True}
        )
        assert restarted.json() == {"running": True, "posted": True}
        after = await last_sync(ok)
        assert before is not None
        assert after is not None
        assert after > before

        never = await last_sync(broken)
        refused = await maas_sim.control.post(
            f"/_sim/machines/{broken}/hw-sync-timer", json={"running": True}
        )
        assert refused.json() == {"running": False, "posted": False}
        assert await last_sync(broken) == never
        bad = await maas_sim.control.post(
            f"/_sim/machines/{ok}/hw-sync-timer", json={"running": "yes"}
        )
        assert bad.status_code == 400


STALE = sim_scenario(
    sim_machine("retry-stale", "10.176.16.73", status="Deployed", enable_hw_sync=True,
                faults=[{"kind": "hw_sync_never_healthy"}]),
    site={"hardware_sync_interval": SYNC_INTERVAL},
)  # fmt: skip


@pytest.mark.maas_scenario(STALE)
async def test_a_retried_pass_gets_back_its_own_claims_and_no_other_run_does(
    maas_sim: Any, db_sessions: Any, secret_store: Any
) -> None:
    """The reconcile pass commits its re-seed claims and can still fail after (its local
    activity is then retried, in the same workflow run): the retry gets back exactly the claims
    that run made and has no outcome for, with the same task ids, so none stays `dispatched`
    without a re-seed; another run gets none of them, nor does the same run once the outcome is
    recorded. The pass runs as the worker runs it, against PostgreSQL, Vault and the MAAS
    simulator; only the activity's info (its workflow run id) is the test's."""
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    machine = await maas_sim.machine("retry-stale")
    node_id = uuid.uuid4()
    async with db_sessions() as session, session.begin():
        session.add(
            Node(
                id=node_id,
                hostname=f"retry-stale-{node_id.hex[:6]}",
                region="us-east-1",
                sku="h100-8x",
                status="active",
                gpu_count=8,
                host_address=machine["ip_addresses"][0],
                last_agent_contact_at=dt.datetime.now(dt.UTC),
            )
        )
        await session.flush()
        session.add(
            NodeMaasState(node_id=node_id, site_id=site_id, maas_system_id=machine["system_id"])
        )
    await wait_hw_sync_late(maas_sim, machine["system_id"])
    acts = MaasReconcileActivities(db_sessions, secret_store)

    async def attempt(run_id: str) -> ReconcileResult:
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, workflow_run_id=run_id, is_local=True)
        return await env.run(acts.reconcile, ReconcileInput(str(site_id)))

    first = await attempt("run-a")
    assert first.drift_detected == 1
    assert [r.node_id for r in first.reseeds] == [str(node_id)]
    (event,) = await _drift_events_of(db_sessions, node_id)
    assert event.details["reseed"]["status"] == "dispatched"
    assert event.details["reseed"]["run_id"] == "run-a"

    retried = await attempt("run-a")  # the same run's retry after the claim was committed
    assert retried.drift_detected == 0
    assert retried.reseeds == first.reseeds  # same event, same task id
    assert f"reseed_dispatched:{node_id}" in retried.actions
    (again,) = await _drift_events_of(db_sessions, node_id)
    assert again.details["reseed"] == event.details["reseed"]  # not claimed anew

    other = await attempt("run-b")
    assert (other.drift_detected, other.reseeds) == (0, [])
    assert not [a for a in other.actions if a.startswith("reseed_")]

    (request,) = first.reseeds
    await ActivityEnvironment().run(
        acts.record_reseeds,
        ReseedOutcomes(
            site_id=str(site_id),
            outcomes=[
                ReseedOutcome(
                    node_id=request.node_id,
                    drift_event_id=request.drift_event_id,
                    task_id=request.task_id,
                    status="failed",
                    message="test",
                )
            ],
        ),
    )
    done = await attempt("run-a")  # the outcome is recorded: nothing left to this run either
    assert done.reseeds == []
    (recorded,) = await _drift_events_of(db_sessions, node_id)
    assert recorded.details["reseed"]["status"] == "failed"
    assert recorded.details["reseed"]["run_id"] == "run-a"


async def _drift_events_of(sessions: Any, node_id: uuid.UUID) -> list[NodeDriftEvent]:
    async with sessions() as session:
        return list(
            await session.scalars(
                select(NodeDriftEvent)
                .where(NodeDriftEvent.node_id == node_id)
                .order_by(NodeDriftEvent.id)
            )
        )
