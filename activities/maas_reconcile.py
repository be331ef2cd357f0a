"""The MAAS site reconciler (docs/lifecycles/node.md#drift-with-maas): one pass compares what a MAAS
region says about its machines with the GPUaaS nodes bound to them (node_maas_state) and applies the
§6.4 rules.

One pass is: the site row with its policy (1 query), its API token from Vault (read now, so a
rotated token is used by the next run), ONE `GET machines/`, the site's bindings joined with their
nodes (1 query), the check that the list can be whole (`judge_list`, below), then a pure
decision per binding (`decide`), the few MAAS actions (release + power off of retired
nodes), and batched writes: node status changes as one compare-and-set statement per chunk
through the one transition function (node_lifecycle.transition_nodes: each node moved only from
the status it was decided on, with its `node.status_changed` event), host updates
likewise, drift events as one multi-row INSERT, node_maas_state as one UPDATE, all of a chunk in
one transaction. Round trips do not grow with the number of machines (except per CHUNK rows).

Rules as implemented (node status → MAAS status → rule, severity, action):

    active|offline  absent from MAAS                machine_deleted            CRITICAL quarantine
    active|offline  Ready, Releasing, Disk erasing, released_outside_workflow  CRITICAL quarantine
                    Allocated, Reserved, New
    active|offline  Deploying                       redeployed_outside_workflow CRITICAL quarantine
    active|offline  Failed * / Broken               hardware_failure           CRITICAL quarantine
    active|offline  Commissioning, Testing          recommissioning            WARN
    active|offline  Missing, Retired, rescue modes  unexpected_maas_status     WARN
    offline         Deployed                        deployed_offline           WARN (agent issue)
    active          Deployed, host not in its IPs   ip_changed                 INFO host updated
    active|offline  Deployed, no host yet           (none: host set, no drift)
    active          Deployed, power off             deployed_powered_off       WARN (§6.2 row)
    active          Deployed, enable_hw_sync on,    hw_sync_stale              WARN, re-seed
                    no sync in 1.5 * sync_interval                             (below)
                    (only where the site requires hardware sync and MAAS shows the sync fields)
    active          Deployed                        ok
    active|offline  Ready, Releasing, …, and the    released_by_reconciler     WARN (no quarantine)
                    reconciler released it itself
                    (node_maas_state.drift_details.released_by)
    retired         Deployed                        (none: retire leaves the machine alone)
    retired         Deployed, site policy           retired_cleanup            INFO release+off
                    release_retired_machines on,
                    and a fresh observation agrees (below)
    any             machine with no binding         unmanaged (counted only)   DEBUG, no row
    bootstrap_issued|enrolling|draining|removing|deleted: owned by an in-flight onboarding or
                    decommission (or gone): observation recorded, no rule, no action.
    quarantined:    observation recorded; its drift stays open until an admin resolves it.

Quarantine sets nodes.status only: allocations are NOT released (§6.4: alert the admin first).
One run quarantines at most `reconcile_max_quarantine` nodes (site policy, default 10): a run whose
decisions would quarantine more quarantines none and changes nothing else (no MAAS action, no
write), and records a refused reconcile (`reconcile_suspect`, reason `quarantine_cap`, CRITICAL):
a rack-wide power event or a MAAS-side mass change is for an admin to look at, not for the
reconciler to act on node by node.

Retired nodes (issue 35): retire leaves the MAAS machine alone. Only where the site policy says
so (`release_retired_machines`) does the reconciler release and power off a retired node's
Deployed machine, and only after a fresh observation agrees, read right before the release: the
node is still `retired`, not `protected`, still bound to that machine, and MAAS (a fresh GET of
the machine, not the list) still shows it Deployed. Whatever it then does it records as its own:
the node_maas_state row gets the machine's status AFTER the action (read again from MAAS), and
drift_details.released_by = "maas_reconciler"; a later run that finds that machine released under
a node that is active again says `released_by_reconciler` (WARN), never quarantines the node for a
release the product made itself. The marker is dropped once the machine is seen Deployed again.

Site-wide MAAS settings (issue 35): the reconciler is their one owner. Each run writes the site's
CURRENT policy value of MAAS's global `hardware_sync_interval` (read in the same run) when MAAS
holds another; onboarding no longer writes it (each onboarding wrote the value it had loaded at
its start, so the last job to run won, whatever the site said by then).

A machines list that cannot be whole is not acted on (`judge_list`): the list request failed (a
MaasError after the client's retries, or an answer it cannot read), the list is empty while the
site has bound nodes, or more of the bound active/offline nodes' machines are missing than the
policy allows (`reconcile_max_missing_share` of them, default 10 %, and always at least one, so
that a single real deletion on a small site still meets the machine_deleted row). Such a run
records one `reconcile_suspect` alert (CRITICAL, a `maas.reconcile_suspect` domain event on the
site: the alert is about the site's list, no node) and changes nothing else: no node status, no
host, no drift, no node_maas_state row. The next scheduled run looks again.

Host addresses: onboarding and reimage set nodes.host_address from the machine's deployed IPs
(activities/onboarding/maas_stages.py), so `ip_changed` means a real change: the host is no longer
among the machine's IPs. A node without a host yet (onboarded before that, or adopted) gets the
machine's first IP without any drift (`host_set`). Every applied IP change writes its drift event,
also while an earlier ip_changed drift is still open.

Drift bookkeeping (idempotent): an event row is written when a rule starts to match (no open drift,
or an open drift of another rule); while the same rule keeps matching nothing new is written. When
no rule matches any more and the node is not quarantined, the drift heals: drift_detected false,
drift_resolved_at set (ip_changed and retired_cleanup therefore heal on the next run, once MAAS
shows the fixed state). A compare-and-set that loses a race (the node changed status meanwhile)
writes neither event nor drift: the next run decides again.

Sync drift is acted on (§9.1 "whenever reconciliation detects sync drift on a deployed node"):
after the writes, one statement claims the open hw_sync_stale drift events that no run has
claimed yet (`reseed` absent from their details; at most MAX_RESEEDS_PER_RUN, the rest next run),
marking each `reseed.status` dispatched, with the host task's id, or skipped (the node is no
longer active, or no agent of it was ever heard from), and the claiming workflow run's id, in the
event and in node_maas_state. A retry of the pass (same run) gets back, unchanged, the claims an
earlier attempt committed before it failed and that have no outcome yet. The
dispatched ones are returned (`ReconcileResult.reseeds`): the workflow runs `node.hw_sync_reseed`
on each node's queue and writes the outcome back (`record_reseeds`). So a drift event is
re-seeded at most once, however many runs see it open; a failure is recorded, not retried; the
drift heals on the first run that finds the sync healthy again, and a later drift is a new event
with a re-seed of its own.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text, tuple_
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.cloud_init import HW_SYNC_INTERVAL_RANGE_MINUTES
from activities.maas.client import MaasClient
from activities.maas.errors import MaasError
from activities.maas.types import (
    SYNC_GRACE_FACTOR,
    Machine,
    MachineState,
    MachineStatus,
    PowerState,
)
from activities.node_lifecycle import transition_nodes
from contracts.host_tasks import NODE_HW_SYNC_RESEED
from contracts.maas_reconciler import (
    RECORD_RESEEDS_ACTIVITY,
    ReconcileInput,
    ReconcileResult,
    ReseedOutcomes,
    ReseedRequest,
    ReseedStatus,
)
from contracts.states import NodeStatus, node_transition_allowed
from core.redaction import redact
from core.secrets import SecretStore
from schema.models import DomainEvent, MaasSite, MaasSitePolicy, Node, NodeMaasState

log = logging.getLogger(__name__)

CHUNK = 1000  # rows per batched statement

CRITICAL, WARN, INFO, DEBUG = "CRITICAL", "WARN", "INFO", "DEBUG"

# The share of the bound active/offline nodes whose machines may be missing from one list before
# the list is suspect, when the site policy does not say (`reconcile_max_missing_share`).
DEFAULT_MAX_MISSING_SHARE = 0.10
SUSPECT_RULE = "reconcile_suspect"
SUSPECT_EVENT = "maas.reconcile_suspect"
SUSPECT_SAMPLE = 20  # missing system_ids named in the alert

# Nodes a running onboarding/decommission owns (docs/lifecycles/node.md#drift-with-maas): observed,
# never acted on.
IN_FLIGHT = frozenset(
    {
        NodeStatus.BOOTSTRAP_ISSUED,
        NodeStatus.ENROLLING,
        NodeStatus.DRAINING,
        NodeStatus.REMOVING,
        NodeStatus.DELETED,
    }
)
_WATCHED = frozenset({NodeStatus.ACTIVE, NodeStatus.OFFLINE})
RECONCILER_ACTOR = "maas_reconciler"  # who moved the node, in its node.status_changed events

_RELEASED = frozenset(
    {
        MachineStatus.READY,
        MachineStatus.RELEASING,
        MachineStatus.DISK_ERASING,
        MachineStatus.ALLOCATED,
        MachineStatus.RESERVED,
        MachineStatus.NEW,
    }
)
_RECOMMISSIONING = frozenset({MachineStatus.COMMISSIONING, MachineStatus.TESTING})


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    message: str
    quarantine: bool = False


MACHINE_DELETED = Rule("machine_deleted", CRITICAL, "machine deleted from MAAS", True)
RELEASED = Rule("released_outside_workflow", CRITICAL, "node released outside workflow", True)
REDEPLOYED = Rule("redeployed_outside_workflow", CRITICAL, "node redeployed outside workflow", True)
HARDWARE_FAILURE = Rule("hardware_failure", CRITICAL, "hardware failure detected", True)
RECOMMISSIONING = Rule("recommissioning", WARN, "node being recommissioned")
UNEXPECTED = Rule("unexpected_maas_status", WARN, "unexpected MAAS status for an active node")
DEPLOYED_OFFLINE = Rule("deployed_offline", WARN, "agent not polling")
POWERED_OFF = Rule("deployed_powered_off", WARN, "node powered off outside workflow")
IP_CHANGED = Rule("ip_changed", INFO, "IP change detected")
HW_SYNC_STALE = Rule("hw_sync_stale", WARN, "hardware sync enabled but MAAS has no recent sync")
# What the reconciler workflow does about it: §9.1 re-sync through the node's agent.
HW_SYNC_RESEED_ACTION = NODE_HW_SYNC_RESEED
# Re-seeds claimed by one run: a bounded fan-out of host tasks per workflow run.
MAX_RESEEDS_PER_RUN = 50
RETIRED_CLEANUP = Rule("retired_cleanup", INFO, "cleaning up retired node")
OWN_RELEASE = Rule(
    "released_by_reconciler",
    WARN,
    "machine released by the reconciler while the node was retired: re-onboard the node",
)
DEFAULT_MAX_QUARANTINE = 10  # nodes one run may quarantine, without a policy row
QUARANTINE_CAP_SAMPLE = 20  # node ids named in a quarantine_cap alert


@dataclass(frozen=True)
class Binding:
    node_id: uuid.UUID
    node_status: str
    host_address: str | None
    maas_system_id: str
    drift_detected: bool
    drift_rule: str | None
    # The machine's last release was the reconciler's own (a retired node's cleanup).
    own_release: bool = False


# A machine as the reconciler reads it: what a run lists (MachineState), or a whole Machine.
Listed = Machine | MachineState


@dataclass
class Decision:
    binding: Binding
    machine: Listed | None
    rule: Rule | None = None
    # The host address to write: a real change (rule ip_changed), or the first one a node
    # without a host gets (no rule: nothing drifted).
    new_host: str | None = None


@dataclass(frozen=True)
class SyncPolicy:
    """§9.1 as the reconciler checks it: whether the site requires hardware sync, and the
    site's interval (used when MAAS reports none for the machine)."""

    required: bool = True
    interval: dt.timedelta = dt.timedelta(minutes=15)

    @classmethod
    def of(cls, policy: MaasSitePolicy | None) -> SyncPolicy:
        if policy is None:
            return cls()
        return cls(
            required=bool(policy.require_hw_sync),
            interval=_timespan(policy.hardware_sync_interval) or dt.timedelta(minutes=15),
        )


