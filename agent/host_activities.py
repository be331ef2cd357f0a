"""The node agent's Temporal activities (contract names in contracts/host_tasks.py).

Each activity validates its spec, runs the blocking backend call on a thread pool and, while it
runs, heartbeats the phase list so far (a list of HostPhase: what the gateway's timeline decodes
from a pending activity). It also reports the attempt's progress to the workflow that scheduled
it (HOST_TASK_PROGRESS_SIGNAL): once when the attempt starts, then when its phases change, at
most every REPORT_MIN_INTERVAL_S, so the workflow records the task as running with its phases
(docs/lifecycles/allocation.md#task-timeline) without a database write per heartbeat.

A HostError becomes an ApplicationError of the same type, non-retryable where the contract says
so, with the phase list as its first detail so the timeline can show how far the task got.
Cancellation reaches the backend through `Progress`: it stops at the next phase boundary, and the
activity waits a short grace period for that before reporting cancelled, so a retry does not
overlap with a still-running attempt.

Nothing here logs or raises spec contents: only ids, phase names and error types.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from agent import validation
from agent.backend import (
    HostBackend,
    HostCancelled,
    HostError,
    ProvisionOutcome,
    ReleaseOutcome,
)
from agent.progress import TaskProgress, utc_now_iso
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    BAREMETAL_REVOKE_USER,
    HOST_TASK_PROGRESS_SIGNAL,
    NON_RETRYABLE_HOST_ERRORS,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
    HostProvisionInput,
    HostProvisionResult,
    HostReleaseInput,
    HostReleaseResult,
    HostRevokeResult,
    HostTaskProgress,
)

logger = logging.getLogger("agent.host")

# An unclassified exception from a provision backend: a bug or an unforeseen host state. Retried,
# because the workflow bounds provisioning attempts anyway.
HOST_INTERNAL_ERROR = "host_internal_error"

# Heartbeat at this fraction of the heartbeat timeout, so one lost heartbeat is not fatal.
HEARTBEAT_FRACTION = 1 / 3
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
MIN_HEARTBEAT_INTERVAL_S = 0.05
# Phase changes closer together than this go to the workflow in one report (a phase's success
# and the next one's start are usually one report).
REPORT_MIN_INTERVAL_S = 1.0
# A report is best effort: the task does not wait longer than this for one to be taken.
REPORT_RPC_TIMEOUT = timedelta(seconds=5)

_Outcome = TypeVar("_Outcome")
_Spec = TypeVar("_Spec", HostProvisionInput, HostReleaseInput)


class HostActivities:
    """Host activities for one node, bound to a backend. Register `activities()` on a worker
    polling `node-{node_id}` (see agent.node_worker.build_node_worker)."""

    def __init__(
        self,
        backend: HostBackend,
        *,
        node_id: str | None = None,
        executor: Executor | None = None,
        max_concurrent: int = 16,
        cancel_grace_seconds: float = 10.0,
        is_draining: Callable[[], bool] | None = None,
    ) -> None:
        self._backend = backend
        # A drained node (node.drain) refuses new tenant work; releases still run.
        self._is_draining = is_draining
        # When set, tasks for another node are refused (they reached the wrong queue).
        self._node_id = node_id
        self._executor = executor or ThreadPoolExecutor(
            max_workers=max_concurrent, thread_name_prefix=f"host-{node_id or 'agent'}"
        )
        self._cancel_grace_seconds = cancel_grace_seconds
        # Tenant host tasks whose backend call is in flight (node.drain reports it). Changed
        # only on the event loop; read from maintenance threads, where an int read is atomic.
        self._running = 0

    def running(self) -> int:
        """How many tenant host tasks this node runs now (agent.maintenance.RunningTaskCounter)."""
        return self._running

    async def run_tenant_task(
        self,
        name: str,
        task_id: str,
        allocation_id: str,
        call: Callable[[TaskProgress], _Outcome],
        *,
        unexpected_error_type: str,
        new_work: bool,
    ) -> tuple[_Outcome, TaskProgress]:
        """Run a tenant host task defined beside this class (agent/storage_mounts.py) as these
        run: counted as running, its progress reported and heartbeated, its HostError mapped.
        `new_work`: refused while the node is draining (a mount; an unmount always runs)."""
        if new_work:
            self._refuse_if_draining()
        return await self._run(name, task_id, allocation_id, call, unexpected_error_type)

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.provision_slice_vm,
            self.release_slice_vm,
            self.provision_baremetal_user,
            self.deprovision_baremetal_user,
            self.revoke_baremetal_user,
        ]

    # ------------------------------------------------------------------ activities

    @activity.defn(name=SLICE_VM_PROVISION)
    async def provision_slice_vm(self, spec: HostProvisionInput) -> HostProvisionResult:
        self._refuse_if_draining()
        self._validate(validation.validate_slice_provision, spec)
        return await self._provision(SLICE_VM_PROVISION, spec, self._backend.provision_slice_vm)

    @activity.defn(name=SLICE_VM_RELEASE)
    async def release_slice_vm(self, spec: HostReleaseInput) -> HostReleaseResult:
        self._validate(validation.validate_slice_release, spec)
        return await self._release(SLICE_VM_RELEASE, spec, self._backend.release_slice_vm)

    @activity.defn(name=BAREMETAL_PROVISION_USER)
    async def provision_baremetal_user(self, spec: HostProvisionInput) -> HostProvisionResult:
        self._refuse_if_draining()
        self._validate(validation.validate_baremetal_provision, spec)
        return await self._provision(
            BAREMETAL_PROVISION_USER, spec, self._backend.provision_baremetal_user
        )

    @activity.defn(name=BAREMETAL_DEPROVISION_USER)
    async def deprovision_baremetal_user(self, spec: HostReleaseInput) -> HostReleaseResult:
        self._validate(validation.validate_baremetal_release, spec)
        return await self._release(
            BAREMETAL_DEPROVISION_USER, spec, self._backend.deprovision_baremetal_user
        )

    @activity.defn(name=BAREMETAL_REVOKE_USER)
    async def revoke_baremetal_user(self, spec: HostReleaseInput) -> HostRevokeResult:
        self._validate(validation.validate_baremetal_release, spec)
        started_at = utc_now_iso()
        outcome, progress = await self._run(
            BAREMETAL_REVOKE_USER,
            spec.task_id,
            spec.allocation_id,
            lambda p: self._backend.revoke_baremetal_user(spec, p),
            HostErrorType.RELEASE_ERROR.value,
        )
        return HostRevokeResult(
            task_id=spec.task_id,
            started_at=started_at,
            finished_at=utc_now_iso(),
            phases=progress.snapshot(),
            revoked=outcome.revoked,
            sessions_terminated=outcome.sessions_terminated,
        )

    # ------------------------------------------------------------------ shared flow

    def _task_finished(self) -> None:
        self._running -= 1

    def _refuse_if_draining(self) -> None:
        if self._is_draining is not None and self._is_draining():
            raise ApplicationError(
                "this node is draining: it takes no new tenant work",
                type=HostErrorType.NODE_DRAINING.value,
                non_retryable=True,
            )

    def _validate(self, check: Callable[[_Spec, str | None], None], spec: _Spec) -> None:
        try:
            check(spec, self._node_id)
        except validation.InvalidSpec as err:
            logger.warning(
                "task %s (%s, allocation %s): invalid spec: %s",
                spec.task_id,
                activity.info().activity_type,
                spec.allocation_id,
                err,
            )
            raise ApplicationError(
                str(err), type=HostErrorType.INVALID_SPEC.value, non_retryable=True
            ) from None

    async def _provision(
        self,
        name: str,
        spec: HostProvisionInput,
        call: Callable[[HostProvisionInput, TaskProgress], ProvisionOutcome],
    ) -> HostProvisionResult:
        started_at = utc_now_iso()
        outcome, progress = await self._run(
            name, spec.task_id, spec.allocation_id, lambda p: call(spec, p), HOST_INTERNAL_ERROR
        )
        return HostProvisionResult(
            task_id=spec.task_id,
            started_at=started_at,
            finished_at=utc_now_iso(),
            phases=progress.snapshot(),
            connect_host=outcome.connect_host,
            adopted_existing=outcome.adopted_existing,
        )

    async def _release(
        self,
        name: str,
        spec: HostReleaseInput,
        call: Callable[[HostReleaseInput, TaskProgress], ReleaseOutcome],
    ) -> HostReleaseResult:
        started_at = utc_now_iso()
        # Any unclassified failure during cleanup is a failed cleanup step: retried, then
        # release_failed.
        outcome, progress = await self._run(
            name,
            spec.task_id,
            spec.allocation_id,
            lambda p: call(spec, p),
            HostErrorType.RELEASE_ERROR.value,
        )
        return HostReleaseResult(
            task_id=spec.task_id,
            started_at=started_at,
            finished_at=utc_now_iso(),
            phases=progress.snapshot(),
            released=outcome.released,
            hard_stopped=outcome.hard_stopped,
            wiped=outcome.wiped,
            leases_released=outcome.leases_released,
            unhealthy_gpus=list(outcome.unhealthy_gpus),
        )

    async def _run(
        self,
        name: str,
        task_id: str,
        allocation_id: str,
        call: Callable[[TaskProgress], _Outcome],
        unexpected_error_type: str,
    ) -> tuple[_Outcome, TaskProgress]:
        loop = asyncio.get_running_loop()
        attempt = activity.info().attempt
        progress = TaskProgress(
            loop, task_id=task_id, allocation_id=allocation_id, activity_name=name, attempt=attempt
        )
        logger.info(
            "task %s (%s, allocation %s): attempt %d", task_id, name, allocation_id, attempt
        )
        reporter = _ProgressReporter(task_id, attempt, utc_now_iso())
        # Awaited, so the attempt is on record as running (and counted) before any host work.
        await reporter.send(progress)
        reports = asyncio.create_task(reporter.run(progress))
        heartbeats = asyncio.create_task(self._heartbeat_loop(progress))
        self._running += 1
        work = loop.run_in_executor(self._executor, call, progress)
        # Counted until the backend thread is done, not until this coroutine gives up on it.
        work.add_done_callback(lambda _: self._task_finished())
        # Whatever happens to this coroutine, the thread's outcome is consumed (no "exception was
        # never retrieved" noise when it finishes after a cancellation).
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            # shield: a cancellation must not orphan the thread; we tell it to stop instead.
            outcome = await asyncio.shield(work)
        except asyncio.CancelledError:
            progress.request_cancel()
            logger.info("task %s (%s): cancelled, stopping the backend", task_id, name)
            await asyncio.wait({work}, timeout=self._cancel_grace_seconds)
            raise
        except HostCancelled:
            # The backend saw a cancellation the SDK has not delivered to us yet.
            raise asyncio.CancelledError() from None
        except HostError as err:
            progress.fail_open_phase(err.message)
            # A retried attempt's failure reaches no workflow code: this report is its record.
            await reporter.send(progress)
            logger.warning(
                "task %s (%s, allocation %s): %s",
                task_id,
                name,
                allocation_id,
                err.error_type.value,
            )
            raise ApplicationError(
                err.message,
                progress.snapshot(),
                type=err.error_type.value,
                non_retryable=err.error_type in NON_RETRYABLE_HOST_ERRORS,
            ) from None
        except Exception as err:
            progress.fail_open_phase("unexpected host error")
            await reporter.send(progress)
            # The traceback's frames, not the exception's text, which might quote the spec.
            logger.error(
                "task %s (%s, allocation %s): unexpected %s\n%s",
                task_id,
                name,
                allocation_id,
                type(err).__name__,
                "".join(traceback.format_tb(err.__traceback__)),
            )
            raise ApplicationError(
                f"unexpected {type(err).__name__} in {name}",
                progress.snapshot(),
                type=unexpected_error_type,
            ) from None
        finally:
            # A result carries the whole phase list: no last report after a success.
            for loop_task in (heartbeats, reports):
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop_task
        logger.info("task %s (%s, allocation %s): done", task_id, name, allocation_id)
        return outcome, progress

    async def _heartbeat_loop(self, progress: TaskProgress) -> None:
        """Heartbeat now, on every phase change, and every interval while a phase runs; the SDK
        throttles what reaches the server and always sends the latest details."""
        interval = heartbeat_interval_seconds()
        while True:
            if not progress.heartbeats_suspended:
                activity.heartbeat(progress.snapshot())
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow our cancellation when
            # the event fires at the same moment, and this loop would never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await progress.changed.wait()
            progress.changed.clear()


class _ProgressReporter:
    """Signals one attempt's progress to the workflow that scheduled the task. Best effort: a
    report that cannot be delivered (no client, the workflow gone, Temporal slow) is skipped,
    never the task's failure; the next report, the heartbeat and the result carry the phases."""

    def __init__(self, task_id: str, attempt: int, started_at: str) -> None:
        self._task_id = task_id
        self._attempt = attempt
        self._started_at = started_at
        self._sent = -1  # how many phases the last delivered report carried
        self._handle: WorkflowHandle[Any, Any] | None = None
        info = activity.info()
        try:
            client = activity.client()
        except RuntimeError:  # no client: an activity run outside a worker (unit tests)
            return
        if info.workflow_id is not None:  # else a standalone activity: nobody to report to
            self._handle = client.get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)

    async def send(self, progress: TaskProgress) -> None:
        phases = progress.snapshot()
        if self._handle is None or len(phases) == self._sent:
            return
        report = HostTaskProgress(self._task_id, self._attempt, self._started_at, phases)
        try:
            await self._handle.signal(
                HOST_TASK_PROGRESS_SIGNAL, report, rpc_timeout=REPORT_RPC_TIMEOUT
            )
        except RPCError as err:
            logger.info("task %s: progress not reported: %s", self._task_id, err.status)
            return
        self._sent = len(phases)

    async def run(self, progress: TaskProgress) -> None:
        changed = progress.subscribe()
        while True:
            await asyncio.sleep(REPORT_MIN_INTERVAL_S)
            await changed.wait()
            changed.clear()
            await self.send(progress)


def heartbeat_interval_seconds() -> float:
    timeout = activity.info().heartbeat_timeout
    if not timeout:
        return DEFAULT_HEARTBEAT_INTERVAL_S
    return max(
        MIN_HEARTBEAT_INTERVAL_S,
        min(DEFAULT_HEARTBEAT_INTERVAL_S, timeout.total_seconds() * HEARTBEAT_FRACTION),
    )
