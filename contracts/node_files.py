"""The files the control plane writes onto a node (cloud-init at first boot, SSH seeding after
it) and the node agent reads or rewrites: where the agent's config and state live, and the MAAS
hardware-sync units. One definition, so the two sides never disagree about a path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEFAULT_CONFIG_PATH = Path("/etc/gpucloud/agent.toml")
DEFAULT_STATE_DIR = Path("/var/lib/gpucloud-agent")
# Under a host root other than "/" (a simulated machine's disk) no systemd runs: the agent leaves
# each unit restart it would make as an empty file named after the unit here, for whatever plays
# systemd for that tree (sim/first_boot.py) to act on.
UNIT_RESTART_REQUESTS_DIR = PurePosixPath("/run/gpucloud-agent/unit-restarts")


@dataclass(frozen=True)
class HwSyncConfig:
    service_unit: str = "/etc/systemd/system/maas_hardware_sync.service"
    timer_unit: str = "/etc/systemd/system/maas_hardware_sync.timer"
    credentials: str = "/etc/maas/maas-machine-creds.yml"
    # Agent config (never task input): what the service runs.
    exec_start: str = (
        "/usr/bin/maas-run-scripts report-results --config /etc/maas/maas-machine-creds.yml"
    )


def render_hw_sync_service(cfg: HwSyncConfig) -> str:
    return (
        "# Managed by gpucloud-agent (node.hw_sync_reseed); changes are overwritten.\n"
        "[Unit]\n"
        "Description=MAAS hardware sync\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        f"ConditionPathExists={cfg.credentials}\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"ExecStart={cfg.exec_start}\n"
    )


def render_hw_sync_timer(cfg: HwSyncConfig, interval_minutes: int) -> str:
    return (
        "# Managed by gpucloud-agent (node.hw_sync_reseed); changes are overwritten.\n"
        "[Unit]\n"
        "Description=MAAS hardware sync timer\n"
        "\n"
        "[Timer]\n"
        "OnBootSec=1min\n"
        f"OnUnitActiveSec={int(interval_minutes)}min\n"
        f"Unit={PurePosixPath(cfg.service_unit).name}\n"
        "\n"
        "[Install]\n"
        "WantedBy=timers.target\n"
    )
