"""What every single-purpose operation activity (AdminOperationWorkflow's) shares: one database
transaction per operation, a database that is not answering as the one retryable failure, a
refusal as a final typed answer, and the audit row written inside the operation's transaction."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import sqlalchemy.exc
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError

from contracts.admin_operation import DATABASE_UNAVAILABLE, Actor
from schema import audit

DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    sqlalchemy.exc.DisconnectionError,
    OSError,
)


def refusal(code: str, message: str, details: Mapping[str, Any] | None = None) -> ApplicationError:
    """The operation's final answer (not retried); `message` is shown to the API client."""
    extra = [dict(details)] if details else []
    return ApplicationError(message, *extra, type=code, non_retryable=True)


@contextlib.asynccontextmanager
async def transaction(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """One transaction; a database that is not answering is a retryable failure."""
    try:
        async with sessions() as session, session.begin():
            yield session
    except DATABASE_ERRORS:
        raise ApplicationError("the database is not reachable", type=DATABASE_UNAVAILABLE) from None


def record_audit(session: AsyncSession, actor: Actor, **row: Any) -> None:
    """The audit row of what `actor` asked for, naming the operation's workflow."""
    audit.record(
        session,
        actor=actor.name,
        actor_token_id=uuid.UUID(actor.token_id) if actor.token_id else None,
        role=actor.role,
        reason=actor.reason,
        workflow_ids=[workflow_id] if (workflow_id := activity.info().workflow_id) else [],
        **row,
    )
