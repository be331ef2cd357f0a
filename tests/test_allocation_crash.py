"""Kill the control-plane worker (SIGKILL, a real process) while an allocation is provisioning;
a fresh worker picks the workflow up and it reaches active exactly once, with one reservation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from contracts.host_tasks import SLICE_VM_PROVISION
from core.config import Settings
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import create_fleet, events_of, slice_request, wait_status

REPO = Path(__file__).resolve().parents[1]


def start_worker_process(settings: Settings) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "GPUCLOUD_DATABASE_URL": settings.database_url,
        "GPUCLOUD_TEMPORAL_ADDRESS": settings.temporal_address,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
        "GPUCLOUD_TASK_QUEUE": settings.control_plane_task_queue,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "worker"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def worker_processes(settings: Settings) -> Any:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        process = start_worker_process(settings)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


async def test_worker_killed_during_provisioning_reaches_active_once(
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    worker_processes: Any,
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    host = SimulatedHost(str(node.id), config=SimHostConfig(phase_delay_s=0.5))
    await start_node_agent(node.id, host=host)
    client = await api(token=await make_token("tenant", await make_project()))
    key = await client.post(
        "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
    )

    first = worker_processes()
    created = await client.post(
        "/api/v1/allocations", json=slice_request(2, key.json()["id"]), timeout=60
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    await wait_status(client, allocation_id, "provisioning", timeout=30)

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    worker_processes()

    await wait_status(client, allocation_id, "active", timeout=60)
    events = await events_of(db_sessions, allocation_id)
    assert events.count("active") == 1
    assert events.count("provisioning_started") == 1
    assert events.count("placement_reserved") == 1
    async with db_sessions() as session:
        claims = await session.scalar(
            text("SELECT count(*) FROM allocation_resource_claims WHERE status = 'held'")
        )
        allocations = await session.scalar(text("SELECT count(*) FROM allocations"))
        provision_tasks = await session.scalar(
            text("SELECT count(*) FROM node_tasks WHERE kind = :kind"), {"kind": SLICE_VM_PROVISION}
        )
    assert (claims, allocations, provision_tasks) == (2, 1, 1)
    assert host.attempts(SLICE_VM_PROVISION, allocation_id) == 1
