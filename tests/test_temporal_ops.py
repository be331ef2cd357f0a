"""TemporalOps' health check before an update: a Temporal that refuses answers 503 at once, one
that is only slow to answer the check still gets the update (under the update's own deadline).
A check that ran out of time once turned a force-release sent from the console into a spurious
503 (RPCError CANCELLED "Timeout expired": the SDK's client reports its own deadline so)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from temporalio.service import RPCError, RPCStatusCode

from core.config import Settings
from gateway.errors import TemporalUnavailable
from gateway.temporal import TemporalOps

RPC_SECONDS = 0.2  # the health check's bound is this + 0.5 s


def ops(check_health: Any) -> TemporalOps:
    client = SimpleNamespace(service_client=SimpleNamespace(check_health=check_health))
    settings = cast(Settings, SimpleNamespace(temporal_rpc_timeout_seconds=RPC_SECONDS))
    return TemporalOps(cast(Any, client), settings)


def answering(error: BaseException | None = None, *, hang: bool = False) -> Any:
    async def check_health(timeout: Any) -> bool:
        if hang:
            await asyncio.sleep(60)
        if error is not None:
            raise error
        return True

    return check_health


async def sent(client: Any) -> str:
    return "sent"


@pytest.mark.parametrize(
    "check",
    [
        answering(RPCError("Timeout expired", RPCStatusCode.CANCELLED, b"")),
        answering(RPCError("deadline exceeded", RPCStatusCode.DEADLINE_EXCEEDED, b"")),
        answering(hang=True),
    ],
    ids=["client-deadline", "server-deadline", "no-answer"],
)
async def test_a_health_check_that_ran_out_of_time_does_not_refuse_the_update(check: Any) -> None:
    temporal = ops(check)
    assert await temporal.update(sent) == "sent"
    assert await temporal.update_with_start(sent) == "sent"


async def not_serving(timeout: Any) -> bool:
    return False


@pytest.mark.parametrize(
    "check",
    [
        answering(RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")),
        answering(RuntimeError("Failed client connect: connection refused")),
        not_serving,
    ],
    ids=["unavailable", "no-connection", "not-serving"],
)
async def test_a_temporal_that_refuses_answers_503_before_the_update(check: Any) -> None:
    called: list[Any] = []

    async def call(client: Any) -> str:
        called.append(client)
        return "sent"

    temporal = ops(check)
    with pytest.raises(TemporalUnavailable):
        await temporal.update(call)
    with pytest.raises(TemporalUnavailable):
        await temporal.update_with_start(call)
    assert called == []
