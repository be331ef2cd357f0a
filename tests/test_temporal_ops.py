"""TemporalOps' health check before an update: a Temporal that refuses answers 503 at once, one
that is only slow to answer the check still gets the update (under the update's own deadline).
A check that ran out of time once turned a force-release sent from the console into a spurious
503 (RPCError CANCELLED "Timeout expired": the SDK's client reports its own deadline so)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from temporalio.client import WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from core.config import Settings
from gateway.errors import TemporalBusy, TemporalUnavailable, translate
from gateway.temporal import TemporalOps

RPC_SECONDS = 0.2  # the health check's bound is this + 0.5 s


def ops(check_health: Any, sends: list[dict[str, Any]] | None = None) -> TemporalOps:
    """A TemporalOps on a client that answers the health check with `check_health` and each
    update-with-start with "sent", recording what it was sent in `sends`."""
    sent_log = [] if sends is None else sends

    async def execute_update_with_start_workflow(update: str, **kwargs: Any) -> str:
        sent_log.append({"update": update, **kwargs})
        return "sent"

    client = SimpleNamespace(
        service_client=SimpleNamespace(check_health=check_health),
        execute_update_with_start_workflow=execute_update_with_start_workflow,
    )
    settings = cast(Settings, SimpleNamespace(temporal_rpc_timeout_seconds=RPC_SECONDS))
    return TemporalOps(cast(Any, client), settings)


def start_operation() -> WithStartWorkflowOperation[Any, Any]:
    return WithStartWorkflowOperation(
        "Workflow", id="wf-1", task_queue="q", id_conflict_policy=WorkflowIDConflictPolicy.FAIL
    )


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
    result = await temporal.update_with_start(start_operation, "open", result_type=str)
    assert result == "sent"


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

    sends: list[dict[str, Any]] = []
    temporal = ops(check, sends)
    with pytest.raises(TemporalUnavailable):
        await temporal.update(call)
    with pytest.raises(TemporalUnavailable):
        await temporal.update_with_start(start_operation, "open", result_type=str)
    assert called == []
    assert sends == []


async def test_an_aborted_update_with_start_is_retried_with_one_update_id_and_fresh_starts() -> (
    None
):
    sends: list[dict[str, Any]] = []
    temporal = ops(answering(), sends)
    aborted = RPCError("workflow update was aborted", RPCStatusCode.UNAVAILABLE, b"")
    client = cast(Any, temporal.client)
    answer = client.execute_update_with_start_workflow

    async def aborting_twice(update: str, **kwargs: Any) -> str:
        result = await answer(update, **kwargs)
        if len(sends) <= 2:
            raise aborted
        return str(result)

    client.execute_update_with_start_workflow = aborting_twice

    assert await temporal.update_with_start(start_operation, "open", "x", result_type=str) == "sent"

    assert len(sends) == 3
    assert len({s["id"] for s in sends}) == 1
    assert sends[0]["id"].startswith("open-")
    assert all(s["args"] == ("x",) for s in sends)
    operations = [s["start_workflow_operation"] for s in sends]
    assert len({id(o) for o in operations}) == 3  # the SDK's operations are single-use


async def test_a_503_names_what_the_request_would_have_created() -> None:
    temporal = ops(answering(RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")))

    with pytest.raises(TemporalUnavailable) as raised:
        await temporal.update_with_start(
            start_operation, "reserve", result_type=str, accepted_as=("allocation", "a-1")
        )

    assert raised.value.details == {"allocation_id": "a-1"}
    assert raised.value.message.endswith("if the request was accepted, the allocation is a-1")


async def test_a_call_temporal_refused_for_load_is_a_503_temporal_busy() -> None:
    """RESOURCE_EXHAUSTED is what the server answers a workflow's eleventh concurrent update
    once the SDK stops retrying it: a 503 the client can repeat, never a 500."""
    exhausted = RPCError(
        "limit on number of concurrent in-flight updates has been reached (10)",
        RPCStatusCode.RESOURCE_EXHAUSTED,
        b"",
    )

    async def refused(client: Any) -> str:
        raise exhausted

    with pytest.raises(TemporalBusy) as raised:
        await ops(answering()).update(refused)
    assert raised.value.status_code == 503
    assert raised.value.code == "temporal_busy"
    assert raised.value.__cause__ is exhausted
    assert isinstance(translate(exhausted), TemporalBusy)
