"""The audit row (schema.models.AuditEntry) for an admin mutation: who, in which role, why, what,
on what, from which state to which, and the workflows it touched. One writer for the gateway (its
own plain records) and the worker's admin-operation activities, so both write the same shape; the
row is added to the caller's session and commits with the change it describes."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from schema.models import AuditEntry


def record(
    session: AsyncSession,
    *,
    actor: str,
    actor_token_id: uuid.UUID | None,
    role: str,
    action: str,
    target_type: str,
    target_id: str,
    reason: str | None = None,
    prior_state: str | None = None,
    expected_state: str | None = None,
    workflow_ids: Sequence[str] = (),
    details: Mapping[str, Any] | None = None,
) -> AuditEntry:
    """Add the row to the session; it commits with the change it describes."""
    entry = AuditEntry(
        actor=actor,
        actor_token_id=actor_token_id,
        role=role,
        reason=reason,
        action=action,
        target_type=target_type,
        target_id=target_id,
        prior_state=prior_state,
        expected_state=expected_state,
        workflow_ids=list(workflow_ids),
        details=dict(details or {}),
    )
    session.add(entry)
    return entry
