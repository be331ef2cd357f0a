"""Replay every committed history with the current workflow code and the codec that recorded it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from core.temporal import data_converter
from tests.conftest import TEST_CODEC_KEY
from tests.histories import HISTORIES_DIR
from worker import WORKFLOWS

HISTORY_FILES = sorted(HISTORIES_DIR.glob("*/*.json"))


def _load(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(f"replay-{path.stem}", path.read_text())


def _replayer() -> Replayer:
    return Replayer(workflows=WORKFLOWS, data_converter=data_converter(TEST_CODEC_KEY))


def test_every_workflow_type_has_recorded_histories() -> None:
    recorded = {
        json.loads(p.read_text())["events"][0]["workflowExecutionStartedEventAttributes"][
            "workflowType"
        ]["name"]
        for p in HISTORY_FILES
    }
    defined = {w.__temporal_workflow_definition.name for w in WORKFLOWS}  # type: ignore[attr-defined]
    assert defined <= recorded


@pytest.mark.parametrize("path", HISTORY_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
async def test_history_replays(path: Path) -> None:
    await _replayer().replay_workflow(_load(path))


async def test_a_changed_workflow_is_caught() -> None:
    """Rename the host activity in a recorded history: replay must report non-determinism."""
    source = HISTORIES_DIR / "allocation" / "slice_happy_path.json"
    text = source.read_text().replace('"slice.vm_provision"', '"slice.vm_provision_renamed"')
    assert "slice.vm_provision_renamed" in text
    broken = WorkflowHistory.from_json("replay-broken", text)
    result = await _replayer().replay_workflow(broken, raise_on_replay_failure=False)
    assert result.replay_failure is not None