def timer_minutes(interval: dt.timedelta) -> int:
    """An interval as the re-seeded timer takes it: whole minutes (rounded up), within the
    range node.hw_sync_reseed accepts."""
    low, high = HW_SYNC_INTERVAL_RANGE_MINUTES
    return min(max(-(-int(interval.total_seconds()) // 60), low), high)


def _timespan(value: str | None) -> dt.timedelta | None:
    """A "15m" / "900s" / "1h" span (the policy's format), None if it is not one."""
    if not value:
        return None
    text_value = value.strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600}.get(text_value[-1:])
    number = text_value[:-1] if unit else text_value
    if not number.isdigit():
        return None
    return dt.timedelta(seconds=int(number) * (unit or 1))


def sync_stale(machine: Listed, sync: SyncPolicy, now: dt.datetime) -> bool:
    """Sync drift: enable_hw_sync on, and no sync within MAAS's own health window (last_sync +
    1.5 * sync_interval, the site interval when MAAS reports none), or none at all. A MAAS
    build without the REST sync fields cannot show drift: never stale."""
    hw = machine.hardware_sync
    if not sync.required or not hw.available or not hw.enabled:
        return False
    if hw.last_sync is None:
        return True
    interval = hw.sync_interval or sync.interval
    last = hw.last_sync if hw.last_sync.tzinfo else hw.last_sync.replace(tzinfo=dt.UTC)
    return now > last + interval * SYNC_GRACE_FACTOR


def decide(
    binding: Binding,
    machine: Listed | None,
    *,
    sync: SyncPolicy | None = None,
    now: dt.datetime | None = None,
    release_retired: bool = False,
) -> Decision:
    """The §6.4 rule that matches one binding (pure: no I/O). A retired node's Deployed machine
    is a cleanup only where the site policy releases retired machines (`release_retired`)."""
    d = Decision(binding, machine)
    status = binding.node_status
    if status not in _WATCHED and status != NodeStatus.RETIRED:
        return d  # in flight, quarantined or gone: observe only
    if status == NodeStatus.RETIRED:
        if release_retired and machine is not None and machine.status == MachineStatus.DEPLOYED:
            d.rule = RETIRED_CLEANUP
        return d
    if machine is None:
        d.rule = MACHINE_DELETED
    elif machine.status == MachineStatus.DEPLOYED:
        ips = machine.ip_addresses
        if ips and binding.host_address is None:
            d.new_host = ips[0]  # first sight of its address: not a change
        if status == NodeStatus.OFFLINE:
            d.rule = DEPLOYED_OFFLINE
        elif ips and binding.host_address is not None and binding.host_address not in ips:
            d.rule, d.new_host = IP_CHANGED, ips[0]
        elif machine.power_state == PowerState.OFF:
            d.rule = POWERED_OFF
        elif sync_stale(machine, sync or SyncPolicy(), now or dt.datetime.now(dt.UTC)):
            d.rule = HW_SYNC_STALE
    elif machine.status in _RELEASED:
        d.rule = OWN_RELEASE if binding.own_release else RELEASED
    elif machine.status == MachineStatus.DEPLOYING:
        d.rule = REDEPLOYED
    elif machine.status.is_failure:
        d.rule = HARDWARE_FAILURE
    elif machine.status in _RECOMMISSIONING:
        d.rule = RECOMMISSIONING
    else:
        d.rule = UNEXPECTED
    return d


@dataclass(frozen=True)
class Suspicion:
    """Why a machines list is not acted on (`reason`: list_failed, empty_list, missing_share)."""

    reason: str
    message: str
    details: dict[str, Any]


def judge_list(
    bindings: Sequence[Binding],
    machines: Mapping[str, Listed],
    max_missing_share: float = DEFAULT_MAX_MISSING_SHARE,
) -> Suspicion | None:
    """None when the list can be whole; else why not (pure: no I/O). Counted against the bound
    nodes the machine_deleted row would quarantine (active, offline): a quarantined or retired
    node whose machine is long gone must not make every later list suspect."""
    live = [b for b in bindings if b.node_status != NodeStatus.DELETED]
    watched = [b for b in live if b.node_status in _WATCHED]
    missing = [b.maas_system_id for b in watched if b.maas_system_id not in machines]
    allowed = max(1, int(max_missing_share * len(watched)))
    details: dict[str, Any] = {
        "machines_listed": len(machines),
        "bound_nodes": len(live),
        "watched_nodes": len(watched),
        "missing": len(missing),
        "missing_allowed": allowed,
        "max_missing_share": max_missing_share,
        "missing_system_ids": sorted(missing)[:SUSPECT_SAMPLE],
    }
    if not machines and live:
        return Suspicion(
            "empty_list",
            f"MAAS listed no machines while {len(live)} node(s) are bound to the site",
            details,
        )
    if len(missing) > allowed:
        return Suspicion(
            "missing_share",
            f"{len(missing)} of {len(watched)} bound machines are missing from the MAAS list "
            f"(at most {allowed} may be, {max_missing_share:.0%})",
            details,
        )
    return None


def quarantine_cap(
    decisions: Sequence[Decision], max_quarantine: int = DEFAULT_MAX_QUARANTINE
) -> Suspicion | None:
    """None when the run's decisions quarantine at most `max_quarantine` nodes; else the
    refusal (pure: no I/O). Counted are the nodes the run would move to quarantined."""
    would = [d for d in decisions if _quarantines(d)]
    if len(would) <= max_quarantine:
        return None
    rules: dict[str, int] = {}
    for d in would:
        assert d.rule is not None
        rules[d.rule.name] = rules.get(d.rule.name, 0) + 1
    return Suspicion(
        "quarantine_cap",
        f"{len(would)} nodes would be quarantined in one run (at most {max_quarantine} may be)",
        {
            "would_quarantine": len(would),
            "max_quarantine": max_quarantine,
            "rules": rules,
            "node_ids": sorted(str(d.binding.node_id) for d in would)[:QUARANTINE_CAP_SAMPLE],
        },
    )


def _quarantines(d: Decision) -> bool:
    return (
        d.rule is not None
        and d.rule.quarantine
        and node_transition_allowed(NodeStatus(d.binding.node_status), NodeStatus.QUARANTINED)
    )


def max_missing_share_of(policy: MaasSitePolicy | None) -> float:
    """The site policy's `reconcile_max_missing_share` (DEFAULT_MAX_MISSING_SHARE without a
    policy row); clamped to [0, 1]."""
    if policy is None:
        return DEFAULT_MAX_MISSING_SHARE
    return min(max(float(policy.reconcile_max_missing_share), 0.0), 1.0)


class MaasReconcileActivities:
    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], secret_store: SecretStore
    ) -> None:
        self._sessions = sessions
        self._secrets = secret_store

    @activity.defn(name="maas.reconcile_site")
    async def reconcile(self, input: ReconcileInput) -> ReconcileResult:
        result = ReconcileResult(site_id=input.site_id)
        site_id = uuid.UUID(input.site_id)
        async with self._sessions() as session:
            row = (
                await session.execute(
                    select(MaasSite, MaasSitePolicy)
                    .outerjoin(MaasSitePolicy, MaasSitePolicy.site_id == MaasSite.id)
                    .where(MaasSite.id == site_id)
                )
            ).first()
            site, policy = row if row is not None else (None, None)
            if site is None or site.status != "active":
                result.actions.append(
                    "skipped:site_missing" if site is None else "skipped:disabled"
                )
                return result
            base_url, token_path = site.api_base_url, site.api_token_vault_path
            max_missing_share = max_missing_share_of(policy)
            sync_policy = SyncPolicy.of(policy)
            release_retired = bool(policy.release_retired_machines) if policy else False
            max_quarantine = (
                int(policy.reconcile_max_quarantine) if policy else DEFAULT_MAX_QUARANTINE
            )
            hw_sync_interval = policy.hardware_sync_interval if policy else None
        secret = await self._secrets.read(token_path)
        if not secret or not secret.get("token"):
            result.actions.append("skipped:no_credentials")
            return result
        async with MaasClient(base_url, secret["token"], timeout=30) as maas:
            if hw_sync_interval:
                await _write_site_settings(maas, hw_sync_interval, result)
            listed: list[MachineState] = []
            failure: MaasError | None = None
            try:
                listed = await maas.list_machine_states()
            except MaasError as err:
                failure = err
            machines = {m.system_id: m for m in listed}
            del listed
            result.machines_seen = len(machines)
            async with self._sessions() as session:
                bindings = await _load_bindings(session, site_id)
            if failure is not None:
                suspicion: Suspicion | None = Suspicion(
                    "list_failed",
                    f"the MAAS machines list failed: {failure.message}",
                    {
                        "error": type(failure).__name__,
                        "failure_class": failure.failure_class.value,
                        "maas_status_code": failure.status_code,
                        "bound_nodes": len(bindings),
                    },
                )
            else:
                suspicion = judge_list(bindings, machines, max_missing_share)
            if suspicion is not None:
                await self._record_suspect(site_id, suspicion)
                result.actions.append(f"suspect:{suspicion.reason}")
                log.warning("site %s: %s; no node changed", input.site_id, suspicion.message)
                return result
            result.nodes_checked = len(bindings)
            bound = {b.maas_system_id for b in bindings}
            result.unmanaged_machines = sum(1 for s in machines if s not in bound)
            now = dt.datetime.now(dt.UTC)
            decisions = [
                decide(
                    b,
                    machines.get(b.maas_system_id),
                    sync=sync_policy,
                    now=now,
                    release_retired=release_retired,
                )
                for b in bindings
            ]
            del bindings
            refusal = quarantine_cap(decisions, max_quarantine)
            if refusal is not None:
                await self._record_suspect(site_id, refusal)
                result.actions.append(f"suspect:{refusal.reason}")
                result.nodes_checked = 0
                log.warning("site %s: %s; no node changed", input.site_id, refusal.message)
                return result
            cleanup_done: dict[uuid.UUID, list[str]] = {}
            for d in decisions:
                # Every run while MAAS still shows it Deployed (a failed release is retried).
                if d.rule is RETIRED_CLEANUP:
                    cleanup_done[d.binding.node_id] = await self._cleanup_retired(maas, d)
        for start in range(0, len(decisions), CHUNK):
            await self._write(site_id, decisions[start : start + CHUNK], cleanup_done, result)
        # A retry of this local activity runs in the same workflow run: the claims an attempt
        # before it committed are that run's, and come back (not lost, not claimed twice).
        await self._claim_reseeds(site_id, activity.info().workflow_run_id, sync_policy, result)
        if result.unmanaged_machines:
            log.debug(
                "site %s: %d unmanaged MAAS machines", input.site_id, result.unmanaged_machines
            )
        return result

    async def _claim_reseeds(
        self, site_id: uuid.UUID, run_id: str | None, sync: SyncPolicy, result: ReconcileResult
    ) -> None:
        """The open hw_sync_stale drift events no run has claimed, claimed for workflow run
        `run_id`: dispatched (returned for the workflow to run) or skipped, each marked in one
        statement (module docstring); with those this run claimed before and has no outcome
        for (an earlier attempt of this activity committed them, then failed), as they were."""
        async with self._sessions() as session, session.begin():
            claimed = (
                await session.execute(
                    _CLAIM_RESEEDS,
                    {
                        "site": site_id,
                        "run": run_id,
                        "rule": HW_SYNC_STALE.name,
                        "limit": MAX_RESEEDS_PER_RUN,
                    },
                )
            ).all()
        for event_id, node_id, reseed, maas_interval_s in claimed:
            if reseed["status"] == ReseedStatus.DISPATCHED:
                # The timer posts at the interval MAAS judges this machine's sync by (its
                # sync_interval, set from MAAS's global config when onboarding enabled the
                # sync), else the site's.
                interval = dt.timedelta(seconds=maas_interval_s) if maas_interval_s else None
                result.reseeds.append(
                    ReseedRequest(
                        node_id=str(node_id),
                        drift_event_id=event_id,
                        task_id=reseed["task_id"],
                        interval_minutes=timer_minutes(interval or sync.interval),
                    )
                )
            result.actions.append(f"reseed_{reseed['status']}:{node_id}")

    async def _cleanup_retired(self, maas: MaasClient, d: Decision) -> list[str]:
        """A retired node's Deployed machine released and powered off (site policy
        release_retired_machines), once a fresh observation agrees: the node, read now, is still
        retired, not protected and bound to this machine, and MAAS, asked now for this machine,
        still shows it Deployed. The machine as MAAS shows it after the action replaces the
        listed one (`d.machine`), so the run records the status its own action left. Errors are
        recorded, not raised: the next run looks again."""
        node_id, system_id = d.binding.node_id, d.binding.maas_system_id
        async with self._sessions() as session:
            now = (
                await session.execute(
                    select(Node.status, Node.protected, NodeMaasState.maas_system_id)
                    .join(NodeMaasState, NodeMaasState.node_id == Node.id)
                    .where(Node.id == node_id)
                )
            ).first()
        if now is None or now[0] != NodeStatus.RETIRED or now[2] != system_id:
            return ["release_skipped:node_changed"]
        if now[1]:
            return ["release_refused:node_protected"]
        try:
            fresh = await maas.get_machine(system_id)
        except MaasError as err:
            return [f"release_skipped:observe_failed:{type(err).__name__}"]
        d.machine = fresh
        if fresh.status != MachineStatus.DEPLOYED:
            return [f"release_skipped:maas_{fresh.status_name}"]
        done: list[str] = []
        comment = "gpuaas: node retired (reconciler, site policy release_retired_machines)"
        try:
            await maas.release(system_id, comment=comment)
            done.append("released")
        except MaasError as err:
            done.append(f"release_failed:{type(err).__name__}")
        if "released" in done:
            try:
                await maas.power_off(system_id, comment=comment)
                done.append("powered_off")
            except MaasError as err:
                done.append(f"power_off_failed:{type(err).__name__}")
        try:
            d.machine = await maas.get_machine(system_id)  # what this run's action left
        except MaasError as err:
            done.append(f"observe_after_failed:{type(err).__name__}")
        return done

    @activity.defn(name=RECORD_RESEEDS_ACTIVITY)
    async def record_reseeds(self, input: ReseedOutcomes) -> None:
        """Each re-seed's outcome onto its drift event, and onto node_maas_state while that
        drift is still the node's open one (idempotent: a repeat writes the same)."""
        rows = [
            {
                "id": o.drift_event_id,
                "reseed": {
                    "status": o.status,
                    "error_type": o.error_type,
                    "message": redact(o.message),
                    "units_written": o.units_written,
                    "credentials_present": o.credentials_present,
                    "restarted": o.restarted,
                },
            }
            for o in input.outcomes
        ]
        if not rows:
            return
        async with self._sessions() as session, session.begin():
            await session.execute(
                _RECORD_RESEEDS, {"rows": json.dumps(rows), "rule": HW_SYNC_STALE.name}
            )

    async def _record_suspect(self, site_id: uuid.UUID, suspicion: Suspicion) -> None:
        """The reconcile_suspect alert: one domain event on the site, nothing else written."""
        async with self._sessions() as session, session.begin():
            session.add(
                DomainEvent(
                    type=SUSPECT_EVENT,
                    subject_type="maas_site",
                    subject_id=str(site_id),
                    payload={
                        "rule": SUSPECT_RULE,
                        "severity": CRITICAL,
                        "reason": suspicion.reason,
                        "message": suspicion.message,
                        "action": "none: no node changed",
                        **suspicion.details,
                    },
                )
            )

    async def _write(
        self,
        site_id: uuid.UUID,
        chunk: Sequence[Decision],
        cleanup_done: dict[uuid.UUID, list[str]],
        result: ReconcileResult,
    ) -> None:
        quarantine = [d for d in chunk if _quarantines(d)]
        host_updates = [d for d in chunk if d.new_host is not None]
        async with self._sessions() as session, session.begin():
            lost: set[uuid.UUID] = set()
            if quarantine:
                won = await _quarantine(session, quarantine)
                lost |= {d.binding.node_id for d in quarantine} - won
                result.actions += [f"quarantined:{n}" for n in sorted(map(str, won))]
            if host_updates:
                won = await _update_hosts(session, host_updates)
                lost |= {d.binding.node_id for d in host_updates} - won
                changed = {d.binding.node_id for d in host_updates if d.rule is IP_CHANGED}
                result.actions += [
                    f"{'host_updated' if n in changed else 'host_set'}:{n}"
                    for n in sorted(won, key=str)
                ]
            events: list[dict[str, Any]] = []
            states: list[dict[str, Any]] = []
            for d in chunk:
                b, m = d.binding, d.machine
                row: dict[str, Any] = {
                    "node_id": str(b.node_id),
                    "status": m.status_name if m else None,
                    "power": str(m.power_state) if m else None,
                    "ips": list(m.ip_addresses) if m else [],
                    "mode": "observe",
                }
                if b.node_id in lost:
                    pass  # the node moved meanwhile: the next run decides again
                elif d.rule is not None:
                    if _is_new_drift(d):
                        details = _details(d, cleanup_done.get(b.node_id))
                        events.append(
                            {
                                "node_id": str(b.node_id),
                                "rule": d.rule.name,
                                "severity": d.rule.severity,
                                "details": details,
                            }
                        )
                        row.update(mode="drift", rule=d.rule.name, details=details)
                        result.drift_detected += 1
                    for action in cleanup_done.get(b.node_id, []):
                        result.actions.append(f"{action}:{b.node_id}")
                elif b.drift_detected and b.node_status in (
                    NodeStatus.ACTIVE,
                    NodeStatus.OFFLINE,
                    NodeStatus.RETIRED,
                ):
                    row["mode"] = "heal"
                    result.drift_resolved += 1
                states.append(row)
            if events:
                await session.execute(
                    text(
                        "INSERT INTO node_drift_events (node_id, site_id, rule, severity, details)"
                        " SELECT v.node_id, :site, v.rule, v.severity, v.details"
                        " FROM jsonb_to_recordset(CAST(:rows AS jsonb))"
                        " AS v(node_id uuid, rule text, severity text, details jsonb)"
                    ),
                    {"site": site_id, "rows": json.dumps(events)},
                )
            if states:
                await session.execute(_UPDATE_STATE, {"rows": json.dumps(states)})


