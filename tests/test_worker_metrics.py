"""The worker's Temporal SDK metrics for Prometheus: a process connected with a metrics address
serves them, and a worker polling through that client shows up in them."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
from temporalio.worker import Worker

from core.config import Settings
from core.temporal import connect
from tests.conftest import free_port
from workflows.node_liveness import NodeLivenessWorkflow


async def _scrape(address: str) -> str:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(f"http://{address}/metrics")
    assert response.status_code == 200
    return response.text


async def test_a_worker_connected_with_a_metrics_address_serves_its_sdk_metrics(
    settings: Settings,
) -> None:
    address = f"127.0.0.1:{free_port()}"
    client = await connect(dataclasses.replace(settings, metrics_address=address))
    worker = Worker(
        client,
        task_queue=settings.control_plane_task_queue,
        workflows=[NodeLivenessWorkflow],
    )
    async with worker:
        await asyncio.sleep(1)  # the pollers start
        metrics = await _scrape(address)

    assert "temporal_request" in metrics  # the client's RPCs
    pollers = [
        line
        for line in metrics.splitlines()
        if line.startswith("temporal_num_pollers") and settings.control_plane_task_queue in line
    ]
    assert pollers, "the worker's pollers on its task queue"
