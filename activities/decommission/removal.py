"""The end of a full decommission (docs/lifecycles/decommission.md#full-decommission,
docs/lifecycles/decommission.md#failures-and-recommended-actions): the node record's removal in two
halves around the agent's node.uninstall (retired → removing, then removing → deleted with its GPU
slots disabled and its MAAS binding dropped, or back to retired when uninstall failed), and the
cleanup of its enrollment tokens and Vault paths.

Separate from node_inventory because these run only in full decommission and end the node's
identity; a failed secrets cleanup is a follow-up, never a failed job.
"""

from __future__ import annotations

from sqlalchemy import delete, func, update
from temporalio import activity

from activities.decommission.stage_runtime import ACTOR, Run, StageRuntime, ambiguity
from activities.node_lifecycle import transition_node
from activities.onboarding.stage_errors import as_application_error
from contracts.decommission import Stage, StageInput, StageResult
from contracts.states import NodeStatus
from core.secret_paths import node_secret_paths
from core.secrets import SecretStoreError
from schema.models import GpuSlot, NodeEnrollmentToken, NodeMaasState


class RemovalStages(StageRuntime):
    @activity.defn(name="decommission.begin_remove")
    async def begin_remove(self, input: StageInput) -> StageResult:
        """§5.4 RemoveGPUaaSNodeRecord, first half: retired → removing (the remove workflow
        owns it now). Answers skipped=True when the node is already deleted."""
        async with self.stage(input, Stage.REMOVE_GPUAAS_NODE_RECORD) as run:
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.RETIRED],
                    NodeStatus.REMOVING,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied or moved.current == NodeStatus.REMOVING:
                run.done("retired -> removing" if moved.applied else "already removing")
            elif moved.current == NodeStatus.DELETED:
                run.skipped("already deleted")
            else:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}, not retired",
                    node_status=str(moved.current),
                )
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.finish_remove")
    async def finish_remove(self, input: StageInput) -> StageResult:
        """Second half: removing → deleted once node.uninstall succeeded (or was not needed:
        MAAS released the machine, so the agent went with its OS), with the node's GPU slots
        disabled and its MAAS binding dropped; or, when uninstall failed (note
        "uninstall_failed"), back to retired (§5.8: the node must not be deleted prematurely)."""
        run = Run(input=input, stage=Stage.REMOVE_GPUAAS_NODE_RECORD)
        failed = input.note == "uninstall_failed"
        async with self.deps.sessions() as session, session.begin():
            if failed:
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.REMOVING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason="node.uninstall failed",
                )
                return StageResult(state=input.state, message=f"node {moved.current}")
            moved = await transition_node(
                session,
                run.node_id,
                [NodeStatus.REMOVING],
                NodeStatus.DELETED,
                actor=ACTOR,
                reason=input.decommission.reason,
            )
            if moved.current != NodeStatus.DELETED:
                raise as_application_error(
                    ambiguity(
                        "node_state_changed",
                        f"the node is {moved.current}, not removing",
                        node_status=str(moved.current),
                    )
                )
            # The deleted identity no longer claims the machine: a re-onboarding of the same
            # hardware binds it to the new node record (the job row keeps the system id).
            await session.execute(delete(NodeMaasState).where(NodeMaasState.node_id == run.node_id))
            await session.execute(
                update(GpuSlot)
                .where(GpuSlot.node_id == run.node_id, GpuSlot.status != "reserved")
                .values(
                    status="disabled",
                    quarantine_reason="node deleted by full decommission",
                    quarantined_at=func.clock_timestamp(),
                    updated_at=func.clock_timestamp(),
                )
            )
        return StageResult(state=input.state, message="removing -> deleted")

    @activity.defn(name="decommission.cleanup_secrets")
    async def cleanup_secrets(self, input: StageInput) -> StageResult:
        """§5.4 CleanupSecrets: unused enrollment tokens are consumed (a deleted node can never
        enroll again anyway: redemption refuses it) and the node's own Vault paths deleted.
        A failure does not fail the job: it is recorded as a follow-up (§5.8)."""
        async with self.stage(input, Stage.CLEANUP_SECRETS) as run:
            async with self.deps.sessions() as session, session.begin():
                consumed = await session.scalars(
                    update(NodeEnrollmentToken)
                    .where(
                        NodeEnrollmentToken.node_id == run.node_id,
                        NodeEnrollmentToken.used_at.is_(None),
                    )
                    .values(
                        used_at=func.clock_timestamp(),
                        expires_at=func.least(
                            NodeEnrollmentToken.expires_at, func.clock_timestamp()
                        ),
                    )
                    .returning(NodeEnrollmentToken.id)
                )
                tokens = len(list(consumed))
            deleted, failed = [], []
            for path in node_secret_paths(run.node_id):
                try:
                    await self.deps.secrets.delete(path)
                    deleted.append(path)
                except SecretStoreError as err:
                    failed.append(path)
                    run.state.followups.append(
                        {"kind": "vault_cleanup", "path": path, "message": str(err)[:200]}
                    )
            message = f"{tokens} enrollment token(s) consumed, {len(deleted)} Vault path(s) deleted"
            if failed:
                message += f"; {len(failed)} Vault path(s) left as follow-up"
            run.done(message, tokens=tokens, vault_deleted=deleted, vault_failed=failed)
        assert run.result is not None
        return run.result