_UPDATE_STATE = text(
    "UPDATE node_maas_state s SET"
    " last_maas_status = v.status,"
    " last_maas_power_state = v.power,"
    " last_maas_ips = v.ips,"
    " last_reconciled_at = clock_timestamp(),"
    " drift_detected = CASE v.mode WHEN 'drift' THEN true WHEN 'heal' THEN false"
    "   ELSE s.drift_detected END,"
    " drift_rule = CASE WHEN v.mode = 'drift' THEN v.rule ELSE s.drift_rule END,"
    " drift_details = CASE WHEN v.mode = 'drift' THEN v.details"
    "   WHEN v.status = 'Deployed' THEN s.drift_details - 'released_by'"
    "   ELSE s.drift_details END,"
    " drift_resolved_at = CASE v.mode WHEN 'drift' THEN NULL WHEN 'heal' THEN clock_timestamp()"
    "   ELSE s.drift_resolved_at END"
    " FROM jsonb_to_recordset(CAST(:rows AS jsonb))"
    " AS v(node_id uuid, status text, power text, ips text[], mode text, rule text,"
    " details jsonb)"
    " WHERE s.node_id = v.node_id"
)


# The latest drift event of each node whose open drift is sync drift, unclaimed, is claimed:
# `reseed` set on the event (dispatched with a fresh task id, or skipped with its reason, and the
# claiming workflow run's id) and mirrored onto node_maas_state.drift_details. The events the
# same run claimed before and has no outcome for (no `finished_at`) come back unchanged, first:
# an attempt that committed its claims and then failed leaves them to its retry.
_CLAIM_RESEEDS = text(
    "WITH latest AS ("
    "  SELECT DISTINCT ON (e.node_id) e.id, e.node_id, e.details"
    "  FROM node_maas_state s JOIN node_drift_events e"
    "    ON e.node_id = s.node_id AND e.site_id = s.site_id AND e.rule = s.drift_rule"
    "  WHERE s.site_id = :site AND s.drift_detected AND s.drift_rule = :rule"
    "  ORDER BY e.node_id, e.id DESC"
    "), due AS ("
    "  SELECT l.id, l.node_id, l.details -> 'reseed' AS reseed,"
    "    l.details ->> 'sync_interval_s' AS sync_interval_s,"
    "    n.status, n.last_agent_contact_at IS NOT NULL AS has_agent"
    "  FROM latest l JOIN nodes n ON n.id = l.node_id"
    "  WHERE l.details -> 'reseed' IS NULL"
    "    OR (l.details -> 'reseed' ->> 'run_id' = CAST(:run AS text)"
    "      AND l.details -> 'reseed' -> 'finished_at' IS NULL)"
    "  ORDER BY l.details -> 'reseed' IS NULL, l.id LIMIT :limit"
    "), claimed AS ("
    "  UPDATE node_drift_events e SET details = e.details || jsonb_build_object('reseed',"
    "    CASE"
    "      WHEN due.status <> 'active' THEN jsonb_build_object("
    "        'status', 'skipped', 'reason', 'node_not_active', 'node_status', due.status)"
    "      WHEN NOT due.has_agent THEN jsonb_build_object("
    "        'status', 'skipped', 'reason', 'no_agent')"
    "      ELSE jsonb_build_object('status', 'dispatched', 'task_id', gen_random_uuid()::text)"
    "    END || jsonb_build_object('at', clock_timestamp(), 'run_id', CAST(:run AS text)))"
    "  FROM due WHERE e.id = due.id AND due.reseed IS NULL"
    "  RETURNING e.id, e.node_id, e.details -> 'reseed' AS reseed,"
    "    e.details ->> 'sync_interval_s' AS sync_interval_s"
    "), mirrored AS ("
    "  UPDATE node_maas_state s"
    "  SET drift_details = COALESCE(s.drift_details, '{}'::jsonb)"
    "    || jsonb_build_object('reseed', c.reseed)"
    "  FROM claimed c WHERE s.node_id = c.node_id"
    "), mine AS ("
    "  SELECT id, node_id, reseed, sync_interval_s FROM claimed"
    "  UNION ALL"
    "  SELECT id, node_id, reseed, sync_interval_s FROM due WHERE reseed IS NOT NULL"
    ")"
    " SELECT id, node_id, reseed, CAST(sync_interval_s AS int) FROM mine ORDER BY id"
)

