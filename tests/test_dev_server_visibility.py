"""The embedded stack drops the dev server's visibility indexes nothing queries
(devstack.temporal.drop_unused_visibility_indexes): they go, the ones Temporal Web and our
queries use stay, and a list query on a dropped column still answers while the server runs."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.testing import WorkflowEnvironment

from core import search_attributes as sa
from devstack.temporal import (
    UNUSED_VISIBILITY_INDEXES,
    dev_server_extra_args,
    drop_unused_visibility_indexes,
    temporal_cli_path,
)
from tests.lifecycle_support import eventually


async def _ids(client: Client, query: str) -> list[str]:
    return [wf.id async for wf in client.list_workflows(query)]


def _visibility_indexes(db_file: Path) -> set[str]:
    with sqlite3.connect(db_file) as db:
        rows = db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?",
            ("executions_visibility",),
        ).fetchall()
    return {name for (name,) in rows}


async def test_unused_visibility_indexes_go_and_queries_still_answer(tmp_path: Path) -> None:
    db_file = tmp_path / "temporal.db"
    env = await WorkflowEnvironment.start_local(
        namespace="default",
        dev_server_existing_path=str(temporal_cli_path()),
        dev_server_extra_args=[*dev_server_extra_args(), "--db-filename", str(db_file)],
        ui=False,
    )
    try:
        before = _visibility_indexes(db_file)
        assert set(UNUSED_VISIBILITY_INDEXES) <= before, "the server's schema changed names"

        assert drop_unused_visibility_indexes(db_file) == len(UNUSED_VISIBILITY_INDEXES)
        after = _visibility_indexes(db_file)
        assert after == before - set(UNUSED_VISIBILITY_INDEXES)
        for kept in ("default_idx", "by_workflow_type", "by_status", "by_keyword_01"):
            assert kept in after
        assert drop_unused_visibility_indexes(db_file) == 0  # idempotent

        # No worker: the start alone writes the visibility row, with one of our attributes.
        workflow_id = f"visibility-{uuid.uuid4()}"
        await env.client.start_workflow(
            "NoSuchWorkflow",
            id=workflow_id,
            task_queue=f"nobody-{uuid.uuid4()}",
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(sa.ALLOCATION_STATUS, "provisioning")]
            ),
        )
        # The visibility row is written after the start returns: ask until it is there.
        kept_query = f"AllocationStatus = 'provisioning' AND WorkflowId = '{workflow_id}'"
        # RootWorkflowId and ExecutionDuration lost their indexes: the query scans, same answer.
        dropped_query = f"RootWorkflowId = '{workflow_id}' AND ExecutionDuration IS NULL"
        assert await eventually(lambda: _ids(env.client, kept_query), timeout=10) == [workflow_id]
        assert await _ids(env.client, dropped_query) == [workflow_id]
    finally:
        await env.shutdown()
