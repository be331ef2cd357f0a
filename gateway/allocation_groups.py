"""Allocation-group use cases behind the tenant and admin controllers
(docs/lifecycles/allocation-group.md).

Creation is update-with-start on `allocation-group-{id}`: the workflow's first activity writes
the group `requested` and the `submit` update answers with it; the group then starts each member
as an ordinary AllocationWorkflow (built here from the same pieces POST /allocations uses).
Release is the group's `request_group_release` update, which fans out to the members. The
gateway reads the read model and never writes it.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from contracts.allocation import (
    BALANCE_DEPLETED,
    IDEMPOTENCY_KEY_REUSED,
    SKU_UNAVAILABLE,
    AllocationInput,
    ReleaseRequest,
)
from contracts.allocation_group import (
    MEMBER_REJECTED,
    NOT_RELEASABLE,
    PLACING,
    RELEASE_UPDATE,
    SUBMIT_UPDATE,
    WORKFLOW_NAME,
    AllocationGroupInput,
    AllocationGroupResult,
    GroupAccepted,
    GroupMember,
    GroupReleaseAccepted,
    Spread,
    allocation_group_workflow_id,
)
from contracts.billing_meter import BalanceState
from contracts.states import AllocationGroupStatus
from core.config import Settings
from core.timestamps import parse_iso
from gateway import allocations, timeline
from gateway.allocation_group_schemas import (
    AllocationGroupCreate,
    AllocationGroupCreated,
    AllocationGroupDetail,
    AllocationGroupList,
    AllocationGroupSummary,
    AllocationGroupTimeline,
    GroupMemberSpec,
    GroupMemberView,
    GroupReleaseResponse,
    GroupTimelineEntry,
)
from gateway.errors import ApiError, Conflict, NotFound, Unprocessable
from gateway.pagination import newest_first_page
from gateway.temporal import TemporalOps
from schema.models import (
    Allocation,
    AllocationGroup,
    AllocationGroupEvent,
    AllocationGroupMember,
    BillingAccount,
    Sku,
    SshKey,
)

# Fixed forever: group and member ids derived from idempotency keys must not change.
GROUP_ID_NAMESPACE = uuid.UUID("0d6f1b4e-8c2a-4f57-9e3b-5a7c9d1e2f30")
MEMBER_ID_NAMESPACE = uuid.UUID("7a2e9c41-3b6d-4e8f-a150-c4d2e6f8b913")
NO_REQUIRED_MEMBER = "no_required_member"


def group_id_for(project_id: uuid.UUID, idempotency_key: str | None) -> uuid.UUID:
    if idempotency_key is None:
        return uuid.uuid4()
    return uuid.uuid5(GROUP_ID_NAMESPACE, f"{project_id}:{idempotency_key}")


def member_id_for(group_id: uuid.UUID, position: int) -> uuid.UUID:
    return uuid.uuid5(MEMBER_ID_NAMESPACE, f"{group_id}:{position}")


def request_fingerprint(body: AllocationGroupCreate) -> str:
    """sha256 of the canonical JSON of the validated body: members in order (each by the
    allocation fingerprint of its request, and whether it is required) and the spread."""
    canonical = {
        "members": [
            [allocations.request_fingerprint(member), member.required] for member in body.members
        ],
        "spread": body.placement.spread,
    }
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()


# --- create ---


async def _refuse_depleted(db: AsyncSession, project_id: uuid.UUID) -> None:
    """Issue 37: 402 balance_depleted, as a single allocation gets, before anything is created
    (docs/lifecycles/balance.md: no positive balance, no allocation; no account yet is a balance of
    0). Each member's placement still checks the state in the statement that reserves its
    capacity."""
    state = await db.scalar(
        select(BillingAccount.state).where(BillingAccount.project_id == project_id)
    )
    if state in (None, BalanceState.DEPLETED.value):
        raise ApiError(
            "the project's balance is depleted; add credit to allocate",
            code=BALANCE_DEPLETED,
            status_code=402,
        )


async def create(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    *,
    project_id: uuid.UUID,
    body: AllocationGroupCreate,
    idempotency_key: str | None,
) -> tuple[AllocationGroupCreated, bool]:
    """The group as created, and whether it was answered from an earlier request's record."""
    key = allocations.validate_idempotency_key(idempotency_key)
    if not any(member.required for member in body.members):
        raise Unprocessable(
            "an allocation group needs at least one required member", code=NO_REQUIRED_MEMBER
        )
    group_id = group_id_for(project_id, key)
    fingerprint = request_fingerprint(body)
    ssh_key_ids = allocations.unique_ids([k for m in body.members for k in m.ssh_key_ids])
    owned = set(
        await db.scalars(
            select(SshKey.id).where(SshKey.project_id == project_id, SshKey.id.in_(ssh_key_ids))
        )
    )
    allocations.refuse_unowned_keys(ssh_key_ids, owned)
    if key is not None:
        earlier = await _answer_from_record(db, group_id, project_id, fingerprint)
        if earlier is not None:
            return earlier, True
    await _refuse_depleted(db, project_id)
    await _refuse_unoffered(db, body)
    await db.close()  # no connection held across the Temporal call

    spread = Spread(body.placement.spread)
    policy = allocations.policy_from(settings)
    workflow_input = AllocationGroupInput(
        group_id=str(group_id),
        project_id=str(project_id),
        idempotency_key=key,
        request_fingerprint=fingerprint,
        spread=spread.value,
        members=[
            GroupMember(
                AllocationInput(
                    allocation_id=str(member_id_for(group_id, position)),
                    project_id=str(project_id),
                    sku=member.sku,
                    gpus=member.gpus,
                    region=member.region,
                    ssh_key_ids=[str(k) for k in allocations.unique_ids(member.ssh_key_ids)],
                    idempotency_key=None,  # the group's key is the one that deduplicates
                    request_fingerprint=allocations.request_fingerprint(member),
                    policy=policy,
                    allocation_group_id=str(group_id),
                    same_node_forbidden=spread == Spread.SAME_NODE_FORBIDDEN,
                ),
                required=member.required,
            )
            for position, member in enumerate(body.members)
        ],
    )
    try:
        accepted = await allocations.update_with_start(
            temporal,
            lambda: WithStartWorkflowOperation(
                WORKFLOW_NAME,
                workflow_input,
                id=allocation_group_workflow_id(str(group_id)),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                task_queue=settings.control_plane_task_queue,
                result_type=AllocationGroupResult,
            ),
            SUBMIT_UPDATE,
            fingerprint,
            result_type=GroupAccepted,
            accepted_as=("group", group_id),
        )
    except WorkflowAlreadyStartedError:
        # The workflow for this key has ended: its record answers.
        closed = await _answer_from_record(db, group_id, project_id, fingerprint)
        if closed is None:
            raise
        return closed, True
    created_at = parse_iso(accepted.created_at)
    assert created_at is not None
    created = AllocationGroupCreated(
        group_id=group_id,
        status=accepted.status,
        spread=spread.value,
        created_at=created_at,
        members=[
            GroupMemberSpec(
                allocation_id=uuid.UUID(m.input.allocation_id),
                position=position,
                required=m.required,
                sku=m.input.sku,
                region=m.input.region,
                gpu_count=m.input.gpus,
            )
            for position, m in enumerate(workflow_input.members)
        ],
    )
    return created, False