# A re-seed's outcome merged into its event's `reseed` (and node_maas_state's, while that drift
# is the node's open one).
_RECORD_RESEEDS = text(
    "WITH v AS ("
    "  SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(id bigint, reseed jsonb)"
    "), recorded AS ("
    "  UPDATE node_drift_events e SET details = e.details || jsonb_build_object('reseed',"
    "    COALESCE(e.details -> 'reseed', '{}'::jsonb) || v.reseed"
    "    || jsonb_build_object('finished_at', clock_timestamp()))"
    "  FROM v WHERE e.id = v.id"
    "  RETURNING e.node_id, e.details -> 'reseed' AS reseed"
    ")"
    " UPDATE node_maas_state s"
    " SET drift_details = COALESCE(s.drift_details, '{}'::jsonb)"
    "   || jsonb_build_object('reseed', r.reseed)"
    " FROM recorded r"
    " WHERE s.node_id = r.node_id AND s.drift_detected AND s.drift_rule = :rule"
)


def _is_new_drift(d: Decision) -> bool:
    """A rule that starts to match. An IP change is new every time it is applied: a second
    change while the first's drift is still open writes its own event."""
    b = d.binding
    if d.rule is IP_CHANGED:
        return True
    return d.rule is not None and not (b.drift_detected and b.drift_rule == d.rule.name)


