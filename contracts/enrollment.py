"""Agent enrollment as the worker runs it (AdminOperationWorkflow operations): an operator's
token issue and an agent's one redemption. Only the token's SHA-256 crosses to the worker, so no
plaintext token is ever in a workflow or activity payload."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from contracts.admin_operation import Actor


class RedeemFailure(StrEnum):
    """Why a token did not enroll: the ApplicationError type, also the API's error code."""

    INVALID = "enrollment_token_invalid"
    EXPIRED = "enrollment_token_expired"
    USED = "enrollment_token_used"
    NODE_DELETED = "node_deleted"


@dataclass
class IssueTokenInput:
    actor: Actor
    node_id: str
    token_sha256: str
    ttl_seconds: int


@dataclass
class IssuedToken:
    token_id: str
    node_id: str
    expires_at: str  # ISO 8601


@dataclass
class RedeemTokenInput:
    token_sha256: str
    agent_version: str | None = None


@dataclass
class Enrollment:
    node_id: str
    hostname: str | None
