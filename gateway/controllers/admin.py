"""Admin routes: projects, tokens, audit, allocations across projects. Every mutation is audited
in the same transaction as the change (or, for workflow actions, right after Temporal accepted)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import AllocationStatus, TokenRole
from gateway import allocations, audit, identity, timeline
from gateway.auth import Principal, admin_guard
from gateway.controllers.common import audit_reason
from gateway.errors import InvalidRequest, NotFound, Unprocessable
from gateway.openapi import errors, one_of
from gateway.schemas import (
    AllocationDetail,
    AllocationList,
    AuditList,
    AuditView,
    Detach,
    DetachResponse,
    ForceRelease,
    ProjectCreate,
    ProjectList,
    ProjectView,
    ReleaseResponse,
    Timeline,
    TokenCreate,
    TokenIssued,
    TokenList,
    TokenRevoke,
    TokenView,
)
from gateway.temporal import TemporalOps
from schema.models import ApiToken, AuditEntry, Project

AnyRequest = Request[Any, Any, Any]


def _project_view(p: Project) -> ProjectView:
    return ProjectView(id=p.id, name=p.name, created_at=p.created_at)


def _token_view(t: ApiToken) -> TokenView:
    return TokenView(
        id=t.id,
        name=t.name,
        role=t.role,
        project_id=t.project_id,
        display_prefix=t.display_prefix,
        created_at=t.created_at,
        revoked_at=t.revoked_at,
    )


class AdminProjectsController(Controller):
    path = "/api/v1/admin/projects"
    guards = [admin_guard]
    tags = ["admin"]

    @post(
        "/",
        status_code=201,
        summary="Create a project (name unique)",
        responses=errors(400, 403, 409, 413),
    )
    async def create_project(
        self,
        data: JSONBody[ProjectCreate],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        request: AnyRequest,
    ) -> ProjectView:
        project = await identity.create_project(
            db,
            data.name,
            actor=principal.name,
            actor_token_id=principal.token_id,
            role=principal.role,
            reason=audit_reason(request, data.reason),
        )
        await db.commit()
        await db.refresh(project)
        return _project_view(project)

    @get("/", summary="List projects", responses=errors(400, 403))
    async def list_projects(
        self,
        db: NamedDependency[AsyncSession],
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> ProjectList:
        rows = await db.scalars(
            select(Project).order_by(Project.created_at, Project.id).limit(limit)
        )
        return ProjectList(items=[_project_view(p) for p in rows])

    @get("/{project_id:uuid}", summary="One project", responses=errors(403, 404))
    async def get_project(
        self, db: NamedDependency[AsyncSession], project_id: FromPath[uuid.UUID]
    ) -> ProjectView:
        project = await db.get(Project, project_id)
        if project is None:
            raise NotFound("project not found")
        return _project_view(project)


class AdminTokensController(Controller):
    path = "/api/v1/admin/tokens"
    guards = [admin_guard]
    tags = ["admin"]

    @post(
        "/",
        status_code=201,
        summary="Issue a token; the plaintext is returned this once",
        responses=errors(400, 403, 413, 422),
    )
    async def issue_token(
        self,
        data: JSONBody[TokenCreate],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        request: AnyRequest,
    ) -> TokenIssued:
        role = TokenRole(data.role)
        if role == TokenRole.ADMIN and data.project_id is not None:
            raise InvalidRequest(
                "admin tokens are not bound to a project", details={"field": "project_id"}
            )
        if role == TokenRole.TENANT:
            if data.project_id is None:
                raise InvalidRequest(
                    "tenant tokens need a project_id", details={"field": "project_id"}
                )
            if await db.get(Project, data.project_id) is None:
                raise Unprocessable("no such project", code="project_not_found")
        row, token = await identity.issue_token(
            db,
            name=data.name,
            role=role,
            project_id=data.project_id,
            actor=principal.name,
            actor_token_id=principal.token_id,
            actor_role=principal.role,
            reason=audit_reason(request, data.reason),
        )
        await db.commit()
        await db.refresh(row)
        return TokenIssued(
            id=row.id,
            name=row.name,
            role=row.role,
            project_id=row.project_id,
            display_prefix=row.display_prefix,
            created_at=row.created_at,
            token=token,
        )

    @get("/", summary="List tokens (never their hashes or plaintext)", responses=errors(400, 403))
    async def list_tokens(
        self,
        db: NamedDependency[AsyncSession],
        project_id: FromQuery[uuid.UUID | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> TokenList:
        query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id).limit(limit)
        if project_id is not None:
            query = query.where(ApiToken.project_id == project_id)
        return TokenList(items=[_token_view(t) for t in await db.scalars(query)])

    @post(
        "/{token_id:uuid}/revoke",
        status_code=200,
        summary="Revoke a token, at once",
        responses=errors(403, 404),
    )
    async def revoke_token(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        request: AnyRequest,
        token_id: FromPath[uuid.UUID],
        data: JSONBody[TokenRevoke | None] = None,
    ) -> TokenView:
        row = await db.get(ApiToken, token_id)
        if row is None:
            raise NotFound("token not found")
        prior = "revoked" if row.revoked_at is not None else "active"
        if row.revoked_at is None:
            await db.execute(
                update(ApiToken)
                .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=func.clock_timestamp())
            )
        audit.record_by(
            db,
            principal,
            action="token.revoke",
            target_type="api_token",
            target_id=str(token_id),
            reason=audit_reason(request, data.reason if data else None),
            prior_state=prior,
            expected_state="revoked",
            details={"name": row.name, "display_prefix": row.display_prefix},
        )
        await db.commit()
        await db.refresh(row)
        return _token_view(row)


class AdminAuditController(Controller):
    path = "/api/v1/admin/audit"
    guards = [admin_guard]
    tags = ["admin"]

    @get("/", summary="Audit log, newest first", responses=errors(400, 403))
    async def list_audit(
        self,
        db: NamedDependency[AsyncSession],
        target_type: FromQuery[str | None] = None,
        target_id: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> AuditList:
        query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
        if target_type is not None:
            query = query.where(AuditEntry.target_type == target_type)
        if target_id is not None:
            query = query.where(AuditEntry.target_id == target_id)
        if action is not None:
            query = query.where(AuditEntry.action == action)
        return AuditList(
            items=[
                AuditView(
                    id=a.id,
                    occurred_at=a.occurred_at,
                    actor=a.actor,
                    actor_token_id=a.actor_token_id,
                    role=a.role,
                    reason=a.reason,
                    action=a.action,
                    target_type=a.target_type,
                    target_id=a.target_id,
                    prior_state=a.prior_state,
                    expected_state=a.expected_state,
                    workflow_ids=list(a.workflow_ids or []),
                    details=dict(a.details or {}),
                )
                for a in await db.scalars(query)
            ]
        )


async def force_release_audited(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    allocation_id: uuid.UUID,
    reason: str,
) -> ReleaseResponse:
    """Force-release (the workflow's request_release update, force=True) and its audit row:
    the admin API's and the console's. 409 node_protected while the allocation's node is
    protected: a force-release tears tenant work down."""
    from gateway.controllers.nodes import refuse_if_protected
    from schema.models import Allocation

    node_id = await db.scalar(select(Allocation.node_id).where(Allocation.id == allocation_id))
    if node_id is not None:
        await refuse_if_protected(db, node_id, "force-released")
    answer, prior, workflow_id = await allocations.release(
        db,
        temporal,
        allocation_id=allocation_id,
        project_id=None,
        request=allocations.admin_force_release(reason),
    )
    audit.record_by(
        db,
        principal,
        action="allocation.force_release",
        target_type="allocation",
        target_id=str(allocation_id),
        reason=reason,
        prior_state=answer.prior_status or prior,
        expected_state=answer.expected_status,
        workflow_ids=[workflow_id],
        details={
            "force": True,
            "read_model_status": prior,
            "release_pending": answer.release_pending,
            "requested_at": dt.datetime.now(dt.UTC).isoformat(),
        },
    )
    await db.commit()
    return answer


async def detach_audited(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    allocation_id: uuid.UUID,
    reason: str,
) -> DetachResponse:
    """Detach (the workflow's detach update) and its audit row: the admin API's and the
    console's."""
    answer, prior, workflow_id = await allocations.detach(
        db, temporal, allocation_id=allocation_id, reason=reason
    )
    audit.record_by(
        db,
        principal,
        action="allocation.detach",
        target_type="allocation",
        target_id=str(allocation_id),
        reason=reason,
        prior_state=prior,
        expected_state=answer.status,
        workflow_ids=[workflow_id],
        details={
            "quarantined": answer.quarantined,
            "node_id": str(answer.node_id),
            "node_status": answer.node_status,
        },
    )
    await db.commit()
    return answer


class AdminAllocationsController(Controller):
    path = "/api/v1/admin/allocations"
    guards = [admin_guard]
    tags = ["admin"]

    @get("/", summary="Allocations across projects, newest first", responses=errors(400, 403))
    async def list_allocations(
        self,
        db: NamedDependency[AsyncSession],
        status: Annotated[str | None, QueryParameter(schema_extra=one_of(AllocationStatus))] = None,
        project_id: FromQuery[uuid.UUID | None] = None,
        node_id: FromQuery[uuid.UUID | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> AllocationList:
        """`node_id` answers what runs (or ran) on a node, e.g. with `status=provisioning` while
        Temporal Web does not show the node yet."""
        return await allocations.list_rows(
            db,
            project_id=project_id,
            node_id=node_id,
            status=status,
            limit=limit,
            cursor=cursor,
        )

    @get(
        "/{allocation_id:uuid}",
        summary="One allocation (full read model)",
        responses=errors(403, 404),
    )
    async def get_allocation(
        self, db: NamedDependency[AsyncSession], allocation_id: FromPath[uuid.UUID]
    ) -> AllocationDetail:
        return allocations.detail(await allocations.get_row(db, allocation_id, None))

    @get(
        "/{allocation_id:uuid}/timeline",
        summary="Lifecycle and node-task timeline",
        responses=errors(403, 404),
    )
    async def get_timeline(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        allocation_id: FromPath[uuid.UUID],
    ) -> Timeline:
        return await timeline.build(db, temporal, allocation_id=allocation_id, project_id=None)

    @post(
        "/{allocation_id:uuid}/force-release",
        status_code=202,
        summary="Force-release (workflow update request_release, force=True); audited",
        responses=errors(400, 403, 404, 409),
    )
    async def force_release(
        self,
        data: JSONBody[ForceRelease],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> Response[ReleaseResponse]:
        answer = await force_release_audited(db, temporal, principal, allocation_id, data.reason)
        return Response(answer, status_code=202)

    @post(
        "/{allocation_id:uuid}/detach",
        status_code=200,
        summary=(
            "Detach a release_failed allocation whose node cannot clean up (workflow update "
            "detach): released, its node or GPU slots quarantined for cleanup; audited"
        ),
        responses=errors(400, 403, 404, 409),
    )
    async def detach(
        self,
        data: JSONBody[Detach],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> DetachResponse:
        """docs/lifecycles/allocation.md's "admin removes the assignment". Only from release_failed
        (409 allocation_not_detachable otherwise); a repeated detach answers the same."""
        return await detach_audited(db, temporal, principal, allocation_id, data.reason)
