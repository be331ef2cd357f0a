"""Audit rows for every admin mutation (and tenant changes to project credentials): who, in
which role, why, what, on what, from which state to which, and the workflows it touched. The row
itself is schema.audit's (the worker's admin-operation activities write the same shape); here, the
gateway's principal as its actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import Principal
from schema.audit import record
from schema.models import AuditEntry

__all__ = ["CLI_ACTOR", "record", "record_by"]

CLI_ACTOR = "cli"


def record_by(
    session: AsyncSession,
    principal: Principal,
    *,
    action: str,
    target_type: str,
    target_id: str,
    reason: str | None = None,
    prior_state: str | None = None,
    expected_state: str | None = None,
    workflow_ids: Sequence[str] = (),
    details: Mapping[str, Any] | None = None,
) -> AuditEntry:
    return record(
        session,
        actor=principal.name,
        actor_token_id=principal.token_id,
        role=principal.role,
        action=action,
        target_type=target_type,
        target_id=target_id,
        reason=reason,
        prior_state=prior_state,
        expected_state=expected_state,
        workflow_ids=workflow_ids,
        details=details,
    )
