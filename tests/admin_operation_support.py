"""Helpers for tests of the admin operations the gateway runs through AdminOperationWorkflow:
a worker with just that workflow and its activities (as worker.py registers them) on a test's
task queue, and finding the operation's runs in Temporal to record their histories.

    async with admin_operations_worker(temporal_client, settings, db_engine):
        ...  # the gateway's admin credits, slot returns, drift resolves, site credentials ...
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from contracts.admin_operation import (
    WORKFLOW_ID_PREFIX,
    WORKFLOW_NAME,
    admin_operation_workflow_id,
)
from core.config import Settings
from core.secrets import SecretStore, VaultSecretStore
from schema.db import session_factory
from tests.histories import record_history
from tests.lifecycle_support import eventually
from workflows.admin_operation import AdminOperationWorkflow

HISTORY_DIR = "admin_operation"


@contextlib.asynccontextmanager
async def admin_operations_worker(
    client: Client,
    settings: Settings,
    engine: AsyncEngine,
    secret_store: SecretStore | None = None,
) -> AsyncIterator[Worker]:
    """The admin operations' part of the control-plane worker on settings' task queue, reading
    Vault as `settings` say (or through `secret_store`)."""
    from worker import WORKFLOW_RUNNER, operation_activities

    async with Worker(
        client,
        task_queue=settings.control_plane_task_queue,
        workflows=[AdminOperationWorkflow],
        activities=operation_activities(
            session_factory(engine),
            secret_store or VaultSecretStore.from_settings(settings),
            client,
        ),
        workflow_runner=WORKFLOW_RUNNER,
    ) as worker:
        yield worker


async def operation_ids(client: Client, settings: Settings, operation: str) -> list[str]:
    """Ids of `operation`'s runs on this test's task queue, oldest first (visibility lags a
    little behind: callers wait for the count they expect)."""
    prefix = admin_operation_workflow_id(operation, "")
    assert prefix.startswith(WORKFLOW_ID_PREFIX)
    query = f'WorkflowType="{WORKFLOW_NAME}" AND TaskQueue="{settings.control_plane_task_queue}"'
    runs = [wf async for wf in client.list_workflows(query)]
    runs.sort(key=lambda wf: wf.start_time)
    return [wf.id for wf in runs if wf.id.startswith(prefix)]


async def nth_run(client: Client, settings: Settings, operation: str, n: int) -> WorkflowHandle:
    """The handle of `operation`'s n-th run (0 = the first) on this test's task queue."""

    async def found() -> str | None:
        ids = await operation_ids(client, settings, operation)
        return ids[n] if len(ids) > n else None

    return client.get_workflow_handle(await eventually(found, timeout=15.0, interval=0.2))


async def record(handle: WorkflowHandle, name: str) -> None:
    await record_history(handle, HISTORY_DIR, name)
