"""`MaintenanceActivities`: the node.* maintenance tasks as Temporal activities on the node's
queue. Runs the blocking backend on an executor, heartbeats the phase list while it runs, maps
`HostError` to `ApplicationError`, and sanitises everything that leaves the node. Separate from
the backend so the same activities drive the file backend and the simulator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from agent.backend import HostCancelled, HostError, Progress
from agent.backends.system_root import SystemRoot
from agent.host_activities import heartbeat_interval_seconds
from agent.maintenance.interfaces import RunningTaskCounter
from agent.maintenance.protocol import DrainOutcome, MaintenanceBackend
from agent.maintenance.sanitising import sanitise, sanitise_strings
from agent.progress import TaskProgress, utc_now_iso
from contracts.host_tasks import (
    NODE_DRAIN,
    NODE_GPU_SCRUB,
    NODE_HW_SYNC_RESEED,
    NODE_STORAGE_CLEANUP,
    NODE_UNDRAIN,
    NODE_UNINSTALL,
    NODE_VALIDATE_CLEAN,
    NON_RETRYABLE_MAINTENANCE_ERRORS,
    DrainResult,
    GpuScrubResult,
    HostErrorType,
    HostPhase,
    HwSyncReseedInput,
    HwSyncReseedResult,
    NodeMaintenanceInput,
    StorageCleanupInput,
    StorageCleanupResult,
    UninstallResult,
    ValidateCleanResult,
)

logger = logging.getLogger("agent.maintenance")

_T = TypeVar("_T")

# An unclassified exception in a maintenance backend: retried (the workflow bounds attempts).
MAINTENANCE_INTERNAL_ERROR = HostErrorType.MAINTENANCE_ERROR.value

_Out = TypeVar("_Out")


class MaintenanceActivities:
    """The six node.* maintenance activities bound to a backend; register `activities()` on the
    node's worker (agent.node_worker.build_node_worker(..., maintenance=backend))."""

    def __init__(
        self,
        backend: MaintenanceBackend,
        *,
        node_id: str | None = None,
        executor: Executor | None = None,
        cancel_grace_seconds: float = 10.0,
        tasks: RunningTaskCounter | None = None,
    ) -> None:
        self._backend = backend
        self._node_id = node_id
        # The node's in-flight tenant host tasks, which node.drain reports (agent.node_worker
        # passes the node's HostActivities: the only place that knows what runs).
        self._tasks = tasks
        self._executor = executor or ThreadPoolExecutor(
            max_workers=4, thread_name_prefix=f"maint-{node_id or 'agent'}"
        )
        self._cancel_grace_seconds = cancel_grace_seconds

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.gpu_scrub,
            self.storage_cleanup,
            self.validate_clean,
            self.drain,
            self.undrain,
            self.uninstall,
            self.hw_sync_reseed,
        ]

    @activity.defn(name=NODE_GPU_SCRUB)
    async def gpu_scrub(self, spec: NodeMaintenanceInput) -> GpuScrubResult:
        started = self._start(spec.task_id, spec.node_id)
        gpus, phases = await self._run(
            NODE_GPU_SCRUB, spec.task_id, spec.node_id, lambda p: self._backend.gpu_scrub(spec, p)
        )
        return self._clean(GpuScrubResult(spec.task_id, started, utc_now_iso(), phases, gpus))

    @activity.defn(name=NODE_STORAGE_CLEANUP)
    async def storage_cleanup(self, spec: StorageCleanupInput) -> StorageCleanupResult:
        started = self._start(spec.task_id, spec.node_id)
        out, phases = await self._run(
            NODE_STORAGE_CLEANUP,
            spec.task_id,
            spec.node_id,
            lambda p: self._backend.storage_cleanup(spec, p),
        )
        return self._clean(
            StorageCleanupResult(
                spec.task_id, started, utc_now_iso(), phases, scope=out.scope, roots=out.roots
            )
        )

    @activity.defn(name=NODE_VALIDATE_CLEAN)
    async def validate_clean(self, spec: NodeMaintenanceInput) -> ValidateCleanResult:
        started = self._start(spec.task_id, spec.node_id)
        out, phases = await self._run(
            NODE_VALIDATE_CLEAN,
            spec.task_id,
            spec.node_id,
            lambda p: self._backend.validate_clean(spec, p),
        )
        return self._clean(
            ValidateCleanResult(
                spec.task_id, started, utc_now_iso(), phases, clean=out.clean, checks=out.checks
            )
        )

    @activity.defn(name=NODE_DRAIN)
    async def drain(self, spec: NodeMaintenanceInput) -> DrainResult:
        return await self._drain_marker(
            NODE_DRAIN, spec, lambda s, p: self._backend.drain(s, p, self._tasks)
        )

    @activity.defn(name=NODE_UNDRAIN)
    async def undrain(self, spec: NodeMaintenanceInput) -> DrainResult:
        return await self._drain_marker(NODE_UNDRAIN, spec, self._backend.undrain)

    async def _drain_marker(
        self,
        kind: str,
        spec: NodeMaintenanceInput,
        step: Callable[[NodeMaintenanceInput, Progress], DrainOutcome],
    ) -> DrainResult:
        """node.drain and node.undrain: set or clear the marker, report what it was."""
        started = self._start(spec.task_id, spec.node_id)
        out, phases = await self._run(kind, spec.task_id, spec.node_id, lambda p: step(spec, p))
        return self._clean(
            DrainResult(
                spec.task_id,
                started,
                utc_now_iso(),
                phases,
                draining=out.draining,
                already_draining=out.already_draining,
                running_tasks=out.running_tasks,
            )
        )

    @activity.defn(name=NODE_UNINSTALL)
    async def uninstall(self, spec: NodeMaintenanceInput) -> UninstallResult:
        started = self._start(spec.task_id, spec.node_id)
        out, phases = await self._run(
            NODE_UNINSTALL, spec.task_id, spec.node_id, lambda p: self._backend.uninstall(spec, p)
        )
        return self._clean(
            UninstallResult(
                spec.task_id, started, utc_now_iso(), phases, removed=out.removed, absent=out.absent
            )
        )

    @activity.defn(name=NODE_HW_SYNC_RESEED)
    async def hw_sync_reseed(self, spec: HwSyncReseedInput) -> HwSyncReseedResult:
        started = self._start(spec.task_id, spec.node_id)
        out, phases = await self._run(
            NODE_HW_SYNC_RESEED,
            spec.task_id,
            spec.node_id,
            lambda p: self._backend.hw_sync_reseed(spec, p),
        )
        return self._clean(
            HwSyncReseedResult(
                spec.task_id,
                started,
                utc_now_iso(),
                phases,
                units_written=out.units_written,
                units_unchanged=out.units_unchanged,
                credentials_present=out.credentials_present,
                restarted=out.restarted,
            )
        )

    # ------------------------------------------------------------------ shared flow

    def _start(self, task_id: str, node_id: str) -> str:
        if not task_id or (self._node_id is not None and node_id != self._node_id):
            raise ApplicationError(
                "task id missing or task for another node",
                type=HostErrorType.INVALID_SPEC.value,
                non_retryable=True,
            )
        return utc_now_iso()

    def _clean(self, result: _T) -> _T:
        return sanitise_strings(result, root=self._backend.sanitise_root())

    async def _run(
        self, name: str, task_id: str, node_id: str, call: Callable[[TaskProgress], _Out]
    ) -> tuple[_Out, list[HostPhase]]:
        loop = asyncio.get_running_loop()
        progress = TaskProgress(loop, task_id=task_id, allocation_id="-", activity_name=name)
        root = self._backend.sanitise_root()
        logger.info(
            "task %s (%s, node %s): attempt %d", task_id, name, node_id, activity.info().attempt
        )
        heartbeats = asyncio.create_task(self._heartbeat_loop(progress, root))
        work = loop.run_in_executor(self._executor, call, progress)
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            outcome = await asyncio.shield(work)
        except asyncio.CancelledError:
            progress.request_cancel()
            await asyncio.wait({work}, timeout=self._cancel_grace_seconds)
            raise
        except HostCancelled:
            raise asyncio.CancelledError() from None
        except HostError as err:
            message = sanitise(err.message, root=root)
            progress.fail_open_phase(message)
            logger.warning("task %s (%s): %s", task_id, name, err.error_type.value)
            raise ApplicationError(
                message,
                _clean_phases(progress.snapshot(), root),
                type=err.error_type.value,
                non_retryable=err.error_type in NON_RETRYABLE_MAINTENANCE_ERRORS,
            ) from None
        except Exception as err:
            progress.fail_open_phase("unexpected maintenance error")
            logger.error(
                "task %s (%s): unexpected %s\n%s",
                task_id,
                name,
                type(err).__name__,
                "".join(traceback.format_tb(err.__traceback__)),
            )
            raise ApplicationError(
                f"unexpected {type(err).__name__} in {name}",
                _clean_phases(progress.snapshot(), root),
                type=MAINTENANCE_INTERNAL_ERROR,
            ) from None
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats
        logger.info("task %s (%s, node %s): done", task_id, name, node_id)
        return outcome, _clean_phases(progress.snapshot(), root)

    async def _heartbeat_loop(self, progress: TaskProgress, root: SystemRoot | None) -> None:
        interval = heartbeat_interval_seconds()
        while True:
            if not progress.heartbeats_suspended:
                activity.heartbeat(_clean_phases(progress.snapshot(), root))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await progress.changed.wait()
            progress.changed.clear()


def _clean_phases(phases: list[HostPhase], root: SystemRoot | None) -> list[HostPhase]:
    return [replace(p, message=sanitise(p.message, root=root)) for p in phases]
