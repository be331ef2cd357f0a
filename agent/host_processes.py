"""What the production agent does to processes and services on its host: end a tenant's
sessions when bare-metal access is revoked, and reload/restart systemd units after the
hardware-sync re-seed.

Under a host root other than "/" (a MAAS-simulator machine, GPUCLOUD_AGENT_ROOT) nothing
outside that root may be touched: sessions are counted from its proc/ but no signal is sent, and
no systemd call is made: the units are written and each restart is left as a request under the
root (`UnitRestartRequests`), for the simulated OS to carry out.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess

from agent.backends.system_root import SystemRoot
from agent.maintenance import ProcProcessLister
from contracts.node_files import UNIT_RESTART_REQUESTS_DIR

logger = logging.getLogger("agent.host")

SYSTEMCTL_TIMEOUT_S = 60


class ProcSessionTerminator:
    """`loginctl terminate-user` (when systemd-logind is there), then SIGKILL to every process
    left with the tenant's uid. Answers how many processes it found."""

    def __init__(self, root: SystemRoot, *, kill: bool) -> None:
        self._processes = ProcProcessLister(root)
        self._kill = kill

    def terminate(self, username: str, uid: int) -> int:
        if self._kill and (loginctl := shutil.which("loginctl")) is not None:
            subprocess.run(
                [loginctl, "terminate-user", username],
                check=False,
                capture_output=True,
                timeout=SYSTEMCTL_TIMEOUT_S,
            )
        try:
            found = [p.pid for p in self._processes.processes() if p.uid == uid]
        except RuntimeError:
            return 0  # no proc/ under the root: nothing can be running there
        if self._kill:
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            if found:
                logger.info("ended %d process(es) of uid %d", len(found), uid)
        return len(found)


class SystemctlUnits:
    """`UnitManager` on a systemd host: daemon-reload, then restart the given units."""

    def reload_and_restart(self, units: list[str]) -> None:
        systemctl = shutil.which("systemctl")
        if systemctl is None:
            raise RuntimeError("systemctl is not available on this host")
        for argv in ([systemctl, "daemon-reload"], [systemctl, "restart", *units]):
            subprocess.run(argv, check=True, capture_output=True, timeout=SYSTEMCTL_TIMEOUT_S)


class UnitRestartRequests:
    """`UnitManager` under a host root other than "/": no systemd runs there, so each restart is
    an empty file named after the unit in UNIT_RESTART_REQUESTS_DIR under the root, which the
    simulated OS (sim/first_boot.py) picks up as systemd would carry it out."""

    def __init__(self, root: SystemRoot) -> None:
        self._root = root

    def reload_and_restart(self, units: list[str]) -> None:
        path = ""
        for part in UNIT_RESTART_REQUESTS_DIR.parts[1:]:
            path += f"/{part}"
            self._root.ensure_dir(path, mode=0o755)
        for unit in units:
            self._root.write_atomic(f"{path}/{unit}", "", mode=0o644)
