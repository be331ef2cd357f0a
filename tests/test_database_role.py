"""The application reaches PostgreSQL as a production deployment does: as a role that is no
superuser and must give its password; the cluster's superuser is not reachable over TCP."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.postgres import PostgresCluster


async def test_application_role_is_no_superuser(db_engine: AsyncEngine) -> None:
    async with db_engine.connect() as connection:
        row = (
            await connection.execute(
                text(
                    "SELECT rolsuper, rolcreaterole, rolcreatedb FROM pg_roles"
                    " WHERE rolname = current_user"
                )
            )
        ).one()
    assert tuple(row) == (False, False, False)


async def test_logins_over_tcp_need_the_password(pg_cluster: PostgresCluster) -> None:
    for user, password in (
        (pg_cluster.user, None),
        (pg_cluster.user, "wrong"),
        (pg_cluster.admin_user, None),
    ):
        with pytest.raises(
            (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError)
        ):
            await asyncpg.connect(
                host="127.0.0.1",
                port=pg_cluster.port,
                user=user,
                password=password,
                database="gpucloud_test",
                passfile="/nonexistent",
            )
    connection = await asyncpg.connect(
        host="127.0.0.1",
        port=pg_cluster.port,
        user=pg_cluster.user,
        password=pg_cluster.password(),
        database="gpucloud_test",
    )
    await connection.close()
    assert pg_cluster.password_file.stat().st_mode & 0o077 == 0
