"""Issue 35: a reimage whose deploy ends in MAAS `Failed deployment` goes onboarding's way
(docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions): wait_for_deployed
classifies the failure with onboarding's classifier; a datasource-like failure gets the site's
bounded redeploy (release to Ready, deploy again); past the bound the job stops for an operator with
the machine left in Failed deployment, and the recommended `resume` starts from the release step,
never with a deploy MAAS refuses there.

Driven through the admin API against the MAAS simulator over HTTP, with its
`deploy_fails_datasource` fault armed on the node's machine after a real onboarding; MAAS's own
request log (the simulator's counters: every machine.deploy and the answer it got) says what
was asked of it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from schema.models import Node, NodeMaasState
from tests.decommission_fixtures import DecommissionRig, Job
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario

MACHINES = sim_scenario(
    sim_machine("rr-a", "10.176.19.10"),
    sim_machine("rr-b", "10.176.19.11"),
)


async def _node(rig: DecommissionRig, node_id: str) -> Node:
    async with rig.sessions() as session:
        node: Node | None = await session.get(Node, uuid.UUID(node_id))
        assert node is not None
        return node


async def _system_id(rig: DecommissionRig, node_id: str) -> str:
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        return str(binding.maas_system_id)


async def _reimage(admin: Any, rig: DecommissionRig, node_id: str) -> Job:
    created = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "reimage", "erase": "quick", "reason": "fresh OS"},
    )
    assert created.status_code == 201, created.text
    return rig.track(created.json()["decommission_id"], node_id, "reimage")


def _trail(events: list[Any], stages: tuple[str, ...]) -> list[tuple[str, str]]:
    """The finished events (not `started`) of these stages, in order."""
    return [(e.stage, e.status) for e in events if e.stage in stages and e.status != "started"]


def _erases(events: list[Any]) -> list[str]:
    """The erase each succeeded release_maas_node used."""
    return [
        e.details["erase"]
        for e in events
        if (e.stage, e.status) == ("release_maas_node", "succeeded")
    ]


_DEPLOY_TRAIL = (
    "release_maas_node",
    "deploy_via_maas",
    "wait_for_deployed",
    "classify_deploy_failure",
)


@pytest.mark.maas_scenario(MACHINES)
async def test_a_reimage_deploy_failing_once_is_classified_released_and_redeployed(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("rr-a", "10.176.19.10")
    system_id = await _system_id(decommission, node_id)
    await decommission.agent(node_id)
    before = await _node(decommission, node_id)
    sim = decommission.onboarding.maas_sim
    await sim.set_fault(system_id, "deploy_fails_datasource", times=1)
    await sim.reset_counters()

    job = await _reimage(admin, decommission, node_id)
    row = await decommission.wait_status(
        job, "completed", "failed_retryable", "failed_manual_intervention", timeout=120
    )
    assert row.status == "completed", (row.current_stage, row.error_code, row.error_message)
    await record_history(decommission.handle(job), "decommission", "reimage_deploy_recovered")

    events = await decommission.events(job)
    assert _trail(events, _DEPLOY_TRAIL) == [
        ("release_maas_node", "succeeded"),
        ("deploy_via_maas", "succeeded"),
        ("wait_for_deployed", "failed"),
        ("classify_deploy_failure", "succeeded"),
        ("release_maas_node", "succeeded"),  # the recovery: back to Ready, observed
        ("deploy_via_maas", "succeeded"),  # the one redeploy the site allows
        ("wait_for_deployed", "succeeded"),
    ]
    # The reimage's release erased as asked; the recovery's went back to Ready without one,
    # as onboarding's recover does.
    assert _erases(events) == ["quick", "none"]
    classified = next(
        e for e in events if (e.stage, e.status) == ("classify_deploy_failure", "succeeded")
    )
    assert classified.details["failure_kind"] == "datasource_like"

    counters = await sim.counters()
    assert counters["machines"][system_id]["machine.deploy"] == 2  # exactly one extra deploy
    assert counters["answers"]["machine.deploy"] == {"200": 2}  # none refused by MAAS
    assert (await sim.machine(system_id))["status_name"] == "Deployed"
    after = await _node(decommission, node_id)
    assert (after.id, after.status) == (before.id, "active")
    assert after.enrolled_at is not None
    assert before.enrolled_at is not None
    assert after.enrolled_at > before.enrolled_at  # the redeployed OS's agent enrolled


@pytest.mark.maas_scenario(MACHINES)
async def test_past_the_redeploy_bound_resume_releases_before_deploying_again(
    api: Any, make_token: Any, decommission: DecommissionRig
) -> None:
    admin = await api(token=await make_token("admin"))
    node_id = await decommission.maas_node("rr-b", "10.176.19.11")
    system_id = await _system_id(decommission, node_id)
    await decommission.agent(node_id)
    sim = decommission.onboarding.maas_sim
    await sim.set_fault(system_id, "deploy_fails_datasource", times=5)  # beyond the bound
    await sim.reset_counters()

    job = await _reimage(admin, decommission, node_id)
    row = await decommission.wait_status(
        job, "completed", "failed_retryable", "failed_manual_intervention", timeout=120
    )
    assert (row.status, row.current_stage, row.error_code, row.recommended_action) == (
        "failed_manual_intervention",
        "wait_for_deployed",
        "redeploy_retries_exhausted",
        "resume",
    )
    assert row.error_details["failure_kind"] == "datasource_like"
    assert row.error_details["redeploys"] == 1
    # The machine is left in Failed deployment (its installation log stays readable).
    assert (await sim.machine(system_id))["status_name"] == "Failed deployment"
    assert (await sim.counters())["machines"][system_id]["machine.deploy"] == 2
    assert (await _node(decommission, node_id)).status == "draining"

    # The operator fixes the image / metadata path, then takes the recommended action.
    await sim.clear_faults(system_id)
    path = f"/api/v1/admin/decommissions/{job.decommission_id}"
    resumed = await admin.post(f"{path}/resume", json={"reason": "metadata path fixed"})
    assert resumed.status_code == 200, resumed.text
    row = await decommission.wait_status(
        job, "completed", "failed_retryable", "failed_manual_intervention", timeout=120
    )
    assert row.status == "completed", (row.current_stage, row.error_code, row.error_message)
    await record_history(
        decommission.handle(job), "decommission", "reimage_redeploy_exhausted_resumed"
    )

    events = await decommission.events(job)
    trail = _trail(events, _DEPLOY_TRAIL)
    # After the job's failure (its last failed event) the resume released the machine back to
    # Ready before it deployed again.
    failed_at = max(i for i, t in enumerate(trail) if t == ("wait_for_deployed", "failed"))
    assert trail[failed_at - 1] == ("classify_deploy_failure", "succeeded")
    assert trail[failed_at + 1 :] == [
        ("release_maas_node", "succeeded"),
        ("deploy_via_maas", "succeeded"),
        ("wait_for_deployed", "succeeded"),
    ]
    # The resume's release is the reimage's own release step, with the erase asked for.
    assert _erases(events) == ["quick", "none", "quick"]
    counters = await sim.counters()
    assert counters["machines"][system_id]["machine.deploy"] == 3
    # MAAS never had a deploy to refuse: no deploy went into Failed deployment.
    assert counters["answers"]["machine.deploy"] == {"200": 3}
    assert (await sim.machine(system_id))["status_name"] == "Deployed"
    assert (await _node(decommission, node_id)).status == "active"
