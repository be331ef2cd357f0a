"""Model-based safety suite (issue 35, "Tests and checks"): a Hypothesis state machine draws
sequences of operator verbs, MAAS faults, agent deaths and reconcile runs over a small fleet of
MAAS-simulator machines, on the real stack: every verb through the admin API (onboarding with the
right BMC address or a mistyped one that is another live node's; retire, reactivate, resume,
protect/unprotect; decommission soft_reset/reimage/full_decommission; retry/resume/adopt/cancel of
whatever job is failed; record-disk-disposition on any decommission, in any state), the
workflows on Temporal with the production worker, the MAAS simulator over HTTP, the agents
booted from the rendered cloud-init. After every step the invariants of
tests/safety_model_support.py hold:

- no BMC powered (cycle or on, as the simulator's BMC log shows) without a BMC check this
  product recorded for that address, nor one whose machine was bound to a live node or
  Deployed/Allocated/Deploying in MAAS;
- no node deleted by a full decommission or enabled by a reimage that asked for an erase unless
  the simulator's erase log shows that erase done on the job's machine since the job began (or
  the job's disk disposition says the erase failed, as the simulator saw, and the site's
  fallback released without it); a disposition `erased` agrees with the simulator;

- no release/erase/power-off/delete/deploy of a machine bound to a live node other than the one
  the step (or a job still running) was for;
- no node `active` without a health proof or validate_clean pass in the run that enabled it;
- no full decommission `completed`/`reconciled` unless the machine is released and off (or its
  record removed by the job) and the agent gone, or the job says what was not done;
- no machine deployed more often than the onboarding/reimage runs and retries allow;
- no full decommission whose machine vanished from MAAS unreleased ends completed/reconciled or
  leaves its node deleted without the operator's disk-disposition record;
- record-disk-disposition is refused (409) and changes nothing unless the job stands
  failed_manual_intervention with host_not_wiped; there it ends the job reconciled, the node
  deleted and the operator's record in the followups.

The steps are drawn as data (`STEP`, a list of fixed length per example, so every example runs
its whole budget and a failing sequence is replayable as an explicit list); the model runs in a
thread, and each step sends its coroutine to the session's event loop
(`asyncio.run_coroutine_threadsafe`), where the rig's worker, gateway and first-boot
simulator run. Each example gets a fresh fleet (its own scenario, hostnames and BMC
addresses).

CI runs a fixed seed (derandomize) and a small budget; GPUCLOUD_SAFETY_EXAMPLES /
GPUCLOUD_SAFETY_STEPS run it longer (bench/safety_fuzz.sh), GPUCLOUD_SAFETY_SHRINK=1 lets
Hypothesis shrink a failure it finds. A failure found is kept below as a named regression test
with its explicit step sequence."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from temporalio.client import Client

from activities.node_admin import DRAIN_POLL_ENV
from gateway.maas_sites import sync_reconciler_schedule
from tests.decommission_fixtures import DecommissionRig
from tests.lifecycle_support import LoopBridge
from tests.safety_model_support import (
    SafetyWorld,
    Snapshot,
    fleet_machines,
    fleet_scenario,
    unknown_machines,
)

EXAMPLES = int(os.environ.get("GPUCLOUD_SAFETY_EXAMPLES", "3"))
STEPS = int(os.environ.get("GPUCLOUD_SAFETY_STEPS", "12"))
FLEET = 3
STEP_TIMEOUT_S = 240.0


class _Temporal:
    """gateway's TemporalOps shape, enough for sync_reconciler_schedule."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def update(self, fn: Any) -> None:
        await fn(self.client)


async def _world(
    rig: DecommissionRig, admin: Any, maas_sim: Any, example: int, reconciler: bool
) -> SafetyWorld:
    machines = fleet_machines(example, FLEET)
    if reconciler:
        await sync_reconciler_schedule(
            _Temporal(rig.client),  # type: ignore[arg-type]
            rig.onboarding.settings,
            rig.onboarding.site_id,
            every_seconds=86400,
            paused=False,
        )
    return SafetyWorld(
        rig=rig,
        admin=admin,
        maas_sim=maas_sim,
        example=example,
        machines=machines,
        unknown=[(h, ip) for h, ip, _ in unknown_machines(example)],
    )


# One step, as data (replayable: a regression test is a list of these). Node, job and machine
# choices are indices, taken modulo what exists when the step runs. The first alternative is
# what Hypothesis' simplest example repeats: a cheap reconcile.
STEP = st.one_of(
    st.tuples(st.just("reconcile")),
    st.tuples(st.just("onboard"), st.integers(0, FLEET - 1)),
    st.tuples(st.just("onboard_mistyped"), st.integers(0, FLEET - 1)),
    # A machine MAAS does not know: a new one (off) or a host running outside MAAS.
    st.tuples(st.just("onboard_unknown"), st.integers(0, 1)),
    st.tuples(
        st.just("node"),
        st.sampled_from(["retire", "reactivate", "resume", "protect", "unprotect"]),
        st.integers(0, FLEET - 1),
    ),
    st.tuples(
        st.just("decommission"),
        st.sampled_from(["soft_reset", "reimage", "full_decommission"]),
        st.sampled_from(["none", "quick"]),
        st.integers(0, FLEET - 1),
    ),
    st.tuples(
        st.just("job"),
        st.sampled_from(["adopt", "retry", "resume", "cancel"]),
        st.integers(0, 7),
    ),
    st.tuples(
        st.just("disk_disposition"),
        st.sampled_from(["destroyed", "wiped_out_of_band", "retained_quarantined"]),
        st.integers(0, 7),
    ),
    st.tuples(
        st.just("fault"),
        st.sampled_from(["release", "power_off", "delete", "stop_agent"]),
        st.integers(0, FLEET - 1),
    ),
)


