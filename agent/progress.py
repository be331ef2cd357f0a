"""`TaskProgress`: the `Progress` a backend reports to, shared between the backend's thread and
the activity's event loop. It keeps the phase list (what heartbeats, progress reports and results
carry), wakes the heartbeat and report loops when a phase changes, and carries the cancellation
request back to the thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from datetime import UTC, datetime

from agent.backend import HostCancelled, PhaseStatus
from contracts.host_tasks import HostPhase

logger = logging.getLogger("agent.host")


def utc_now_iso() -> str:
    """ISO-8601 UTC with a `Z`, millisecond precision (the timeline's format)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TaskProgress:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        task_id: str,
        allocation_id: str,
        activity_name: str,
        attempt: int = 0,
    ) -> None:
        self._loop = loop
        self._attempt = attempt
        self._task_id = task_id
        self._allocation_id = allocation_id
        self._activity_name = activity_name
        self._lock = threading.Lock()
        self._phases: list[HostPhase] = []
        self._open: dict[str, None] = {}  # started phases without an outcome, in start order
        self._cancel = threading.Event()
        self._heartbeats_suspended = False
        # Set from the backend's thread, awaited by the heartbeat loop on the event loop.
        self.changed = asyncio.Event()
        self._listeners = [self.changed]

    # ---------------------------------------------------------------- Progress (backend side)

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        if status == PhaseStatus.STARTED and self._cancel.is_set():
            # Do not begin new work for a task that nobody waits for any more.
            raise HostCancelled(f"cancelled before {phase}")
        self._record(phase, PhaseStatus(status), message)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, seconds: float | None) -> None:
        if self._cancel.wait(seconds):
            raise HostCancelled("cancelled while waiting")

    def suspend_heartbeats(self) -> None:
        with self._lock:
            self._heartbeats_suspended = True
        logger.warning(
            "task %s (%s, allocation %s): heartbeats suspended",
            self._task_id,
            self._activity_name,
            self._allocation_id,
        )

    # ---------------------------------------------------------------- activity side

    @property
    def heartbeats_suspended(self) -> bool:
        with self._lock:
            return self._heartbeats_suspended

    def snapshot(self) -> list[HostPhase]:
        with self._lock:
            return list(self._phases)

    def subscribe(self) -> asyncio.Event:
        """Another event set on every phase change, for a second loop (each clears its own)."""
        event = asyncio.Event()
        self._listeners.append(event)
        return event

    def request_cancel(self) -> None:
        self._cancel.set()

    def fail_open_phase(self, message: str) -> None:
        """Mark the phase that was running when the backend raised as failed (backends need not
        report their own failures)."""
        with self._lock:
            open_phase = next(reversed(self._open), None) if self._open else None
        if open_phase is not None:
            self._record(open_phase, PhaseStatus.FAILED, message)

    def _record(self, phase: str, status: PhaseStatus, message: str) -> None:
        entry = HostPhase(
            phase=phase,
            status=status.value,
            at=utc_now_iso(),
            message=message,
            attempt=self._attempt,
        )
        with self._lock:
            self._phases.append(entry)
            if status == PhaseStatus.STARTED:
                self._open[phase] = None
            else:
                self._open.pop(phase, None)
        # Ids and phase names only: a message could quote something the backend saw.
        logger.info(
            "task %s (%s, allocation %s): %s %s",
            self._task_id,
            self._activity_name,
            self._allocation_id,
            phase,
            status.value,
        )
        with contextlib.suppress(RuntimeError):  # the loop is gone: the activity has ended
            self._loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        for event in self._listeners:
            event.set()
