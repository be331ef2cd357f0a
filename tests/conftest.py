"""Session harness: one private PostgreSQL cluster with a migrated database, one Temporal dev
server (the real `temporal` CLI), both started here; rows cleared before each test.

Subsystem fixtures live beside their tests (tests/gateway_fixtures.py, tests/agent_fixtures.py,
tests/vault_fixtures.py) and are registered below, so each has one owner.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from core.config import Settings
from core.temporal import data_converter
from devstack.postgres import PostgresCluster, throwaway_cluster
from devstack.processes import free_port
from devstack.temporal import dev_server_extra_args, temporal_cli_path
from devstack.temporal_cluster import running_cluster
from schema.db import create_engine, session_factory
from schema.migrate import upgrade
from schema.models import Base

pytest_plugins = [
    "tests.gateway_fixtures",
    "tests.agent_fixtures",
    "tests.vault_fixtures",
    "tests.netns_fixtures",
    "tests.maas_fixtures",
    "tests.stripe_fixtures",
    "tests.onboarding_fixtures",
    "tests.decommission_fixtures",
    "tests.terminal_fixtures",
    "tests.qemu_fixtures",
    "tests.enrolled_fleet",
]

# Skip reasons that mean "this machine lacks root", not "this machine lacks hardware". Under
# GPUCLOUD_REQUIRE_ROOT=1 (.ci/run, which checks it runs as root) such a skip fails the test
# instead, so CI can never pass with the storage, netns or user tests silently left out.
ROOT_SKIP_WORDS = ("root", "CAP_SYS_ADMIN", "bind mounts need")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    if os.environ.get("GPUCLOUD_REQUIRE_ROOT") != "1":
        return
    report = outcome.get_result()
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    if any(word in reason for word in ROOT_SKIP_WORDS):
        report.outcome = "failed"
        report.longrepr = f"skipped for want of root under GPUCLOUD_REQUIRE_ROOT=1: {reason}"


# Recorded histories in tests/histories were written with this key; keep it fixed.
TEST_CODEC_KEY = b"gpucloud-test-codec-key-32bytes!"
TEST_CODEC_KEY_B64 = base64.b64encode(TEST_CODEC_KEY).decode()


@pytest.fixture(scope="session", autouse=True)
def storage_provider_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The storage provider's tree (GPUCLOUD_STORAGE_ROOT, activities/storage_provider.py) for
    every worker a test starts: a temporary directory, never this machine's own default."""
    root = tmp_path_factory.mktemp("storage-provider")
    previous = os.environ.get("GPUCLOUD_STORAGE_ROOT")
    os.environ["GPUCLOUD_STORAGE_ROOT"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("GPUCLOUD_STORAGE_ROOT", None)
    else:
        os.environ["GPUCLOUD_STORAGE_ROOT"] = previous


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    # Under /tmp with world-traversable parents: the server runs as `postgres`, not as root.
    with throwaway_cluster(Path(f"/tmp/gpucloud-test-pg-{os.getpid()}"), free_port()) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def database_url(pg_cluster: PostgresCluster) -> str:
    pg_cluster.create_database("gpucloud_test", recreate=True)
    url = pg_cluster.url("gpucloud_test")
    upgrade(url)
    return url


@pytest.fixture(scope="session")
async def db_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=20, max_overflow=40)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def db_sessions(db_engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return session_factory(db_engine)


@pytest.fixture(autouse=True)
async def clean_db(db_engine: AsyncEngine) -> None:
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    async with db_engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {tables} CASCADE"))


# GPUCLOUD_TEST_TEMPORAL=cluster runs the session against a Temporal server on PostgreSQL (the
# production persistence, devstack/temporal_cluster.py) instead of the dev server; bin/test's
# cluster tier sets it for the lifecycle suites.
TEST_TEMPORAL = os.environ.get("GPUCLOUD_TEST_TEMPORAL", "dev")


@pytest.fixture(scope="session")
async def temporal_env(request: pytest.FixtureRequest) -> AsyncIterator[WorkflowEnvironment]:
    if TEST_TEMPORAL == "cluster":
        pg: PostgresCluster = request.getfixturevalue("pg_cluster")
        root = pg.datadir.parent / "temporal"
        root.mkdir(exist_ok=True)
        with running_cluster(pg, root, free_port()) as cluster:
            client = await Client.connect(
                cluster.address,
                namespace=cluster.namespace,
                data_converter=data_converter(TEST_CODEC_KEY),
            )
            yield WorkflowEnvironment.from_client(client)
        return
    env = await WorkflowEnvironment.start_local(
        namespace="default",
        data_converter=data_converter(TEST_CODEC_KEY),
        dev_server_existing_path=str(temporal_cli_path()),
        dev_server_extra_args=dev_server_extra_args(),
        ui=False,
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


@pytest.fixture
def settings(database_url: str, temporal_client: Client) -> Settings:
    """Settings for one test: its own control-plane task queue and short timeouts."""
    base = Settings.from_env({})
    return dataclasses.replace(
        base,
        database_url=database_url,
        temporal_address=temporal_client.service_client.config.target_host,
        codec_key_b64=TEST_CODEC_KEY_B64,
        control_plane_task_queue=f"control-plane-{uuid.uuid4()}",
        node_schedule_to_start_seconds=5.0,
        host_provision_timeout_seconds=30.0,
        host_heartbeat_timeout_seconds=5.0,
        release_max_attempts=3,
        release_retry_initial_seconds=0.1,
        lease_conflict_max_attempts=3,
    )


@pytest.fixture
async def control_plane(
    settings: Settings, temporal_client: Client, db_engine: AsyncEngine
) -> AsyncIterator[None]:
    """The control-plane worker, in-process, on this test's own task queue."""
    from worker import build_worker

    async with build_worker(temporal_client, settings, db_engine):
        yield