async def _refuse_unoffered(db: AsyncSession, body: AllocationGroupCreate) -> None:
    """409 sku_unavailable, before anything starts, for a member whose SKU the catalog does not
    offer in its region, or not with its GPU count: what POST /allocations answers for the same
    member (placement checks it again, atomically, when the member is placed)."""
    pairs = {(m.sku, m.region) for m in body.members}
    rows = await db.execute(
        select(Sku.name, Sku.region, Sku.allowed_gpu_counts).where(
            Sku.active.is_(True),
            tuple_(Sku.name, Sku.region).in_(sorted(pairs)),
        )
    )
    offered = {(name, region): set(counts) for name, region, counts in rows}
    for position, member in enumerate(body.members):
        counts = offered.get((member.sku, member.region))
        if counts is None:
            message = f"SKU {member.sku!r} is not offered in {member.region!r}"
        elif member.gpus not in counts:
            allowed = ", ".join(str(c) for c in sorted(counts))
            message = f"SKU {member.sku!r} is offered with {allowed} GPUs, not {member.gpus}"
        else:
            continue
        raise Conflict(
            f"member {position}: {message}",
            code=SKU_UNAVAILABLE,
            details={"member": position},
        )


async def _answer_from_record(
    db: AsyncSession, group_id: uuid.UUID, project_id: uuid.UUID, fingerprint: str
) -> AllocationGroupCreated | None:
    """The answer an earlier request with this key got (status requested, as it was), if it
    created its group; another body under the same key is refused."""
    group = await db.scalar(
        select(AllocationGroup).where(
            AllocationGroup.id == group_id, AllocationGroup.project_id == project_id
        )
    )
    if group is None:
        return None
    if group.request_fingerprint != fingerprint:
        raise allocations.rejection(IDEMPOTENCY_KEY_REUSED)
    members = await _members(db, group_id)
    return AllocationGroupCreated(
        group_id=group.id,
        status=AllocationGroupStatus.REQUESTED.value,
        spread=group.spread,
        created_at=group.created_at,
        members=[
            GroupMemberSpec(
                allocation_id=m.allocation_id,
                position=m.position,
                required=m.required,
                sku=m.sku,
                region=m.region,
                gpu_count=m.gpu_count,
            )
            for m, _ in members
        ],
    )


