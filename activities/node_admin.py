"""The node lifecycle actions an operator takes (docs/lifecycles/node.md#states-and-transitions,
docs/lifecycles/node.md#who-moves-it), run by AdminOperationWorkflow like every admin mutation: each
moves the node through the one transition function (node_lifecycle.transition_node, with its
`node.status_changed` event) and writes its audit row, with the operator's reason, in the same
transaction.

- activate: quarantined → active ("explicit operator recovery … after the node is proven healthy
  again"), only with a health proof (`health_proof`, below); never without one.
- retire: active|offline|quarantined → draining, and the NodeDrainWorkflow that owns the drain
  (§3.3 guardrail: entering draining creates its owning lifecycle operation) is started before
  the transaction commits; the workflow moves the node draining → retired once no allocation
  lives on it.
- reactivate: retired → active ("reactivate/reuse same identity"), with the same health proof:
  a retired node whose machine the reconciler has since released
  (docs/lifecycles/node.md#reconciliation-rules, Deployed while retired) has no agent left to prove
  it, and is re-onboarded instead.

A node that an onboarding or decommission job owns (a live job) is that job's to move: every
action is refused with `node_lifecycle_in_progress`.

The health proof is observed now, in the run that moves the node, never read from what was
stored before (a reconciler that released the machine after storing "Deployed", a contact from
before a release, prove nothing about the node now):
- agent_answered: the node's agent ran a read-only `node.validate_clean` on its own queue in this
  run (workflows/node_health_probe.py), and for a retired node (reactivate: nothing of a tenant
  may be left on it) found no tenant residue;
- gpu_inventory: its last reported GPU inventory matches the node's GPU slots (every GPU is still
  on the bus);
- for a node bound to MAAS: maas_deployed, the node's MAAS site asked now for the machine (by
  the site's token from the secret store) holds it Deployed; maas_power_on, the machine's power
  asked now is on; and drift_resolved, no drift is open (an operator resolves the drift, audited,
  once the cause is fixed).
A failed proof is refused with `node_not_proven_healthy`, naming the failed checks and what was
observed: `maas_status`, `power_state` and `agent_seen_at` (None: the agent did not answer)."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from activities.maas.client import MaasClient
from activities.maas.errors import MaasError, MaasNotFound
from activities.node_lifecycle import transition_node
from activities.operation_support import record_audit, refusal, transaction
from contracts.admin_operation import (
    NODE_ACTIVATE,
    NODE_LIFECYCLE_IN_PROGRESS,
    NODE_NOT_PROVEN_HEALTHY,
    NODE_REACTIVATE,
    NODE_RETIRE,
    NODE_STATUS_CONFLICT,
    NOT_FOUND,
    Actor,
    HealthCheck,
    NodeActionInput,
    NodeActionResult,
)
from contracts.lifecycle import LIVE_JOB_STATUSES
from contracts.node_drain import (
    POLL_SECONDS,
    DrainStatus,
    NodeDrainInput,
    node_drain_workflow_id,
)
from contracts.node_drain import (
    WORKFLOW_NAME as DRAIN_WORKFLOW,
)
from contracts.node_health_probe import (
    WORKFLOW_NAME as PROBE_WORKFLOW,
)
from contracts.node_health_probe import (
    HealthProbeInput,
    HealthProbeResult,
    node_health_probe_workflow_id,
)
from contracts.states import NodeStatus
from core.secrets import SecretStore, SecretStoreError
from schema.models import (
    MaasSite,
    Node,
    NodeDecommission,
    NodeDrain,
    NodeMaasState,
    NodeOnboarding,
)

MAAS_DEPLOYED = "Deployed"
POWER_ON = "on"
# A health proof asks MAAS and the agent inside one admin operation (60 s): each bounded well
# below it.
MAAS_TIMEOUT_SECONDS = 10.0
PROBE_PICKUP_SECONDS = 5.0
PROBE_RUN_SECONDS = 20.0
RETIRABLE = (NodeStatus.ACTIVE, NodeStatus.OFFLINE, NodeStatus.QUARANTINED)
# How often a drain looks again at the node's allocations (tests shorten it).
DRAIN_POLL_ENV = "GPUCLOUD_NODE_DRAIN_POLL_S"


def _actor_name(actor: Actor) -> str:
    return f"admin:{actor.name}"


async def _refuse_if_owned(session: AsyncSession, node_id: uuid.UUID) -> None:
    """An onboarding or decommission job that is still live owns the node's state."""
    live = [s.value for s in LIVE_JOB_STATUSES]
    owned = await session.scalar(
        select(
            exists().where(NodeDecommission.node_id == node_id, NodeDecommission.status.in_(live))
            | exists().where(NodeOnboarding.node_id == node_id, NodeOnboarding.status.in_(live))
        )
    )
    if owned:
        raise refusal(
            NODE_LIFECYCLE_IN_PROGRESS,
            "an onboarding or decommission of this node is in progress; act on that job",
        )


