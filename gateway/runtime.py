"""What the app holds for its lifetime: settings, the engine and session factory, the Temporal
client. Built in the lifespan and injected; handlers never construct clients themselves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from litestar.datastructures import State
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from core.config import Settings
from core.secrets import SecretStore
from gateway.config import GatewayConfig
from gateway.temporal import TemporalOps

STATE_KEY = "gpucloud"


@dataclass
class Runtime:
    settings: Settings
    config: GatewayConfig
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    temporal: TemporalOps
    # Read at call time, never cached: a rotated secret is used by the next request.
    secrets: SecretStore


def get_runtime(state: State) -> Runtime:
    runtime = state.get(STATE_KEY)
    if not isinstance(runtime, Runtime):  # pragma: no cover - only before the lifespan ran
        raise RuntimeError("gateway runtime is not initialised")
    return runtime


async def provide_runtime(state: State) -> Runtime:
    return get_runtime(state)


async def provide_db(state: State) -> AsyncIterator[AsyncSession]:
    """One short session per request; handlers commit their own writes."""
    async with get_runtime(state).sessions() as session:
        yield session


async def provide_temporal(state: State) -> TemporalOps:
    return get_runtime(state).temporal


async def provide_secrets(state: State) -> SecretStore:
    return get_runtime(state).secrets
