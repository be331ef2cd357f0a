"""MaasNodeBatchOnboardWorkflow: 20 nodes with mixed simulator faults. Each fault must end in the
failure class, job state, node state and recommended action
docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions, docs/runbooks/index.md,
docs/lifecycles/onboarding.md#mark-manual-intervention prescribe, no node's failure blocks another,
and never more than max_parallel run at once."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from core.temporal import run_histories
from schema.models import Node, OnboardingSiteSlot
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig

PLAIN = [f"b-ok-{i:02d}" for i in range(14)]
# hostname -> (scenario machine kwargs, expected (status, failure_class, error_code, action))
FAULTY: dict[str, tuple[dict[str, Any], tuple[str, str | None, str | None, str | None]]] = {
    "b-noboss": (
        {"boss": False},
        ("failed_manual_intervention", "hardware_mismatch", "boss_disk_missing", "rerun"),
    ),
    "b-ds-once": (
        {"faults": [{"kind": "deploy_fails_datasource"}]},
        ("completed", None, None, None),
    ),
    "b-ds-always": (
        {"faults": [{"kind": "deploy_fails_datasource", "times": 5}]},
        (
            "failed_manual_intervention",
            "deploy_cloud_init_failure",
            "deploy_datasource_retries_exhausted",
            "rerun",
        ),
    ),
    "b-deploy-fails": (
        {"faults": [{"kind": "deploy_fails"}]},
        ("failed_retryable", "deploy_cloud_init_failure", "deploy_failed", "rerun"),
    ),
    "b-no-sync": (
        {"faults": [{"kind": "hw_sync_never_healthy"}]},
        (
            "failed_manual_intervention",
            "hardware_sync_failure",
            "failed_hw_sync_health",
            "resume",
        ),
    ),
}
AMBIGUOUS = "b-ambiguous"  # two MAAS records claim its BMC
AMBIGUOUS_BMC = "10.176.17.99"


def _bmc(i: int) -> str:
    return f"10.176.17.{10 + i}"


MACHINES = [
    sim_machine(name, _bmc(i), status="New" if i % 3 == 0 else "Ready")
    for i, name in enumerate(PLAIN)
] + [
    sim_machine(name, _bmc(20 + i), **kwargs)
    for i, (name, (kwargs, _)) in enumerate(FAULTY.items())
]
MACHINES.append(sim_machine("b-ambiguous-maas", AMBIGUOUS_BMC))
SCENARIO = sim_scenario(*MACHINES)
BMC_OF = {m["hostname"]: m["bmc"]["address"] for m in MACHINES}
BMC_OF[AMBIGUOUS] = AMBIGUOUS_BMC


@pytest.mark.maas_scenario(SCENARIO)
async def test_batch_of_twenty_with_mixed_faults(onboarding: OnboardingRig) -> None:
    # A stale IPMI-only record at the same BMC: discovery must fail closed, not guess.
    async with onboarding.maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={"hostname": "b-stale", "power_type": "ipmi",
                  "power_parameters_power_address": AMBIGUOUS_BMC},
        )  # fmt: skip
        assert created.status_code == 200, created.text

    names = [*PLAIN, *FAULTY, AMBIGUOUS]
    assert len(names) == 20
    batch_id, jobs, handle = await onboarding.start_batch(
        [(n, BMC_OF[n]) for n in names], max_parallel=5
    )
    summary = await handle.result()
    await record_history(handle, "onboarding_batch", "mixed_faults")

    assert summary.max_in_flight <= 5
    assert summary.succeeded == 15, [d for d in summary.details if d.status != "completed"]
    assert summary.failed == 5
    by_host = {job.hostname: job for job in jobs}
    for hostname in PLAIN:
        row = await onboarding.row(by_host[hostname])
        assert row.status == "completed", (hostname, row.error_code, row.error_message)
    for hostname, (_, (status, failure_class, code, action)) in FAULTY.items():
        row = await onboarding.row(by_host[hostname])
        got = (row.status, row.failure_class, row.error_code, row.recommended_action)
        assert got == (status, failure_class, code, action), (hostname, row.error_message)
    ambiguous = await onboarding.row(by_host[AMBIGUOUS])
    assert (ambiguous.status, ambiguous.failure_class, ambiguous.error_code) == (
        "failed_manual_intervention",
        "state_ambiguity",
        "bmc_address_ambiguous",
    )
    assert ambiguous.recommended_action == "adopt_observed_state"

    # Node states: active only where onboarding completed; none before render; the one whose
    # hardware sync never became healthy stays enrolling (never active).
    async with onboarding.sessions() as session:
        nodes = {n.hostname: n for n in await session.scalars(select(Node))}
    assert all(nodes[h].status == "active" for h in [*PLAIN, "b-ds-once"])
    assert nodes["b-no-sync"].status == "enrolling"
    assert "b-noboss" not in nodes
    assert AMBIGUOUS not in nodes

    # MAAS: the generic failure went back to Ready; the datasource-once node deployed twice.
    failed_generic = await onboarding.row(by_host["b-deploy-fails"])
    assert (await onboarding.maas_sim.machine(failed_generic.maas_system_id))["status_name"] == (
        "Ready"
    )
    once = await onboarding.row(by_host["b-ds-once"])
    assert once.deploy_attempts == 2
    counters = await onboarding.maas_sim.counters()
    assert counters["machines"][once.maas_system_id]["machine.deploy"] == 2
    # Deploys never exceed the bound: 1 + max_deploy_retry_attempts (1) per node.
    for hostname in names:
        row = await onboarding.row(by_host[hostname])
        if row.maas_system_id:
            assert counters["machines"][row.maas_system_id].get("machine.deploy", 0) <= 2
    # Per-node history stays in the read model under the batch
    # (docs/lifecycles/onboarding.md#batches).
    for job in jobs:
        assert str((await onboarding.row(job)).batch_id) == batch_id


SITE_WIDE = [(f"sw-{i}", f"10.176.19.{10 + i}") for i in range(5)]


def _max_overlap(intervals: list[tuple[Any, Any]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


@pytest.mark.maas_scenario(sim_scenario(*(sim_machine(h, ip) for h, ip in SITE_WIDE)))
async def test_batch_max_parallel_bounds_every_onboarding_on_the_site(
    onboarding: OnboardingRig,
) -> None:
    """docs/lifecycles/onboarding.md#batches / open question 5: the site's batch_max_parallel bounds
    the onboardings whose stages run on it, across two batches and a single onboarding started
    together (each batch alone would allow 2). Read from the stage events: from each job's first
    stage after load_site_config to its last event, never more than 2 at once; all of them
    finish."""
    await onboarding.set_policy(batch_max_parallel=2)
    _, first, first_handle = await onboarding.start_batch(SITE_WIDE[:2], max_parallel=2)
    _, second, second_handle = await onboarding.start_batch(SITE_WIDE[2:4], max_parallel=2)
    single = await onboarding.start(*SITE_WIDE[4])

    summaries = [await first_handle.result(), await second_handle.result()]
    assert [s.succeeded for s in summaries] == [2, 2]
    await onboarding.wait_status(single, "completed", timeout=120)
    await record_history(
        onboarding.client.get_workflow_handle(single.workflow_id), "onboarding", "site_slot"
    )

    intervals = []
    for job in [*first, *second, single]:
        row = await onboarding.row(job)
        assert row.status == "completed", (job.hostname, row.error_code, row.error_message)
        times = [
            e.occurred_at for e in await onboarding.events(job) if e.stage != "load_site_config"
        ]
        intervals.append((min(times), max(times)))
    assert _max_overlap(intervals) == 2
    async with onboarding.sessions() as session:
        held = await session.scalar(select(func.count()).select_from(OnboardingSiteSlot))
    assert held == 0  # every permit given back


RUNS_OF_FOUR = [(f"cr-{i}", f"10.176.21.{10 + i}") for i in range(10)]
CR_NOBOSS = "cr-1"  # fails in the first run: its outcome must reach the last run's summary
# The parent's events per child (issue 27 measured 7-13) and per run (start, patch marker,
# first and last workflow tasks, search attribute upsert, the close).
EVENTS_PER_CHILD = 13
EVENTS_PER_RUN = 12


@pytest.fixture
async def admin(api: Any, make_token: Any, onboarding: OnboardingRig) -> Any:
    return await api(token=await make_token("admin"))


@pytest.mark.maas_scenario(
    sim_scenario(*(sim_machine(h, ip, boss=h != CR_NOBOSS) for h, ip in RUNS_OF_FOUR))
)
async def test_batch_continues_as_new_with_its_history_bounded_per_run(
    onboarding: OnboardingRig, admin: Any
) -> None:
    """Issue 27: a batch larger than its run share continues as new every 4 children, so each
    run's history stays bounded; every node is onboarded once, the batch's and the site's caps
    hold across runs, and the summary, the progress query and the progress API see the whole
    batch."""
    await onboarding.set_policy(batch_max_parallel=2)
    batch_id, jobs, handle = await onboarding.start_batch(
        RUNS_OF_FOUR, max_parallel=3, children_per_run=4
    )
    summary = await handle.result()

    runs = await run_histories(onboarding.client, handle.id)
    per_run = [len(r.events) for r in runs]
    assert len(runs) == 3, per_run  # 4 + 4 + 2 children
    assert max(per_run) <= 4 * EVENTS_PER_CHILD + EVENTS_PER_RUN, per_run
    await record_history(
        onboarding.client.get_workflow_handle(handle.id, run_id=runs[0].run_id),
        "onboarding_batch",
        "continued_first_run",
    )
    await record_history(handle, "onboarding_batch", "continued_last_run")

    assert (summary.succeeded, summary.failed) == (9, 1)
    assert [d.hostname for d in summary.details] == [h for h, _ in RUNS_OF_FOUR]
    assert {d.hostname: d.error_code for d in summary.details}[CR_NOBOSS] == "boss_disk_missing"
    assert 2 <= summary.max_in_flight <= 3
    assert await handle.query("progress") == {
        "total": 10, "started": 10, "in_flight": 0, "settled": 10,
        "max_in_flight": summary.max_in_flight,
    }  # fmt: skip

    # Every node onboarded once: one deploy per machine that got that far, one stage run each.
    counters = await onboarding.maas_sim.counters()
    intervals = []
    for job in jobs:
        row = await onboarding.row(job)
        expected = "failed_manual_intervention" if job.hostname == CR_NOBOSS else "completed"
        assert row.status == expected, (job.hostname, row.error_code, row.error_message)
        events = await onboarding.events(job)
        first_stage = [e for e in events if e.stage == "load_site_config" and e.status == "started"]
        assert len(first_stage) == 1, job.hostname
        if job.hostname != CR_NOBOSS:
            assert counters["machines"][row.maas_system_id]["machine.deploy"] == 1
        times = [e.occurred_at for e in events if e.stage != "load_site_config"]
        intervals.append((min(times), max(times)))
    assert _max_overlap(intervals) <= 2  # the site's batch_max_parallel, across runs
    async with onboarding.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(OnboardingSiteSlot)) == 0

    # The progress API reads the read model: the whole batch, whichever run is current.
    listed = await admin.get("/api/v1/admin/onboardings", params={"batch_id": batch_id})
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert sorted(i["hostname"] for i in items) == sorted(h for h, _ in RUNS_OF_FOUR)
    assert sum(1 for i in items if i["status"] == "completed") == 9
