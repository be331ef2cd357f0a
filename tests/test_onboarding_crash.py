"""Kill the control-plane worker (SIGKILL, a real process) in the middle of a batch and start a
fresh one: every node ends as it would have, with exactly one deploy per machine and one node
record per hostname."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from schema.models import Node, NodeOnboardingEvent
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig

REPO = Path(__file__).resolve().parent.parent
HOSTS = [f"crash-{i:02d}" for i in range(12)]
SCENARIO = sim_scenario(
    *(sim_machine(h, f"10.176.19.{10 + i}", status="New") for i, h in enumerate(HOSTS))
)


def start_worker(rig: OnboardingRig, vault: Any) -> subprocess.Popen[bytes]:
    settings = rig.settings
    env = {
        **os.environ,
        "GPUCLOUD_DATABASE_URL": settings.database_url,
        "GPUCLOUD_TEMPORAL_ADDRESS": settings.temporal_address,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
        "GPUCLOUD_TASK_QUEUE": settings.control_plane_task_queue,
        "GPUCLOUD_VAULT_ADDR": vault.addr,
        "GPUCLOUD_VAULT_TOKEN": vault.token,
        "GPUCLOUD_PUBLIC_API_URL": settings.public_api_url,
        "GPUCLOUD_HOST_ACCESS": "simulated",
        "GPUCLOUD_SIM_MAAS_URL": rig.maas_sim.base_url,
        "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": rig.maas_sim.control_token,
        # SSH to a deployed host is a write to the machine's disk the rig's first boot keeps.
        "GPUCLOUD_SIM_MACHINES_DIR": str(rig.first_boot.machines_dir),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "worker"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.maas_scenario(SCENARIO)
async def test_worker_killed_mid_batch_restarts_without_duplicate_deploys(
    onboarding_without_worker: OnboardingRig, vault_server: Any
) -> None:
    rig = onboarding_without_worker
    first = start_worker(rig, vault_server)
    second: subprocess.Popen[bytes] | None = None
    try:
        _, jobs, handle = await rig.start_batch(
            [(h, f"10.176.19.{10 + i}") for i, h in enumerate(HOSTS)], max_parallel=4
        )

        async def deploys_issued() -> int:
            async with rig.sessions() as session:
                return int(
                    await session.scalar(
                        select(func.count())
                        .select_from(NodeOnboardingEvent)
                        .where(
                            NodeOnboardingEvent.stage == "deploy_via_maas",
                            NodeOnboardingEvent.status == "succeeded",
                        )
                    )
                    or 0
                )

        deadline = time.monotonic() + 90
        while await deploys_issued() < 3:  # some nodes are past deploy, others before it
            assert time.monotonic() < deadline, "the batch never got going"
            await asyncio.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)

        second = start_worker(rig, vault_server)
        summary = await asyncio.wait_for(handle.result(), timeout=240)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)

    failed = [d for d in summary.details if d.status != "completed"]
    why = [
        (d.hostname, (await rig.row(j)).error_message)
        for d in failed
        for j in jobs
        if j.hostname == d.hostname
    ]
    assert summary.succeeded == len(HOSTS), (failed, why)
    assert summary.max_in_flight <= 4
    counters = await rig.maas_sim.counters()
    for job in jobs:
        row = await rig.row(job)
        assert row.status == "completed"
        assert counters["machines"][row.maas_system_id]["machine.deploy"] == 1, job.hostname
    async with rig.sessions() as session:
        nodes = list(await session.scalars(select(Node)))
    assert sorted(n.hostname for n in nodes) == HOSTS
    assert {n.status for n in nodes} == {"active"}
