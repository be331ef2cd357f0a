"""Tenant allocations: create (update-with-start), list, read, timeline, release."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import AllocationStatus
from core.config import Settings
from gateway import allocations, timeline
from gateway.allocations import IDEMPOTENCY_HEADER
from gateway.auth import Principal, tenant_guard
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.schemas import (
    AllocationCreate,
    AllocationCreated,
    AllocationDetail,
    AllocationList,
    ReleaseResponse,
    Timeline,
)
from gateway.temporal import TemporalOps


class AllocationsController(Controller):
    path = "/api/v1/allocations"
    guards = [tenant_guard]
    tags = ["allocations"]

    @post(
        "/",
        status_code=201,
        summary="Allocate GPUs: answers with the reservation or a typed rejection",
        description=(
            "With X-Idempotency-Key, a retry gets the same allocation and answer "
            "(header Idempotent-Replayed: true when answered from the record); the same key "
            "with another body is 422 idempotency_key_reused."
        ),
        responses=errors(402, 400, 403, 409, 413, 422),
    )
    async def create_allocation(
        self,
        data: JSONBody[AllocationCreate],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        idempotency_key: Annotated[
            str | None, HeaderParameter(name=IDEMPOTENCY_HEADER, required=False)
        ] = None,
    ) -> Response[AllocationCreated]:
        settings: Settings = runtime.settings
        outcome = await allocations.create(
            runtime.engine,
            temporal,
            settings,
            project_id=principal.project,
            body=data,
            idempotency_key=idempotency_key,
        )
        headers = {"Idempotent-Replayed": "true"} if outcome.replayed else {}
        return Response(outcome.allocation, status_code=201, headers=headers)

    @get("/", summary="The project's allocations, newest first", responses=errors(400, 403))
    async def list_allocations(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        status: Annotated[str | None, QueryParameter(schema_extra=one_of(AllocationStatus))] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AllocationList:
        return await allocations.list_rows(
            db, project_id=principal.project, status=status, limit=limit, cursor=cursor
        )

    @get(
        "/{allocation_id:uuid}",
        summary="One allocation (full read model)",
        responses=errors(403, 404),
    )
    async def get_allocation(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> AllocationDetail:
        return allocations.detail(await allocations.get_row(db, allocation_id, principal.project))

    @get(
        "/{allocation_id:uuid}/timeline",
        summary="Lifecycle and node-task timeline",
        responses=errors(403, 404),
    )
    async def get_timeline(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> Timeline:
        return await timeline.build(
            db, temporal, allocation_id=allocation_id, project_id=principal.project
        )

    @post(
        "/{allocation_id:uuid}/release",
        status_code=202,
        summary="Release (workflow update request_release); idempotent once released",
        responses=errors(403, 404, 409),
    )
    async def release_allocation(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> Response[ReleaseResponse]:
        answer, _, _ = await allocations.release(
            db,
            temporal,
            allocation_id=allocation_id,
            project_id=principal.project,
            request=allocations.user_release(),
        )
        return Response(answer, status_code=202)
