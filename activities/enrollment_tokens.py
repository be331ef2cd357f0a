"""Node enrollment tokens: issued for one node (by onboarding and reimage when they render the
node's cloud-init, or by an operator), single-use and TTL-bound, stored as SHA-256. Redemption is
one compare-and-set, so two agents racing with the same token cannot both enroll.

EnrollmentActivities are the AdminOperationWorkflow operations the gateway runs for an operator's
token issue and an agent's redemption; they see the token's SHA-256 only."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.operation_support import record_audit, refusal, transaction
from contracts.admin_operation import ENROLLMENT_ISSUE_TOKEN, ENROLLMENT_REDEEM_TOKEN, NOT_FOUND
from contracts.enrollment import (
    Enrollment,
    IssuedToken,
    IssueTokenInput,
    RedeemFailure,
    RedeemTokenInput,
)
from contracts.states import NodeStatus
from core.enrollment_token import DEFAULT_TTL_SECONDS, hash_enrollment_token, new_enrollment_token
from schema.models import Node, NodeEnrollmentToken

_REDEEM_MESSAGES = {
    RedeemFailure.INVALID: "the enrollment token is not valid",
    RedeemFailure.EXPIRED: "the enrollment token has expired; ask for a fresh one",
    RedeemFailure.USED: "the enrollment token was already used",
    RedeemFailure.NODE_DELETED: "this node was deleted and cannot enroll again",
}


@dataclass(frozen=True)
class Redemption:
    node_id: uuid.UUID | None
    hostname: str | None
    failure: RedeemFailure | None = None


def _token_row(
    node_id: uuid.UUID, token_sha256: str, *, created_by: str, ttl_seconds: int
) -> NodeEnrollmentToken:
    return NodeEnrollmentToken(
        id=uuid.uuid4(),
        node_id=node_id,
        token_sha256=token_sha256,
        expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ttl_seconds),
        created_by=created_by,
    )


async def issue_enrollment_token(
    session: AsyncSession,
    node_id: uuid.UUID,
    *,
    created_by: str,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
) -> tuple[NodeEnrollmentToken, str]:
    """Add the token row to the session (the caller commits); the plaintext is returned once."""
    token = new_enrollment_token()
    row = _token_row(
        node_id, hash_enrollment_token(token), created_by=created_by, ttl_seconds=ttl_seconds
    )
    session.add(row)
    await session.flush()
    return row, token


async def redeem_enrollment_token(
    session: AsyncSession, token_sha256: str, *, agent_version: str | None = None
) -> Redemption:
    """Use the token (once) and record the enrollment on the node, in the caller's transaction.
    A deleted node is never revived: its tokens stop working."""
    node_id = await session.scalar(
        update(NodeEnrollmentToken)
        .where(
            NodeEnrollmentToken.token_sha256 == token_sha256,
            NodeEnrollmentToken.used_at.is_(None),
            NodeEnrollmentToken.expires_at > func.clock_timestamp(),
            NodeEnrollmentToken.node_id.in_(
                select(Node.id).where(Node.status != NodeStatus.DELETED)
            ),
        )
        .values(used_at=func.clock_timestamp())
        .returning(NodeEnrollmentToken.node_id)
    )
    if node_id is None:
        return Redemption(None, None, await _why_not(session, token_sha256))
    node = await session.scalar(
        update(Node)
        .where(Node.id == node_id)
        .values(
            enrolled_at=func.clock_timestamp(),
            last_agent_contact_at=func.clock_timestamp(),
            agent_version=agent_version,
        )
        .returning(Node)
    )
    assert node is not None
    return Redemption(node.id, node.hostname)


async def _why_not(session: AsyncSession, digest: str) -> RedeemFailure:
    row = (
        await session.execute(
            select(
                NodeEnrollmentToken.used_at,
                NodeEnrollmentToken.expires_at <= func.clock_timestamp(),
                Node.status,
            )
            .join(Node, Node.id == NodeEnrollmentToken.node_id)
            .where(NodeEnrollmentToken.token_sha256 == digest)
        )
    ).first()
    if row is None:
        return RedeemFailure.INVALID
    used_at, expired, node_status = row
    if node_status == NodeStatus.DELETED:
        return RedeemFailure.NODE_DELETED
    if used_at is not None:
        return RedeemFailure.USED
    if expired:
        return RedeemFailure.EXPIRED
    return RedeemFailure.INVALID


class EnrollmentActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    def activities(self) -> list[Callable[..., Any]]:
        return [self.issue_token, self.redeem_token]

    @activity.defn(name=ENROLLMENT_ISSUE_TOKEN)
    async def issue_token(self, input: IssueTokenInput) -> IssuedToken:
        """The token row and its audit row, for a node that exists and is not deleted."""
        node_id = uuid.UUID(input.node_id)
        async with transaction(self._sessions) as session:
            status = await session.scalar(
                select(Node.status).where(Node.id == node_id).with_for_update()
            )
            if status is None:
                raise refusal(NOT_FOUND, "node not found")
            if status == NodeStatus.DELETED:
                raise refusal(RedeemFailure.NODE_DELETED.value, "the node was deleted")
            row = _token_row(
                node_id,
                input.token_sha256,
                created_by=input.actor.name,
                ttl_seconds=input.ttl_seconds,
            )
            session.add(row)
            record_audit(
                session,
                input.actor,
                action="node.enrollment_token_issue",
                target_type="node",
                target_id=input.node_id,
                details={"token_id": str(row.id), "ttl_seconds": input.ttl_seconds},
            )
        return IssuedToken(
            token_id=str(row.id), node_id=input.node_id, expires_at=row.expires_at.isoformat()
        )

    @activity.defn(name=ENROLLMENT_REDEEM_TOKEN)
    async def redeem_token(self, input: RedeemTokenInput) -> Enrollment:
        async with transaction(self._sessions) as session:
            redemption = await redeem_enrollment_token(
                session, input.token_sha256, agent_version=input.agent_version
            )
        if redemption.failure is not None or redemption.node_id is None:
            failure = redemption.failure or RedeemFailure.INVALID
            raise refusal(failure.value, _REDEEM_MESSAGES[failure])
        return Enrollment(node_id=str(redemption.node_id), hostname=redemption.hostname)
