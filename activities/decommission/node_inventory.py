"""The decommission stages that move the node's inventory status (docs/lifecycles/decommission.md),
always through activities/node_lifecycle.py, the one place node status changes: disable (into
`draining`, which makes the workflow the drain's owner), retire, enable (back to `active` without
passing `retired`) and quarantine after a failed validate_clean; plus load_node for the legacy
two-stage storage cleanup.

Each is status-aware, so a resumed or re-entered run converges: a node already draining is
adopted by disable_node, a retired node is not retired twice. Host work (node.drain,
node.validate_clean, ...) is not here: the workflow dispatches it on the node's own queue.
"""

from __future__ import annotations

import uuid

from sqlalchemy import insert, select
from temporalio import activity

from activities.decommission.stage_runtime import ACTOR, Run, StageRuntime, ambiguity
from activities.node_lifecycle import transition_node, transition_path
from activities.onboarding.stage_errors import StageError
from contracts.decommission import Mode, Stage, StageInput, StageResult
from contracts.states import NodeStatus
from core.failures import FailureClass
from schema.models import DomainEvent, Node, NodeDriftEvent


class NodeInventoryStages(StageRuntime):
    @activity.defn(name="decommission.disable_node")
    async def disable_node(self, input: StageInput) -> StageResult:
        """§5.2 DisableNode: the node becomes unschedulable by entering `draining` (only active
        nodes are placed on), which also makes this workflow the owning lifecycle operation of
        the drain (docs/lifecycles/node.md#who-moves-it). Also loads what later stages need:
        hostname, MAAS binding, SKU and the profile (the request's, else the one the node was
        onboarded with)."""
        async with self.stage(input, Stage.DISABLE_NODE) as run:
            await self._load_node(run)
            sources = (NodeStatus.ACTIVE, NodeStatus.OFFLINE, NodeStatus.QUARANTINED)
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    sources,
                    NodeStatus.DRAINING,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied:
                run.done(f"{moved.prior} -> draining: no new allocations", prior=str(moved.prior))
            elif moved.current == NodeStatus.DRAINING:
                run.skipped("already draining: this decommission owns the drain")
            elif (
                moved.current in (NodeStatus.RETIRED, NodeStatus.REMOVING)
                and input.decommission.mode == Mode.FULL_DECOMMISSION
            ):
                run.skipped(f"already {moved.current}: past disable (resumed full decommission)")
            else:
                raise StageError(
                    FailureClass.INPUT_CONFIG_ERROR,
                    "node_not_decommissionable",
                    f"a node in {moved.current or 'no state (missing)'} cannot be disabled",
                    details={"node_status": str(moved.current)},
                    non_retryable=True,
                )
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.load_node")
    async def load_node(self, input: StageInput) -> StageResult:
        """What a storage_cleanup started before it disabled the node (the legacy two-stage
        run, workflows/decommission.py LEGACY_STORAGE_CLEANUP_STAGES) needs to know about it."""
        run = Run(input=input, stage=Stage.CLEANUP_STORAGE)
        await self._load_node(run)
        return StageResult(state=run.state, message="node loaded")

    @activity.defn(name="decommission.retire_gpuaas_node")
    async def retire_gpuaas_node(self, input: StageInput) -> StageResult:
        """§5.4 RetireGPUaaSNode: draining → retired (the drain lifecycle completed)."""
        async with self.stage(input, Stage.RETIRE_GPUAAS_NODE) as run:
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.DRAINING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied:
                run.done("draining -> retired")
            elif moved.current in (NodeStatus.RETIRED, NodeStatus.REMOVING):
                run.skipped(f"already {moved.current}")
            else:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}, not draining: something else moved it",
                    node_status=str(moved.current),
                )
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.enable_node")
    async def enable_node(self, input: StageInput) -> StageResult:
        """§5.2/§5.3 EnableNode: back to `active`, through the table's own path without ever
        passing `retired` (a soft reset or reimage retires nothing): draining → offline (the
        drain stops short of retirement, docs/lifecycles/node.md#who-moves-it) → active (the node
        was just validated clean: proven healthy); a node an operator released from quarantine
        (adopt after validation) goes quarantined → active."""
        async with self.stage(input, Stage.ENABLE_NODE) as run:
            async with self.deps.sessions() as session, session.begin():
                current = await session.scalar(select(Node.status).where(Node.id == run.node_id))
                if current == NodeStatus.QUARANTINED:
                    moved = await transition_node(
                        session,
                        run.node_id,
                        [NodeStatus.QUARANTINED],
                        NodeStatus.ACTIVE,
                        actor=ACTOR,
                        reason="operator adopted after validation",
                    )
                else:
                    moved = await transition_path(
                        session,
                        run.node_id,
                        [NodeStatus.DRAINING, NodeStatus.OFFLINE, NodeStatus.ACTIVE],
                        actor=ACTOR,
                        reason=input.decommission.reason,
                    )
            if moved.current != NodeStatus.ACTIVE:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}; it cannot be enabled from there",
                    node_status=str(moved.current),
                )
            if moved.applied:
                run.done(f"{moved.prior} -> active: available for allocations")
            else:
                run.skipped("already active")
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.quarantine_node")
    async def quarantine_node(self, input: StageInput) -> StageResult:
        """A failed validate_clean (§5.2): the node is quarantined (draining → offline →
        quarantined, or active/offline → quarantined) and an alert is raised: a CRITICAL drift
        row for MAAS nodes and a `node.decommission.validation_failed` domain event."""
        run = Run(input=input, stage=Stage.VALIDATE_CLEAN_NODE)
        reason = "decommission validation found tenant residue"
        async with self.deps.sessions() as session, session.begin():
            moved = await transition_path(
                session,
                run.node_id,
                [NodeStatus.DRAINING, NodeStatus.OFFLINE, NodeStatus.QUARANTINED],
                actor=ACTOR,
                reason=reason,
            )
            if moved.current == NodeStatus.ACTIVE:
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.ACTIVE],
                    NodeStatus.QUARANTINED,
                    actor=ACTOR,
                    reason=reason,
                )
            checks = input.state.followups[-1:] if input.state.followups else []
            session.add(
                DomainEvent(
                    type="node.decommission.validation_failed",
                    subject_type="node",
                    subject_id=str(run.node_id),
                    payload={
                        "decommission_id": input.decommission.decommission_id,
                        "severity": "CRITICAL",
                        "node_status": str(moved.current),
                        "checks": checks,
                    },
                )
            )
            if input.state.site_id is not None:
                await session.execute(
                    insert(NodeDriftEvent).values(
                        node_id=run.node_id,
                        site_id=uuid.UUID(input.state.site_id),
                        rule="decommission_validation_failed",
                        severity="CRITICAL",
                        details={
                            "decommission_id": input.decommission.decommission_id,
                            "node_status": str(moved.current),
                        },
                    )
                )
        input.state.quarantined = moved.current == NodeStatus.QUARANTINED
        return StageResult(state=input.state, message=f"node {moved.current}")
