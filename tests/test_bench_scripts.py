"""The benchmark scripts run at small sizes (the Temporal servers' one with a whole stack on
each server), so a change that breaks one fails here rather than in the next quiet-machine
run: the reconciler bench once called its activity outside an activity context after the
activity started reading its run id, and nothing noticed for a session.

Their timing targets are not judged here (a CI machine runs the suite beside them); exit 1 is
a missed target, anything else, or a traceback, is a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_bench(module: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-4000:]
    assert done.returncode in (0, 1), output[-4000:]
    return done.stdout


@pytest.mark.parametrize(
    ("module", "args", "figures"),
    [
        (
            "bench.placement",
            ("--nodes", "20", "40", "--placements", "10"),
            ["20 nodes", "40 nodes", "wall p50", "p50 at 40 nodes / p50 at 20 nodes"],
        ),
        (
            "bench.queries",
            ("--allocations", "5000", "--requests", "5"),
            ["tenant list, first page", "admin timeline"],
        ),
        (
            "bench.reconciler",
            ("--machines", "60"),
            ["60 machines, clean pass", "60 machines, after drift", "refused as reconcile_suspect"],
        ),
        (
            # Issue 37: a small ledger at two ages (4 allocations, 1 and 3 days of minute
            # windows); about 20 s.
            "bench.ledger",
            ("--allocations", "4", "--days", "1", "3", "--requests", "5", "--meter-runs", "3"),
            [
                "balance read (GET /billing/balance)",
                "meter run (4 records",
                "usage export, first page (CSV)",
                "3 days / 1 day(s), ratio of p50s",
            ],
        ),
        (
            # Both Temporal servers, each under a whole stack of its own (issue 26 item 2: the
            # benchmark once in CI); about 35 s.
            "bench.temporal_servers",
            (
                *("--requests", "40", "--empty-requests", "40", "--idle-seconds", "2"),
                *("--clients", "4", "--warmup", "4"),
            ),
            ["dev: (i) idle", "cluster: (i) idle", "| (a) POST /allocations, /s |"],
        ),
    ],
    ids=["placement", "queries", "reconciler", "ledger", "temporal_servers"],
)
def test_bench_script_runs_and_prints_its_figures(
    module: str, args: tuple[str, ...], figures: list[str]
) -> None:
    printed = run_bench(module, *args)
    for figure in figures:
        assert figure in printed, printed[-4000:]
