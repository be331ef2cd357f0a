"""Liveness from what an idle agent already does: real agent processes (`python -m agent.main`,
the simulated host backend on a simulated machine's disk) signal their presence at start and
when their GPU inventory changes, and otherwise only long-poll their node queue, which the
liveness sweep reads through Temporal's DescribeTaskQueue. A killed agent's node goes offline
within the threshold; a live idle one, heard from only through its polls, stays active."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from contracts.node_liveness import LivenessInput, LivenessResult
from contracts.node_presence import PresenceView, node_presence_workflow_id
from core.config import Settings
from schema.models import GpuSlot, Node
from sim.libvirt_hosts import GpuPlacement
from sim.machine_image import Machine, build_machine
from tests.histories import record_history
from tests.lifecycle_support import create_fleet, eventually
from workflows.node_liveness import NodeLivenessWorkflow

pytestmark = pytest.mark.usefixtures("control_plane")

# Longer than one idle long poll (Temporal answers an empty poll after about a minute, and only
# then does the poller's last access time move again): the shortest threshold a live idle agent
# can meet. Production's is 300 s.
OFFLINE_AFTER_SECONDS = 75.0
SWEEP_EVERY_SECONDS = 3.0


async def node_machine(db_sessions: Any, node_id: uuid.UUID, directory: Path) -> Machine:
    """A simulated machine whose PCI bus holds exactly the node's GPU slots."""
    async with db_sessions() as session:
        slots = (
            await session.execute(
                select(GpuSlot.pci_address, GpuSlot.numa_node).where(GpuSlot.node_id == node_id)
            )
        ).all()
    gpus = [GpuPlacement(address, numa or 0) for address, numa in slots]
    return build_machine(directory, address=str(node_id), gpus=gpus, machine_key=str(node_id))


@contextlib.contextmanager
def agent_process(
    settings: Settings, node_id: uuid.UUID, machine: Machine, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The real agent, as cloud-init starts it but with its node id given (no enrollment)."""
    env = {
        **os.environ,
        "GPUCLOUD_TEMPORAL_ADDRESS": settings.temporal_address,
        "GPUCLOUD_TEMPORAL_NAMESPACE": settings.temporal_namespace,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
        "GPUCLOUD_TASK_QUEUE": settings.control_plane_task_queue,
        "GPUCLOUD_AGENT_ROOT": str(machine.root),
    }
    command = [sys.executable, "-m", "agent.main", "--node-id", str(node_id)]
    command += ["--backend", "simulated", "--heartbeat-seconds", "0.2"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def node_row(db_sessions: Any, node_id: uuid.UUID) -> Node:
    async with db_sessions() as session:
        node: Node | None = await session.get(Node, node_id)
        assert node is not None
        return node


async def presence(client: Any, node_id: uuid.UUID) -> PresenceView:
    handle = client.get_workflow_handle(node_presence_workflow_id(str(node_id)))
    view: PresenceView = await handle.query("presence", result_type=PresenceView)
    return view


async def test_the_agent_signals_at_start_and_when_its_inventory_changes_only(
    db_sessions: Any, temporal_client: Any, settings: Settings, tmp_path: Path
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1, gpus=2)
    machine = await node_machine(db_sessions, node.id, tmp_path / "machine")
    with agent_process(settings, node.id, machine, tmp_path / "agent.log"):

        async def reported() -> Node | None:
            row = await node_row(db_sessions, node.id)
            return row if row.inventory_matches is not None else None

        row = await eventually(reported, timeout=60)
        assert row.inventory_matches is True, (tmp_path / "agent.log").read_text()
        assert row.agent_version
        # It checks its inventory every 0.2 s (--heartbeat-seconds); an unchanged one is not sent
        # again. Something that must not happen: a bounded window of five checks.
        await asyncio.sleep(5 * 0.2)
        assert (await presence(temporal_client, node.id)).heartbeats_seen == 1

        # A GPU falls off the bus: its next check sends the new inventory.
        removed = sorted((machine.root / "sys/bus/pci/devices").iterdir())[0]
        shutil.rmtree(removed)

        async def flagged() -> Node | None:
            row = await node_row(db_sessions, node.id)
            return row if row.inventory_matches is False else None

        row = await eventually(flagged, timeout=30)
        assert removed.name not in [g["pci_address"] for g in row.gpu_inventory]
        view = await presence(temporal_client, node.id)
        assert view.heartbeats_seen == 2
        assert view.mismatched_pci_addresses == [removed.name]


async def sweep(client: Any, settings: Settings) -> tuple[Any, LivenessResult]:
    """One run of the workflow the `node-liveness` schedule starts every 30 s."""
    handle = await client.start_workflow(
        NodeLivenessWorkflow.run,
        LivenessInput(offline_after_seconds=OFFLINE_AFTER_SECONDS),
        id=f"node-liveness-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    return handle, await handle.result()


async def test_a_killed_agent_goes_offline_within_the_threshold_and_an_idle_one_stays(
    db_sessions: Any, temporal_client: Any, settings: Settings, tmp_path: Path
) -> None:
    killed, idle = await create_fleet(db_sessions, slice_nodes=2, gpus=2)
    machines = [
        await node_machine(db_sessions, n.id, tmp_path / f"machine-{i}")
        for i, n in enumerate((killed, idle))
    ]
    with (
        agent_process(settings, killed.id, machines[0], tmp_path / "killed.log") as doomed,
        agent_process(settings, idle.id, machines[1], tmp_path / "idle.log"),
    ):

        async def both_heard() -> bool:
            rows = [await node_row(db_sessions, n.id) for n in (killed, idle)]
            return all(r.inventory_matches for r in rows)

        await eventually(both_heard, timeout=60)
        started = time.monotonic()
        doomed.kill()  # no goodbye: its polls just stop
        doomed.wait()
        killed_at = time.monotonic()

        went_offline_after: float | None = None
        described = 0
        # Until the killed one is offline and the idle one has lived through more than a
        # threshold on its polls alone (its one presence signal was at start).
        while went_offline_after is None or time.monotonic() - started < OFFLINE_AFTER_SECONDS + 5:
            handle, result = await sweep(temporal_client, settings)
            described += result.queues_described
            assert str(idle.id) not in result.went_offline
            if str(killed.id) in result.went_offline:
                went_offline_after = time.monotonic() - killed_at
                await record_history(handle, "node_liveness", "agent_killed")
            assert time.monotonic() - killed_at < OFFLINE_AFTER_SECONDS + 2 * SWEEP_EVERY_SECONDS
            await asyncio.sleep(SWEEP_EVERY_SECONDS)

        assert went_offline_after is not None
        assert (await node_row(db_sessions, killed.id)).status == "offline"
        idle_row = await node_row(db_sessions, idle.id)
        assert idle_row.status == "active"
        assert (await presence(temporal_client, idle.id)).heartbeats_seen == 1
        assert described > 0  # the idle agent was seen through its queue's pollers