def _details(d: Decision, cleanup: list[str] | None) -> dict[str, Any]:
    assert d.rule is not None
    m = d.machine
    details: dict[str, Any] = {
        "rule": d.rule.name,
        "message": d.rule.message,
        "maas_status": m.status_name if m else None,
        "maas_power_state": str(m.power_state) if m else None,
        "node_status": d.binding.node_status,
        "expected": "Deployed",
        "maas_system_id": d.binding.maas_system_id,
    }
    if d.rule.quarantine:
        details["action"] = "quarantined"
    if d.rule is IP_CHANGED:
        details.update(action="host_updated", old_host=d.binding.host_address, new_host=d.new_host)
    if d.rule is HW_SYNC_STALE and m is not None:
        hw = m.hardware_sync
        details.update(
            last_sync=hw.last_sync.isoformat() if hw.last_sync else None,
            next_sync=hw.next_sync.isoformat() if hw.next_sync else None,
            sync_interval_s=int(hw.sync_interval.total_seconds()) if hw.sync_interval else None,
            # The re-seed the workflow runs through the node's agent (task queue node-{id});
            # its outcome is recorded here as `reseed`.
            recommended_action=HW_SYNC_RESEED_ACTION,
            task_queue=f"node-{d.binding.node_id}",
        )
    if cleanup is not None:
        details["actions"] = cleanup
        if "released" in cleanup:
            details["released_by"] = RECONCILER_ACTOR
    if d.rule is OWN_RELEASE:
        details.update(released_by=RECONCILER_ACTOR, expected="Deployed (re-onboard the node)")
    return details


