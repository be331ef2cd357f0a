"""Async engine and session factory. Connect timeouts are short so that a dead database turns
into a prompt 503 at the gateway and a prompt activity retry in the worker, never a hang."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


def create_engine(
    database_url: str,
    *,
    connect_timeout_seconds: float = 3.0,
    pool_size: int = 10,
    max_overflow: int = 20,
    pre_ping: bool = True,
) -> AsyncEngine:
    """`pre_ping` checks each pooled connection before use (with asyncpg that is three round
    trips: BEGIN, a no-op, ROLLBACK), so a request after a database restart does not fail on a
    dead connection. Callers that retry anyway (the worker's activities) turn it off: a dead
    connection then fails one attempt, SQLAlchemy drops the pool, and the retry reconnects."""
    return create_async_engine(
        database_url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=connect_timeout_seconds + 2,
        pool_pre_ping=pre_ping,
        connect_args={"timeout": connect_timeout_seconds, "command_timeout": 30},
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
