"""Tools the stack builds once from Go modules (the temporal CLI, stripe-mock): found on PATH, or
in the cached tools folder, or built there with `go install`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

TOOLS_DIR = Path(
    os.environ.get("GPUCLOUD_TOOLS_DIR", Path.home() / ".cache" / "gpucloud" / "tools")
)


def go_tool_path(name: str, module: str, *, build: bool = True) -> Path:
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    cached = TOOLS_DIR / name
    if cached.exists():
        return cached
    if not build:
        raise RuntimeError(f"{name} not found; run bin/bootstrap")
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "install", module], check=True, env={**os.environ, "GOBIN": str(TOOLS_DIR)}
    )
    return cached
