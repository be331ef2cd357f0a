"""The agent's presence signal: it signals-with-start its node's presence workflow on the control
plane's task queue with what only the agent knows, its version and its GPU inventory (NVML where
present, sysfs otherwise). Through Temporal only, like everything else the agent says.

Liveness is not what this signal is for: the control plane reads it from the node worker's own
long polls on `node-{id}` (activities/node_liveness.py), which cost nothing extra. So the agent
checks its inventory every `interval` (local work) and signals only when that inventory changed
since the last signal it got through (compared by digest), at start, and every `refresh`
otherwise. An idle node costs the control plane a couple of signals an hour instead of one every
30 s (bench/liveness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from contracts.node_presence import (
    HEARTBEAT_SIGNAL,
    WORKFLOW_NAME,
    Heartbeat,
    NodePresenceInput,
    ReportedGpu,
    node_presence_workflow_id,
)

log = logging.getLogger("agent.heartbeat")
# How often the agent reads its GPU inventory (locally; a signal goes out only if it changed).
DEFAULT_INTERVAL_SECONDS = 30.0
# The longest the agent stays without a presence signal: version and contact kept fresh even if
# nothing changes, and a presence workflow someone terminated comes back.
DEFAULT_REFRESH_SECONDS = 1800.0

InventoryProbe = Callable[[], list[ReportedGpu] | None]


def probe_local_gpus(
    sysfs_root: Path | str = "/sys", *, use_nvml: bool = True
) -> list[ReportedGpu] | None:
    """This host's GPUs, read-only (agent/inventory.py: NVML where present, else sysfs; [] when
    neither can be read, which the control plane then flags as not matching the node's slots)."""
    from agent.inventory import probe_gpus

    return [
        ReportedGpu(r.pci_address, r.numa_node, r.model or "", r.memory_mib)
        for r in probe_gpus(sysfs_root, use_nvml=use_nvml)
    ]


def inventory_digest(gpus: list[ReportedGpu]) -> str:
    """A digest of what the control plane records of an inventory (order does not matter)."""
    rows = sorted(json.dumps(dataclasses.asdict(g), sort_keys=True) for g in gpus)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


async def send_heartbeat(
    client: Client,
    node_id: str,
    *,
    control_plane_queue: str,
    agent_version: str = "",
    gpus: list[ReportedGpu] | None = None,
) -> None:
    await client.start_workflow(
        WORKFLOW_NAME,
        NodePresenceInput(node_id),
        id=node_presence_workflow_id(node_id),
        task_queue=control_plane_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=HEARTBEAT_SIGNAL,
        start_signal_args=[
            Heartbeat(node_id, dt.datetime.now(dt.UTC).isoformat(), agent_version, gpus)
        ],
    )


async def run_heartbeats(
    client: Client,
    node_id: str,
    *,
    control_plane_queue: str,
    stop: asyncio.Event,
    inventory: InventoryProbe = probe_local_gpus,
    interval: float = DEFAULT_INTERVAL_SECONDS,
    refresh: float = DEFAULT_REFRESH_SECONDS,
    agent_version: str = "",
) -> None:
    """Until `stop` is set. A failed signal is logged and tried again at the next check: its
    inventory still counts as not sent."""
    sent_digest: str | None = None
    last_sent: float | None = None
    while not stop.is_set():
        try:
            gpus = await asyncio.to_thread(inventory)
            digest = inventory_digest(gpus) if gpus is not None else None
            changed = digest is not None and digest != sent_digest
            if changed or last_sent is None or time.monotonic() - last_sent >= refresh:
                await send_heartbeat(
                    client,
                    node_id,
                    control_plane_queue=control_plane_queue,
                    agent_version=agent_version,
                    gpus=gpus if changed else None,  # None: the recorded inventory stands
                )
                last_sent = time.monotonic()
                if changed:
                    sent_digest = digest
        except Exception as err:
            log.warning("heartbeat for node %s failed: %s", node_id, type(err).__name__)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