async def _load_bindings(session: AsyncSession, site_id: uuid.UUID) -> list[Binding]:
    rows = await session.execute(
        select(
            Node.id,
            Node.status,
            Node.host_address,
            NodeMaasState.maas_system_id,
            NodeMaasState.drift_detected,
            NodeMaasState.drift_rule,
            func.coalesce(
                NodeMaasState.drift_details["released_by"].astext == RECONCILER_ACTOR, False
            ),
        )
        .join(Node, Node.id == NodeMaasState.node_id)
        .where(NodeMaasState.site_id == site_id)
    )
    return [Binding(*row) for row in rows]


async def _quarantine(session: AsyncSession, decisions: Sequence[Decision]) -> set[uuid.UUID]:
    """active|offline → quarantined, each node compare-and-set against the status it was decided
    on, through the one transition function (each moved node gets its node.status_changed
    event, whose reason is its rule): one statement per rule; the ids that moved."""
    by_rule: dict[str, list[tuple[uuid.UUID, str]]] = {}
    for d in decisions:
        assert d.rule is not None
        by_rule.setdefault(d.rule.name, []).append((d.binding.node_id, d.binding.node_status))
    won: set[uuid.UUID] = set()
    for rule, expected in sorted(by_rule.items()):
        moved = await transition_nodes(
            session,
            _WATCHED,
            NodeStatus.QUARANTINED,
            tuple_(Node.id, Node.status).in_(expected),
            actor=RECONCILER_ACTOR,
            reason=f"MAAS drift: {rule}",
        )
        won |= {m.node_id for m in moved}
    return won


