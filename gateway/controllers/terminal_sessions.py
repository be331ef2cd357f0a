"""Terminal sessions (docs/lifecycles/terminal-session.md): tenant open, list and close, admin list
and force-close (audited).
The streams are WebSocket routes of gateway/terminal_relay.py."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from gateway import audit
from gateway import terminal_sessions as terminals
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.temporal import TemporalOps
from gateway.terminal_sessions import (
    TerminalCloseAccepted,
    TerminalForceClose,
    TerminalSessionCreated,
    TerminalSessionList,
)


class TerminalSessionsController(Controller):
    path = "/api/v1/allocations/{allocation_id:uuid}/terminal-sessions"
    guards = [tenant_guard]
    tags = ["terminal sessions"]

    @post(
        "/",
        status_code=201,
        summary="Open a terminal session: a single-use open token and the stream's WebSocket URL",
        description=(
            'Connect to stream_url and send {"type": "auth", "token": open_token} as the '
            "first frame within the token's lifetime. One live session per allocation: a "
            "second open is 409 terminal_session_active with details.active_session_id. A "
            "reconnect is a new open (new token, new session)."
        ),
        responses=errors(403, 404, 409),
    )
    async def open_session(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
    ) -> Response[TerminalSessionCreated]:
        created = await terminals.open_session(
            db,
            temporal,
            runtime.settings,
            allocation_id=allocation_id,
            project_id=principal.project,
        )
        return Response(created, status_code=201, headers={"Cache-Control": "no-store"})

    @get(
        "/",
        summary="The allocation's terminal sessions, newest first (status, opened/closed at, "
        "close reason)",
        responses=errors(400, 403, 404),
    )
    async def list_sessions(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> TerminalSessionList:
        return await terminals.list_for_allocation(
            db,
            allocation_id=allocation_id,
            project_id=principal.project,
            limit=limit,
            cursor=cursor,
        )

    @post(
        "/{session_id:uuid}/close",
        status_code=202,
        summary="Close one of the allocation's terminal sessions (client_closed, by the user)",
        description=(
            "The session's workflow tells the node agent to end the shell and waits for its "
            "ack (or the close timeout); the answer comes once the close is accepted. "
            "expected_status: closed for an active session, error for one still opening. A "
            "session that has ended already is 409 terminal_session_not_live."
        ),
        responses=errors(403, 404, 409),
    )
    async def close_session(
        self,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        session_id: FromPath[uuid.UUID],
    ) -> Response[TerminalCloseAccepted]:
        answer = await terminals.tenant_close(
            db,
            temporal,
            allocation_id=allocation_id,
            project_id=principal.project,
            session_id=session_id,
        )
        return Response(answer, status_code=202)


class AdminTerminalSessionsController(Controller):
    path = "/api/v1/admin/terminal-sessions"
    guards = [admin_guard]
    tags = ["admin"]

    @get(
        "/",
        summary="Terminal sessions across projects, newest first",
        responses=errors(403, 422),
    )
    async def list_sessions(
        self,
        db: NamedDependency[AsyncSession],
        status: Annotated[
            str | None, QueryParameter(schema_extra=one_of(terminals.TERMINAL_STATUSES))
        ] = None,
        allocation_id: FromQuery[uuid.UUID | None] = None,
        node_id: FromQuery[uuid.UUID | None] = None,
        project_id: FromQuery[uuid.UUID | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> TerminalSessionList:
        return await terminals.admin_list(
            db,
            status=status,
            allocation_id=allocation_id,
            node_id=node_id,
            project_id=project_id,
            limit=limit,
            cursor=cursor,
        )

    @post(
        "/{session_id:uuid}/force-close",
        status_code=202,
        summary="Force-close a session (workflow update close, admin_force_closed); audited",
        responses=errors(400, 403, 404, 409),
    )
    async def force_close(
        self,
        data: JSONBody[TerminalForceClose],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        session_id: FromPath[uuid.UUID],
    ) -> Response[TerminalCloseAccepted]:
        answer, workflow_id = await terminals.force_close(
            db, temporal, session_id=session_id, reason=data.reason
        )
        audit.record_by(
            db,
            principal,
            action="terminal_session.force_close",
            target_type="terminal_session",
            target_id=str(session_id),
            reason=data.reason,
            prior_state=answer.prior_status,
            expected_state=answer.expected_status,
            workflow_ids=[workflow_id],
        )
        await db.commit()
        return Response(answer, status_code=202)
