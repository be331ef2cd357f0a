"""Emptying the node of tenant work (docs/lifecycles/decommission.md#soft-reset,
docs/lifecycles/decommission.md#full-decommission): live allocations force-released through each
allocation's own AllocationWorkflow (never around it, so billing closes and the host is cleaned as
for any release), and the soft reset's wait until no allocation and no host task of another workflow
is live on the node.

Separate because it is the one stage group that talks to other workflows (Temporal updates)
rather than to the node record or MAAS.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.decommission.stage_runtime import Run, StageRuntime
from activities.onboarding.stage_errors import StageError
from contracts.allocation import (
    RELEASE_UPDATE,
    ReleaseAccepted,
    ReleaseRequest,
    allocation_workflow_id,
)
from contracts.decommission import Mode, Stage, StageInput, StageResult
from contracts.states import AllocationStatus, NodeTaskStatus, ReleaseActor
from core.failures import FailureClass
from schema.models import Allocation, NodeTask


class DrainStages(StageRuntime):
    @activity.defn(name="decommission.force_release_allocations")
    async def force_release_allocations(self, input: StageInput) -> StageResult:
        """§5.4 ForceReleaseAllocations: each live allocation on the node is released by its own
        AllocationWorkflow (the `request_release` update, actor admin, force), never around it,
        so billing closes and the host is cleaned as for any release; then we wait until each
        is released. release_failed means allocations remain attached: manual intervention."""
        async with self.stage(input, Stage.FORCE_RELEASE_ALLOCATIONS) as run:
            live = await self._live_allocations(run.node_id)
            if not live:
                run.skipped("no live allocations on the node")
            else:
                force = (
                    input.decommission.force_release_allocations
                    or input.decommission.mode == Mode.FULL_DECOMMISSION
                )
                holding = [a for a, s in live if s != AllocationStatus.RELEASING]
                if holding and not force:
                    raise StageError(
                        FailureClass.STATE_AMBIGUITY,
                        "allocations_attached",
                        f"{len(holding)} live allocation(s) hold the node and force-release was "
                        "not requested",
                        details={"allocations": [str(a) for a in holding][:20]},
                        non_retryable=True,
                    )
                requested = await self._request_releases(run, holding)
                await self._wait_released(run, [a for a, _ in live])
                run.state.allocations_released = sorted(
                    {*run.state.allocations_released, *(str(a) for a, _ in live)}
                )
                run.done(
                    f"{len(live)} allocation(s) released through their workflows",
                    allocations=[str(a) for a, _ in live][:50],
                    requested=requested,
                )
        assert run.result is not None
        return run.result

    async def _request_releases(self, run: Run, ids: list[uuid.UUID]) -> list[str]:
        if not ids:
            return []
        client = self.deps.client
        if client is None:
            raise RuntimeError("force_release_allocations needs a Temporal client")
        requested: list[str] = []
        reason = f"node decommission {run.input.decommission.decommission_id}: " + (
            run.input.decommission.reason or run.input.decommission.mode
        )
        for allocation_id in ids:
            handle = client.get_workflow_handle(allocation_workflow_id(str(allocation_id)))
            try:
                await handle.execute_update(
                    RELEASE_UPDATE,
                    ReleaseRequest(actor=ReleaseActor.ADMIN.value, reason=reason, force=True),
                    id=f"decommission-{run.input.decommission.decommission_id}-release",
                    result_type=ReleaseAccepted,
                )
                requested.append(str(allocation_id))
            except WorkflowUpdateFailedError:
                pass  # not releasable (failed meanwhile): the wait below reads where it stands
            except RPCError as err:
                raise StageError(
                    FailureClass.UPSTREAM_TRANSIENT,
                    "allocation_workflow_unreachable",
                    f"allocation {allocation_id}: {err.message}",
                ) from err
            if activity.in_activity():
                activity.heartbeat({"requested": len(requested)})
        return requested

    async def _wait_released(self, run: Run, ids: list[uuid.UUID]) -> None:
        failed: list[str] = []

        async def settled() -> bool | None:
            async with self.deps.sessions() as session:
                rows = (
                    await session.execute(
                        select(Allocation.id, Allocation.status).where(Allocation.id.in_(ids))
                    )
                ).all()
            failed[:] = [str(i) for i, s in rows if s == AllocationStatus.RELEASE_FAILED]
            if failed:
                return True
            done = all(s in (AllocationStatus.RELEASED, AllocationStatus.FAILED) for _, s in rows)
            return True if done else None

        timeout = run.input.decommission.policy.allocation_release_timeout_seconds
        if await self._poll(run, timeout, settled) is None:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "allocations_release_failed",
                "allocations did not finish releasing in time; they remain attached",
                details={"allocations": [str(i) for i in ids][:20]},
                non_retryable=True,
            )
        if failed:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "allocations_release_failed",
                f"{len(failed)} allocation(s) ended in release_failed; they remain attached",
                details={"allocations": failed[:20]},
                non_retryable=True,
            )

    @activity.defn(name="decommission.await_quiet_node")
    async def await_quiet_node(self, input: StageInput) -> StageResult:
        """Soft reset's DrainNode (§5.2), after the agent's node.drain: the allocations' own
        releases revoked their users (allocation.deprovision_user); this waits until no
        allocation and no host task is live on the node any more. The node returns to service
        at enable_node, which runs node.undrain first."""
        async with self.stage(input, Stage.DRAIN_NODE) as run:
            pending: list[str] = []

            async def quiet() -> bool | None:
                async with self.deps.sessions() as session:
                    tasks = (
                        await session.scalars(
                            select(NodeTask.kind).where(
                                NodeTask.node_id == run.node_id,
                                NodeTask.status.in_(
                                    [NodeTaskStatus.QUEUED.value, NodeTaskStatus.DISPATCHED.value]
                                ),
                                NodeTask.workflow_id != f"decommission-{run.decommission_id}",
                            )
                        )
                    ).all()
                allocations = await self._live_allocations(run.node_id)
                pending[:] = [*tasks, *(f"allocation {a} {s}" for a, s in allocations)]
                return None if pending else True

            policy = input.decommission.policy
            if await self._poll(run, policy.drain_wait_seconds, quiet) is None:
                raise StageError(
                    FailureClass.STATE_AMBIGUITY,
                    "drain_not_converging",
                    f"{len(pending)} host task(s) or allocation(s) are still live on the node",
                    details={"pending": pending[:20]},
                    non_retryable=True,
                )
            run.done("no live allocations or host tasks on the node")
        assert run.result is not None
        return run.result
