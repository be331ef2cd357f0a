"""The worker's host access on a simulated site (GPUCLOUD_HOST_ACCESS=simulated), loaded by
activities/onboarding/host_access_config.py through the entry point `gpucloud.host_access`, so the
control plane never imports the simulator.

BMCs go through the worker's real ipmitool path (activities/onboarding/ipmi.IpmitoolBmc) with
`gpucloud-sim-ipmitool` as the binary (sim/maas/ipmitool.py); SSH to a deployed host is the
simulated machines' disks (sim/first_boot.SimulatedHostSeeder).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from activities.onboarding.host_access import HostAccess
from activities.onboarding.ipmi import IpmitoolBmc
from sim.first_boot import SimulatedHostSeeder

SIM_IPMITOOL = "gpucloud-sim-ipmitool"
MACHINES_DIR_ENV = "GPUCLOUD_SIM_MACHINES_DIR"


def sim_ipmitool() -> str:
    """The installed `gpucloud-sim-ipmitool` beside this Python, else the name on PATH."""
    script = Path(sys.executable).with_name(SIM_IPMITOOL)
    return str(script) if script.is_file() else SIM_IPMITOOL


def simulated_host_access(
    env: Mapping[str, str], *, seeder: SimulatedHostSeeder | None = None
) -> HostAccess:
    machines = env.get(MACHINES_DIR_ENV, "").strip()
    return HostAccess(
        bmc=IpmitoolBmc(executable=sim_ipmitool(), env=dict(env)),
        seeder=seeder or SimulatedHostSeeder(machines_dir=Path(machines) if machines else None),
    )
