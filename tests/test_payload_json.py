"""core.payload_json: dataclasses through msgspec, on the SDK's own `json/plain` wire format, so
payloads (and recorded histories) pass both ways between it and the SDK's default converter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.converter import DataConverter

from contracts.allocation import AllocationInput, AllocationPolicy
from contracts.allocation_activities import Placement, ProvisionPlan, Reservation
from contracts.host_tasks import GpuAssignment, HostProvisionInput
from contracts.states import ReleaseActor
from core.payload_json import PayloadConverter

SDK = DataConverter.default.payload_converter
OURS = PayloadConverter()

GPUS = [GpuAssignment("0000:1b:00.0", 0, 0), GpuAssignment("0000:3d:00.0", 1, 4)]
PLACEMENT = Placement(
    Reservation(
        "3f1c0c1e-8e7a-4a55-9a59-5f4d1d2b7c10", "requested", "node-1", "gpu_slice",
        "h100.slice", "eu-1", 2, GPUS, "2026-11-22T05:00:00+00:00",
    ),
    ProvisionPlan(
        "task-1",
        "slice.vm_provision",
        HostProvisionInput(
            "task-1", "alloc-1", "node-1", "gpu_slice", "gpu-abc", ["ssh-ed25519 AAAA x"],
            GPUS, 8, 65536, "img", "0" * 64, None,
        ),
    ),
)  # fmt: skip
ALLOCATION_INPUT = AllocationInput(
    "alloc-1", "project-1", "h100.slice", 2, "eu-1", ["key-1"], None, "f" * 64,
    AllocationPolicy(node_schedule_to_start_seconds=5.0, release_max_attempts=7),
)  # fmt: skip


@dataclass
class WithEnum:
    actor: ReleaseActor
    note: str = ""


@pytest.mark.parametrize("value", [PLACEMENT, ALLOCATION_INPUT, WithEnum(ReleaseActor.ADMIN)])
def test_dataclasses_cross_both_ways_with_the_sdk_converter(value: Any) -> None:
    [ours] = OURS.to_payloads([value])
    [theirs] = SDK.to_payloads([value])
    assert ours.metadata["encoding"] == theirs.metadata["encoding"] == b"json/plain"
    assert json.loads(ours.data) == json.loads(theirs.data)  # same document, key order aside
    kind = type(value)
    assert OURS.from_payloads([theirs], [kind]) == [value]
    assert SDK.from_payloads([ours], [kind]) == [value]
    assert OURS.from_payloads([ours], [kind]) == [value]


def test_unknown_fields_are_ignored_and_defaults_fill_missing_ones() -> None:
    """A payload written by an older or newer contract still reads, as with the SDK."""
    payload = Payload(
        metadata={"encoding": b"json/plain"},
        data=json.dumps({"actor": "user", "added_later": 1}).encode(),
    )
    assert OURS.from_payloads([payload], [WithEnum]) == [WithEnum(ReleaseActor.USER, "")]


def test_what_msgspec_refuses_gets_the_sdk_answer() -> None:
    # A field of the wrong JSON type: the SDK decides, and its error is the one raised.
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({"actor": 5}).encode())
    with pytest.raises(TypeError, match="Failed converting field actor"):
        SDK.from_payloads([payload], [WithEnum])
    with pytest.raises(TypeError, match="Failed converting field actor"):
        OURS.from_payloads([payload], [WithEnum])


def test_values_that_are_not_dataclasses_keep_the_sdk_encoding() -> None:
    for value in ({"b": 1, "a": [1, 2]}, "text", 3, None, b"raw"):
        assert OURS.to_payloads([value]) == SDK.to_payloads([value])


def run_first_decode_race(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.msgspec_first_decode_race", mode, "50"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_threads_decoding_a_type_for_the_first_time_at_once_do_not_crash_the_process() -> None:
    """The worker's one native crash: msgspec's first decode of a dataclass type, in several
    workflow-task threads at once. Plain msgspec dies of it here; our converter decodes them all.
    The first half is the reproduction: once a msgspec release fixes the race, it fails, and
    core/payload_json.py's lock can go with it."""
    plain = run_first_decode_race("plain")
    assert plain.returncode == -signal.SIGSEGV, (plain.returncode, plain.stdout, plain.stderr)
    assert "Fatal Python error: Segmentation fault" in plain.stderr
    assert "msgspec_first_decode_race.py" in plain.stderr  # the trace names the decode

    ours = run_first_decode_race("converter")
    assert ours.returncode == 0, (ours.stdout, ours.stderr)
    assert ours.stdout.strip() == "decoded 200 of 200"
