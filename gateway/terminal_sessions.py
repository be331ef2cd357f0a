"""Terminal session use cases behind the tenant and admin controllers
(docs/lifecycles/terminal-session.md).

Opening is update-with-start on `terminal-{id}`: the workflow's first activity creates the row
(or refuses: 404 allocation_not_found, 409 allocation_not_active, 409 terminal_session_active
with the live session's id), and the answer carries the single-use open token, shown once: the
gateway generated it and hands only its sha256 to the workflow. The stream itself is
gateway/terminal_relay.py. Force-close is the workflow's `close` update, audited by the
controller; a tenant's close of its own session is the same update (client_closed, by the
user). Reads come from the `terminal_sessions` read model; the gateway never writes it.
"""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from typing import Any

import msgspec
from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowUpdateFailedError,
    WorkflowUpdateStage,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from contracts.terminal_session import (
    ACTOR_ADMIN,
    ACTOR_USER,
    ALLOCATION_NOT_ACTIVE,
    ALLOCATION_NOT_FOUND,
    CLOSE_UPDATE,
    OPEN_UPDATE,
    SESSION_ACTIVE,
    SESSION_NOT_LIVE,
    TENANT_STREAM_PATH,
    WORKFLOW_NAME,
    CloseReason,
    CloseRequest,
    TerminalPolicy,
    TerminalSessionInput,
    TerminalSessionOpened,
    TerminalSessionResult,
    TerminalSessionStatus,
    terminal_workflow_id,
)
from core.config import Settings
from gateway.allocations import get_row
from gateway.errors import ApiError, Conflict, NotFound, unknown_query_value
from gateway.pagination import newest_first_page
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from gateway.temporal import TemporalOps
from gateway.tokens import hash_token
from schema.models import TerminalSession

# Open tokens are recognisable in a leaked log or paste (and by secret scanners).
OPEN_TOKEN_PREFIX = "gts_"  # noqa: S105 - a prefix, not a token
TERMINAL_STATUSES = [s.value for s in TerminalSessionStatus]


# --- API bodies ---


class TerminalSessionCreated(msgspec.Struct, kw_only=True):
    session_id: uuid.UUID
    allocation_id: uuid.UUID
    status: str
    # Single use, short-lived: present it as the first frame on `stream_url`. Shown only here.
    open_token: str
    open_token_expires_at: dt.datetime
    stream_url: str


class TerminalSessionView(msgspec.Struct, kw_only=True):
    session_id: uuid.UUID
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    node_id: uuid.UUID
    status: str
    close_reason: str | None
    closed_by: str | None
    created_at: dt.datetime
    opened_at: dt.datetime | None  # when the stream attached (active)
    closed_at: dt.datetime | None


class TerminalSessionList(msgspec.Struct, kw_only=True):
    items: list[TerminalSessionView]
    next_cursor: str | None = None


class TerminalForceClose(RequestBody, kw_only=True):
    reason: Reason


class TerminalCloseAccepted(msgspec.Struct, kw_only=True):
    session_id: uuid.UUID
    prior_status: str
    expected_status: str


# --- helpers ---


def policy_from(settings: Settings) -> TerminalPolicy:
    return TerminalPolicy(
        max_ttl_seconds=settings.terminal_session_max_ttl_seconds,
        node_schedule_to_start_seconds=settings.node_schedule_to_start_seconds,
        heartbeat_timeout_seconds=settings.host_heartbeat_timeout_seconds,
        close_timeout_seconds=settings.terminal_close_timeout_seconds,
        open_token_ttl_seconds=settings.terminal_open_token_ttl_seconds,
    )


def websocket_url(settings: Settings, path: str) -> str:
    """The public API URL as ws:// or wss:// with `path` below it."""
    base = settings.public_api_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base + path


def view(row: TerminalSession) -> TerminalSessionView:
    return TerminalSessionView(
        session_id=row.id,
        allocation_id=row.allocation_id,
        project_id=row.project_id,
        node_id=row.node_id,
        status=row.status,
        close_reason=row.close_reason,
        closed_by=row.closed_by,
        created_at=row.created_at,
        opened_at=row.active_at,
        closed_at=row.closed_at,
    )


def _refusal(cause: ApplicationError) -> ApiError:
    details = list(cause.details)
    if cause.type == SESSION_ACTIVE:
        return Conflict(
            "the allocation has an active terminal session; close it or wait for it to end",
            code=SESSION_ACTIVE,
            details={"active_session_id": str(details[0]) if details else None},
        )
    if cause.type == ALLOCATION_NOT_FOUND:
        return NotFound("allocation not found")
    if cause.type == ALLOCATION_NOT_ACTIVE:
        return Conflict(
            "terminal sessions open on active allocations only",
            code=ALLOCATION_NOT_ACTIVE,
            details={"status": str(details[0]) if details else None},
        )
    return ApiError(
        "the terminal session workflow refused the request unexpectedly",
        code="workflow_error",
        status_code=502,
        details={"type": cause.type or "unknown"},
    )


# --- use cases ---


