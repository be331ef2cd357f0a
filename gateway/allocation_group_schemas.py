"""msgspec Structs of the allocation-group API (docs/lifecycles/allocation-group.md)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Literal

import msgspec

from contracts.allocation_group import MAX_MEMBERS
from gateway.schemas import AllocationCreate, Request, TimelineStateItem, TimelineTaskItem


class GroupMemberCreate(AllocationCreate):
    """One member: an allocation request like POST /allocations's, and whether the group needs
    it (a group fails when no required member can become usable)."""

    required: bool = True


class GroupPlacement(Request):
    # same_node_forbidden: no two live members on one node (anti-affinity).
    spread: Literal["same_node_forbidden", "any"] = "any"


class AllocationGroupCreate(Request):
    members: Annotated[list[GroupMemberCreate], msgspec.Meta(min_length=1, max_length=MAX_MEMBERS)]
    placement: GroupPlacement = msgspec.field(default_factory=GroupPlacement)


class GroupMemberSpec(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    position: int
    required: bool
    sku: str
    region: str
    gpu_count: int


class AllocationGroupCreated(msgspec.Struct, kw_only=True):
    group_id: uuid.UUID
    status: str
    spread: str
    created_at: dt.datetime
    members: list[GroupMemberSpec]


class GroupMemberView(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    position: int
    required: bool
    sku: str
    region: str
    gpu_count: int
    # The member allocation's own status; `placing` before placement answered, `rejected` when
    # it refused (no allocation exists then).
    status: str
    node_id: uuid.UUID | None = None
    failure_reason: str | None = None


class AllocationGroupSummary(msgspec.Struct, kw_only=True):
    group_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    spread: str
    created_at: dt.datetime
    updated_at: dt.datetime


class AllocationGroupDetail(msgspec.Struct, kw_only=True):
    group_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    spread: str
    idempotency_key: str | None
    workflow_id: str
    release_requested_by: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    members: list[GroupMemberView]


class AllocationGroupList(msgspec.Struct, kw_only=True):
    items: list[AllocationGroupSummary]
    next_cursor: str | None = None


class GroupReleaseResponse(msgspec.Struct, kw_only=True):
    group_id: uuid.UUID
    status: str  # where the group is heading: releasing, or released
    prior_status: str
    expected_status: str
    # True when this request asked the members to release; false when an earlier one had.
    members_asked: bool


class GroupTimelineEntry(msgspec.Struct, kw_only=True):
    # The member the item belongs to; null for the group's own transitions.
    allocation_id: uuid.UUID | None
    item: TimelineStateItem | TimelineTaskItem


class AllocationGroupTimeline(msgspec.Struct, kw_only=True):
    group_id: uuid.UUID
    status: str
    items: list[GroupTimelineEntry]
    warnings: list[str] = []
