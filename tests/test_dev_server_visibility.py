"""What the embedded stack changes in the dev server's visibility table
(devstack.dev_server_visibility), on a real file-backed dev server:

- the indexes nothing queries go, the ones Temporal Web and our queries use stay, and a list
  query on a dropped column still answers while the server runs;
- the guarded full-text triggers index only what a row holds, and the full-text queries
  (BuildIds here, which every workflow's first task sets) answer as the server's own triggers
  did, for rows written before the swap and after it, and after a row is deleted."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from core import search_attributes as sa
from devstack.dev_server_visibility import (
    FULL_TEXT_INDEXES,
    UNUSED_VISIBILITY_INDEXES,
    drop_unused_visibility_indexes,
    guard_full_text_triggers,
)
from devstack.temporal import dev_server_extra_args, temporal_cli_path
from tests.lifecycle_support import eventually

TEXT_INDEX, KEYWORD_LIST_INDEX = FULL_TEXT_INDEXES


async def _ids(client: Client, query: str) -> list[str]:
    return [wf.id async for wf in client.list_workflows(query)]


def _visibility_indexes(db_file: Path) -> set[str]:
    with sqlite3.connect(db_file) as db:
        rows = db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?",
            ("executions_visibility",),
        ).fetchall()
    return {name for (name,) in rows}


@pytest.fixture
async def dev_server(tmp_path: Path) -> AsyncIterator[tuple[WorkflowEnvironment, Path]]:
    db_file = tmp_path / "temporal.db"
    env = await WorkflowEnvironment.start_local(
        namespace="default",
        dev_server_existing_path=str(temporal_cli_path()),
        dev_server_extra_args=[*dev_server_extra_args(), "--db-filename", str(db_file)],
        ui=False,
    )
    try:
        yield env, db_file
    finally:
        await env.shutdown()


async def test_unused_visibility_indexes_go_and_queries_still_answer(
    dev_server: tuple[WorkflowEnvironment, Path],
) -> None:
    env, db_file = dev_server
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


@workflow.defn(name="VisibilityProbe", sandboxed=False)
class VisibilityProbe:
    @workflow.run
    async def run(self) -> None:
        return None


def _indexed_rows(db_file: Path, index: str) -> int:
    """Rows an external-content FTS5 index holds (one docsize row each)."""
    with sqlite3.connect(db_file) as db:
        (count,) = db.execute(f"SELECT count(*) FROM {index}_docsize").fetchone()  # noqa: S608
        # FTS5's own check of its index structure; raises if the index is corrupt.
        db.execute(f"INSERT INTO {index} ({index}) VALUES ('integrity-check')")  # noqa: S608
    return int(count)


async def test_guarded_full_text_triggers_answer_as_the_servers_did(
    dev_server: tuple[WorkflowEnvironment, Path],
) -> None:
    env, db_file = dev_server
    drop_unused_visibility_indexes(db_file)  # as the stack does, first
    task_queue = f"probe-{uuid.uuid4()}"
    everyone = "WorkflowType = 'VisibilityProbe' AND BuildIds = 'unversioned'"

    async def run_probes(count: int) -> list[str]:
        ids = [f"probe-{uuid.uuid4()}" for _ in range(count)]
        for workflow_id in ids:
            await env.client.execute_workflow(
                VisibilityProbe.run, id=workflow_id, task_queue=task_queue
            )
        return ids

    async def listed() -> set[str]:
        return set(await _ids(env.client, everyone))

    def listing(expected: list[str]) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return await listed() == set(expected)

        return check

    async with Worker(env.client, task_queue=task_queue, workflows=[VisibilityProbe]):
        # Written by the server's own triggers: every row is in both indexes.
        before = await run_probes(2)
        assert await eventually(listing(before), timeout=10)

        assert guard_full_text_triggers(db_file) is True
        assert guard_full_text_triggers(db_file) is False  # idempotent
        # Re-indexed from the table: no row holds a Text value, every row holds BuildIds.
        assert _indexed_rows(db_file, TEXT_INDEX) == 0
        assert _indexed_rows(db_file, KEYWORD_LIST_INDEX) == _rows_holding(
            db_file, KEYWORD_LIST_INDEX
        )
        assert await listed() == set(before)

        after = await run_probes(2)
        assert await eventually(listing(before + after), timeout=10)
        assert _indexed_rows(db_file, TEXT_INDEX) == 0
        assert _indexed_rows(db_file, KEYWORD_LIST_INDEX) == _rows_holding(
            db_file, KEYWORD_LIST_INDEX
        )

    # A deleted row leaves the index with it: the next queries neither find it nor fail. The
    # server deletes a row with this same statement, once retention or a delete request comes
    # for it (seconds to days later), so it is issued here directly; the scanner's row is one
    # the full-text indexes never held.
    with sqlite3.connect(db_file) as db:
        db.execute(
            "DELETE FROM executions_visibility WHERE workflow_id IN (?, ?)",
            (before[0], "temporal-sys-tq-scanner"),
        )
    assert await listed() == set(before[1:] + after)
    assert _indexed_rows(db_file, KEYWORD_LIST_INDEX) == _rows_holding(db_file, KEYWORD_LIST_INDEX)
    assert _indexed_rows(db_file, TEXT_INDEX) == 0


def _rows_holding(db_file: Path, index: str) -> int:
    """Visibility rows with a value in one of the index's columns (the server's own scanner
    workflows hold none: they never ran a workflow task of a versioned or unversioned worker)."""
    held = " OR ".join(f"{column} IS NOT NULL" for column in FULL_TEXT_INDEXES[index])
    with sqlite3.connect(db_file) as db:
        (count,) = db.execute(
            f"SELECT count(*) FROM executions_visibility WHERE {held}"  # noqa: S608
        ).fetchone()
    return int(count)
