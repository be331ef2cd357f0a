"""Node agent enrollment: operators issue a single-use enrollment token for a node (cloud-init
carries it to the node); the agent redeems it once on the internal route and gets its identity,
its Temporal settings and its own payload key back (derived for this node from the cluster key,
which never leaves the control plane). After that the agent talks to Temporal only."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from contracts.admin_operation import ENROLLMENT_ISSUE_TOKEN, ENROLLMENT_REDEEM_TOKEN
from contracts.enrollment import (
    Enrollment,
    IssuedToken,
    IssueTokenInput,
    RedeemFailure,
    RedeemTokenInput,
)
from core.codec import key_id, node_payload_key
from core.enrollment_token import (
    DEFAULT_TTL_SECONDS,
    hash_enrollment_token,
    is_well_formed,
    new_enrollment_token,
)
from core.task_queues import node_task_queue
from gateway.admin_operations import actor, per_request, run_admin_operation
from gateway.auth import Principal, admin_guard
from gateway.controllers.common import audit_reason
from gateway.errors import ApiError
from gateway.openapi import errors
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from gateway.temporal import TemporalOps

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
    # The agent's own id for this enrollment, the same on each of its retries: a retry whose
    # first answer was lost (the token already used by it) gets that answer again.
    attempt: Annotated[str, msgspec.Meta(min_length=16, max_length=128)] | None = None


class Enrolled(msgspec.Struct, kw_only=True):
    node_id: uuid.UUID
    hostname: str | None
    temporal_address: str
    temporal_namespace: str
    task_queue: str
    # Where the agent's heartbeats go (the control plane's worker queue): the agent knows the
    # site only from this answer, like the Temporal address.
    control_plane_task_queue: str
    # This node's payload key (base64; core/codec.py, derived from the cluster key for this node
    # alone): what the agent encrypts and decrypts its Temporal payloads with. Only here, over
    # the enrollment call: never in cloud-init, never in Temporal.
    payload_key: str
    payload_key_id: str


# The answer to each refusal: the token is the agent's only credential, so a bad one is 401.
_REDEEM_STATUSES = {
    RedeemFailure.INVALID.value: 401,
    RedeemFailure.EXPIRED.value: 401,
    RedeemFailure.USED.value: 401,
    RedeemFailure.NODE_DELETED.value: 410,
}


def _redemption_key(data: EnrollRequest) -> str:
    """One redemption per agent attempt: only the agent that holds both the token and its
    attempt id can be answered with the redemption's identity again; anyone else with a used
    token is refused. Without an attempt id, each call redeems anew."""
    if data.attempt is None:
        return per_request("agent")
    both = f"{data.enrollment_token}:{data.attempt}".encode()
    return hashlib.sha256(both).hexdigest()[:40]


class AdminNodeEnrollmentController(Controller):
    path = "/api/v1/admin/nodes"
    guards = [admin_guard]
    tags = ["admin: nodes"]

    @post(
        "/{node_id:uuid}/enrollment-tokens",
        status_code=201,
        summary="Issue a single-use enrollment token for a node's agent",
        responses=errors(400, 403, 404, 410, 413),
    )
    async def issue(
        self,
        data: JSONBody[EnrollmentTokenCreate],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        request: AnyRequest,
        node_id: FromPath[uuid.UUID],
    ) -> EnrollmentTokenIssued:
        # The worker answers a missing (404) or deleted (410) node. The plaintext stays here:
        # the worker stores (and Temporal carries) its SHA-256 only.
        token = new_enrollment_token()
        issued = await run_admin_operation(
            temporal,
            runtime.settings.control_plane_task_queue,
            ENROLLMENT_ISSUE_TOKEN,
            IssueTokenInput(
                actor=actor(principal, audit_reason(request, data.reason)),
                node_id=str(node_id),
                token_sha256=hash_enrollment_token(token),
                ttl_seconds=data.ttl_seconds,
            ),
            key=per_request(node_id),
            result_type=IssuedToken,
            statuses=_REDEEM_STATUSES,
        )
        return EnrollmentTokenIssued(
            token_id=uuid.UUID(issued.token_id),
            node_id=node_id,
            expires_at=dt.datetime.fromisoformat(issued.expires_at),
            enrollment_token=token,
        )


class AgentEnrollmentController(Controller):
    """No bearer token here: the single-use enrollment token is the credential."""

    path = "/api/v1/internal/agent"
    tags = ["internal: node agent"]

    @post(
        "/enroll",
        status_code=200,
        summary="Redeem an enrollment token: the node's identity and Temporal settings",
        responses=errors(401, 410),
    )
    async def enroll(
        self,
        data: JSONBody[EnrollRequest],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
    ) -> Enrolled:
        if not is_well_formed(data.enrollment_token):
            raise ApiError(
                "the enrollment token is not valid",
                code=RedeemFailure.INVALID.value,
                status_code=401,
            )
        settings = runtime.settings
        enrolled = await run_admin_operation(
            temporal,
            settings.control_plane_task_queue,
            ENROLLMENT_REDEEM_TOKEN,
            RedeemTokenInput(
                token_sha256=hash_enrollment_token(data.enrollment_token),
                agent_version=data.agent_version,
            ),
            key=_redemption_key(data),
            result_type=Enrollment,
            statuses=_REDEEM_STATUSES,
            answer_once=True,
        )
        node_id = uuid.UUID(enrolled.node_id)
        node_key = node_payload_key(settings.codec_key, node_id)
        return Enrolled(
            node_id=node_id,
            hostname=enrolled.hostname,
            temporal_address=settings.temporal_address,
            temporal_namespace=settings.temporal_namespace,
            task_queue=node_task_queue(node_id),
            control_plane_task_queue=settings.control_plane_task_queue,
            payload_key=base64.b64encode(node_key).decode(),
            payload_key_id=key_id(node_key),
        )
