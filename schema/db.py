"""Async engine and session factory. Connect timeouts are short so that a dead database turns
into a prompt 503 at the gateway and a prompt activity retry in the worker, never a hang."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

# A pooled connection that sat unused this long is checked before use (it may have died with a
# database restart). One in steady use is not: with asyncpg a check is three round trips (BEGIN,
# a no-op, ROLLBACK), which SQLAlchemy's pool_pre_ping would pay on every checkout, several
# times per API request.
IDLE_BEFORE_PING_SECONDS = 5.0
_CHECKED_IN_AT = "gpucloud_checked_in_at"


def create_engine(
    database_url: str,
    *,
    connect_timeout_seconds: float = 3.0,
    pool_size: int = 10,
    max_overflow: int = 20,
) -> AsyncEngine:
    engine = create_async_engine(
        database_url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=connect_timeout_seconds + 2,
        connect_args={"timeout": connect_timeout_seconds, "command_timeout": 30},
    )
    _ping_connections_that_sat_idle(engine, IDLE_BEFORE_PING_SECONDS)
    return engine


def _ping_connections_that_sat_idle(engine: AsyncEngine, idle_seconds: float) -> None:
    """Raising DisconnectionError from a checkout listener makes the pool drop that connection
    and check out (or open) another, so a request never meets a connection that died while
    idle."""

    @event.listens_for(engine.sync_engine, "checkin")
    def _remember_checkin(dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        checked_in_at = record.info.get(_CHECKED_IN_AT)
        if checked_in_at is None or time.monotonic() - checked_in_at < idle_seconds:
            return
        try:
            dbapi_connection.ping()
        except Exception as dead:
            raise DisconnectionError("pooled connection died while idle") from dead


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def driver_connection(engine: AsyncEngine) -> AsyncIterator[asyncpg.Connection]:
    """A pooled connection's asyncpg connection, for hot paths written in plain SQL (placement,
    the gateway's per-request lookups), whose statements each commit on their own.

    SQLAlchemy only lends the connection, straight from the pool rather than through a session:
    it has begun nothing on it, so returning it does nothing more. A one-row lookup costs about
    0.2 ms of CPU this way against 0.6 to 1 ms through an ORM session, and the POST /allocations
    path makes two of them (the token, then the SSH keys and the idempotent replay together)."""
    async with engine.connect() as connection:
        lent = await connection.get_raw_connection()
        pg: asyncpg.Connection = lent.driver_connection
        try:
            yield pg
        except BaseException:
            if pg.is_closed():
                # A connection that died mid-statement must not go back to the pool.
                await connection.invalidate()
            raise
