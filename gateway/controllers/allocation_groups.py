"""Allocation groups (docs/lifecycles/allocation-group.md): tenant create (update-with-start), list,
read, merged timeline, release; admin list, read, timeline and force-release (audited)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import AllocationGroupStatus
from gateway import allocation_groups, allocations, audit
from gateway.allocation_group_schemas import (
    AllocationGroupCreate,
    AllocationGroupCreated,
    AllocationGroupDetail,
    AllocationGroupList,
    AllocationGroupTimeline,
    GroupReleaseResponse,
)
from gateway.allocations import IDEMPOTENCY_HEADER
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.schemas import ForceRelease
from gateway.temporal import TemporalOps

_Limit = Annotated[int, QueryParameter(ge=1, le=200)]


class AllocationGroupsController(Controller):
    path = "/api/v1/allocation-groups"
    guards = [tenant_guard]
    tags = ["allocation-groups"]

    @post(
        "/",
        status_code=201,
        summary="Create an allocation group: each member an ordinary allocation",
        description=(
            "Answers with the group (status requested) and its members' allocation ids; the "
            "group workflow then places and provisions each member as its own allocation. "
            "`placement.spread: same_node_forbidden` keeps every two members off one node. With "
            "X-Idempotency-Key a retry gets the same group (header Idempotent-Replayed: true "
            "when answered from the record); the same key with another body is 422 "
            "idempotency_key_reused. A member whose SKU the catalog does not offer in its "
            "region, or not with its GPU count, is 409 sku_unavailable before anything starts."
        ),
        responses=errors(400, 403, 409, 413, 422),
    )
    async def create_group(
        self,
        data: JSONBody[AllocationGroupCreate],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        idempotency_key: Annotated[
            str | None, HeaderParameter(name=IDEMPOTENCY_HEADER, required=False)
        ] = None,
    ) -> Response[AllocationGroupCreated]:
        created, replayed = await allocation_groups.create(
            db,
            temporal,
            runtime.settings,
            project_id=principal.project,
            body=data,
            idempotency_key=idempotency_key,
        )
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return Response(created, status_code=201, headers=headers)

    @get("/", summary="The project's allocation groups, newest first", responses=errors(400, 403))
    async def list_groups(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        status: Annotated[
            str | None, QueryParameter(schema_extra=one_of(AllocationGroupStatus))
        ] = None,
        limit: _Limit = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AllocationGroupList:
        return await allocation_groups.list_rows(
            db, project_id=principal.project, status=status, limit=limit, cursor=cursor
        )

    @get("/{group_id:uuid}", summary="One group with its members", responses=errors(403, 404))
    async def get_group(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        group_id: FromPath[uuid.UUID],
    ) -> AllocationGroupDetail:
        return await allocation_groups.detail(db, group_id, principal.project)

    @get(
        "/{group_id:uuid}/timeline",
        summary="The group's transitions merged with its members' timelines",
        responses=errors(403, 404),
    )
    async def get_timeline(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        group_id: FromPath[uuid.UUID],
    ) -> AllocationGroupTimeline:
        return await allocation_groups.build_timeline(
            db, temporal, group_id=group_id, project_id=principal.project
        )

    @post(
        "/{group_id:uuid}/release",
        status_code=202,
        summary="Release every member (group update request_group_release); idempotent",
        responses=errors(403, 404, 409),
    )
    async def release_group(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        group_id: FromPath[uuid.UUID],
    ) -> Response[GroupReleaseResponse]:
        answer, _, _ = await allocation_groups.release(
            db,
            temporal,
            group_id=group_id,
            project_id=principal.project,
            request=allocations.user_release(),
        )
        return Response(answer, status_code=202)


class AdminAllocationGroupsController(Controller):
    path = "/api/v1/admin/allocation-groups"
    guards = [admin_guard]
    tags = ["admin"]

    @get("/", summary="Allocation groups across projects, newest first", responses=errors(400, 403))
    async def list_groups(
        self,
        db: NamedDependency[AsyncSession],
        status: Annotated[
            str | None, QueryParameter(schema_extra=one_of(AllocationGroupStatus))
        ] = None,
        project_id: FromQuery[uuid.UUID | None] = None,
        limit: _Limit = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AllocationGroupList:
        return await allocation_groups.list_rows(
            db, project_id=project_id, status=status, limit=limit, cursor=cursor
        )

    @get("/{group_id:uuid}", summary="One group with its members", responses=errors(403, 404))
    async def get_group(
        self, db: NamedDependency[AsyncSession], group_id: FromPath[uuid.UUID]
    ) -> AllocationGroupDetail:
        return await allocation_groups.detail(db, group_id, None)

    @get(
        "/{group_id:uuid}/timeline",
        summary="The group's transitions merged with its members' timelines",
        responses=errors(403, 404),
    )
    async def get_timeline(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        group_id: FromPath[uuid.UUID],
    ) -> AllocationGroupTimeline:
        return await allocation_groups.build_timeline(
            db, temporal, group_id=group_id, project_id=None
        )

    @post(
        "/{group_id:uuid}/force-release",
        status_code=202,
        summary="Force-release every member that has not ended (force=True); audited",
        responses=errors(400, 403, 404, 409),
    )
    async def force_release(
        self,
        data: JSONBody[ForceRelease],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        group_id: FromPath[uuid.UUID],
    ) -> Response[GroupReleaseResponse]:
        answer, prior, workflow_id = await allocation_groups.release(
            db,
            temporal,
            group_id=group_id,
            project_id=None,
            request=allocations.admin_force_release(data.reason),
        )
        audit.record_by(
            db,
            principal,
            action="allocation_group.force_release",
            target_type="allocation_group",
            target_id=str(group_id),
            reason=data.reason,
            prior_state=answer.prior_status or prior,
            expected_state=answer.expected_status,
            workflow_ids=[workflow_id],
            details={
                "force": True,
                "read_model_status": prior,
                "members_asked": answer.members_asked,
                "requested_at": dt.datetime.now(dt.UTC).isoformat(),
            },
        )
        await db.commit()
        return Response(answer, status_code=202)
