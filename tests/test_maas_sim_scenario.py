"""Scenario files: the demo site loads and builds; mistakes are refused with a clear reason, and
the simulator's command line refuses to start on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.maas.build import build_region
from sim.maas.cli import DEMO_SCENARIO
from sim.maas.scenario import Scenario, ScenarioError, parse_duration
from tests.maas_fixtures import REPO_ROOT, sim_machine, sim_scenario


def test_the_demo_site_builds() -> None:
    scenario = Scenario.load(DEMO_SCENARIO)
    region = build_region(scenario)
    statuses = {m.hostname: m.status.label for m in region.machines.values()}
    assert statuses == {"c07u43": "Ready", "c07u44": "Deployed", "c07u46": "Ready"}
    assert len(region.hardware) == 4  # c07u45 waits for a BMC power cycle
    assert region.clock.time_scale == scenario.time_scale == 0.02
    troubled = region.find_hardware("c07u46")
    assert troubled is not None
    assert {f.spec.kind for f in troubled.faults.faults} == {
        "deploy_fails_datasource",
        "erase_fails",
        "token_delayed",
    }


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(90, 90.0), ("90", 90.0), ("30s", 30.0), ("15m", 900.0), ("1h30m", 5400.0)],
)
def test_durations(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


def _with(machine_changes: dict[str, Any], **scenario: Any) -> dict[str, Any]:
    return sim_scenario(sim_machine("n1", "10.0.0.1", **machine_changes), **scenario)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        ({"machines": [{"hostname": "x"}]}, "needs a hostname and a bmc"),
        ({"colour": "blue"}, "unknown keys colour"),
        (_with({"status": "Deploying"}), "cannot start in Deploying"),
        (_with({"status": "Sideways"}), "unknown MAAS status"),
        (_with({"faults": [{"kind": "gremlins"}]}), "unknown fault kind"),
        (_with({"faults": [{"kind": "erase_fails", "delay": 3}]}), "does not take: delay"),
        (_with({"boot_disk": "sdz"}), "no disk 'sdz'"),
        (_with({}, faults=[{"kind": "boss_disk_missing"}]), "top-level faults are request"),
        (
            sim_scenario(sim_machine("a", "10.0.0.1"), sim_machine("b", "10.0.0.1")),
            "duplicate BMC address",
        ),
        (_with({}, subnets=[]), "unknown subnet 'pxe'"),
        (_with({"timings": {"deploying": "soon"}}), "not a duration"),
    ],
)
def test_mistakes_are_refused(document: dict[str, Any], reason: str) -> None:
    with pytest.raises(ScenarioError, match=reason):
        build_region(Scenario.from_dict(document))


def test_the_command_line_refuses_a_broken_scenario(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[[machines]]\nhostname = 'x'\n")
    result = subprocess.run(
        [sys.executable, "-m", "sim.maas", "--scenario", str(broken), "--port", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "needs a hostname and a bmc" in result.stderr