async def _locked_node(session: AsyncSession, node_id: uuid.UUID) -> Node:
    node = await session.scalar(select(Node).where(Node.id == node_id).with_for_update())
    if node is None or node.status == NodeStatus.DELETED:
        raise refusal(NOT_FOUND, "node not found")
    return node


def _status_conflict(node: Node, action: str, sources: tuple[NodeStatus, ...]) -> Exception:
    return refusal(
        NODE_STATUS_CONFLICT,
        f"a node in {node.status} cannot be {action} (only from {', '.join(sources)})",
        {"node_status": node.status, "allowed_from": list(sources)},
    )


@dataclass
class Observed:
    """What a health proof saw now: MAAS's answer (None: the node is not bound to MAAS) and the
    agent's."""

    maas_status: str | None = None
    power_state: str | None = None
    maas_detail: str = ""
    agent: HealthProbeResult | None = None


def health_proof(node: Node, binding: NodeMaasState | None, seen: Observed) -> list[HealthCheck]:
    """Each check of the proof that `node` is healthy now (see the module docstring)."""
    probe = seen.agent
    answered = probe is not None and probe.answered
    want_clean = node.status == NodeStatus.RETIRED
    if probe is None or not probe.answered:
        agent_detail = f"the agent did not answer now: {probe.error if probe else 'not asked'}"
    else:
        agent_detail = f"the agent answered at {probe.answered_at}; " + (
            "no tenant residue"
            if probe.clean
            else f"tenant residue: {', '.join(probe.failed_checks) or 'unclean'}"
        )
    checks = [
        HealthCheck(
            "agent_answered",
            answered and (probe is not None and (probe.clean or not want_clean)),
            agent_detail,
        ),
        HealthCheck(
            "gpu_inventory",
            bool(node.inventory_matches) and (node.gpu_count == 0 or bool(node.gpu_inventory)),
            f"{len(node.gpu_inventory or [])} GPU(s) reported; "
            f"matches the slots: {node.inventory_matches}",
        ),
    ]
    if binding is not None:
        checks += [
            HealthCheck(
                "maas_deployed",
                seen.maas_status == MAAS_DEPLOYED,
                f"MAAS now: {seen.maas_status or 'unknown'}{seen.maas_detail}",
            ),
            HealthCheck(
                "maas_power_on",
                seen.power_state == POWER_ON,
                f"power now: {seen.power_state or 'unknown'}",
            ),
            HealthCheck(
                "drift_resolved",
                not binding.drift_detected,
                f"open drift: {binding.drift_rule}" if binding.drift_detected else "none open",
            ),
        ]
    return checks


class NodeAdminActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        client: Client,
        secrets: SecretStore | None = None,
    ) -> None:
        self._sessions = sessions
        self._client = client
        self._secrets = secrets

    def activities(self) -> list[Callable[..., Any]]:
        return [self.node_activate, self.node_retire, self.node_reactivate]

    async def _to_active(self, input: NodeActionInput, source: NodeStatus) -> NodeActionResult:
        """source → active once the health proof, observed now, holds: compare-and-set, audited.
        MAAS and the agent are asked outside any transaction; the node is then locked and checked
        again (status, owner, drift) before it moves."""
        node_id = uuid.UUID(input.node_id)
        action = "activated" if source == NodeStatus.QUARANTINED else "reactivated"
        async with transaction(self._sessions) as session:
            node = await _locked_node(session, node_id)
            await _refuse_if_owned(session, node_id)
            if node.status != source:
                raise _status_conflict(node, action, (source,))
            binding = await session.get(NodeMaasState, node_id)
            site = await session.get(MaasSite, binding.site_id) if binding is not None else None
            target = (
                (site.api_base_url, site.api_token_vault_path, binding.maas_system_id)
                if binding is not None and site is not None
                else None
            )
        seen = Observed()
        if binding is not None:
            await self._observe_maas(seen, target)
        seen.agent = await self._probe_agent(node_id)
        async with transaction(self._sessions) as session:
            node = await _locked_node(session, node_id)
            await _refuse_if_owned(session, node_id)
            if node.status != source:
                raise _status_conflict(node, action, (source,))
            binding = await session.get(NodeMaasState, node_id)
            checks = health_proof(node, binding, seen)
            failed = [c.name for c in checks if not c.passed]
            if failed:
                raise refusal(
                    NODE_NOT_PROVEN_HEALTHY,
                    f"the node is not proven healthy now: {', '.join(failed)}",
                    {
                        "failed": failed,
                        "checks": [vars(c) for c in checks],
                        "maas_status": seen.maas_status,
                        "power_state": seen.power_state,
                        "agent_seen_at": seen.agent.answered_at if seen.agent else None,
                        "agent_last_contact_at": (
                            node.last_agent_contact_at.isoformat()
                            if node.last_agent_contact_at
                            else None
                        ),
                    },
                )
            moved = await transition_node(
                session,
                node_id,
                [source],
                NodeStatus.ACTIVE,
                actor=_actor_name(input.actor),
                reason=input.actor.reason or "",
            )
            assert moved.applied  # the row is locked and was in `source`
            record_audit(
                session,
                input.actor,
                action=f"node.{action.removesuffix('d')}",
                target_type="node",
                target_id=str(node_id),
                prior_state=source.value,
                expected_state=NodeStatus.ACTIVE.value,
                details={
                    "health": [vars(c) for c in checks],
                    "maas_status": seen.maas_status,
                    "power_state": seen.power_state,
                    "agent_seen_at": seen.agent.answered_at if seen.agent else None,
                },
            )
        return NodeActionResult(
            node_id=str(node_id),
            prior_status=source.value,
            status=NodeStatus.ACTIVE.value,
            health=checks,
        )

    async def _observe_maas(self, seen: Observed, target: tuple[str, str, str] | None) -> None:
        """Ask the node's MAAS site now for its machine: status, and power asked of the BMC
        (MAAS's last view of it when that query fails). Whatever MAAS cannot answer stays
        unknown, and the proof fails on it."""
        if target is None:
            seen.maas_detail = " (the node's MAAS site is gone)"
            return
        base_url, token_path, system_id = target
        if self._secrets is None:
            seen.maas_detail = " (no secret store: MAAS cannot be asked)"
            return
        try:
            secret = await self._secrets.read(token_path)
        except SecretStoreError as err:
            seen.maas_detail = f" (the site's MAAS token could not be read: {err})"
            return
        if not secret or not secret.get("token"):
            seen.maas_detail = f" (no MAAS API token at {token_path})"
            return
        try:
            async with MaasClient(base_url, secret["token"], timeout=MAAS_TIMEOUT_SECONDS) as maas:
                try:
                    machine = await maas.get_machine(system_id)
                except MaasNotFound:
                    seen.maas_status = "absent"
                    seen.maas_detail = f" (machine {system_id} is not in MAAS)"
                    return
                seen.maas_status = machine.status.label
                seen.power_state = str(machine.power_state)
                try:
                    seen.power_state = str(await maas.query_power_state(system_id))
                except MaasError as err:
                    seen.maas_detail = f" (BMC power query failed: {err.message}; MAAS's view)"
        except MaasError as err:
            seen.maas_detail = f" (MAAS could not be asked: {err.message})"

    async def _probe_agent(self, node_id: uuid.UUID) -> HealthProbeResult:
        """The agent asked now, through a one-task probe workflow on the node's queue."""
        request = str(uuid.uuid4())
        try:
            result: HealthProbeResult = await self._client.execute_workflow(
                PROBE_WORKFLOW,
                HealthProbeInput(
                    node_id=str(node_id),
                    task_id=f"health-probe-{request}",
                    pickup_seconds=PROBE_PICKUP_SECONDS,
                    run_seconds=PROBE_RUN_SECONDS,
                ),
                id=node_health_probe_workflow_id(str(node_id), request),
                task_queue=activity.info().task_queue,
                result_type=HealthProbeResult,
                execution_timeout=dt.timedelta(
                    seconds=PROBE_PICKUP_SECONDS + PROBE_RUN_SECONDS + 10
                ),
            )
        except (WorkflowFailureError, RPCError) as err:
            return HealthProbeResult(answered=False, error=f"the probe did not finish: {err}")
        return result

    @activity.defn(name=NODE_ACTIVATE)
    async def node_activate(self, input: NodeActionInput) -> NodeActionResult:
        return await self._to_active(input, NodeStatus.QUARANTINED)

    @activity.defn(name=NODE_REACTIVATE)
    async def node_reactivate(self, input: NodeActionInput) -> NodeActionResult:
        return await self._to_active(input, NodeStatus.RETIRED)

    @activity.defn(name=NODE_RETIRE)
    async def node_retire(self, input: NodeActionInput) -> NodeActionResult:
        """→ draining with its drain row, audited, and the drain workflow started before the
        commit: a start Temporal refuses rolls everything back (the node never sits in draining
        without its owner); a commit that fails after the start leaves a workflow that finds no
        running drain and stops. A retry after success answers the running drain."""
        node_id = uuid.UUID(input.node_id)
        async with transaction(self._sessions) as session:
            node = await _locked_node(session, node_id)
            await _refuse_if_owned(session, node_id)
            prior = NodeStatus(node.status)
            if prior == NodeStatus.DRAINING:
                running = await session.scalar(
                    select(NodeDrain).where(
                        NodeDrain.node_id == node_id, NodeDrain.status == DrainStatus.RUNNING
                    )
                )
                if running is None:
                    raise _status_conflict(node, "retired", RETIRABLE)
                await self._start_drain(node_id, running.drain_id)
                return NodeActionResult(
                    node_id=str(node_id),
                    prior_status=prior.value,
                    status=prior.value,
                    drain_id=str(running.drain_id),
                )
            if prior not in RETIRABLE:
                raise _status_conflict(node, "retired", RETIRABLE)
            await transition_node(
                session,
                node_id,
                RETIRABLE,
                NodeStatus.DRAINING,
                actor=_actor_name(input.actor),
                reason=input.actor.reason or "",
            )
            drain_id = uuid.uuid4()
            workflow_id = node_drain_workflow_id(str(node_id))
            await session.execute(
                insert(NodeDrain).values(
                    drain_id=drain_id,
                    node_id=node_id,
                    status=DrainStatus.RUNNING.value,
                    reason=input.actor.reason or "",
                    requested_by=input.actor.name,
                    workflow_id=workflow_id,
                )
            )
            record_audit(
                session,
                input.actor,
                action="node.retire",
                target_type="node",
                target_id=str(node_id),
                prior_state=prior.value,
                expected_state=NodeStatus.RETIRED.value,
                details={"drain_id": str(drain_id), "drain_workflow_id": workflow_id},
            )
            await self._start_drain(node_id, drain_id)
        return NodeActionResult(
            node_id=str(node_id),
            prior_status=prior.value,
            status=NodeStatus.DRAINING.value,
            drain_id=str(drain_id),
        )

    async def _start_drain(self, node_id: uuid.UUID, drain_id: uuid.UUID) -> None:
        """Start the drain on the queue this operation runs on (the control plane's); the one
        already running for the node is the one asked for."""
        await self._client.start_workflow(
            DRAIN_WORKFLOW,
            NodeDrainInput(
                node_id=str(node_id),
                drain_id=str(drain_id),
                poll_seconds=float(os.environ.get(DRAIN_POLL_ENV, POLL_SECONDS)),
            ),
            id=node_drain_workflow_id(str(node_id)),
            task_queue=activity.info().task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
