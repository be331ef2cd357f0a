"""Which `HostAccess` the worker uses, from its environment.

    GPUCLOUD_HOST_ACCESS=real        (default) ipmitool for BMCs, SSH (asyncssh) for hosts
    GPUCLOUD_HOST_ACCESS=simulated   the MAAS simulator's BMCs and a simulated SSH seeder
                                     (sim/first_boot.py); needs GPUCLOUD_SIM_MAAS_URL
                                     (http://HOST:PORT/MAAS) and GPUCLOUD_SIM_MAAS_CONTROL_TOKEN

The embedded default (devstack/up.py) sets `simulated`: there is no real BMC or host to reach, and
`python -m sim.first_boot` plays the deployed OS beside the MAAS simulator. Production leaves it
unset. Why an environment switch rather than a per-site setting: which world the worker lives in
(real hardware or the simulator) is a property of the deployment, not of a MAAS site row an API
caller could change. The simulator is imported only when selected, so a production worker never
loads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from activities.onboarding.host_access import HostAccess
from activities.onboarding.ipmi import IpmitoolBmc
from activities.onboarding.ssh_seeder import SshHostSeeder

HOST_ACCESS_ENV = "GPUCLOUD_HOST_ACCESS"
SIM_MAAS_URL_ENV = "GPUCLOUD_SIM_MAAS_URL"
SIM_MAAS_CONTROL_TOKEN_ENV = "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN"  # noqa: S105 - a variable name
SIM_MACHINES_DIR_ENV = "GPUCLOUD_SIM_MACHINES_DIR"
REAL = "real"
SIMULATED = "simulated"


class HostAccessConfigError(ValueError):
    """The environment does not describe a usable HostAccess (the message names variables,
    never their values)."""


def host_access_from_env(env: Mapping[str, str] = os.environ) -> HostAccess:
    mode = env.get(HOST_ACCESS_ENV, "").strip().lower() or REAL
    if mode == REAL:
        return HostAccess(bmc=IpmitoolBmc(), seeder=SshHostSeeder())
    if mode == SIMULATED:
        url = env.get(SIM_MAAS_URL_ENV, "").strip()
        token = env.get(SIM_MAAS_CONTROL_TOKEN_ENV, "").strip()
        missing = [
            name for name, value in ((SIM_MAAS_URL_ENV, url), (SIM_MAAS_CONTROL_TOKEN_ENV, token))
            if not value
        ]  # fmt: skip
        if missing:
            raise HostAccessConfigError(
                f"{HOST_ACCESS_ENV}={SIMULATED} needs {' and '.join(missing)} "
                "(the MAAS simulator's URL, e.g. http://127.0.0.1:5240/MAAS, and its control "
                "token)"
            )
        if not url.startswith(("http://", "https://")):
            raise HostAccessConfigError(f"{SIM_MAAS_URL_ENV} must be an http(s) URL")
        from sim.first_boot import SimulatedBmc, SimulatedHostSeeder

        machines = env.get(SIM_MACHINES_DIR_ENV, "").strip()
        return HostAccess(
            bmc=SimulatedBmc(url, token),
            seeder=SimulatedHostSeeder(machines_dir=Path(machines) if machines else None),
        )
    raise HostAccessConfigError(f"{HOST_ACCESS_ENV} must be {REAL!r} or {SIMULATED!r}")