async def open_session(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID,
) -> TerminalSessionCreated:
    await get_row(db, allocation_id, project_id)  # another project's allocation: 404
    await db.close()  # no connection held across the Temporal call
    session_id = uuid.uuid4()
    token = OPEN_TOKEN_PREFIX + secrets.token_urlsafe(32)
    workflow_input = TerminalSessionInput(
        session_id=str(session_id),
        allocation_id=str(allocation_id),
        project_id=str(project_id),
        open_token_sha256=hash_token(token),
        policy=policy_from(settings),
    )
    try:
        opened = await temporal.update_with_start(
            lambda: WithStartWorkflowOperation(
                WORKFLOW_NAME,
                workflow_input,
                id=terminal_workflow_id(str(session_id)),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                task_queue=settings.control_plane_task_queue,
                result_type=TerminalSessionResult,
            ),
            OPEN_UPDATE,
            result_type=TerminalSessionOpened,
        )
    except WorkflowUpdateFailedError as err:
        if isinstance(err.cause, ApplicationError):
            raise _refusal(err.cause) from None
        raise
    return TerminalSessionCreated(
        session_id=session_id,
        allocation_id=allocation_id,
        status=opened.status,
        open_token=token,
        open_token_expires_at=dt.datetime.fromisoformat(opened.open_token_expires_at),
        stream_url=websocket_url(settings, TENANT_STREAM_PATH.format(session_id=session_id)),
    )


async def _page(
    db: AsyncSession, query: Select[Any], limit: int, cursor: str | None
) -> TerminalSessionList:
    rows, next_cursor = await newest_first_page(
        db,
        query,
        created=TerminalSession.created_at,
        row_id=TerminalSession.id,
        limit=limit,
        cursor=cursor,
    )
    return TerminalSessionList(items=[view(r) for r in rows], next_cursor=next_cursor)


async def list_for_allocation(
    db: AsyncSession,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID | None,
    limit: int,
    cursor: str | None,
) -> TerminalSessionList:
    """The allocation's sessions, newest first: each reconnect is a new one, so paged."""
    await get_row(db, allocation_id, project_id)
    query = select(TerminalSession).where(TerminalSession.allocation_id == allocation_id)
    return await _page(db, query, limit, cursor)


async def admin_list(
    db: AsyncSession,
    *,
    status: str | None,
    allocation_id: uuid.UUID | None,
    node_id: uuid.UUID | None,
    project_id: uuid.UUID | None,
    limit: int,
    cursor: str | None,
) -> TerminalSessionList:
    query: Select[Any] = select(TerminalSession)
    if status is not None:
        if status not in TERMINAL_STATUSES:
            raise unknown_query_value("status", TERMINAL_STATUSES)
        query = query.where(TerminalSession.status == status)
    if allocation_id is not None:
        query = query.where(TerminalSession.allocation_id == allocation_id)
    if node_id is not None:
        query = query.where(TerminalSession.node_id == node_id)
    if project_id is not None:
        query = query.where(TerminalSession.project_id == project_id)
    return await _page(db, query, limit, cursor)


async def get_session(db: AsyncSession, session_id: uuid.UUID) -> TerminalSession:
    row = await db.get(TerminalSession, session_id)
    if row is None:
        raise NotFound("terminal session not found")
    return row


async def force_close(
    db: AsyncSession, temporal: TemporalOps, *, session_id: uuid.UUID, reason: str
) -> tuple[TerminalCloseAccepted, str]:
    """The `close` update, answered once the workflow accepted it (the close itself takes up to
    the close timeout). Returns the answer and the workflow id, for the audit row."""
    row = await get_session(db, session_id)
    request = CloseRequest(CloseReason.ADMIN_FORCE_CLOSED.value, actor=ACTOR_ADMIN, note=reason)
    return await _close(db, temporal, row, request)


async def tenant_close(
    db: AsyncSession,
    temporal: TemporalOps,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID,
    session_id: uuid.UUID,
) -> TerminalCloseAccepted:
    """The tenant closes its own session (client_closed, by the user): the same `close` update
    as a force-close. Another project's session, or one of another allocation, is 404."""
    await get_row(db, allocation_id, project_id)
    row = await db.get(TerminalSession, session_id)
    if row is None or row.allocation_id != allocation_id or row.project_id != project_id:
        raise NotFound("terminal session not found")
    request = CloseRequest(CloseReason.CLIENT_CLOSED.value, actor=ACTOR_USER)
    answer, _ = await _close(db, temporal, row, request)
    return answer


async def _close(
    db: AsyncSession, temporal: TemporalOps, row: TerminalSession, request: CloseRequest
) -> tuple[TerminalCloseAccepted, str]:
    session_id, prior, workflow_id = row.id, row.status, row.workflow_id
    await db.close()
    not_live = Conflict(
        "the terminal session has already ended",
        code=SESSION_NOT_LIVE,
        details={"status": prior},
    )

    async def close(client: Client) -> None:
        await client.get_workflow_handle(workflow_id).start_update(
            CLOSE_UPDATE,
            request,
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            rpc_timeout=temporal.rpc_timeout,
        )

    try:
        await temporal.update(close)
    except WorkflowUpdateFailedError as err:
        if isinstance(err.cause, ApplicationError) and err.cause.type == SESSION_NOT_LIVE:
            raise not_live from None
        raise
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise not_live from None
        raise
    expected = (
        TerminalSessionStatus.ERROR
        if prior == TerminalSessionStatus.OPENING
        else TerminalSessionStatus.CLOSED
    )
    return (
        TerminalCloseAccepted(session_id=session_id, prior_status=prior, expected_status=expected),
        workflow_id,
    )
