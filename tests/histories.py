"""Recorded workflow histories: tests write them when GPUCLOUD_RECORD_HISTORIES=1 and
tests/test_replay.py replays every committed one, so a change that would break running
workflows fails CI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from temporalio.client import WorkflowHandle

HISTORIES_DIR = Path(__file__).parent / "histories"


async def record_history(handle: WorkflowHandle, workflow_dir: str, name: str) -> None:
    if os.environ.get("GPUCLOUD_RECORD_HISTORIES") != "1":
        return
    history = await handle.fetch_history()
    path = HISTORIES_DIR / workflow_dir / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
