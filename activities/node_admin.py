"""The node lifecycle actions an operator takes (seed 004 §3.2, §3.3), run by
AdminOperationWorkflow like every admin mutation: each moves the node through the one transition
function (node_lifecycle.transition_node, with its `node.status_changed` event) and writes its
audit row, with the operator's reason, in the same transaction.

- activate: quarantined → active ("explicit operator recovery … after the node is proven healthy
  again"), only with a health proof (`health_proof`, below); never without one.
- retire: active|offline|quarantined → draining, and the NodeDrainWorkflow that owns the drain
  (§3.3 guardrail: entering draining creates its owning lifecycle operation) is started before
  the transaction commits; the workflow moves the node draining → retired once no allocation
  lives on it.
- reactivate: retired → active ("reactivate/reuse same identity"), with the same health proof:
  a retired node whose machine the reconciler has since released (seed 003 §6.4, Deployed while
  retired) has no agent left to prove it, and is re-onboarded instead.

A node that an onboarding or decommission job owns (a live job) is that job's to move: every
action is refused with `node_lifecycle_in_progress`.

The health proof, from what the control plane has recorded (the agent talks to Temporal only):
the node's agent was heard from within HEALTH_PROOF_MAX_AGE_SECONDS and after the node entered
its current state (a heartbeat from before a quarantine proves nothing about after it), its last
reported GPU inventory matches the node's GPU slots (every GPU is still on the bus), and for a
node bound to MAAS, MAAS was last seen holding the machine Deployed and no drift is open (an
operator resolves the drift, audited, once the cause is fixed)."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from activities.node_lifecycle import STATUS_CHANGED, transition_node
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
from contracts.states import NodeStatus
from schema.models import (
    DomainEvent,
    Node,
    NodeDecommission,
    NodeDrain,
    NodeMaasState,
    NodeOnboarding,
)

# A contact older than this proves nothing about the node now. An out-of-service node's contact
# is refreshed by every liveness sweep (30 s) from its agent's long polls, each at most about a
# minute old (activities/node_liveness.py): a live agent's is always younger.
HEALTH_PROOF_MAX_AGE_SECONDS = 120.0
MAAS_DEPLOYED = "Deployed"
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


async def health_proof(session: AsyncSession, node: Node) -> list[HealthCheck]:
    """Each check of the proof that `node` is healthy now (see the module docstring)."""
    entered = await session.scalar(
        select(func.max(DomainEvent.occurred_at)).where(
            DomainEvent.type == STATUS_CHANGED,
            DomainEvent.subject_type == "node",
            DomainEvent.subject_id == str(node.id),
            DomainEvent.payload["to"].astext == node.status,
        )
    )
    now = await session.scalar(select(func.clock_timestamp()))
    assert now is not None
    contact = node.last_agent_contact_at
    checks = [
        HealthCheck(
            "agent_heartbeat",
            contact is not None
            and now - contact <= dt.timedelta(seconds=HEALTH_PROOF_MAX_AGE_SECONDS)
            and (entered is None or contact > entered),
            f"last heard from {contact.isoformat() if contact else 'never'}; "
            f"in {node.status} since {entered.isoformat() if entered else 'unknown'}",
        ),
        HealthCheck(
            "gpu_inventory",
            bool(node.inventory_matches) and (node.gpu_count == 0 or bool(node.gpu_inventory)),
            f"{len(node.gpu_inventory or [])} GPU(s) reported; "
            f"matches the slots: {node.inventory_matches}",
        ),
    ]
    binding = await session.get(NodeMaasState, node.id)
    if binding is not None:
        checks += [
            HealthCheck(
                "maas_deployed",
                binding.last_maas_status == MAAS_DEPLOYED,
                f"MAAS last seen: {binding.last_maas_status or 'absent'}",
            ),
            HealthCheck(
                "drift_resolved",
                not binding.drift_detected,
                f"open drift: {binding.drift_rule}" if binding.drift_detected else "none open",
            ),
        ]
    return checks


class NodeAdminActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        return [self.node_activate, self.node_retire, self.node_reactivate]

    async def _to_active(self, input: NodeActionInput, source: NodeStatus) -> NodeActionResult:
        """source → active once the health proof holds: compare-and-set, audited."""
        node_id = uuid.UUID(input.node_id)
        action = "activated" if source == NodeStatus.QUARANTINED else "reactivated"
        async with transaction(self._sessions) as session:
            node = await _locked_node(session, node_id)
            await _refuse_if_owned(session, node_id)
            if node.status != source:
                raise _status_conflict(node, action, (source,))
            checks = await health_proof(session, node)
            failed = [c.name for c in checks if not c.passed]
            if failed:
                raise refusal(
                    NODE_NOT_PROVEN_HEALTHY,
                    f"the node is not proven healthy: {', '.join(failed)}",
                    {"failed": failed, "checks": [vars(c) for c in checks]},
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
                details={"health": [vars(c) for c in checks]},
            )
        return NodeActionResult(
            node_id=str(node_id),
            prior_status=source.value,
            status=NodeStatus.ACTIVE.value,
            health=checks,
        )

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