async def _update_hosts(session: AsyncSession, decisions: Sequence[Decision]) -> set[uuid.UUID]:
    rows = [
        {
            "id": str(d.binding.node_id),
            "expected": d.binding.node_status,
            "old": d.binding.host_address,
            "new": d.new_host,
        }
        for d in decisions
    ]
    won = await session.scalars(
        text(
            "UPDATE nodes n SET host_address = v.new, updated_at = clock_timestamp()"
            " FROM jsonb_to_recordset(CAST(:rows AS jsonb))"
            " AS v(id uuid, expected text, old text, new text)"
            " WHERE n.id = v.id AND n.status = v.expected"
            " AND n.host_address IS NOT DISTINCT FROM v.old RETURNING n.id"
        ),
        {"rows": json.dumps(rows)},
    )
    return set(won)


async def _write_site_settings(maas: MaasClient, interval: str, result: ReconcileResult) -> None:
    """MAAS's site-wide settings from the site's current policy (the reconciler is their one
    owner): the global hardware_sync_interval, written only when MAAS holds another value. A
    failure is an action in the result, never the run's failure: the next run writes again."""
    try:
        if await maas.ensure_hardware_sync_interval(interval):
            result.actions.append(f"site_setting:hardware_sync_interval={interval}")
    except MaasError as err:
        result.actions.append(f"site_setting_failed:hardware_sync_interval:{type(err).__name__}")
