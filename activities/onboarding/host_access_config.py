"""Which `HostAccess` the worker uses, from its environment.

    GPUCLOUD_HOST_ACCESS=real        (default) ipmitool for BMCs, SSH (asyncssh) for hosts
    GPUCLOUD_HOST_ACCESS=simulated   the MAAS simulator's BMCs and a simulated SSH seeder
                                     (a plugin: sim/host_access.py, the real ipmitool path
                                     with the simulator's ipmitool); needs
                                     GPUCLOUD_SIM_MAAS_URL (http://HOST:PORT/MAAS) and
                                     GPUCLOUD_SIM_MAAS_CONTROL_TOKEN

The embedded default (devstack/up.py) sets `simulated`: there is no real BMC or host to reach, and
`python -m sim.first_boot` plays the deployed OS beside the MAAS simulator. Production leaves it
unset. Why an environment switch rather than a per-site setting: which world the worker lives in
(real hardware or the simulator) is a property of the deployment, not of a MAAS site row an API
caller could change. The simulator is a plugin found by entry point only when selected: the
control plane never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points

from activities.onboarding.host_access import HostAccess
from activities.onboarding.ipmi import IpmitoolBmc
from activities.onboarding.ssh_seeder import SshHostSeeder

HOST_ACCESS_ENV = "GPUCLOUD_HOST_ACCESS"
SIM_MAAS_URL_ENV = "GPUCLOUD_SIM_MAAS_URL"
SIM_MAAS_CONTROL_TOKEN_ENV = "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN"  # noqa: S105 - a variable name
# Host access other than the real one comes from a plugin (the simulator's: sim/host_access.py).
HOST_ACCESS_ENTRY_POINTS = "gpucloud.host_access"
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
        for entry in entry_points(group=HOST_ACCESS_ENTRY_POINTS, name=SIMULATED):
            factory: Callable[[Mapping[str, str]], HostAccess] = entry.load()
            return factory(env)
        raise HostAccessConfigError(
            f"{HOST_ACCESS_ENV}={SIMULATED} needs the simulator installed (entry point "
            f"{HOST_ACCESS_ENTRY_POINTS}:{SIMULATED})"
        )
    raise HostAccessConfigError(f"{HOST_ACCESS_ENV} must be {REAL!r} or {SIMULATED!r}")
