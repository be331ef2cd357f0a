"""Node enrollment tokens: issued for one node (by an operator now, by onboarding and reimage
later), single-use and TTL-bound, stored as SHA-256. Redemption is one compare-and-set, so two
agents racing with the same token cannot both enroll."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import NodeStatus
from schema.models import Node, NodeEnrollmentToken

PREFIX = "gpe_"
_TOKEN_RE = re.compile(r"^gpe_[A-Za-z0-9_-]{43}$")
DEFAULT_TTL_SECONDS = 7200  # seed 003 §3.6 enrollment_token_ttl_seconds


def hash_enrollment_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RedeemFailure(StrEnum):
    INVALID = "enrollment_token_invalid"
    EXPIRED = "enrollment_token_expired"
    USED = "enrollment_token_used"
    NODE_DELETED = "node_deleted"


@dataclass(frozen=True)
class Redemption:
    node_id: uuid.UUID | None
    hostname: str | None
    failure: RedeemFailure | None = None


async def issue_enrollment_token(
    session: AsyncSession,
    node_id: uuid.UUID,
    *,
    created_by: str,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
) -> tuple[NodeEnrollmentToken, str]:
    """Add the token row to the session (the caller commits); the plaintext is returned once."""
    token = PREFIX + secrets.token_urlsafe(32)
    row = NodeEnrollmentToken(
        id=uuid.uuid4(),
        node_id=node_id,
        token_sha256=hash_enrollment_token(token),
        expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ttl_seconds),
        created_by=created_by,
    )
    session.add(row)
    await session.flush()
    return row, token


async def redeem_enrollment_token(
    session: AsyncSession, token: str, *, agent_version: str | None = None
) -> Redemption:
    """Use the token (once) and record the enrollment on the node, in the caller's transaction.
    A deleted node is never revived: its tokens stop working."""
    if not _TOKEN_RE.match(token):
        return Redemption(None, None, RedeemFailure.INVALID)
    digest = hash_enrollment_token(token)
    node_id = await session.scalar(
        update(NodeEnrollmentToken)
        .where(
            NodeEnrollmentToken.token_sha256 == digest,
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
        return Redemption(None, None, await _why_not(session, digest))
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
