"""Node agent enrollment: operators issue a single-use enrollment token for a node (cloud-init
carries it to the node); the agent redeems it once on the internal route and gets its identity
and Temporal settings back. After that the agent talks to Temporal only."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from activities.enrollment_tokens import (
    DEFAULT_TTL_SECONDS,
    RedeemFailure,
    issue_enrollment_token,
    redeem_enrollment_token,
)
from contracts.states import NodeStatus
from core.task_queues import node_task_queue
from gateway import audit
from gateway.auth import Principal, admin_guard
from gateway.controllers.common import audit_reason, errors
from gateway.errors import ApiError, NotFound
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from schema.models import Node

AnyRequest = Request[Any, Any, Any]


class EnrollmentTokenCreate(RequestBody):
    ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=7 * 24 * 3600)] = DEFAULT_TTL_SECONDS
    reason: Reason | None = None


class EnrollmentTokenIssued(msgspec.Struct, kw_only=True):
    token_id: uuid.UUID
    node_id: uuid.UUID
    expires_at: dt.datetime
    # Shown once; it belongs in the node's cloud-init and nowhere else.
    enrollment_token: str


class EnrollRequest(RequestBody):
    enrollment_token: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    agent_version: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class Enrolled(msgspec.Struct, kw_only=True):
    node_id: uuid.UUID
    hostname: str | None
    temporal_address: str
    temporal_namespace: str
    task_queue: str
    # Where the agent's heartbeats go (the control plane's worker queue): the agent knows the
    # site only from this answer, like the Temporal address.
    control_plane_task_queue: str


_REDEEM_ERRORS = {
    RedeemFailure.INVALID: (401, "the enrollment token is not valid"),
    RedeemFailure.EXPIRED: (401, "the enrollment token has expired; ask for a fresh one"),
    RedeemFailure.USED: (401, "the enrollment token was already used"),
    RedeemFailure.NODE_DELETED: (410, "this node was deleted and cannot enroll again"),
}


class AdminNodeEnrollmentController(Controller):
    path = "/api/v1/admin/nodes"
    guards = [admin_guard]
    tags = ["admin: nodes"]

    @post(
        "/{node_id:uuid}/enrollment-tokens",
        status_code=201,
        summary="Issue a single-use enrollment token for a node's agent",
        responses=errors(400, 403, 404, 413),
    )
    async def issue(
        self,
        data: JSONBody[EnrollmentTokenCreate],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        request: AnyRequest,
        node_id: FromPath[uuid.UUID],
    ) -> EnrollmentTokenIssued:
        node = await db.get(Node, node_id)
        if node is None:
            raise NotFound("node not found")
        if node.status == NodeStatus.DELETED:
            raise ApiError("the node was deleted", code="node_deleted", status_code=410)
        row, token = await issue_enrollment_token(
            db, node_id, created_by=principal.name, ttl_seconds=data.ttl_seconds
        )
        audit.record_by(
            db,
            principal,
            action="node.enrollment_token_issue",
            target_type="node",
            target_id=str(node_id),
            reason=audit_reason(request, data.reason),
            details={"token_id": str(row.id), "ttl_seconds": data.ttl_seconds},
        )
        await db.commit()
        return EnrollmentTokenIssued(
            token_id=row.id, node_id=node_id, expires_at=row.expires_at, enrollment_token=token
        )


class AgentEnrollmentController(Controller):
    """No bearer token here: the single-use enrollment token is the credential."""

    path = "/api/v1/internal/agent"
    tags = ["internal: node agent"]

    @post(
        "/enroll",
        status_code=200,
        summary="Redeem an enrollment token: the node's identity and Temporal settings",
        responses=errors(400, 410, 413),
    )
    async def enroll(
        self,
        data: JSONBody[EnrollRequest],
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
    ) -> Enrolled:
        redemption = await redeem_enrollment_token(
            db, data.enrollment_token, agent_version=data.agent_version
        )
        if redemption.failure is not None or redemption.node_id is None:
            failure = redemption.failure or RedeemFailure.INVALID
            status, message = _REDEEM_ERRORS[failure]
            await db.rollback()
            raise ApiError(message, code=failure.value, status_code=status)
        await db.commit()
        settings = runtime.settings
        return Enrolled(
            node_id=redemption.node_id,
            hostname=redemption.hostname,
            temporal_address=settings.temporal_address,
            temporal_namespace=settings.temporal_namespace,
            task_queue=node_task_queue(redemption.node_id),
            control_plane_task_queue=settings.control_plane_task_queue,
        )
