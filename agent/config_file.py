"""Reading the agent's config: `agent.toml` (written by cloud-init) plus the drop-ins of
`agent.d/*.toml` beside it (baked into the OS image or written by a site hook), merged table by
table in file-name order, later files winning. A drop-in can set host facts the control plane
cannot know (the uplink NIC, the libvirt URI, a GPU driver policy) without touching the file
cloud-init owns.

`HostRoot` is where the agent's host lives: "/" on a node. Every absolute path the agent reads or
writes on its host (this config, its state dir, the account files, /proc, /sys, image and seed
directories) is resolved under it; the MAAS simulator's machines run the same agent under a
per-machine directory (GPUCLOUD_AGENT_ROOT), as a containerised agent would with the host
mounted at /host.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT_ENV = "GPUCLOUD_AGENT_ROOT"
DROP_IN_DIR = "agent.d"


class ConfigError(ValueError):
    """The agent config cannot be used. The message names files and keys, never values."""


@dataclass(frozen=True)
class HostRoot:
    path: Path

    @classmethod
    def from_env(cls, value: str | None = None) -> HostRoot:
        raw = value if value is not None else os.environ.get(ROOT_ENV, "")
        return cls(Path(raw or "/").resolve())

    @property
    def is_real_root(self) -> bool:
        return self.path == Path("/")

    def __call__(self, absolute: str | Path) -> Path:
        """The host path `absolute` ("/etc/gpucloud/agent.toml") under this root."""
        text = str(absolute)
        if not text.startswith("/"):
            raise ConfigError(f"{text!r} must be an absolute path")
        return self.path / text.lstrip("/") if not self.is_real_root else Path(text)


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
