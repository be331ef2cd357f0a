"""Find (or build once) the `temporal` CLI and describe how its dev server is started."""

from __future__ import annotations

from pathlib import Path

from core.search_attributes import dev_server_flags
from devstack.go_tools import TOOLS_DIR, go_tool_path

__all__ = [
    "DEV_SERVER_ENV",
    "TOOLS_DIR",
    "dev_server_extra_args",
    "temporal_cli_path",
]

TEMPORAL_CLI_VERSION = "v1.5.1"


def temporal_cli_path(*, build: bool = True) -> Path:
    """`temporal` from PATH, else the cached build, else build it with Go (slow, once)."""
    return go_tool_path(
        "temporal", f"github.com/temporalio/cli/cmd/temporal@{TEMPORAL_CLI_VERSION}", build=build
    )


# The dev server's Go garbage collector took 7 to 9 % of its CPU under allocation load;
# GOGC=200 roughly halves that, for a larger heap (360 MB resident at the benchmark's peak
# instead of 265 MB).
DEV_SERVER_ENV = {"GOGC": "200"}

# Every node agent keeps AGENT_NODE_QUEUE_POLLERS long polls open on its node queue, and the
# frontend refuses polls beyond frontend.namespaceCount per namespace and API (default 1,200:
# a batch onboarding stalled at about 280 simulated nodes on it, issue 27). Sized for 10,000 nodes
# with two polls each, plus the control plane's own.
LONG_POLLS_PER_NAMESPACE = 25_000


def dev_server_extra_args(*, codec_endpoint: str | None = None) -> list[str]:
    """Flags every dev server of ours gets: search attributes, update-with-start, codec."""
    # forceSearchAttributesCacheRefreshOnRead: the CLI turns it on so that attributes added at
    # run time show at once; ours are all registered at start, and with it every history call
    # read the cluster metadata and the namespace from SQLite again (6 % of the server's CPU,
    # on its one connection).
    args = [
        *dev_server_flags(),
        "--dynamic-config-value",
        "frontend.enableExecuteMultiOperation=true",
        "--dynamic-config-value",
        "frontend.enableUpdateWorkflowExecution=true",
        "--dynamic-config-value",
        "system.forceSearchAttributesCacheRefreshOnRead=false",
        "--dynamic-config-value",
        "matching.numTaskqueueReadPartitions=1",
        "--dynamic-config-value",
        "matching.numTaskqueueWritePartitions=1",
        "--dynamic-config-value",
        f"frontend.namespaceCount={LONG_POLLS_PER_NAMESPACE}",
        "--log-level",
        "error",
        "--sqlite-pragma",
        "journal_mode=wal",
        "--sqlite-pragma",
        "synchronous=normal",
    ]
    if codec_endpoint:
        args += ["--ui-codec-endpoint", codec_endpoint]
    return args
