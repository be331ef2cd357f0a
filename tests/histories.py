"""Recorded workflow histories: tests write them when GPUCLOUD_RECORD_HISTORIES=1 and
tests/test_replay.py replays every committed one, so a change that would break running
workflows fails CI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowHistory

from tests.lifecycle_support import eventually

HISTORIES_DIR = Path(__file__).parent / "histories"

_TASK_CLOSED = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
}


async def record_history(handle: WorkflowHandle, workflow_dir: str, name: str) -> None:
    if os.environ.get("GPUCLOUD_RECORD_HISTORIES") != "1":
        return
    history = await _settled_history(handle)
    path = HISTORIES_DIR / workflow_dir / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")


async def _settled_history(handle: WorkflowHandle, timeout: float = 15.0) -> WorkflowHistory:
    """The history once no workflow task is outstanding. A test may call this right after what
    it waited for became visible (a row, an API answer), which an activity does before the
    workflow task that follows it; a history cut there would record less than the run did."""

    async def settled() -> WorkflowHistory | None:
        history = await handle.fetch_history()
        return None if _workflow_task_outstanding(history) else history

    return await eventually(settled, timeout=timeout, interval=0.1)


def _workflow_task_outstanding(history: WorkflowHistory) -> bool:
    outstanding = False
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            outstanding = True
        elif event.event_type in _TASK_CLOSED:
            outstanding = False
    return outstanding
