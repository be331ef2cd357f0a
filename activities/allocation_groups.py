"""AllocationGroupWorkflow's activities: the group read model (created, each transition as
compare-and-set with its event row, a member's refused placement) and the release fan-out,
which asks each member's own AllocationWorkflow to release through its `request_release`
update. The DB ones run as local activities, so each is idempotent: a rerun finds its work done.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from collections.abc import Callable
from typing import Any, overload

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import RELEASE_UPDATE, ReleaseAccepted, allocation_workflow_id
from contracts.allocation_group import (
    CreateGroupInput,
    GroupTransition,
    MemberRejection,
    MemberReleases,
    MemberReleasesResult,
)
from contracts.states import ALLOCATION_GROUP_TRANSITIONS, AllocationGroupStatus
from schema.models import AllocationGroup, AllocationGroupEvent, AllocationGroupMember

# What PostgreSQL cannot store in text (NUL; lone surrogates do not encode as UTF-8) and the
# other control characters the gateway refuses (gateway.schemas.TEXT_FORBIDDEN).
_UNSTORABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ud800-\udfff]")


@overload
def storable(text: str) -> str: ...
@overload
def storable(text: None) -> None: ...
def storable(text: str | None) -> str | None:
    """Free text as the group's records can hold it. The gateway refuses such text at the
    edge; should some still arrive (an older gateway, a direct Temporal client), the transition
    is recorded with those characters replaced: a retried write that can never succeed would
    fail the group's workflow and leave the group unreleasable."""
    return None if text is None else _UNSTORABLE.sub("\ufffd", text)


CLOCK = func.clock_timestamp()
# The event a group's creation records (its status then: requested).
REQUESTED_EVENT = "requested"
MEMBER_REJECTED_EVENT = "member_rejected"


class AllocationGroupActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        return [self.create, self.transition, self.member_rejected, self.release_members]

    @activity.defn(name="allocation_group.create")
    async def create(self, input: CreateGroupInput) -> str:
        """The group `requested`, its members and its first event; answers its created_at (ISO
        8601). A rerun finds the row and answers the same."""
        group = input.group
        group_id = uuid.UUID(group.group_id)
        async with self._sessions() as session, session.begin():
            inserted = await session.scalar(
                pg_insert(AllocationGroup)
                .values(
                    id=group_id,
                    project_id=uuid.UUID(group.project_id),
                    idempotency_key=group.idempotency_key,
                    request_fingerprint=group.request_fingerprint,
                    spread=group.spread,
                    status=AllocationGroupStatus.REQUESTED.value,
                    workflow_id=input.workflow_id,
                )
                .on_conflict_do_nothing(index_elements=[AllocationGroup.id])
                .returning(AllocationGroup.created_at)
            )
            if inserted is None:
                created = await session.scalar(
                    select(AllocationGroup.created_at).where(AllocationGroup.id == group_id)
                )
                assert created is not None
                return created.isoformat()
            session.add_all(
                AllocationGroupMember(
                    allocation_id=uuid.UUID(member.input.allocation_id),
                    group_id=group_id,
                    position=position,
                    required=member.required,
                    sku=member.input.sku,
                    region=member.input.region,
                    gpu_count=member.input.gpus,
                )
                for position, member in enumerate(group.members)
            )
            session.add(
                AllocationGroupEvent(
                    group_id=group_id,
                    event=REQUESTED_EVENT,
                    to_status=AllocationGroupStatus.REQUESTED.value,
                    details={"members": len(group.members), "spread": group.spread},
                )
            )
            created_at: dt.datetime = inserted
            return created_at.isoformat()

    @activity.defn(name="allocation_group.transition")
    async def transition(self, input: GroupTransition) -> None:
        """from_status → to_status as compare-and-set, with its event row; a rerun (the row
        already there) changes nothing."""
        source = AllocationGroupStatus(input.from_status)
        target = AllocationGroupStatus(input.to_status)
        if target not in ALLOCATION_GROUP_TRANSITIONS[source]:
            raise ValueError(f"allocation group transition {source} → {target} is not allowed")
        values: dict[str, Any] = {"status": target.value, "updated_at": CLOCK}
        if target == AllocationGroupStatus.RELEASING and input.actor:
            values["release_requested_by"] = input.actor
        async with self._sessions() as session, session.begin():
            moved = await session.execute(
                update(AllocationGroup)
                .where(
                    AllocationGroup.id == uuid.UUID(input.group_id),
                    AllocationGroup.status == source.value,
                )
                .values(**values)
            )
            if moved.rowcount == 0:  # type: ignore[attr-defined]
                return  # applied by an earlier run
            session.add(
                AllocationGroupEvent(
                    group_id=uuid.UUID(input.group_id),
                    event=target.value,
                    from_status=source.value,
                    to_status=target.value,
                    actor=storable(input.actor),
                    reason=storable(input.reason),
                    details=dict(input.details),
                )
            )

    @activity.defn(name="allocation_group.member_rejected")
    async def member_rejected(self, input: MemberRejection) -> None:
        """A member whose placement was refused (it has no allocation row): its reason, and an
        event on the group's timeline."""
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            marked = await session.execute(
                update(AllocationGroupMember)
                .where(
                    AllocationGroupMember.allocation_id == allocation_id,
                    AllocationGroupMember.rejection_reason.is_(None),
                )
                .values(rejection_reason=storable(input.reason or "rejected")[:64])
            )
            if marked.rowcount == 0:  # type: ignore[attr-defined]
                return
            session.add(
                AllocationGroupEvent(
                    group_id=uuid.UUID(input.group_id),
                    event=MEMBER_REJECTED_EVENT,
                    reason=storable(input.reason),
                    details={"allocation_id": input.allocation_id},
                )
            )

    @activity.defn(name="allocation_group.release_members")
    async def release_members(self, input: MemberReleases) -> MemberReleasesResult:
        """Ask each member's workflow to release, all at once. Each update's id is fixed by the
        group, the fan-out round and the member, so a retry of this activity is answered from
        the first attempt's update instead of asking again."""

        async def ask(allocation_id: str) -> bool:
            handle = self._client.get_workflow_handle(allocation_workflow_id(allocation_id))
            try:
                await handle.execute_update(
                    RELEASE_UPDATE,
                    input.request,
                    id=f"{input.group_workflow_id}/release-{input.round}/{allocation_id}",
                    result_type=ReleaseAccepted,
                )
            except WorkflowUpdateFailedError:
                return False  # not releasable (failed or rejected): nothing to ask
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    # Temporal did not answer: the retry asks again under the same update id,
                    # rather than the member being left out of the release.
                    raise
                return False  # its workflow has ended: nothing to ask
            return True

        answers = await asyncio.gather(*(ask(a) for a in input.allocation_ids))
        result = MemberReleasesResult()
        for allocation_id, asked in zip(input.allocation_ids, answers, strict=True):
            (result.asked if asked else result.skipped).append(allocation_id)
        return result
