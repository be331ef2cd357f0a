"""What every single-purpose operation activity (AdminOperationWorkflow's) shares: one database
transaction per operation, a database that is not answering as the one retryable failure, a
refusal as a final typed answer, the audit row written inside the operation's transaction, and
secret-store writes that are put back when the rest of the operation fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import sqlalchemy.exc
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from contracts.admin_operation import DATABASE_UNAVAILABLE, SECRET_STORE_UNAVAILABLE, Actor
from core.secrets import SecretStore, SecretStoreError
from schema import audit

log = logging.getLogger(__name__)

DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    sqlalchemy.exc.DisconnectionError,
    OSError,
)


def refusal(code: str, message: str, details: Mapping[str, Any] | None = None) -> ApplicationError:
    """The operation's final answer (not retried); `message` is shown to the API client. An
    ordinary outcome (a used enrollment token, a namespace that exists), not a fault: BENIGN, so
    the SDK logs it at debug level without a traceback, and this logs one line with its code."""
    log.info("operation refused: %s", code)
    extra = [dict(details)] if details else []
    return ApplicationError(
        message,
        *extra,
        type=code,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


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


def vault_refusal(err: SecretStoreError) -> ApplicationError:
    # The path names which secret, never its value; the API answer names neither.
    log.warning("secret store call failed on %s: %s", err.path, type(err).__name__)
    return refusal(SECRET_STORE_UNAVAILABLE, "the secret store is not reachable; retry shortly")


class SecretChanges:
    """Secrets written (or deleted) by one operation, with what each path held before, so that a
    failure later in the operation puts them back. Values live in this object only."""

    def __init__(self, secrets: SecretStore) -> None:
        self._secrets = secrets
        # (path, what it held: None = nothing); a path whose old value could not be read as a
        # secret (not a map of strings) is overwritten but never put back.
        self._previous: list[tuple[str, dict[str, str] | None]] = []

    async def _remember(self, path: str) -> None:
        try:
            self._previous.append((path, await self._secrets.read(path)))
        except SecretStoreError as err:
            if type(err) is not SecretStoreError:  # unavailable, forbidden, misconfigured
                raise
            log.warning("secret %s holds no readable secret; it is replaced as asked", path)

    async def write(self, writes: Sequence[tuple[str, Mapping[str, str]]]) -> None:
        try:
            for path, value in writes:
                await self._remember(path)
                await self._secrets.write(path, value)
        except SecretStoreError as err:
            await self.undo()
            raise vault_refusal(err) from None

    async def delete(self, path: str) -> None:
        try:
            await self._remember(path)
            await self._secrets.delete(path)
        except SecretStoreError as err:
            await self.undo()
            raise vault_refusal(err) from None

    async def undo(self) -> None:
        """Best effort, newest first: a path that cannot be put back is logged (by path) and
        left as it is."""
        for path, value in reversed(self._previous):
            try:
                if value is None:
                    await self._secrets.delete(path)
                else:
                    await self._secrets.write(path, value)
            except SecretStoreError as err:
                log.error("could not put back secret %s after a failed change (%s)", path,
                          type(err).__name__)  # fmt: skip
        self._previous.clear()


@contextlib.asynccontextmanager
async def undone_on_failure(changes: SecretChanges) -> AsyncIterator[None]:
    try:
        yield
    except BaseException:
        await asyncio.shield(changes.undo())
        raise