class SafetyModel:
    """One example: a fresh fleet (two of its three machines onboarded through the API), then
    the steps, each framed by snapshot, act, settle and the invariant check."""

    def __init__(self, bridge: LoopBridge, rig: DecommissionRig, admin: Any, maas_sim: Any) -> None:
        self.bridge, self.rig = bridge, rig
        COUNTER["example"] += 1
        self.world = bridge(_world(rig, admin, maas_sim, COUNTER["example"], True))
        self.world.log.append(f"example {COUNTER['example']}: {self.world.machines}")
        for host, bmc in self.world.machines[:2]:
            self.step(f"onboard({host}, {bmc})", set(), self.world.onboard(host, bmc))

    def step(self, name: str, allowed: set[str], act: Coroutine[Any, Any, str]) -> None:
        world = self.world

        async def run() -> None:
            before: Snapshot = await world.snapshot()
            outcome = await act
            after = await world.snapshot()
            world.log.append(f"  {name}: {outcome}")
            await world.check(before, after, allowed, name)

        self.bridge(run())

    def run(self, steps: list[tuple[Any, ...]]) -> None:
        try:
            for step in steps:
                self.world.log.append(f"  step {step!r}")
                getattr(self, f"_{step[0]}" + ("_" if step[0] == "node" else ""))(*step[1:])
        finally:
            print("\n".join(self.world.log))  # the trail, shown on failure (-s: always)

    def _node(self, i: int) -> str | None:
        nodes = sorted(self.world.nodes)
        return nodes[i % len(nodes)] if nodes else None

    def _reconcile(self) -> None:
        self.step("reconcile", set(), self.world.reconcile(self.rig.client))

    def _onboard(self, i: int) -> None:
        host, bmc = self.world.machines[i]
        if host in self.world.nodes.values():
            return
        self.step(f"onboard({host}, {bmc})", set(), self.world.onboard(host, bmc))

    def _onboard_mistyped(self, i: int) -> None:
        """A new hostname with the BMC address of a machine another node holds."""
        held = sorted(self.world.physical.items())
        if not held:
            return
        _, host = held[i % len(held)]
        bmc = dict(self.world.machines + self.world.unknown)[host]
        self.world.typos += 1
        typo = f"sf{self.world.example}-typo{self.world.typos}"
        self.step(f"onboard({typo}, {bmc} = {host}'s BMC)", set(), self.world.onboard(typo, bmc))

    def _onboard_unknown(self, i: int) -> None:
        host, bmc = self.world.unknown[i % len(self.world.unknown)]
        if host in self.world.nodes.values():
            return
        self.step(f"onboard({host}, {bmc}, not in MAAS)", set(), self.world.onboard(host, bmc))

    def _node_verb(self, verb: str, node_id: str) -> None:
        self.step(
            f"{verb}({self.world.nodes[node_id]})", {node_id}, self.world.node_verb(node_id, verb)
        )

    def _node_(self, verb: str, i: int) -> None:
        node_id = self._node(i)
        if node_id is not None:
            self._node_verb(verb, node_id)

    def _decommission(self, mode: str, erase: str, i: int) -> None:
        node_id = self._node(i)
        if node_id is None:
            return
        self.step(
            f"decommission({self.world.nodes[node_id]}, {mode}, erase={erase})",
            {node_id},
            self.world.decommission(node_id, mode, erase),
        )

    def _job(self, action: str, i: int) -> None:
        failed = self.bridge(self.world.failed_jobs())
        if not failed:
            return
        kind, job_id, node_id = failed[i % len(failed)]
        self.step(
            f"{action}({kind} {job_id[:8]} of {self.world.nodes.get(node_id)})",
            {node_id},
            self.world.job_action(kind, job_id, action),
        )

    def _disk_disposition(self, disposition: str, i: int) -> None:
        """record-disk-disposition on any decommission of this example, whatever its state."""
        jobs = self.world.decommission_jobs()
        if not jobs:
            return
        did, node_id = jobs[i % len(jobs)]
        self.step(
            f"record-disk-disposition({did[:8]} of {self.world.nodes.get(node_id)}, {disposition})",
            {node_id},
            self.world.record_disk_disposition(did, disposition),
        )

    def _fault(self, fault: str, i: int) -> None:
        host = self.world.machines[i][0]
        self.step(f"fault {fault}({host})", set(), self._do_fault(host, fault))

    async def _do_fault(self, host: str, fault: str) -> str:
        sim = self.world.maas_sim
        if fault == "stop_agent":
            await self.rig.onboarding.first_boot.stop_agent(host)
            return "agent stopped"
        machines = {m["scenario_hostname"]: m for m in (await sim.state())["machines"]}
        machine = machines.get(host)
        if machine is None:
            return "no machine in MAAS"
        sid = machine["system_id"]
        try:
            if fault == "release":
                await sim.release(sid)
            elif fault == "power_off":
                await sim.set_power(sid, "off")
            else:
                await sim.delete(sid)
        except AssertionError as refused:  # MAAS refused it (e.g. releasing a Ready machine)
            return f"refused: {str(refused)[:80]}"
        return f"{sid} {fault}"


