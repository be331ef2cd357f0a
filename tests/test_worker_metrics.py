"""The worker's Temporal SDK metrics for Prometheus: a process connected with a metrics address
serves them, and a worker polling through that client shows up in them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import httpx
from temporalio.worker import Worker

from core.config import Settings
from core.temporal import connect
from devstack.processes import free_port
from tests.lifecycle_support import eventually
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

    def pollers_in(metrics: str) -> list[str]:
        return [
            line
            for line in metrics.splitlines()
            if line.startswith("temporal_num_pollers") and settings.control_plane_task_queue in line
        ]

    async with worker:
        # Scraped until the pollers have started, rather than after a guessed pause.
        metrics = await eventually(
            lambda: _scrape_when(address, pollers_in), timeout=10, interval=0.2
        )

    assert "temporal_request" in metrics  # the client's RPCs
    assert pollers_in(metrics), "the worker's pollers on its task queue"


async def _scrape_when(address: str, found: Callable[[str], list[str]]) -> str | None:
    metrics = await _scrape(address)
    return metrics if found(metrics) else None
