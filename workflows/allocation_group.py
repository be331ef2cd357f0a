"""AllocationGroupWorkflow `allocation-group-{id}` (docs/lifecycles/allocation-group.md): requested
→ provisioning → active → releasing → released, with failed, degraded and release_failed side
states.

A group is an aggregate over ordinary allocations. Each member is its own AllocationWorkflow
(`allocation-{id}`), started here as a child: it places, provisions, bills and releases exactly
as an allocation the tenant asked for alone, and reports each status back (member_status). The
group holds no capacity; its status is derived from its members' and its release intent
(contracts.allocation_group.derive_group_status), and each change is applied to the read model
by an activity as compare-and-set with an event row. A group release asks each member's own
workflow to release (one fan-out per release request the group accepts, however many callers
ask at once).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import (
    RetryPolicy,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, ChildWorkflowError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from contracts.allocation import (
        IDEMPOTENCY_KEY_REUSED,
        STATUS_AT_START,
        AllocationResult,
        ReleaseRequest,
        allocation_workflow_id,
    )
    from contracts.allocation import WORKFLOW_NAME as ALLOCATION_WORKFLOW
    from contracts.allocation_group import (
        MEMBER_ENDED,
        MEMBER_REJECTED,
        MEMBER_STATUS_SIGNAL,
        NOT_RELEASABLE,
        PLACING,
        RELEASE_UPDATE,
        STATUS_QUERY,
        SUBMIT_UPDATE,
        WORKFLOW_NAME,
        AllocationGroupInput,
        AllocationGroupResult,
        CreateGroupInput,
        GroupAccepted,
        GroupMember,
        GroupReleaseAccepted,
        GroupTransition,
        GroupView,
        MemberRejection,
        MemberReleases,
        MemberReleasesResult,
        MemberStatus,
        derive_group_status,
    )
    from contracts.states import (
        ALLOCATION_GROUP_TRANSITIONS,
        AllocationGroupStatus,
        AllocationStatus,
        ReleaseActor,
    )
    from contracts.workflow_input import check_text
    from core import search_attributes as sa

_LOCAL = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=20)
# Why a failed group releases the members it still has: it can never be whole, and a group
# never leaves capacity billed behind it.
GROUP_FAILED_REASON = "allocation group failed: no required member can become usable"
# Issue 37: those releases are the group's, recorded with its actor (they were `user`'s).
GROUP_ACTOR_PATCH = "allocation-group-release-actor"
# Issue 37: a group whose members all ended on their own (each released alone, or failed) has
# nothing left: it completes (→ releasing → released) instead of staying degraded forever.
MEMBERS_ENDED_PATCH = "allocation-group-completes-when-members-ended"
MEMBERS_ENDED_REASON = "every member of the group has ended"
_RELEASE_STATES = (AllocationGroupStatus.RELEASING, AllocationGroupStatus.RELEASE_FAILED)
# A member status that answers a release the group asked of it: the release began, or there is
# nothing left to release.
_MEMBER_STATUSES = frozenset(s.value for s in AllocationStatus)
_ANSWERS_A_RELEASE = MEMBER_ENDED | {AllocationStatus.RELEASING, AllocationStatus.RELEASE_FAILED}


@workflow.defn(name=WORKFLOW_NAME)
class AllocationGroupWorkflow:
    @workflow.init
    def __init__(self, input: AllocationGroupInput) -> None:
        self._input = input
        self._created_at: str | None = None
        self._status = AllocationGroupStatus.REQUESTED
        self._members: dict[str, str] = {m.input.allocation_id: PLACING for m in input.members}
        self._required = {m.input.allocation_id: m.required for m in input.members}
        self._release_intent = False
        # Release requests the group accepted and has not fanned out yet, in order.
        self._release_requests: list[ReleaseRequest] = []
        # Members asked to release that have not reported a release status since.
        self._asked: set[str] = set()
        self._fan_out_running = False
        self._fan_outs = 0
        self._members_started = 0
        # Read-model writes the loop applies, in order.
        self._transitions: list[GroupTransition] = []
        self._rejections: list[MemberRejection] = []

    # ------------------------------------------------------------------ handlers

    @workflow.update(name=SUBMIT_UPDATE)
    async def submit(self, request_fingerprint: str) -> GroupAccepted:
        await workflow.wait_condition(lambda: self._created_at is not None)
        assert self._created_at is not None
        return GroupAccepted(
            group_id=self._input.group_id,
            status=AllocationGroupStatus.REQUESTED.value,
            created_at=self._created_at,
            member_ids=list(self._members),
        )

    @submit.validator
    def _validate_submit(self, request_fingerprint: str) -> None:
        if request_fingerprint != self._input.request_fingerprint:
            raise ApplicationError(
                "this idempotency key was already used with a different request body",
                type=IDEMPOTENCY_KEY_REUSED,
                non_retryable=True,
            )

    @workflow.update(name=RELEASE_UPDATE)
    def request_release(self, request: ReleaseRequest) -> GroupReleaseAccepted:
        """Idempotent under the group: while a release runs, another (not forced) is answered
        without asking the members again. A forced one (admin), or one after release_failed,
        asks every member that has not ended once more."""
        prior = self._status
        group_id = self._input.group_id
        if prior == AllocationGroupStatus.RELEASED or (
            prior == AllocationGroupStatus.RELEASING and not request.force
        ):
            return GroupReleaseAccepted(group_id, prior.value, prior.value, False)
        self._release_intent = True
        self._release_requests.append(request)
        self._observe(request)
        return GroupReleaseAccepted(group_id, prior.value, self._status.value, True)

    @request_release.validator
    def _validate_release(self, request: ReleaseRequest) -> None:
        if request.actor not in {a.value for a in ReleaseActor}:
            raise ApplicationError(f"unknown release actor {request.actor!r}", type="invalid_actor")
        check_text("reason", request.reason)
        if self._status == AllocationGroupStatus.FAILED:
            raise ApplicationError(
                "allocation group is failed; its members were released with it",
                type=NOT_RELEASABLE,
            )

    @workflow.signal(name=MEMBER_STATUS_SIGNAL)
    def member_status(self, report: MemberStatus) -> None:
        # Sent by the members' workflows; a report with a status no allocation has (from any
        # other sender) is dropped: the group's own status is derived from these (issue 38).
        if report.status not in _MEMBER_STATUSES:
            workflow.logger.warning("member status report dropped: unknown status")
            return
        self._member_moved(report.allocation_id, report.status)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> GroupView:
        return GroupView(
            group_id=self._input.group_id,
            status=self._status.value,
            members=dict(self._members),
            release_requested=self._release_intent,
        )

    # ------------------------------------------------------------------ lifecycle

    @workflow.run
    async def run(self, input: AllocationGroupInput) -> AllocationGroupResult:
        self._created_at = await workflow.execute_local_activity(
            "allocation_group.create",
            CreateGroupInput(input, workflow.info().workflow_id),
            result_type=str,
            start_to_close_timeout=_LOCAL,
            retry_policy=_DB_RETRY,
        )
        members = [asyncio.create_task(self._run_member(m)) for m in input.members]
        while True:
            await workflow.wait_condition(
                lambda: (
                    bool(self._transitions or self._rejections or self._fan_out_due())
                    or self._finished()
                )
            )
            while self._rejections:
                await self._record("allocation_group.member_rejected", self._rejections.pop(0))
            while self._transitions:
                await self._record("allocation_group.transition", self._transitions.pop(0))
            if self._fan_out_due():
                await self._fan_out(self._release_requests.pop(0))
            elif self._finished():
                break
        await asyncio.gather(*members)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return AllocationGroupResult(input.group_id, self._status.value)

    async def _run_member(self, member: GroupMember) -> None:
        """Start the member's own AllocationWorkflow and follow it to its end: its result says
        how it ended (a refused placement reports nothing else)."""
        allocation = member.input
        status: str
        reason: str | None
        try:
            handle = await workflow.start_child_workflow(
                ALLOCATION_WORKFLOW,
                allocation,
                id=allocation_workflow_id(allocation.allocation_id),
                result_type=AllocationResult,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(sa.ALLOCATION_STATUS, STATUS_AT_START),
                        SearchAttributePair(sa.PROJECT_ID, allocation.project_id),
                        SearchAttributePair(sa.SKU, allocation.sku),
                    ]
                ),
            )
        except WorkflowAlreadyStartedError as err:
            self._members_started += 1
            self._member_moved(allocation.allocation_id, AllocationStatus.FAILED)
            workflow.logger.warning("member %s not started: %s", allocation.allocation_id, err)
            return
        self._members_started += 1
        try:
            result = await handle
            status, reason = result.status, result.reason
        except ChildWorkflowError as err:
            status, reason = AllocationStatus.FAILED.value, str(err.cause or err)
        if status == MEMBER_REJECTED and self._members[allocation.allocation_id] == PLACING:
            self._rejections.append(
                MemberRejection(self._input.group_id, allocation.allocation_id, reason)
            )
        self._member_moved(allocation.allocation_id, status)

    def _member_moved(self, allocation_id: str, status: str) -> None:
        current = self._members.get(allocation_id)
        if current is None or current in MEMBER_ENDED:
            return  # not a member, or its end was already reported
        self._members[allocation_id] = status
        if status in _ANSWERS_A_RELEASE:
            self._asked.discard(allocation_id)
        self._observe()

    def _observe(self, request: ReleaseRequest | None = None) -> None:
        """Derive the group's status and queue the transitions that reach it."""
        in_flight = bool(self._release_requests) or self._fan_out_running or bool(self._asked)
        target = derive_group_status(
            self._status,
            [(status, self._required[m]) for m, status in self._members.items()],
            release_intent=self._release_intent,
            releases_in_flight=in_flight,
        )
        if self._all_ended_alone(target) and workflow.patched(MEMBERS_ENDED_PATCH):
            target = AllocationGroupStatus.RELEASED
            request = ReleaseRequest(actor=ReleaseActor.GROUP.value, reason=MEMBERS_ENDED_REASON)
        if target == self._status:
            return
        releasing_done = (AllocationGroupStatus.RELEASED, AllocationGroupStatus.RELEASE_FAILED)
        if target in releasing_done and self._status not in _RELEASE_STATES:
            self._move(AllocationGroupStatus.RELEASING, request)
        self._move(target, request)
        if target == AllocationGroupStatus.FAILED and self._unended():
            actor = ReleaseActor.GROUP if workflow.patched(GROUP_ACTOR_PATCH) else ReleaseActor.USER
            self._release_requests.append(
                ReleaseRequest(actor=actor.value, reason=GROUP_FAILED_REASON)
            )

    def _all_ended_alone(self, target: AllocationGroupStatus) -> bool:
        """Every member ended without a group release, the group past placement (a group
        still coming up whose members all ended is failed by the status rule)."""
        return (
            not self._release_intent
            and target in (AllocationGroupStatus.ACTIVE, AllocationGroupStatus.DEGRADED)
            and all(status in MEMBER_ENDED for status in self._members.values())
        )

    def _move(self, to: AllocationGroupStatus, request: ReleaseRequest | None) -> None:
        if to not in ALLOCATION_GROUP_TRANSITIONS[self._status]:
            workflow.logger.warning("group transition %s → %s not allowed", self._status, to)
            return
        self._transitions.append(
            GroupTransition(
                group_id=self._input.group_id,
                from_status=self._status.value,
                to_status=to.value,
                actor=request.actor if request else None,
                reason=request.reason or None if request else None,
                details={"force": "true"} if request and request.force else {},
            )
        )
        self._status = to

    def _unended(self) -> list[str]:
        return [m for m, status in self._members.items() if status not in MEMBER_ENDED]

    def _fan_out_due(self) -> bool:
        return bool(self._release_requests) and self._members_started == len(self._members)

    def _finished(self) -> bool:
        if self._transitions or self._rejections or self._release_requests:
            return False
        if self._status == AllocationGroupStatus.RELEASED:
            return True
        # A failed group ends once its members' releases settled (a member whose own release
        # failed is its own workflow's, and an operator's, to finish).
        return (
            self._status == AllocationGroupStatus.FAILED
            and not self._fan_out_running
            and all(
                status in MEMBER_ENDED or status == AllocationStatus.RELEASE_FAILED
                for status in self._members.values()
            )
        )

    async def _fan_out(self, request: ReleaseRequest) -> None:
        targets = self._unended()
        if not targets:
            self._observe(request)
            return
        self._fan_outs += 1
        self._asked.update(targets)
        self._fan_out_running = True
        result: MemberReleasesResult = await workflow.execute_activity(
            "allocation_group.release_members",
            MemberReleases(workflow.info().workflow_id, self._fan_outs, targets, request),
            result_type=MemberReleasesResult,
            start_to_close_timeout=timedelta(minutes=2),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10),
        )
        self._fan_out_running = False
        self._asked.difference_update(result.skipped)
        self._observe(request)

    async def _record(self, activity: str, arg: GroupTransition | MemberRejection) -> None:
        await workflow.execute_local_activity(
            activity, arg, start_to_close_timeout=_LOCAL, retry_policy=_DB_RETRY
        )