COUNTER = {"example": 0}


@pytest.fixture
async def safety(
    decommission: DecommissionRig, api: Any, make_token: Any, maas_sim: Any, monkeypatch: Any
) -> Any:
    monkeypatch.setenv(DRAIN_POLL_ENV, "0.2")
    # Every example's machines in one scenario (the simulator is not reset between examples).
    await maas_sim.reset(fleet_scenario(EXAMPLES, FLEET))
    COUNTER["example"] = 0
    admin = await api(token=await make_token("admin"), settings=decommission.onboarding.settings)
    return decommission, admin, maas_sim


async def test_safety_model(safety: Any) -> None:
    """Hypothesis draws EXAMPLES sequences of STEPS steps (a fixed seed: derandomize); the
    first is its simplest (reconciles only), the others are drawn."""
    rig, admin, maas_sim = safety
    bridge = LoopBridge(asyncio.get_running_loop(), STEP_TIMEOUT_S)
    shrink = os.environ.get("GPUCLOUD_SAFETY_SHRINK") == "1"

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate, *((Phase.shrink,) if shrink else ())),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(st.lists(STEP, min_size=STEPS, max_size=STEPS))
    def explore(steps: list[tuple[Any, ...]]) -> None:
        SafetyModel(bridge, rig, admin, maas_sim).run(steps)

    await asyncio.to_thread(explore)


async def replay(safety: Any, steps: list[tuple[Any, ...]]) -> list[str]:
    """A regression test: one explicit step sequence on a fresh fleet; returns its trail."""
    rig, admin, maas_sim = safety
    bridge = LoopBridge(asyncio.get_running_loop(), STEP_TIMEOUT_S)

    def run() -> list[str]:
        model = SafetyModel(bridge, rig, admin, maas_sim)
        model.run(steps)
        trail: list[str] = model.world.log
        return trail

    return await asyncio.to_thread(run)


async def test_replay_unknown_bmcs_then_erasing_decommissions(safety: Any) -> None:
    """The BMC and erase invariants on a fixed sequence: the running stranger's onboarding is
    refused (and retried: still never cycled), the dark machine is discovered by a checked
    power-on, then a reimage and a full decommission with a quick erase must show the erase in
    the simulator's log."""
    await replay(
        safety,
        [
            ("onboard_unknown", 1),
            ("job", "retry", 0),
            ("onboard_unknown", 0),
            ("decommission", "reimage", "quick", 0),
            ("decommission", "full_decommission", "quick", 1),
            ("reconcile",),
        ],
    )


async def test_replay_mistyped_bmc_cancel_then_full_decommission(safety: Any) -> None:
    """The replay path, on a sequence the drawn ones reach rarely: a mistyped BMC (another live
    node's) refused, its job cancelled, then a full decommission of that other node and a
    reconcile, each step checked."""
    await replay(
        safety,
        [
            ("onboard_mistyped", 0),
            ("job", "cancel", 0),
            ("decommission", "full_decommission", "quick", 0),
            ("reconcile",),
        ],
    )


async def test_replay_vanished_machine_needs_the_operators_disk_record(safety: Any) -> None:
    """Both onboarded machines deleted from MAAS, then a full decommission: it cannot release
    the vanished machine; the disk record is refused while the job is not host_not_wiped, the
    adopt stops it with host_not_wiped, the record ends it reconciled with the node deleted,
    and a second record on the closed job is refused."""
    trail = await replay(
        safety,
        [
            ("fault", "delete", 0),
            ("fault", "delete", 1),
            ("decommission", "full_decommission", "quick", 0),
            ("disk_disposition", "destroyed", 0),
            ("job", "adopt", 0),
            ("disk_disposition", "wiped_out_of_band", 0),
            ("disk_disposition", "retained_quarantined", 0),
            ("reconcile",),
        ],
    )
    # The sequence reached the verb's every answer (a refusal, the record, the closed job).
    records = [line for line in trail if "record-disk-disposition(" in line]
    assert [r.split("): ")[1].split(" ")[0] for r in records] == ["409", "200", "409"], trail
    assert "reconciled" in records[1], trail
    assert "node deleted" in records[1], trail
