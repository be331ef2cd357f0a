"""Shared steps for allocation lifecycle tests: a tenant with a catalog, a fleet and agents, and
polling with deadlines instead of sleeps."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from contracts.states import SkuShape
from schema.models import AllocationEvent, AllocationResourceClaim, GpuSlot
from tests.factories import BAREMETAL_SKU, REGION, SLICE_SKU, FleetNode, create_node, create_sku

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T | None]], *, timeout: float = 20.0, interval: float = 0.05
) -> T:
    """Await `check()` until it returns a truthy value, and return that; fail at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


async def server_started(server: Any, serving: asyncio.Task[Any], *, timeout: float = 30.0) -> None:
    """Until a uvicorn.Server run as the task `serving` has started (uvicorn offers no started
    event); a startup that failed raises its error here."""

    async def started() -> bool:
        if serving.done():
            serving.result()
            raise AssertionError("the server exited before it started")
        return bool(server.started)

    await eventually(started, timeout=timeout, interval=0.02)


async def wait_status(
    client: httpx.AsyncClient, allocation_id: str, status: str, *, timeout: float = 20.0
) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        body: dict[str, Any] = (await client.get(f"/api/v1/allocations/{allocation_id}")).json()
        return body if body.get("status") == status else None

    try:
        result: dict[str, Any] = await eventually(check, timeout=timeout)
    except AssertionError:
        current = (await client.get(f"/api/v1/allocations/{allocation_id}")).json()
        raise AssertionError(f"allocation never reached {status}: {current}") from None
    return result


@dataclass
class Tenant:
    client: httpx.AsyncClient
    project_id: uuid.UUID
    ssh_key_id: str
    ssh_public_key: str


async def create_fleet(
    sessions: async_sessionmaker[AsyncSession],
    *,
    slice_nodes: int = 1,
    baremetal_nodes: int = 0,
    gpus: int = 8,
) -> list[FleetNode]:
    """The catalog, and `active` node rows written in SQL (no onboarding, enrollment or status
    event): debt that tests/test_suite_hygiene.py counts. New tests take the enrolled fleet
    (tests/enrolled_fleet.py); `slice_nodes=0` (the catalog only) is admin data."""
    await create_sku(sessions, SLICE_SKU, shape=SkuShape.GPU_SLICE, allowed=(1, 2, 4, 8))
    await create_sku(sessions, BAREMETAL_SKU, shape=SkuShape.BAREMETAL, allowed=(8,))
    nodes = [await create_node(sessions, sku=SLICE_SKU, gpus=gpus) for _ in range(slice_nodes)]
    nodes += [
        await create_node(sessions, sku=BAREMETAL_SKU, gpus=8) for _ in range(baremetal_nodes)
    ]
    return nodes


def slice_request(gpus: int = 2, ssh_key_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A slice request body; `overrides` replace any field (including gpus)."""
    body: dict[str, Any] = {
        "sku": SLICE_SKU,
        "gpus": gpus,
        "region": REGION,
        "ssh_key_ids": [ssh_key_id] if ssh_key_id else [],
    }
    body.update(overrides)
    return body


def baremetal_request(ssh_key_id: str | None = None) -> dict[str, Any]:
    return slice_request(8, ssh_key_id, sku=BAREMETAL_SKU)


async def events_of(sessions: async_sessionmaker[AsyncSession], allocation_id: str) -> list[str]:
    async with sessions() as session:
        rows = await session.scalars(
            select(AllocationEvent.event)
            .where(AllocationEvent.allocation_id == uuid.UUID(allocation_id))
            .order_by(AllocationEvent.id)
        )
        return list(rows)


async def held_claims(sessions: async_sessionmaker[AsyncSession], allocation_id: str) -> int:
    async with sessions() as session:
        rows = await session.scalars(
            select(AllocationResourceClaim.id).where(
                AllocationResourceClaim.allocation_id == uuid.UUID(allocation_id),
                AllocationResourceClaim.status == "held",
            )
        )
        return len(rows.all())


async def reserved_slots(sessions: async_sessionmaker[AsyncSession]) -> int:
    async with sessions() as session:
        rows = await session.scalars(select(GpuSlot.id).where(GpuSlot.status == "reserved"))
        return len(rows.all())


class LoopBridge:
    """Runs coroutines on the test's event loop from another thread (a Hypothesis model runs its
    steps in a worker thread while the stack's clients live on the test's loop), each bounded by
    `step_timeout_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_timeout_s: float) -> None:
        self.loop = loop
        self.step_timeout_s = step_timeout_s

    def __call__(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.step_timeout_s)
