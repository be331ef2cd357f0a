"""The world the model-based safety suite (tests/test_safety_model.py, issue 35) drives: a small
fleet of MAAS-simulator machines under the onboarding/decommission rig, every operator verb sent
through the admin API, MAAS faults through the simulator's control API, agent deaths through the
first-boot simulator (`systemctl stop`), reconcile runs through `POST
/api/v1/admin/reconciliation/run`, and the invariants checked after every step, from what the
product itself wrote (nodes, bindings, job rows, stage events, audit) and what the MAAS simulator
counted (requests per machine and operation).

Nothing here inserts or updates a row or starts a lifecycle workflow by hand: the only write
besides the API calls is the site's reconciler schedule, made with the gateway's own
`sync_reconciler_schedule` as site creation makes it (the rig's site is made without it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from temporalio.client import Client

from contracts.decommission import HOST_NOT_WIPED, DiskDisposition, operator_disk_disposition
from contracts.maas_reconciler import reconciler_schedule_id
from schema.models import (
    AuditEntry,
    Node,
    NodeDecommission,
    NodeDecommissionEvent,
    NodeMaasState,
    NodeOnboarding,
    NodeOnboardingEvent,
)
from tests.decommission_fixtures import DecommissionRig
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU

REASON = "model-based safety suite (issue 35)"
SETTLED = frozenset(
    {"completed", "reconciled", "cancelled", "failed_manual_intervention", "failed_retryable"}
)
FAILED = frozenset({"failed_manual_intervention", "failed_retryable"})
# MAAS operations (as the simulator counts them) that change or destroy a machine.
DESTRUCTIVE = ("release", "power_off", "delete", "deploy", "erase", "abort")
DEPLOYS_PER_RUN = 2  # a deploy and, per site policy, max_deploy_retry_attempts = 1 redeploy
LIVE_NODE = ("deleted",)  # statuses of nodes that are not live


class SafetyViolation(AssertionError):
    """An invariant of issue 35 broken after a step."""


def fleet_machines(example: int, size: int) -> list[tuple[str, str]]:
    """Example `example`'s machines (hostname, BMC address): its own, so no node of an earlier
    example is bound to one of them."""
    subnet = 40 + example % 200
    return [(f"sf{example}-{i}", f"10.177.{subnet}.{10 + i}") for i in range(size)]


def unknown_machines(example: int) -> list[tuple[str, str, str]]:
    """Example `example`'s machines MAAS does not know (hostname, BMC address, chassis power):
    a new one, off, that discovery may power-cycle; and a host running outside MAAS, that it
    must not."""
    subnet = 40 + example % 200
    return [(f"sf{example}-dark", f"10.177.{subnet}.30", "off"),
            (f"sf{example}-stranger", f"10.177.{subnet}.31", "on")]  # fmt: skip


def fleet_scenario(examples: int, size: int) -> dict[str, Any]:
    """One scenario holding every example's machines: the simulator is not reset between
    examples, so an earlier example's nodes keep their machines (a reconcile of the site sees
    no machine vanish that no step removed, and is not refused for it)."""
    return sim_scenario(
        *(sim_machine(h, ip) for e in range(1, examples + 1) for h, ip in fleet_machines(e, size)),
        *(
            sim_machine(h, ip, enlisted=False, power=power)
            for e in range(1, examples + 1)
            for h, ip, power in unknown_machines(e)
        ),
    )


@dataclass
class Snapshot:
    """What the invariants compare across a step."""

    counters: dict[str, dict[str, int]]
    bindings: dict[str, str]  # system_id -> live node_id
    node_status: dict[str, str]  # node_id -> status
    live_jobs: set[str]  # node_ids with a decommission/onboarding job not settled
    bmc_requests: int = 0  # how many BMC requests the simulator had logged
    machine_status: dict[str, str] = field(default_factory=dict)  # system_id -> MAAS status
    at_bmc: dict[str, list[str]] = field(default_factory=dict)  # BMC address -> system_ids


@dataclass
class SafetyWorld:
    rig: DecommissionRig
    admin: Any
    maas_sim: Any
    example: int
    machines: list[tuple[str, str]]
    log: list[str] = field(default_factory=list)
    # node_id -> hostname, for the nodes this example onboarded
    nodes: dict[str, str] = field(default_factory=dict)
    onboardings: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (node, host)
    decommissions: dict[str, str] = field(default_factory=dict)  # id -> node_id
    # physical machine (scenario hostname) -> job runs so far that may legitimately deploy it
    deploy_credit: dict[str, int] = field(default_factory=dict)
    physical: dict[str, str] = field(default_factory=dict)  # node_id -> scenario hostname
    checked_jobs: set[str] = field(default_factory=set)
    typos: int = 0
    unknown: list[tuple[str, str]] = field(default_factory=list)  # (hostname, BMC) not in MAAS
    # decommission id -> how many erasures the simulator had logged when it was submitted
    erase_mark: dict[str, int] = field(default_factory=dict)
    # decommission id -> (its machine, MAAS releases of it the simulator had counted at submission)
    release_mark: dict[str, tuple[str | None, int]] = field(default_factory=dict)
    # what a verb saw the product answer against its contract (checked with the invariants)
    verb_problems: list[str] = field(default_factory=list)

    @property
    def sessions(self) -> Any:
        return self.rig.sessions

    @property
    def site_id(self) -> uuid.UUID:
        return self.rig.onboarding.site_id

    # --- reads -----------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        counters = (await self.maas_sim.counters())["machines"]
        async with self.sessions() as session:
            rows = (
                await session.execute(
                    select(NodeMaasState.maas_system_id, Node.id, Node.status).join(
                        Node, Node.id == NodeMaasState.node_id
                    )
                )
            ).all()
            statuses = {
                str(i): str(s)
                for i, s in (
                    await session.execute(
                        select(Node.id, Node.status).where(
                            Node.id.in_([uuid.UUID(n) for n in self.nodes] or [uuid.uuid4()])
                        )
                    )
                ).all()
            }
            live_dec = await session.scalars(
                select(NodeDecommission.node_id).where(NodeDecommission.status.not_in(SETTLED))
            )
            live_onb = await session.scalars(
                select(NodeOnboarding.node_id).where(NodeOnboarding.status.not_in(SETTLED))
            )
            live = {str(n) for n in [*live_dec, *live_onb] if n is not None}
        bindings = {str(sid): str(nid) for sid, nid, st in rows if sid and st not in LIVE_NODE}
        state = await self.maas_sim.state()
        return Snapshot(
            counters,
            bindings,
            statuses,
            live,
            bmc_requests=len(await self.maas_sim.bmc_log()),
            machine_status={m["system_id"]: m["status_name"] for m in state["machines"]},
            at_bmc={h["bmc_address"]: list(h["in_maas"]) for h in state["hardware"]},
        )

    async def node_status(self, node_id: str) -> str | None:
        async with self.sessions() as session:
            node = await session.get(Node, uuid.UUID(node_id))
            return None if node is None else str(node.status)

    async def system_id(self, node_id: str) -> str | None:
        async with self.sessions() as session:
            binding = await session.get(NodeMaasState, uuid.UUID(node_id))
            return None if binding is None else binding.maas_system_id

    async def failed_jobs(self) -> list[tuple[str, str, str]]:
        """(kind, job id, node id) of this example's jobs that are failed now."""
        out: list[tuple[str, str, str]] = []
        async with self.sessions() as session:
            for oid, (node_id, _) in self.onboardings.items():
                row = await session.get(NodeOnboarding, uuid.UUID(oid))
                if row is not None and row.status in FAILED:
                    out.append(("onboarding", oid, node_id))
            for did, node_id in self.decommissions.items():
                drow = await session.get(NodeDecommission, uuid.UUID(did))
                if drow is not None and drow.status in FAILED:
                    out.append(("decommission", did, node_id))
        return sorted(out)

    def decommission_jobs(self) -> list[tuple[str, str]]:
        """(job id, node id) of every decommission of this example, in any state."""
        return sorted(self.decommissions.items())

    async def _decommission_facts(self, did: str) -> dict[str, Any]:
        """What record-disk-disposition may change: the job's state and failure, its disk
        record and its node."""
        async with self.sessions() as session:
            row = await session.get(NodeDecommission, uuid.UUID(did))
            assert row is not None
            facts = {
                "status": row.status,
                "error_code": row.error_code,
                "stage": row.current_stage,
                "followups": list(row.followups or []),
            }
        facts["node"] = await self.node_status(self.decommissions[did])
        return facts

    # --- waits (bounded; a wait that runs out is logged, never a failure of its own) -------

    async def _until(self, what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            if time.monotonic() > deadline:
                self.log.append(f"    (not settled within {timeout:.0f}s: {what})")
                return
            await asyncio.sleep(0.2)

    async def settle_onboarding(self, onboarding_id: str, timeout: float = 90.0) -> str:
        async def done() -> bool:
            async with self.sessions() as session:
                row = await session.get(NodeOnboarding, uuid.UUID(onboarding_id))
                return row is not None and row.status in SETTLED

        await self._until(f"onboarding {onboarding_id[:8]}", done, timeout)
        async with self.sessions() as session:
            row = await session.get(NodeOnboarding, uuid.UUID(onboarding_id))
            assert row is not None
            return f"{row.status}@{row.current_stage} {row.error_code or ''}".strip()

    async def settle_decommission(self, decommission_id: str, timeout: float = 90.0) -> str:
        async def done() -> bool:
            async with self.sessions() as session:
                row = await session.get(NodeDecommission, uuid.UUID(decommission_id))
                return row is not None and row.status in SETTLED

        await self._until(f"decommission {decommission_id[:8]}", done, timeout)
        async with self.sessions() as session:
            row = await session.get(NodeDecommission, uuid.UUID(decommission_id))
            assert row is not None
            return f"{row.status}@{row.current_stage} {row.error_code or ''}".strip()

    async def settle_drain(self, node_id: str, timeout: float = 30.0) -> str:
        async def done() -> bool:
            return await self.node_status(node_id) != "draining"

        await self._until(f"drain of {node_id[:8]}", done, timeout)
        return str(await self.node_status(node_id))

    async def settle_all(self, timeout: float = 60.0) -> None:
        """Every job of this example settled (an action may send one back to work)."""
        for oid in self.onboardings:
            await self.settle_onboarding(oid, timeout)
        for did in self.decommissions:
            await self.settle_decommission(did, timeout)

    # --- verbs (the admin API) -------------------------------------------------------------

    async def onboard(self, hostname: str, bmc: str) -> str:
        response = await self.admin.post(
            "/api/v1/admin/onboardings",
            json={
                "site_id": str(self.site_id),
                "profile_id": str(self.rig.onboarding.profile_id),
                "sku_id": ONBOARD_SKU,
                "hostname": hostname,
                "ipmi_ip": bmc,
            },
        )
        if response.status_code != 201:
            return f"refused {response.status_code} {response.json()['error']['code']}"
        body = response.json()
        oid, node_id = body["onboarding_id"], body["node_id"]
        self.onboardings[oid] = (node_id, hostname)
        self.nodes[node_id] = hostname
        if (hostname, bmc) in self.machines or (hostname, bmc) in self.unknown:
            self.physical[node_id] = hostname
            self.grant_deploy(node_id)
        from tests.onboarding_fixtures import Job

        self.rig.onboarding.jobs.append(Job(oid, node_id, hostname))  # ended at teardown
        return f"{oid[:8]} {await self.settle_onboarding(oid)}"

    async def node_verb(self, node_id: str, verb: str) -> str:
        response = await self.admin.post(
            f"/api/v1/admin/nodes/{node_id}/{verb}", json={"reason": REASON}
        )
        code = response.status_code
        if code >= 400:
            return f"{code} {response.json()['error']['code']}"
        if verb == "retire":
            return f"{code} → {await self.settle_drain(node_id)}"
        if verb == "resume":
            body = response.json()
            if body.get("decommission_id"):
                self.grant_deploy(node_id)
                return f"{code} → {await self.settle_decommission(body['decommission_id'])}"
            return f"{code} → {await self.settle_drain(node_id)}"
        return f"{code} → {await self.node_status(node_id)}"

    async def decommission(self, node_id: str, mode: str, erase: str) -> str:
        body: dict[str, Any] = {"mode": mode, "reason": REASON}
        if mode != "soft_reset":
            body["erase"] = erase
        erasures = len(await self.maas_sim.erasures())
        sid = await self.system_id(node_id)
        releases = (await self.maas_sim.counters())["machines"].get(sid or "", {})
        response = await self.admin.post(f"/api/v1/admin/nodes/{node_id}/decommission", json=body)
        if response.status_code >= 400:
            return f"{response.status_code} {response.json()['error']['code']}"
        did = response.json()["decommission_id"]
        self.erase_mark.setdefault(did, erasures)
        self.release_mark.setdefault(did, (sid, releases.get("machine.release", 0)))
        if mode == "reimage":
            self.grant_deploy(node_id)
        if did not in self.decommissions:
            self.decommissions[did] = node_id
            self.rig.track(did, node_id, mode)
        return f"{did[:8]} {await self.settle_decommission(did)}"

    async def job_action(self, kind: str, job_id: str, action: str) -> str:
        base = "onboardings" if kind == "onboarding" else "decommissions"
        response = await self.admin.post(
            f"/api/v1/admin/{base}/{job_id}/{action}", json={"reason": REASON}
        )
        if response.status_code >= 400:
            return f"{response.status_code} {response.json()['error']['code']}"
        if action in ("retry", "resume", "rerun", "restart-clean"):
            node_id = (
                self.onboardings[job_id][0] if kind == "onboarding" else self.decommissions[job_id]
            )
            self.grant_deploy(node_id)
        await asyncio.sleep(0.5)  # let the workflow take the action before waiting on its row
        if kind == "onboarding":
            return f"200 → {await self.settle_onboarding(job_id)}"
        return f"200 → {await self.settle_decommission(job_id)}"

    async def record_disk_disposition(self, did: str, disposition: str) -> str:
        """The operator's record of where a vanished machine's disks went. Taken only while
        the job stands failed_manual_intervention with host_not_wiped: then it ends reconciled,
        the node deleted and the record in the followups; anywhere else it is refused with 409
        and changes nothing."""
        before = await self._decommission_facts(did)
        reference = f"model-{did[:8]}"
        response = await self.admin.post(
            f"/api/v1/admin/decommissions/{did}/record-disk-disposition",
            json={"disposition": disposition, "reason": REASON, "reference": reference},
        )
        code = response.status_code
        what = f"record-disk-disposition on {did[:8]} ({before['status']} {before['error_code']})"
        standing = (
            before["status"] == "failed_manual_intervention"
            and before["error_code"] == HOST_NOT_WIPED
        )
        if not standing:
            after = await self._decommission_facts(did)
            if code != 409:
                self.verb_problems.append(f"{what} answered {code}, not 409: {response.text}")
            settled = before["status"] in SETTLED
            if operator_disk_disposition(after["followups"]) is not None and (
                operator_disk_disposition(before["followups"]) is None
            ):
                self.verb_problems.append(f"{what} refused, yet the record was kept")
            if settled and after != before:
                self.verb_problems.append(f"{what} refused, yet changed {before} → {after}")
            return f"{code} {response.json()['error']['code'] if code >= 400 else ''}".strip()
        if code != 200:
            self.verb_problems.append(f"{what}: refused {code} {response.text}")
            return f"{code}"
        await asyncio.sleep(0.5)  # let the workflow take the action before waiting on its row
        outcome = await self.settle_decommission(did)
        after = await self._decommission_facts(did)
        kept = operator_disk_disposition(after["followups"])
        if after["status"] != "reconciled" or after["node"] != "deleted":
            self.verb_problems.append(
                f"{what} taken: the job ended {after['status']} with the node {after['node']}, "
                "not reconciled/deleted"
            )
        if kept is None or (kept["disposition"], kept.get("reference"), kept.get("source")) != (
            disposition,
            reference,
            "operator",
        ):
            self.verb_problems.append(f"{what} taken: the followups keep {kept}")
        return f"200 → {outcome}, node {after['node']}"

    async def reconcile(self, client: Client) -> str:
        handle = client.get_schedule_handle(reconciler_schedule_id(str(self.site_id)))
        before = (await handle.describe()).info.num_actions
        response = await self.admin.post(
            "/api/v1/admin/reconciliation/run", json={"site_id": str(self.site_id)}
        )
        if response.status_code != 202:
            return f"{response.status_code} {response.text[:80]}"

        async def ran() -> bool:
            info = (await handle.describe()).info
            return info.num_actions > before and not info.running_actions

        await self._until("reconcile run", ran, 30.0)
        status = (await self.admin.get("/api/v1/admin/reconciliation/status")).json()
        return f"202 → drifted={status.get('drifted')} refused={len(status.get('refused', []))}"

    # --- invariants ------------------------------------------------------------------------

    def grant_deploy(self, node_id: str, runs: int = 1) -> None:
        host = self.physical.get(node_id)
        if host:
            self.deploy_credit[host] = self.deploy_credit.get(host, 0) + runs

    async def check(self, before: Snapshot, after: Snapshot, allowed: set[str], step: str) -> None:
        problems: list[str] = self.verb_problems
        self.verb_problems = []
        problems += self._foreign_operations(before, after, allowed)
        problems += await self._activation_proofs(before, after)
        problems += await self._decommission_outcomes()
        problems += await self._enabled_by_decommission()
        problems += await self._deploys(after)
        problems += await self._power_actions(before)
        problems += await self._erases_observed()
        problems += await self._vanished_machines_recorded()
        if problems:
            trail = "\n".join(self.log)
            raise SafetyViolation(f"after {step}:\n  " + "\n  ".join(problems) + f"\n{trail}")

    def _foreign_operations(
        self, before: Snapshot, after: Snapshot, allowed: set[str]
    ) -> list[str]:
        """No release/erase/power-off/delete/deploy of a machine bound to a live node other than
        the one(s) the step's verb or a still-running job was for."""
        out: list[str] = []
        permitted = allowed | before.live_jobs
        for sid, ops in after.counters.items():
            owner = before.bindings.get(sid)
            if owner is None or owner in permitted:
                continue
            old = before.counters.get(sid, {})
            for op, n in ops.items():
                if any(d in op for d in DESTRUCTIVE) and n > old.get(op, 0):
                    out.append(
                        f"{op} x{n - old.get(op, 0)} on machine {sid}, bound to live node "
                        f"{owner} ({self.nodes.get(owner, '?')}); the step was for {allowed}"
                    )
        return out

    async def _activation_proofs(self, before: Snapshot, after: Snapshot) -> list[str]:
        """No node `active` without a health proof or validate_clean in the run enabling it."""
        out: list[str] = []
        for node_id, status in after.node_status.items():
            if status != "active" or before.node_status.get(node_id) == "active":
                continue
            proof = await self._proof(node_id)
            if proof is None:
                out.append(
                    f"node {node_id} ({self.nodes.get(node_id)}) became active "
                    f"(was {before.node_status.get(node_id)}) with no health proof or "
                    "validate_clean pass in the run that enabled it"
                )
            else:
                self.log.append(f"    {self.nodes.get(node_id)} active by {proof}")
        return out

    async def _proof(self, node_id: str) -> str | None:
        async with self.sessions() as session:
            found: str | None = None
            # A reactivation (node.reactivate audit with what was observed now).
            for audit in await session.scalars(
                select(AuditEntry)
                .where(AuditEntry.target_id == node_id, AuditEntry.action == "node.reactivate")
                .order_by(AuditEntry.id)
            ):
                d = audit.details or {}
                if (
                    d.get("maas_status") == "Deployed"
                    and d.get("power_state") == "on"
                    and d.get("agent_seen_at") is not None
                ):
                    found = "reactivate (MAAS Deployed+on, agent answered)"
            # An onboarding whose last enrollment wait succeeded after its last failure.
            for row in await session.scalars(
                select(NodeOnboarding).where(NodeOnboarding.node_id == uuid.UUID(node_id))
            ):
                events = list(
                    await session.scalars(
                        select(NodeOnboardingEvent)
                        .where(NodeOnboardingEvent.onboarding_id == row.onboarding_id)
                        .order_by(NodeOnboardingEvent.occurred_at)
                    )
                )
                if row.status == "completed" and _proved(events, "wait_for_agent_enrollment"):
                    found = found or "onboarding (agent enrolled in this run)"
            # A soft_reset/reimage whose validate_clean passed after its last failure.
            for drow in await session.scalars(
                select(NodeDecommission).where(NodeDecommission.node_id == uuid.UUID(node_id))
            ):
                if drow.status not in ("completed", "reconciled"):
                    continue
                devents = list(
                    await session.scalars(
                        select(NodeDecommissionEvent)
                        .where(NodeDecommissionEvent.decommission_id == drow.decommission_id)
                        .order_by(NodeDecommissionEvent.occurred_at)
                    )
                )
                proof = _ENABLE_PROOF.get(drow.mode, "validate_clean_node")
                if _proved(devents, proof):
                    found = found or f"{drow.mode} ({proof} passed in this run)"
            return found

    async def _enabled_by_decommission(self) -> list[str]:
        """A soft_reset or reimage that ended completed/reconciled with its node active (it went
        draining and back within the step) passed validate_clean in its run."""
        out: list[str] = []
        async with self.sessions() as session:
            for did, node_id in self.decommissions.items():
                if f"enable:{did}" in self.checked_jobs:
                    continue
                row = await session.get(NodeDecommission, uuid.UUID(did))
                if row is None or row.mode == "full_decommission":
                    continue
                if row.status not in ("completed", "reconciled"):
                    continue
                self.checked_jobs.add(f"enable:{did}")
                if await self.node_status(node_id) != "active":
                    continue
                events = list(
                    await session.scalars(
                        select(NodeDecommissionEvent)
                        .where(NodeDecommissionEvent.decommission_id == row.decommission_id)
                        .order_by(NodeDecommissionEvent.occurred_at)
                    )
                )
                proof = _ENABLE_PROOF.get(row.mode, "validate_clean_node")
                if not _proved(events, proof):
                    out.append(
                        f"{row.mode} {did} {row.status} enabled {self.nodes.get(node_id)} "
                        f"without a {proof} pass in its run"
                    )
                else:
                    self.log.append(f"    {self.nodes.get(node_id)} re-enabled by {row.mode}")
        return out

    async def _decommission_outcomes(self) -> list[str]:
        """A full decommission ends completed/reconciled only with the machine released and off
        (or gone with the MAAS record removed by the job) and the agent gone, unless the job
        states what was not done."""
        out: list[str] = []
        machines = {m["system_id"]: m for m in (await self.maas_sim.state())["machines"]}
        async with self.sessions() as session:
            for did in self.decommissions:
                if did in self.checked_jobs:
                    continue
                row = await session.get(NodeDecommission, uuid.UUID(did))
                if row is None or row.status not in ("completed", "reconciled"):
                    continue
                self.checked_jobs.add(did)
                if row.mode != "full_decommission":
                    continue
                machine = machines.get(row.maas_system_id or "")
                operator = operator_disk_disposition(row.followups or [])
                if operator is not None:
                    if operator["disposition"] not in {d.value for d in DiskDisposition} or not (
                        operator.get("recorded_by") and operator.get("recorded_reason")
                    ):
                        out.append(f"full_decommission {did}: operator record {operator}")
                    continue  # the host work is the operator's word, not this job's
                details = row.error_details or {}
                if details.get("host_not_wiped") or details.get("not_done"):
                    continue
                hostname = self.nodes.get(str(row.node_id), row.hostname or "")
                record = self.rig.onboarding.first_boot.booted.get(hostname)
                agent = record is not None and record.agent_running
                if machine is None:
                    if not row.remove_maas_record:
                        out.append(
                            f"full_decommission {did} {row.status} but machine "
                            f"{row.maas_system_id} vanished from MAAS and the job does not say "
                            "what was not done (host_not_wiped)"
                        )
                elif machine["status_name"] not in ("Ready",) or machine["power_state"] != "off":
                    out.append(
                        f"full_decommission {did} {row.status} with machine "
                        f"{row.maas_system_id} {machine['status_name']}/{machine['power_state']}"
                    )
                if agent:
                    out.append(f"full_decommission {did} {row.status} with {hostname}'s agent live")
        return out

    async def _vanished_machines_recorded(self) -> list[str]:
        """No full decommission whose machine vanished from MAAS unreleased ends
        completed/reconciled, or leaves its node deleted, without the operator's
        record-disk-disposition in its followups. Vanished: the job says so (host_not_wiped,
        `machine_vanished`), or the machine is gone from the simulator and the job neither
        removed it nor recorded a release of it."""
        out: list[str] = []
        present = {m["system_id"] for m in (await self.maas_sim.state())["machines"]}
        counters = (await self.maas_sim.counters())["machines"]
        async with self.sessions() as session:
            for did, node_id in self.decommissions.items():
                if f"vanished:{did}" in self.checked_jobs:
                    continue
                row = await session.get(NodeDecommission, uuid.UUID(did))
                if row is None or row.mode != "full_decommission":
                    continue
                node = await self.node_status(node_id)
                if row.status not in ("completed", "reconciled") and node != "deleted":
                    continue
                self.checked_jobs.add(f"vanished:{did}")
                sid, mark = self.release_mark.get(did, (row.maas_system_id, 0))
                sid = row.maas_system_id or sid
                released = counters.get(sid or "", {}).get("machine.release", 0) > mark
                # Gone from MAAS, and MAAS never released it for this job (the simulator's
                # count, not the job's word), nor did the job remove it.
                unreleased = bool(sid) and sid not in present and not released
                recorded = operator_disk_disposition(row.followups or [])
                if _vanished(row, unreleased) and recorded is None:
                    out.append(
                        f"full_decommission {did[:8]} of {self.nodes.get(node_id)} ended "
                        f"{row.status} with the node {node}, but its machine "
                        f"{row.maas_system_id} vanished from MAAS unreleased and no operator "
                        f"recorded where its disks went (followups: {row.followups})"
                    )
        return out

    async def _deploys(self, after: Snapshot) -> list[str]:
        """No machine deployed more often than the job runs that may deploy it allow (an
        onboarding or reimage and each operator retry/resume of one, DEPLOYS_PER_RUN each)."""
        out: list[str] = []
        physical = {
            m["system_id"]: m["scenario_hostname"]
            for m in (await self.maas_sim.state())["machines"]
        }
        ours = {h for h, _ in self.machines}
        for sid, ops in after.counters.items():
            host = physical.get(sid)
            if host not in ours:
                continue
            n = ops.get("machine.deploy", 0)
            bound = self.deploy_credit.get(str(host), 0) * DEPLOYS_PER_RUN
            if n > bound:
                out.append(
                    f"machine {sid} ({host}) deployed {n} times; the runs so far allow {bound}"
                )
        return out

    async def _power_actions(self, before: Snapshot) -> list[str]:
        """No BMC powered (cycle or on) during the step without this product's recorded BMC
        check of that address, nor one whose machine was, before the step, bound to a live
        node or Deployed/Allocated/Deploying in MAAS. What was powered is the simulator's BMC
        log, not the product's word."""
        out: list[str] = []
        for request in (await self.maas_sim.bmc_log())[before.bmc_requests :]:
            if request["action"] not in BMC_POWER_ACTIONS:
                continue
            address = request["address"]
            for sid in before.at_bmc.get(address, []):
                owner = before.bindings.get(sid)
                if owner is not None:
                    out.append(
                        f"BMC {address} powered ({request['action']}) while its machine {sid} "
                        f"was bound to live node {owner} ({self.nodes.get(owner, '?')})"
                    )
                if before.machine_status.get(sid) in IN_USE_IN_MAAS:
                    out.append(
                        f"BMC {address} powered ({request['action']}) while its machine {sid} "
                        f"was {before.machine_status[sid]} in MAAS"
                    )
            if not await self._bmc_checked(address):
                out.append(
                    f"BMC {address} powered ({request['action']}) with no BMC check recorded "
                    "by an onboarding of this example"
                )
        return out

    async def _bmc_checked(self, address: str) -> bool:
        ids = [uuid.UUID(o) for o in self.onboardings] or [uuid.uuid4()]
        async with self.sessions() as session:
            events = await session.scalars(
                select(NodeOnboardingEvent).where(
                    NodeOnboardingEvent.onboarding_id.in_(ids),
                    NodeOnboardingEvent.stage == "create_or_find_in_maas",
                )
            )
            return any(
                (e.details or {}).get("bmc_check", {}).get("address") == address
                and (e.details or {}).get("bmc_check", {}).get("verdict") == "ok"
                for e in events
            )

    async def _erases_observed(self) -> list[str]:
        """No node deleted by a full decommission, or enabled again by a reimage, that asked
        for an erase, unless the simulator saw that erase done on the job's machine after the
        job was submitted; or the job's disk disposition says it was not erased because the
        erase failed (and the simulator saw it fail) and the site allows the no-erase release.
        A disposition `erased` must agree with the simulator too."""
        out: list[str] = []
        erasures = await self.maas_sim.erasures()
        async with self.sessions() as session:
            for did, node_id in self.decommissions.items():
                if f"erase:{did}" in self.checked_jobs:
                    continue
                row = await session.get(NodeDecommission, uuid.UUID(did))
                if row is None or row.mode not in ("full_decommission", "reimage"):
                    continue
                if row.status not in ("completed", "reconciled"):
                    continue
                node = await self.node_status(node_id)
                if node != ("deleted" if row.mode == "full_decommission" else "active"):
                    continue
                self.checked_jobs.add(f"erase:{did}")
                if operator_disk_disposition(row.followups or []) is not None:
                    continue  # a vanished machine: _vanished_machines_recorded checks the record
                disposition = next(
                    (f for f in row.followups or [] if f.get("kind") == "disk_disposition"), None
                )
                seen = [
                    e
                    for e in erasures[self.erase_mark.get(did, 0) :]
                    if e["system_id"] == row.maas_system_id
                ]
                erased = [e for e in seen if e["outcome"] == "erased" and e["method"] == row.erase]
                what = f"{row.mode} {did[:8]} of {self.nodes.get(node_id)} ({row.status}, {node})"
                if disposition is not None and disposition["disposition"] == "erased":
                    if not erased:
                        out.append(f"{what} records disks erased; MAAS never erased them")
                    continue
                if row.erase == "none":
                    if disposition is None and row.maas_system_id:
                        out.append(f"{what}: no disk disposition recorded")
                    continue
                if erased:
                    out.append(f"{what}: erased, but no disk disposition says so")
                elif (
                    disposition is not None
                    and disposition.get("reason") == "erase_failed_fallback"
                    and any(e["outcome"] == "failed" for e in seen)
                ):
                    continue
                else:
                    out.append(
                        f"{what} asked for a {row.erase} erase; MAAS erased nothing since the "
                        f"job began (disposition: {disposition})"
                    )
        return out


BMC_POWER_ACTIONS = ("cycle", "on")
# What proves a node healthy when a decommission enables it again: a reimage has no
# validate_clean (the OS is new); its proof is the fresh agent's enrollment in the run.
_ENABLE_PROOF = {"reimage": "wait_for_agent_enrollment"}
IN_USE_IN_MAAS = ("Deployed", "Allocated", "Deploying")


def _vanished(row: NodeDecommission, unreleased: bool) -> bool:
    """Whether a full decommission's machine left MAAS before the job released it: the job
    says so, or the machine is gone with no release the simulator counted (`unreleased`) and
    no removal by the job."""
    details = row.error_details or {}
    said = [f for f in row.followups or [] if f.get("kind") == "disk_disposition"]
    said += [details["disk_disposition"]] if "disk_disposition" in details else []
    if row.error_code == HOST_NOT_WIPED or details.get("host_not_wiped"):
        return True
    if any(d.get("reason") == "machine_vanished" for d in said):
        return True
    return unreleased and not row.remove_maas_record


def _proved(events: list[Any], stage: str) -> bool:
    """`stage` succeeded in the run, after its last failure or skip (an adopt or a retry that
    skipped it does not count)."""
    ok = False
    for event in events:
        if event.stage != stage:
            continue
        if event.status == "succeeded":
            ok = True
        elif event.status in ("failed", "skipped", "compensated"):
            ok = False
    return ok
