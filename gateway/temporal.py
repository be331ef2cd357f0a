"""Every Temporal call the gateway makes goes through TemporalOps, which bounds it in time and
turns "Temporal is not answering" into TemporalUnavailable (503 temporal_unavailable) and
"Temporal refused it for load" (RESOURCE_EXHAUSTED, which the SDK retries for ~16 s first: a
workflow with more concurrent updates than the server admits) into TemporalBusy (503
temporal_busy).

The SDK retries UNAVAILABLE for ~10 s on its own, and update-with-start loops until a worker
accepts the update; an outer deadline keeps the HTTP answer prompt. Answers from Temporal that
mean "no" (update failed, workflow already started, not found) pass through unchanged for the
caller to map.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.service import RPCError, RPCStatusCode

from core.config import Settings
from gateway.errors import (
    TemporalBusy,
    TemporalUnavailable,
    is_temporal_busy,
    is_temporal_unavailable,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

# Reads (describe, health, result of a closed workflow) answer within this, whatever the
# configured RPC timeout: a read is never worth a long wait.
READ_DEADLINE_SECONDS = 5.0
HEALTH_DEADLINE_SECONDS = 2.0
# Update-with-start answers a quick UNAVAILABLE ("workflow update was aborted") when the server
# aborts the update before the workflow saw it. Server 1.29 does that when it drops a workflow's
# cached state, which it does whenever a persistence write for that workflow fails (a busy or
# slow store: the dev server's one SQLite connection under load), or when completing the
# workflow task fails. The server calls that retryable, but it hides it inside a
# multi-operation error, which neither the SDK nor its core retries. Retried from here, a
# little later each time, within the call's deadline.
UPDATE_WITH_START_BACKOFF_SECONDS = (0.05, 0.1, 0.2, 0.4, 0.8)
# A healthy answer is trusted this long: under load one check serves many requests instead of
# doubling the gRPC calls per POST. Failures are never cached.
HEALTH_TRUSTED_SECONDS = 1.0
# How an RPC that ran out of time comes back: the server's deadline, or the client's own.
RPC_TIMED_OUT = frozenset({RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED})


class TemporalOps:
    def __init__(self, client: Client | None, settings: Settings) -> None:
        self._client = client
        self._rpc_seconds = settings.temporal_rpc_timeout_seconds
        self._healthy_until = 0.0

    @property
    def client(self) -> Client:
        if self._client is None:
            raise TemporalUnavailable("the gateway has no Temporal client")
        return self._client

    @property
    def rpc_timeout(self) -> timedelta:
        return timedelta(seconds=self._rpc_seconds)

    @property
    def read_timeout(self) -> timedelta:
        return timedelta(seconds=min(self._rpc_seconds, READ_DEADLINE_SECONDS))

    async def _bounded(self, call: Callable[[Client], Awaitable[T]], seconds: float) -> T:
        client = self.client
        try:
            return await asyncio.wait_for(call(client), timeout=seconds)
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
            # Also what the SDK raises when our deadline cancels an update call.
            raise TemporalUnavailable(
                "Temporal did not answer in time; retry (with the same X-Idempotency-Key)"
            ) from err
        except Exception as err:
            if isinstance(err, OSError) or is_temporal_unavailable(err):
                raise TemporalUnavailable() from err
            if is_temporal_busy(err):
                raise TemporalBusy() from err
            raise

    async def read(self, call: Callable[[Client], Awaitable[T]]) -> T:
        """A quick call: describe, query, result of a closed workflow."""
        return await self._bounded(call, self.read_timeout.total_seconds())

    async def update(self, call: Callable[[Client], Awaitable[T]]) -> T:
        """A call that waits on a workflow (an update; update-with-start goes through
        update_with_start). A cheap health check first, so a Temporal that went away answers
        503 at once rather than after the SDK's own retries."""
        await self._check_reachable()
        # A little beyond the RPC timeout so the SDK's own deadline fires first when it can.
        return await self._bounded(call, self._rpc_seconds + 0.5)

    async def update_with_start(
        self,
        start: Callable[[], WithStartWorkflowOperation[Any, Any]],
        update: str,
        *args: Any,
        result_type: type[T],
        accepted_as: tuple[str, object] | None = None,
    ) -> T:
        """Send `update` (with `args`) to the workflow `start` builds, starting it unless it
        runs: the one path for update-with-start. A health check first, as update() does, then
        attempts the server aborted are retried, a little later each time, within the call's
        deadline. `start` builds a fresh operation for each attempt (the SDK's are single-use);
        one update id serves every attempt of this request, so an attempt the server did take
        is answered from its outcome, never applied twice (per request, not per idempotency
        key: a retry with another body must reach the workflow's own check of it).

        A refused update (WorkflowUpdateFailedError) and a closed workflow under that id
        (WorkflowAlreadyStartedError) pass through for the caller to map. Temporal not answering
        is a 503; with `accepted_as` (a name and an id) it names what the request would have
        created, so nothing the client asked for is ever out of its sight."""
        update_id = f"{update}-{uuid.uuid4()}"
        starts: list[WithStartWorkflowOperation[Any, Any]] = []

        async def call(client: Client) -> T:
            operation = start()
            starts.append(operation)
            answer: T = await client.execute_update_with_start_workflow(
                update,
                args=args,
                id=update_id,
                start_workflow_operation=operation,
                result_type=result_type,
                rpc_timeout=self.rpc_timeout,
            )
            return answer

        try:
            return await self._retrying_aborted(call)
        except TemporalUnavailable as err:
            if accepted_as is None:
                raise
            noun, created_id = accepted_as
            raise TemporalUnavailable(
                f"{err.message}; if the request was accepted, the {noun} is {created_id}",
                details={f"{noun}_id": str(created_id)},
            ) from err
        finally:
            for operation in starts:
                _retrieve_start_error(operation)

    async def _retrying_aborted(self, call: Callable[[Client], Awaitable[T]]) -> T:
        await self._check_reachable()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._rpc_seconds + 0.5
        for pause in (*UPDATE_WITH_START_BACKOFF_SECONDS, None):
            try:
                return await self._bounded(call, max(deadline - loop.time(), 0.1))
            except TemporalUnavailable as err:
                cause = err.__cause__
                retryable = (
                    isinstance(cause, RPCError) and cause.status == RPCStatusCode.UNAVAILABLE
                )
                if not retryable or pause is None or loop.time() + pause >= deadline:
                    raise
                log.info("update-with-start aborted by the server (%s); retrying", cause)
            await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last pause is None")

    async def _check_reachable(self) -> None:
        """The health check before a call that waits on a workflow. A refusal (nothing listens,
        not serving) answers 503 at once; a check that only ran out of time proves nothing (a
        loaded server is slow, not gone), so the call goes ahead under its own deadline. The
        SDK's client reports its own RPC deadline as CANCELLED "Timeout expired"."""
        try:
            await self.check_health()
        except TemporalUnavailable as err:
            cause = err.__cause__
            timed_out = isinstance(cause, TimeoutError) or (
                isinstance(cause, RPCError) and cause.status in RPC_TIMED_OUT
            )
            if not timed_out:
                raise
            log.info("Temporal's health check ran out of time (%s); calling anyway", cause)

    async def check_health(self) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self._healthy_until:
            return
        seconds = min(self._rpc_seconds, HEALTH_DEADLINE_SECONDS)

        async def check(client: Client) -> bool:
            return await client.service_client.check_health(timeout=timedelta(seconds=seconds))

        if not await self._bounded(check, seconds + 0.5):
            raise TemporalUnavailable("Temporal reports its workflow service is not serving")
        self._healthy_until = loop.time() + HEALTH_TRUSTED_SECONDS


def _retrieve_start_error(start: WithStartWorkflowOperation[Any, Any]) -> None:
    """The SDK also parks a failed start's error in the operation's handle future; read it so
    asyncio does not report it as never retrieved (there is no public non-blocking accessor)."""
    future = start._workflow_handle
    if future.done() and not future.cancelled():
        future.exception()
