"""Find (or build once) the `temporal` CLI and describe how its dev server is started."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from core.search_attributes import dev_server_flags

TEMPORAL_CLI_VERSION = "v1.5.1"
TOOLS_DIR = Path(
    os.environ.get("GPUCLOUD_TOOLS_DIR", Path.home() / ".cache" / "gpucloud" / "tools")
)


def temporal_cli_path(*, build: bool = True) -> Path:
    """`temporal` from PATH, else the cached build, else build it with Go (slow, once)."""
    on_path = shutil.which("temporal")
    if on_path:
        return Path(on_path)
    cached = TOOLS_DIR / "temporal"
    if cached.exists():
        return cached
    if not build:
        raise RuntimeError("temporal CLI not found; run bin/bootstrap")
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "install", f"github.com/temporalio/cli/cmd/temporal@{TEMPORAL_CLI_VERSION}"],
        check=True,
        env={**os.environ, "GOBIN": str(TOOLS_DIR)},
    )
    return cached


def dev_server_extra_args(*, codec_endpoint: str | None = None) -> list[str]:
    """Flags every dev server of ours gets: search attributes, update-with-start, codec."""
    args = [
        *dev_server_flags(),
        "--dynamic-config-value",
        "frontend.enableExecuteMultiOperation=true",
        "--dynamic-config-value",
        "frontend.enableUpdateWorkflowExecution=true",
        "--dynamic-config-value",
        "system.forceSearchAttributesCacheRefreshOnRead=true",
        "--log-level",
        "error",
    ]
    if codec_endpoint:
        args += ["--ui-codec-endpoint", codec_endpoint]
    return args
