"""Operator recovery (docs/lifecycles/onboarding.md#actions,
docs/lifecycles/onboarding.md#safe-re-entry): each action on a real failed or running onboarding,
asserting convergence without duplicates through the MAAS simulator's counters, the node table and
the stage events."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from schema.models import Node
from tests.histories import record_history
from tests.lifecycle_support import eventually
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import (
    Job,
    OnboardingRig,
    control_plane_worker_config,
    operator_action_admitted,
)
from tests.workflow_probes import activity_completed

SCENARIO = sim_scenario(
    sim_machine("r-deploy-once", "10.176.18.10", faults=[{"kind": "deploy_fails", "times": 1}]),
    sim_machine("r-nosync", "10.176.18.11", faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("r-nosync2", "10.176.18.12", faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("r-late", "10.176.18.13"),
    sim_machine("r-slow", "10.176.18.14", timings={"deploying": 60_000}),
    sim_machine("r-clean", "10.176.18.15", faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("r-gone", "10.176.18.16", boss=False),
    sim_machine("r-race", "10.176.18.17", timings={"deploying": 3_000}),
    sim_machine(
        "r-lost",
        "10.176.18.18",
        faults=[{"kind": "http_error", "op": "machine.deploy", "times": 1, "applied": True}],
    ),
)


async def _nodes_named(rig: OnboardingRig, hostname: str) -> list[Node]:
    async with rig.sessions() as session:
        return list(await session.scalars(select(Node).where(Node.hostname == hostname)))


async def _stages_after(rig: OnboardingRig, job: Job, marker: int) -> list[tuple[str, str]]:
    return [(e.stage, e.status) for e in (await rig.events(job))[marker:]]


@pytest.mark.maas_scenario(SCENARIO)
async def test_rerun_after_deploy_failure_converges_without_duplicates(
    onboarding: OnboardingRig,
) -> None:
    job = await onboarding.start("r-deploy-once", "10.176.18.10")
    row = await onboarding.wait_status(job, "failed_retryable")
    assert row.error_code == "deploy_failed"
    system_id = row.maas_system_id
    assert (await onboarding.maas_sim.machine(system_id))["status_name"] == "Ready"

    # Not allowed: a second, different action while one is pending is fine to refuse, and
    # an unknown action is refused by the validator.
    with pytest.raises(WorkflowUpdateFailedError):
        await onboarding.action(job, "reboot_everything")

    result = await onboarding.action(job, "rerun")
    assert result.accepted
    assert (result.prior_status, result.prior_stage) == ("failed_retryable", "wait_for_deployed")
    row = await onboarding.wait_status(job, "completed")
    counters = await onboarding.maas_sim.counters()
    assert counters["ops"].get("machines.create", 0) == 0
    assert counters["machines"][system_id]["machine.deploy"] == 2  # the failed one + one more
    assert row.maas_system_id == system_id
    nodes = await _nodes_named(onboarding, "r-deploy-once")
    assert [str(n.id) for n in nodes] == [job.node_id]
    assert nodes[0].status == "active"
    # Closed: further actions are refused by Temporal (the gateway answers 409).
    with pytest.raises(RPCError) as closed:  # the gateway answers this with 409
        await onboarding.action(job, "retry_stage")
    assert closed.value.status == RPCStatusCode.NOT_FOUND
    await record_history(
        onboarding.client.get_workflow_handle(job.workflow_id), "onboarding", "rerun_after_failure"
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_retry_stage_reruns_only_the_wait_and_resume_reseeds_first(
    onboarding: OnboardingRig,
) -> None:
    retry = await onboarding.start("r-nosync", "10.176.18.11")
    resume = await onboarding.start("r-nosync2", "10.176.18.12")
    for job in (retry, resume):
        row = await onboarding.wait_status(job, "failed_manual_intervention")
        assert row.error_code == "failed_hw_sync_health"
        assert row.current_stage == "wait_for_hardware_sync_healthy"
    # The operator fixes maas-agent on both nodes (the fault is cleared).
    await onboarding.maas_sim.clear_faults("r-nosync")
    await onboarding.maas_sim.clear_faults("r-nosync2")
    marks = {job.hostname: len(await onboarding.events(job)) for job in (retry, resume)}

    assert (await onboarding.action(retry, "retry_stage")).accepted
    assert (await onboarding.action(resume, "resume")).accepted
    for job in (retry, resume):
        await onboarding.wait_status(job, "completed")

    retried = await _stages_after(onboarding, retry, marks["r-nosync"])
    resumed = await _stages_after(onboarding, resume, marks["r-nosync2"])
    assert retried[0] == ("wait_for_hardware_sync_healthy", "started")
    assert ("ensure_hardware_sync_configured", "started") not in retried
    assert resumed[0] == ("ensure_hardware_sync_configured", "started")
    assert ("ensure_hardware_sync_configured", "succeeded") in resumed
    await record_history(
        onboarding.client.get_workflow_handle(retry.workflow_id), "onboarding", "retry_stage"
    )
    await record_history(
        onboarding.client.get_workflow_handle(resume.workflow_id), "onboarding", "resume"
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_late_enrollment_is_adopted(onboarding: OnboardingRig) -> None:
    onboarding.first_boot.hold("r-late")  # the agent cannot reach the API
    await onboarding.set_policy(enrollment_timeout_seconds=4)  # it will not enroll: fail fast
    job = await onboarding.start("r-late", "10.176.18.13")
    row = await onboarding.wait_status(job, "failed_manual_intervention", timeout=90)
    assert (row.failure_class, row.error_code) == ("agent_enrollment_failure", "failed_enrollment")
    assert row.recommended_action == "adopt_observed_state"
    assert onboarding.seeder.agent_config_pushes == 1  # one token refresh before failing
    node = (await _nodes_named(onboarding, "r-late"))[0]
    assert node.status == "enrolling"
    assert (await onboarding.maas_sim.machine(row.maas_system_id))["status_name"] == "Deployed"

    onboarding.first_boot.release("r-late")  # it enrolls late, with the pushed token
    await onboarding.first_boot.wait_for("r-late", enrolled=True, timeout=20)
    # The adopt re-observes enrollment and inventory under the site's timeout: give the agent,
    # reachable now, the usual time (4 s was for failing fast above, and is too short for its
    # first inventory on a loaded machine).
    await onboarding.set_policy(enrollment_timeout_seconds=120)
    result = await onboarding.action(job, "adopt_observed_state")
    assert result.expected_status == "reconciled"
    row = await onboarding.wait_status(job, "reconciled")
    node = (await _nodes_named(onboarding, "r-late"))[0]
    assert node.status == "active"
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][row.maas_system_id]["machine.deploy"] == 1
    await record_history(
        onboarding.client.get_workflow_handle(job.workflow_id),
        "onboarding",
        "adopt_late_enrollment",
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_cancel_while_deploying_compensates(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("r-slow", "10.176.18.14")
    await onboarding.wait_status(job, "running", stage="wait_for_deployed")
    result = await onboarding.action(job, "cancel")
    assert result.accepted
    assert result.prior_status == "running"
    row = await onboarding.wait_status(job, "cancelled")
    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    assert machine["status_name"] == "Ready"  # deploy compensation: released back to Ready
    assert await _nodes_named(onboarding, "r-slow") == []  # the never-enrolled node is gone
    await record_history(
        onboarding.client.get_workflow_handle(job.workflow_id), "onboarding", "cancel_running"
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_restart_clean_releases_and_starts_over(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("r-clean", "10.176.18.15")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    system_id = row.maas_system_id
    await onboarding.maas_sim.clear_faults("r-clean")
    assert (await onboarding.action(job, "restart_clean")).accepted
    row = await onboarding.wait_status(job, "completed")
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][system_id]["machine.release"] >= 1
    assert counters["machines"][system_id]["machine.deploy"] == 2
    nodes = await _nodes_named(onboarding, "r-clean")
    assert len(nodes) == 1
    assert nodes[0].status == "active"


@pytest.mark.maas_scenario(SCENARIO)
async def test_mark_manual_and_adopt_refusals(onboarding: OnboardingRig) -> None:
    job = await onboarding.start("r-gone", "10.176.18.16")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "boss_disk_missing"
    # Idempotent: marking an already-blocked job answers "already in effect".
    again = await onboarding.action(job, "mark_manual_intervention_required")
    assert not again.accepted
    # The machine disappears from MAAS behind our back: adopt has nothing to adopt.
    await onboarding.maas_sim.delete(row.maas_system_id)
    await onboarding.action(job, "adopt_observed_state")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    events = await onboarding.events(job)
    assert any(e.status == "failed" for e in events)
    async with onboarding.sessions() as session:
        count = await session.scalar(select(func.count()).select_from(Node))
    assert count == 0
    assert str(row.node_id) == job.node_id  # reserved at submission, never created


ADOPT = sim_scenario(
    sim_machine("r-fixed", "10.176.18.20", faults=[{"kind": "hw_sync_never_healthy"}]),
)


@pytest.mark.maas_scenario(ADOPT)
async def test_adopt_after_an_out_of_band_fix_verifies_hardware_sync(
    onboarding: OnboardingRig,
) -> None:
    job = await onboarding.start("r-fixed", "10.176.18.20")
    row = await onboarding.wait_status(job, "failed_manual_intervention")
    assert row.error_code == "failed_hw_sync_health"
    seeds_before = len(onboarding.seeder.seeds)
    # Out of band: an operator repairs maas-agent on the node and power-cycles it at the BMC.
    await onboarding.maas_sim.clear_faults("r-fixed")
    await onboarding.maas_sim.set_power("r-fixed", "off")
    await onboarding.maas_sim.set_power("r-fixed", "on")
    marker = len(await onboarding.events(job))
    result = await onboarding.action(job, "adopt_observed_state")
    assert result.expected_status == "reconciled"
    row = await onboarding.wait_status(job, "reconciled")
    stages = await _stages_after(onboarding, job, marker)
    # Verified, not re-seeded: the operator's fix is what made sync healthy.
    assert ("wait_for_hardware_sync_healthy", "succeeded") in stages
    assert ("ensure_hardware_sync_configured", "started") not in stages
    assert len(onboarding.seeder.seeds) == seeds_before
    node = (await _nodes_named(onboarding, "r-fixed"))[0]
    assert node.status == "active"
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][row.maas_system_id]["machine.deploy"] == 1


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_cancel_that_lands_with_a_stage_completion_stops_before_the_next_stage(
    onboarding_without_worker: OnboardingRig,
    temporal_client: Client,
    db_engine: AsyncEngine,
    secret_store: Any,
    maas_sim: Any,
) -> None:
    """The cancel and the deploy stage's completion reach the workflow in one workflow task (its
    workflow worker is away while both happen; the stages' activities run in a worker of their
    own). The update runs first and cancels the stage, but the stage's result is already there
    and wins the await: the next stage must still not start, and the job compensates."""
    rig = onboarding_without_worker
    config = control_plane_worker_config(rig, temporal_client, db_engine, secret_store, maas_sim)

    def workflows_only() -> Worker:  # and their local activities
        return Worker(**{**config, "no_remote_activities": True})

    try:
        async with Worker(**{**config, "workflows": []}):
            async with workflows_only():
                job = await rig.start("r-race", "10.176.18.17")
                await rig.wait_status(job, "running", stage="wait_for_deployed")
            # The stage's result waits for a workflow task; the cancel is admitted to wait for
            # the same one.
            handle = rig.client.get_workflow_handle(job.workflow_id)
            await eventually(
                lambda: activity_completed(handle, "onboarding.wait_for_deployed"), timeout=30
            )
            # The OS runs by the time the operator cancels (its agent asks to enroll; the
            # enrollment itself is the control-plane worker's to write, and that is away).
            await rig.first_boot.wait_for("r-race", enrolled=False, timeout=30)
            cancel = await operator_action_admitted(
                temporal_client, job.workflow_id, "cancel", "wrong machine"
            )
            async with workflows_only():
                answer = await asyncio.wait_for(cancel, timeout=30)
                assert answer.accepted
                row = await rig.wait_status(job, "cancelled")
                await record_history(handle, "onboarding", "cancel_with_stage_result")
    finally:
        await rig.terminate_workflows()

    stages = [(e.stage, e.status) for e in await rig.events(job)]
    assert ("wait_for_deployed", "succeeded") in stages
    assert ("ensure_hardware_sync_configured", "started") not in stages, "a stage ran after it"
    # Compensated as for any cancel before the OS is known to run (no post-deploy stage began,
    # the agent never enrolled: §4.6): the machine goes back to Ready, the node record goes.
    assert stages[-1] == ("deploy_via_maas", "compensated")
    assert await _nodes_named(rig, "r-race") == []
    assert (await rig.maas_sim.machine(row.maas_system_id))["status_name"] == "Ready"


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_deploy_whose_answer_was_lost_counts_the_enrollment_of_its_agent(
    onboarding_without_worker: OnboardingRig,
    temporal_client: Client,
    db_engine: AsyncEngine,
    secret_store: Any,
    maas_sim: Any,
) -> None:
    """MAAS took the deploy but its answer was lost (a 5xx after applying): the stage's retry
    finds the machine deploying or deployed and adopts it. The agent of that deploy may have
    enrolled before the retry's adoption (here: the worker is away until the OS runs, and the
    retry's first MAAS read is slow while the returning worker writes the agent's enrollment);
    its enrollment counts, since it came after the deploy was issued, and the node becomes
    active."""
    rig = onboarding_without_worker
    config = control_plane_worker_config(rig, temporal_client, db_engine, secret_store, maas_sim)

    async def deploy_applied() -> bool:
        row = await rig.row(job)
        if row.maas_system_id is None:
            return False
        machines = (await maas_sim.counters())["machines"]
        return bool(machines.get(row.maas_system_id, {}).get("machine.deploy"))

    async with Worker(**config):
        job = await rig.start("r-lost", "10.176.18.18")
        await eventually(deploy_applied, timeout=60, interval=0.02)
    await rig.first_boot.wait_for("r-lost", enrolled=False, timeout=60)  # before the retry
    await maas_sim.add_request_fault(
        "slow", delay=4.0, op="machine.read", machine="r-lost", times=1
    )
    async with Worker(**config):
        row = await rig.wait_status(job, "completed", timeout=90)
    assert row.status == "completed"
    assert (await maas_sim.counters())["machines"][row.maas_system_id]["machine.deploy"] == 1
    stages = [(e.stage, e.status) for e in await rig.events(job)]
    assert ("deploy_via_maas", "skipped") in stages  # adopted, not deployed twice
