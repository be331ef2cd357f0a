"""Terminal session activities (docs/lifecycles/terminal-session.md): the `terminal_sessions` read
model, applied as compare-and-set with an append-only event row per transition, the node_tasks rows
of the terminal host tasks (so the allocation's timeline shows them), and the close of an
allocation's sessions that AllocationWorkflow's release runs first.

`create_session` and `apply_change` run as local activities of TerminalSessionWorkflow and are
idempotent (a retried one finds its work done). `close_for_allocation` is a regular activity: it
asks each live session's workflow to close (the `close` update) and waits for their answers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.service import RPCError, RPCStatusCode

from activities.allocations import username_for
from activities.node_task_log import queue_task, record_task_outcome, record_task_progress
from contracts.host_tasks import HostTaskProgress
from contracts.states import AllocationStatus, NodeTaskStatus
from contracts.terminal_session import (
    ACTOR_SYSTEM,
    ACTOR_USER,
    ALLOCATION_NOT_ACTIVE,
    ALLOCATION_NOT_FOUND,
    APPLY_CHANGE,
    CLOSE_FOR_ALLOCATION,
    CLOSE_UPDATE,
    CREATE_SESSION,
    LIVE_TERMINAL_STATUSES,
    SESSION_ACTIVE,
    TERMINAL_SESSION_TRANSITIONS,
    CloseForAllocationInput,
    CloseForAllocationResult,
    CloseRequest,
    CloseResult,
    CreateSessionInput,
    SessionPlan,
    TerminalChange,
    TerminalSessionStatus,
)
from schema.models import Allocation, TerminalSession, TerminalSessionEvent

log = logging.getLogger(__name__)
CLOCK = func.clock_timestamp()

# The timestamp column each status sets when a session enters it.
_ENTERED_AT = {
    TerminalSessionStatus.ACTIVE: "active_at",
    TerminalSessionStatus.CLOSING: "closing_at",
    TerminalSessionStatus.CLOSED: "closed_at",
    TerminalSessionStatus.ERROR: "closed_at",
}


def _refuse(type_: str, message: str, *details: Any) -> ApplicationError:
    """A refused open is an ordinary answer (409/404 at the gateway), not a fault."""
    return ApplicationError(
        message,
        *details,
        type=type_,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


class TerminalSessionActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        return [self.create_session, self.apply_change, self.close_for_allocation]

    @activity.defn(name=CREATE_SESSION)
    async def create_session(self, input: CreateSessionInput) -> SessionPlan:
        """The session row, `opening`; or a refusal: the allocation is not the project's, not
        active, or has a live session already (one per allocation: its id in the details)."""
        session_id = uuid.UUID(input.session_id)
        async with self._sessions() as session, session.begin():
            # Locked: two opens for one allocation take turns, and a release that has begun
            # (allocation.begin_release) is seen; one that begins later waits for this commit,
            # then closes what this created.
            allocation = await session.scalar(
                select(Allocation)
                .where(Allocation.id == uuid.UUID(input.allocation_id))
                .with_for_update()
            )
            if allocation is None or str(allocation.project_id) != input.project_id:
                raise _refuse(ALLOCATION_NOT_FOUND, "allocation not found")
            existing = await session.get(TerminalSession, session_id)
            if existing is None:
                if allocation.status != AllocationStatus.ACTIVE:
                    raise _refuse(
                        ALLOCATION_NOT_ACTIVE,
                        f"the allocation is {allocation.status}: terminals open on active ones",
                        allocation.status,
                    )
                live = await session.scalar(
                    select(TerminalSession.id).where(
                        TerminalSession.allocation_id == allocation.id,
                        TerminalSession.status.in_([s.value for s in LIVE_TERMINAL_STATUSES]),
                    )
                )
                if live is not None:
                    raise _refuse(
                        SESSION_ACTIVE,
                        "the allocation has an active terminal session",
                        str(live),
                    )
                expires = await session.scalar(
                    select(CLOCK + dt.timedelta(seconds=input.open_token_ttl_seconds))
                )
                existing = TerminalSession(
                    id=session_id,
                    allocation_id=allocation.id,
                    project_id=allocation.project_id,
                    node_id=allocation.node_id,
                    workflow_id=input.workflow_id,
                    status=TerminalSessionStatus.OPENING.value,
                    open_token_sha256=input.open_token_sha256,
                    open_token_expires_at=expires,
                )
                session.add(existing)
                session.add(
                    TerminalSessionEvent(
                        session_id=session_id,
                        from_status=None,
                        to_status=TerminalSessionStatus.OPENING.value,
                        actor=ACTOR_USER,
                    )
                )
            return SessionPlan(
                node_id=str(allocation.node_id),
                shape=allocation.shape,
                username=username_for(str(allocation.id)),
                open_token_expires_at=existing.open_token_expires_at.isoformat(),
            )

    @activity.defn(name=APPLY_CHANGE)
    async def apply_change(self, change: TerminalChange) -> None:
        session_id = uuid.UUID(change.session_id)
        async with self._sessions() as session, session.begin():
            row = await session.get(TerminalSession, session_id, with_for_update=True)
            if row is None:
                raise ApplicationError("no such terminal session", non_retryable=True)
            if change.to_status:
                await _transition(session, row, change)
            for task in change.tasks:
                if not task.status:
                    await queue_task(
                        session,
                        task.task_id,
                        row.allocation_id,
                        row.node_id,
                        task.kind,
                        row.workflow_id,
                    )
                elif task.status == NodeTaskStatus.DISPATCHED:
                    # The agent attached the stream: its one attempt started (database clock).
                    progress = HostTaskProgress(task.task_id, attempt=1, started_at="")
                    await record_task_progress(session, row.workflow_id, progress)
                else:
                    await record_task_outcome(
                        session,
                        uuid.UUID(task.task_id),
                        task.status,
                        error_type=task.error_type,
                        error_message=task.error_message,
                    )

    @activity.defn(name=CLOSE_FOR_ALLOCATION)
    async def close_for_allocation(
        self, input: CloseForAllocationInput
    ) -> CloseForAllocationResult:
        """Close every live session of the allocation and wait until each has ended (each
        session's workflow bounds its wait for the agent's ack by its close timeout)."""
        async with self._sessions() as session:
            workflow_ids = list(
                await session.scalars(
                    select(TerminalSession.workflow_id).where(
                        TerminalSession.allocation_id == uuid.UUID(input.allocation_id),
                        TerminalSession.status.in_([s.value for s in LIVE_TERMINAL_STATUSES]),
                    )
                )
            )
        request = CloseRequest(reason=input.reason, actor=ACTOR_SYSTEM)
        answers = await asyncio.gather(*(self._close(wid, request) for wid in workflow_ids))
        return CloseForAllocationResult(closed=[a for a in answers if a is not None])

    async def _close(self, workflow_id: str, request: CloseRequest) -> CloseResult | None:
        handle = self._client.get_workflow_handle(workflow_id)
        try:
            result: CloseResult = await handle.execute_update(
                CLOSE_UPDATE, request, result_type=CloseResult
            )
        except WorkflowUpdateFailedError:
            return None  # it ended meanwhile
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None  # its workflow has completed
            raise
        return result


async def _transition(session: AsyncSession, row: TerminalSession, change: TerminalChange) -> None:
    """Compare-and-set from any status the transition table allows into `change.to_status`,
    with its event row. Already there: a retried activity, nothing written."""
    to = TerminalSessionStatus(change.to_status)
    prior = TerminalSessionStatus(row.status)
    if prior == to:
        return
    if to not in TERMINAL_SESSION_TRANSITIONS[prior]:
        raise ApplicationError(
            f"terminal session is {prior}; {to} does not follow", non_retryable=True
        )
    values: dict[str, Any] = {"status": to.value, "updated_at": CLOCK, _ENTERED_AT[to]: CLOCK}
    if change.close_reason is not None:
        values["close_reason"] = change.close_reason
        values["closed_by"] = change.actor
    await session.execute(
        update(TerminalSession)
        .where(TerminalSession.id == row.id, TerminalSession.status == prior.value)
        .values(**values)
    )
    await session.execute(
        insert(TerminalSessionEvent).values(
            session_id=row.id,
            from_status=prior.value,
            to_status=to.value,
            actor=change.actor,
            reason=change.close_reason,
        )
    )
