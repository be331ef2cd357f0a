"""The agent's heartbeat: every `interval` it signals-with-start its node's presence workflow on
the control plane's task queue, with its GPU inventory (NVML where present, sysfs otherwise).
Through Temporal only, like everything else the agent says."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
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
DEFAULT_INTERVAL_SECONDS = 30.0

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
    agent_version: str = "",
) -> None:
    """Until `stop` is set. A failed heartbeat is logged and retried at the next tick: missing a
    few is exactly what the control plane's offline detection is for."""
    while not stop.is_set():
        try:
            gpus = await asyncio.to_thread(inventory)
            await send_heartbeat(
                client,
                node_id,
                control_plane_queue=control_plane_queue,
                agent_version=agent_version,
                gpus=gpus,
            )
        except Exception as err:
            log.warning("heartbeat for node %s failed: %s", node_id, type(err).__name__)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
