"""Small helpers shared by controllers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from litestar import Request
from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncSession

from core.config import Settings
from gateway.auth import Principal
from gateway.errors import InvalidRequest
from gateway.runtime import Runtime
from gateway.temporal import TemporalOps

AUDIT_REASON_HEADER = "X-Audit-Reason"
MAX_REASON_CHARS = 500


def audit_reason(request: Request[Any, Any, Any], body_reason: str | None = None) -> str | None:
    """The `reason` of a JSON body where it has one, else the X-Audit-Reason header."""
    if body_reason:
        return body_reason
    header = request.headers.get(AUDIT_REASON_HEADER)
    if header is None:
        return None
    header = header.strip()
    if len(header) > MAX_REASON_CHARS:
        raise InvalidRequest(
            f"{AUDIT_REASON_HEADER} may be at most {MAX_REASON_CHARS} characters",
            details={"header": AUDIT_REASON_HEADER},
        )
    return header or None


P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class AdminCall:
    """What an audited admin route acts with: who asks, why (`reason`), and the Temporal client,
    settings and control-plane queue that reach the worker. Routes take it as a dependency
    (`provide_admin_call`), instead of the principal, the request and the runtime each."""

    principal: Principal
    request: Request[Any, Any, Any]
    runtime: Runtime

    @property
    def temporal(self) -> TemporalOps:
        return self.runtime.temporal

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def queue(self) -> str:
        """The control-plane task queue, where the worker runs admin operations."""
        return self.runtime.settings.control_plane_task_queue

    def reason(self, body_reason: str | None = None) -> str | None:
        """The audit reason: the body's `reason`, else the X-Audit-Reason header."""
        return audit_reason(self.request, body_reason)

    async def operate(
        self,
        operation: Callable[
            Concatenate[AsyncSession, TemporalOps, str, Principal, P], Awaitable[R]
        ],
        db: AsyncSession,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """An operation the worker runs for this caller, taking (db, temporal, task queue,
        principal, what it acts on...): called with the first four from here."""
        return await operation(db, self.temporal, self.queue, self.principal, *args, **kwargs)


async def provide_admin_call(
    principal: NamedDependency[Principal],
    request: Request[Any, Any, Any],
    runtime: NamedDependency[Runtime],
) -> AdminCall:
    return AdminCall(principal, request, runtime)
