"""The connection pool outlives dead connections: one that died while idle in the pool (a
database restart, an idle timeout somewhere on the path) is checked before use and replaced,
so the caller never sees it; one in steady use is not checked at all."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from schema import db
from tests.lifecycle_support import eventually


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts liveness checks of pooled connections (they bypass the cursor events)."""
    calls: list[int] = []
    real_ping = AsyncAdapt_asyncpg_connection.ping

    def counting_ping(self: AsyncAdapt_asyncpg_connection) -> None:
        calls.append(1)
        real_ping(self)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(AsyncAdapt_asyncpg_connection, "ping", counting_ping)
    return calls


async def _backend_pid(engine: AsyncEngine) -> int:
    async with engine.connect() as connection:
        pid = (await connection.execute(text("select pg_backend_pid()"))).scalar_one()
    return int(pid)


async def _terminate(database_url: str, pid: int) -> None:
    # A connection of its own, never pooled: the suite's shared engine would ping its own idle
    # connection on checkout, and `pings` counts every ping in the process.
    terminator = create_async_engine(database_url, poolclass=NullPool)
    try:
        async with terminator.connect() as connection:
            await connection.execute(text("select pg_terminate_backend(:pid)"), {"pid": pid})

        async def gone() -> bool:  # pg_terminate_backend only signals the backend
            async with terminator.connect() as connection:
                alive = await connection.execute(
                    text("select 1 from pg_stat_activity where pid = :pid"), {"pid": pid}
                )
                return alive.first() is None

        await eventually(gone, timeout=10)
    finally:
        await terminator.dispose()


async def test_connection_that_died_while_idle_is_replaced(
    database_url: str, monkeypatch: pytest.MonkeyPatch, pings: list[int]
) -> None:
    monkeypatch.setattr(db, "IDLE_BEFORE_PING_SECONDS", 0.3)
    engine = db.create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        first = await _backend_pid(engine)
        await _terminate(database_url, first)
        # Past the idle time after which the pool pings a connection before handing it out:
        # the product's own threshold (0.3 s here), not an event to wait for.
        await asyncio.sleep(0.4)
        second = await _backend_pid(engine)  # would raise if the dead connection were handed out
        assert second != first
        assert len(pings) == 1
    finally:
        await engine.dispose()


async def test_connection_in_steady_use_is_not_pinged(
    database_url: str, monkeypatch: pytest.MonkeyPatch, pings: list[int]
) -> None:
    monkeypatch.setattr(db, "IDLE_BEFORE_PING_SECONDS", 60)
    engine = db.create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        pids = {await _backend_pid(engine) for _ in range(5)}
        assert len(pids) == 1
        assert pings == []
    finally:
        await engine.dispose()
