"""MaasNodeBatchOnboardWorkflow `onboarding-batch-{id}` (docs/lifecycles/onboarding.md#batches): one
MaasNodeOnboardWorkflow child per node, at most `max_parallel` in flight. Across batches and
single onboardings the site's batch_max_parallel is enforced by the children themselves (each
holds a site permit while its stages run, workflows/onboarding.py), so several batches started
together never exceed it.

A child is in flight until it *settles* (its first completed / failed_* / cancelled state, told
by signal): a failed node then waits for an operator without holding a slot, so one node's
failure never blocks the others, and the batch ends once every node has settled. Children are
abandoned when the batch closes (they outlive it, waiting for their operator actions), and each
keeps its own per-node history in the read model. The summary counts completed (and
reconciled) nodes as succeeded, everything else as failed.

The parent's history is bounded per run (issue 27): a run starts at most `children_per_run`
children, waits for those to settle, then continues as new with the outcomes so far
(BatchCarry) and the remaining nodes as the next run's share. Waiting keeps each child's
result awaited by the run that started it, so one that closes without signalling (terminated)
still settles; the cost is one child's duration of a thinner window per run. Children signal the
batch by workflow id, so a settle always reaches the current run; progress for people comes
from the read model (`GET /api/v1/admin/onboardings?batch_id=`), whole across runs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from contracts.onboarding import (
        BATCH_CHILDREN_PER_RUN,
        BATCH_CONTINUE_AS_NEW_PATCH,
        BATCH_WORKFLOW_NAME,
        CHILD_SETTLED_SIGNAL,
        PROGRESS_QUERY,
        WORKFLOW_NAME,
        BatchCarry,
        BatchInput,
        BatchNode,
        BatchSummary,
        ChildSettled,
        JobStatus,
        OnboardInput,
        OnboardResult,
        onboarding_workflow_id,
    )
    from core import search_attributes as sa

SUCCEEDED = frozenset({JobStatus.COMPLETED.value, JobStatus.RECONCILED.value})


@workflow.defn(name=BATCH_WORKFLOW_NAME)
class MaasNodeBatchOnboardWorkflow:
    def __init__(self) -> None:
        self._settled: dict[str, ChildSettled] = {}
        self._in_flight: set[str] = set()
        self._max_in_flight = 0
        self._started = 0
        self._total = 0

    @workflow.run
    async def run(self, input: BatchInput) -> BatchSummary:
        carried = input.carried or BatchCarry()
        self._settled = {s.onboarding_id: s for s in carried.settled}
        self._max_in_flight = carried.max_in_flight
        self._started = len(carried.settled)  # the runs before this one settled all they started
        self._total = len(input.nodes)
        limit = max(1, input.max_parallel)
        # None: histories recorded before the bound run the whole batch in one run.
        run_share = (
            max(1, input.children_per_run or BATCH_CHILDREN_PER_RUN)
            if workflow.patched(BATCH_CONTINUE_AS_NEW_PATCH)
            else None
        )
        pending = list(input.nodes[self._started :])
        started_here = 0
        watchers: list[asyncio.Task[None]] = []
        while pending or self._in_flight:
            while (
                pending
                and len(self._in_flight) < limit
                and (run_share is None or started_here < run_share)
            ):
                node = pending.pop(0)
                watchers.append(asyncio.create_task(self._start_child(input, node)))
                self._in_flight.add(node.onboarding_id)
                self._started += 1
                started_here += 1
                self._max_in_flight = max(self._max_in_flight, len(self._in_flight))
            if not self._in_flight:  # this run's share has settled; the rest is the next run's
                workflow.continue_as_new(
                    replace(
                        input,
                        carried=BatchCarry(
                            settled=list(self._settled.values()),
                            max_in_flight=self._max_in_flight,
                        ),
                    )
                )
            await workflow.wait_condition(lambda: any(o in self._settled for o in self._in_flight))
            self._in_flight -= set(self._settled)
        workflow.upsert_search_attributes([sa.LIFECYCLE_STATUS.value_set("completed")])
        details = [
            OnboardResult(
                onboarding_id=node.onboarding_id,
                hostname=node.hostname,
                status=self._settled[node.onboarding_id].status,
                node_id=node.node_id,
                failure_class=self._settled[node.onboarding_id].failure_class,
                error_code=self._settled[node.onboarding_id].error_code,
            )
            for node in input.nodes
        ]
        succeeded = sum(1 for d in details if d.status in SUCCEEDED)
        return BatchSummary(
            batch_id=input.batch_id,
            succeeded=succeeded,
            failed=len(details) - succeeded,
            details=details,
            max_in_flight=self._max_in_flight,
        )

    async def _start_child(self, input: BatchInput, node: BatchNode) -> None:
        """Start one child and, should it close without having told us (terminated, or a bug),
        settle it from its result so the batch cannot hang."""
        handle = await workflow.start_child_workflow(
            WORKFLOW_NAME,
            OnboardInput(
                onboarding_id=node.onboarding_id,
                site_id=input.site_id,
                profile_id=input.profile_id,
                sku_id=input.sku_id,
                hostname=node.hostname,
                ipmi_ip=node.ipmi_ip,
                node_id=node.node_id,
                batch_id=input.batch_id,
                requested_by=input.requested_by,
            ),
            id=onboarding_workflow_id(node.onboarding_id),
            task_queue=workflow.info().task_queue,
            parent_close_policy=ParentClosePolicy.ABANDON,
            result_type=OnboardResult,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(sa.SITE_ID, input.site_id),
                    SearchAttributePair(sa.HOSTNAME, node.hostname),
                    SearchAttributePair(sa.BATCH_ID, input.batch_id),
                    SearchAttributePair(sa.NODE_ID, node.node_id),
                    SearchAttributePair(sa.LIFECYCLE_STATUS, JobStatus.PENDING.value),
                    SearchAttributePair(sa.CURRENT_STAGE, "load_site_config"),
                ]
            ),
        )
        try:
            result: OnboardResult = await handle
            status, failure_class, error_code = (
                result.status,
                result.failure_class,
                result.error_code,
            )
        except ChildWorkflowError as err:
            status, failure_class, error_code = "failed_manual_intervention", None, str(err)[:200]
        self._settled.setdefault(
            node.onboarding_id, ChildSettled(node.onboarding_id, status, failure_class, error_code)
        )

    @workflow.signal(name=CHILD_SETTLED_SIGNAL)
    def child_settled(self, settled: ChildSettled) -> None:
        self._settled.setdefault(settled.onboarding_id, settled)

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, int]:
        return {
            "total": self._total,
            "started": self._started,
            "in_flight": len(self._in_flight),
            "settled": len(self._settled),
            "max_in_flight": self._max_in_flight,
        }
