"""Reading the agent's config: `agent.toml` (written by cloud-init) plus the drop-ins of
`agent.d/*.toml` beside it (baked into the OS image or written by a site hook), merged table by
table in file-name order, later files winning. A drop-in can set host facts the control plane
cannot know (the uplink NIC, the libvirt URI, a GPU driver policy) without touching the file
cloud-init owns.

The host root (an `agent.backends.system_root.SystemRoot`) is where the agent's host lives: "/"
on a node. Every absolute path the agent reads or
writes on its host (this config, its state dir, the account files, /proc, /sys, image and seed
directories) is resolved under it; the MAAS simulator's machines run the same agent under a
per-machine directory (GPUCLOUD_AGENT_ROOT), as a containerised agent would with the host
mounted at /host.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from agent.backends.system_root import SystemRoot

ROOT_ENV = "GPUCLOUD_AGENT_ROOT"
DROP_IN_DIR = "agent.d"


class ConfigError(ValueError):
    """The agent config cannot be used. The message names files and keys, never values."""


def host_root_from_env(value: str | None = None) -> SystemRoot:
    """The agent's host root: GPUCLOUD_AGENT_ROOT, else "/"."""
    raw = value if value is not None else os.environ.get(ROOT_ENV, "")
    return SystemRoot(raw or "/")


def gpu_sysfs(data: dict[str, Any], root: SystemRoot) -> Path:
    """Where the host's PCI devices are read: `[gpu] sysfs` (default /sys) under the root."""
    return root.host_path(str(table(data, "gpu").get("sysfs", "/sys")))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read agent config {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"agent config {path} is not valid TOML: {err}") from None


def read_agent_config(path: Path) -> dict[str, Any]:
    """`path` (already under the host root) merged with `agent.d/*.toml` beside it."""
    data = _read_toml(path)
    drop_ins = path.parent / DROP_IN_DIR
    if drop_ins.is_dir():
        for extra in sorted(drop_ins.glob("*.toml")):
            data = _merge(data, _read_toml(extra))
    return data


def table(data: dict[str, Any], name: str) -> dict[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{name}] must be a table")
    return section