# --- reads ---


async def get_row(
    db: AsyncSession, group_id: uuid.UUID, project_id: uuid.UUID | None
) -> AllocationGroup:
    """The group, scoped to a project for tenants: another project's id is a 404."""
    query = select(AllocationGroup).where(AllocationGroup.id == group_id)
    if project_id is not None:
        query = query.where(AllocationGroup.project_id == project_id)
    row = await db.scalar(query)
    if row is None:
        raise NotFound("allocation group not found")
    return row


async def _members(
    db: AsyncSession, group_id: uuid.UUID
) -> list[tuple[AllocationGroupMember, Allocation | None]]:
    rows = await db.execute(
        select(AllocationGroupMember, Allocation)
        .outerjoin(Allocation, Allocation.id == AllocationGroupMember.allocation_id)
        .where(AllocationGroupMember.group_id == group_id)
        .order_by(AllocationGroupMember.position)
    )
    return [(member, allocation) for member, allocation in rows.all()]


def _member_view(member: AllocationGroupMember, allocation: Allocation | None) -> GroupMemberView:
    if allocation is not None:
        status, node_id, reason = allocation.status, allocation.node_id, allocation.failure_reason
    elif member.rejection_reason is not None:
        status, node_id, reason = MEMBER_REJECTED, None, member.rejection_reason
    else:
        status, node_id, reason = PLACING, None, None
    return GroupMemberView(
        allocation_id=member.allocation_id,
        position=member.position,
        required=member.required,
        sku=member.sku,
        region=member.region,
        gpu_count=member.gpu_count,
        status=status,
        node_id=node_id,
        failure_reason=reason,
    )


async def detail(
    db: AsyncSession, group_id: uuid.UUID, project_id: uuid.UUID | None
) -> AllocationGroupDetail:
    group = await get_row(db, group_id, project_id)
    members = await _members(db, group_id)
    return AllocationGroupDetail(
        group_id=group.id,
        project_id=group.project_id,
        status=group.status,
        spread=group.spread,
        idempotency_key=group.idempotency_key,
        workflow_id=group.workflow_id,
        release_requested_by=group.release_requested_by,
        created_at=group.created_at,
        updated_at=group.updated_at,
        members=[_member_view(m, a) for m, a in members],
    )


async def list_rows(
    db: AsyncSession,
    *,
    project_id: uuid.UUID | None,
    status: str | None,
    limit: int,
    cursor: str | None,
) -> AllocationGroupList:
    query = select(AllocationGroup)
    if project_id is not None:
        query = query.where(AllocationGroup.project_id == project_id)
    if allocations.parse_status(status, AllocationGroupStatus, "allocation group") is not None:
        query = query.where(AllocationGroup.status == status)
    rows, next_cursor = await newest_first_page(
        db,
        query,
        created=AllocationGroup.created_at,
        row_id=AllocationGroup.id,
        limit=limit,
        cursor=cursor,
    )
    return AllocationGroupList(
        items=[
            AllocationGroupSummary(
                group_id=r.id,
                project_id=r.project_id,
                status=r.status,
                spread=r.spread,
                created_at=r.created_at,
                updated_at=r.updated_at,
            )
            for r in rows
        ],
        next_cursor=next_cursor,
    )


async def build_timeline(
    db: AsyncSession, temporal: TemporalOps, *, group_id: uuid.UUID, project_id: uuid.UUID | None
) -> AllocationGroupTimeline:
    """The group's transitions merged with each placed member's own timeline (gateway.timeline),
    in time order."""
    group = await get_row(db, group_id, project_id)
    status = group.status
    events = (
        await db.scalars(
            select(AllocationGroupEvent)
            .where(AllocationGroupEvent.group_id == group_id)
            .order_by(AllocationGroupEvent.occurred_at, AllocationGroupEvent.id)
        )
    ).all()
    placed = [a for _, a in await _members(db, group_id) if a is not None]
    entries = [
        # A member's refused placement is the group's event, shown with the member's id.
        GroupTimelineEntry(allocation_id=_member_of(e), item=timeline.event_item(e))
        for e in events
    ]
    warnings: set[str] = set()
    for member in await timeline.build_many(db, temporal, placed):
        entries.extend(
            GroupTimelineEntry(allocation_id=member.allocation_id, item=i) for i in member.items
        )
        warnings.update(member.warnings)
    entries.sort(key=lambda e: (e.item.started_at, e.allocation_id is not None))
    return AllocationGroupTimeline(
        group_id=group_id, status=status, items=entries, warnings=sorted(warnings)
    )


def _member_of(event: AllocationGroupEvent) -> uuid.UUID | None:
    allocation_id = (event.details or {}).get("allocation_id")
    return uuid.UUID(allocation_id) if isinstance(allocation_id, str) else None


# --- release ---

# Group states in which a plain (not forced) release asks nothing more of the members.
_RELEASE_ANSWERED = frozenset({AllocationGroupStatus.RELEASING, AllocationGroupStatus.RELEASED})


async def release(
    db: AsyncSession,
    temporal: TemporalOps,
    *,
    group_id: uuid.UUID,
    project_id: uuid.UUID | None,
    request: ReleaseRequest,
) -> tuple[GroupReleaseResponse, str, str]:
    """Ask the group's workflow to release its members. Returns the answer, the status the read
    model showed before and the workflow id (for audit)."""
    group = await get_row(db, group_id, project_id)
    prior, workflow_id = group.status, group.workflow_id
    await db.close()
    if prior in _RELEASE_ANSWERED and not request.force:
        # What the workflow would answer (the read model never runs ahead of it), without an
        # update: a client repeating its release costs Temporal nothing.
        answer = GroupReleaseResponse(
            group_id=group_id,
            status=prior,
            prior_status=prior,
            expected_status=prior,
            members_asked=False,
        )
        return answer, prior, workflow_id
    accepted = await allocations.update_running(
        temporal,
        workflow_id,
        RELEASE_UPDATE,
        request,
        result_type=GroupReleaseAccepted,
        refusals={NOT_RELEASABLE: lambda _: _not_releasable(prior)},
    )
    if accepted is None:
        # The workflow has ended: released is released (idempotent); failed has nothing left.
        now = (await get_row(db, group_id, project_id)).status
        if now != AllocationGroupStatus.RELEASED:
            raise _not_releasable(now)
        accepted = GroupReleaseAccepted(str(group_id), now, now, False)
    answer = GroupReleaseResponse(
        group_id=group_id,
        status=accepted.expected_status,
        prior_status=accepted.prior_status,
        expected_status=accepted.expected_status,
        members_asked=accepted.members_asked,
    )
    return answer, prior, workflow_id


def _not_releasable(status: str) -> Conflict:
    return Conflict(
        f"allocation group is {status}; there is nothing to release",
        code=NOT_RELEASABLE,
        details={"status": status},
    )
