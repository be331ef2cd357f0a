"""The console's pages and form posts. Reads call what the admin API's routes call; every action
goes through the same workflow update or admin operation as its API route, audited the same way
(the principal is the signed-in admin's token). Errors keep the API's codes, shown on a page."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Protocol
from urllib.parse import quote, urlencode

from jinja2 import Environment
from litestar import Controller, Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.handlers import HTTPRouteHandler
from litestar.params import Body, FromPath, FromQuery
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts import decommission as decommission_contract
from contracts.decommission import STAGES_BY_MODE, Mode
from contracts.lifecycle import FAILED_JOB_STATUSES, TERMINAL_JOB_STATUSES, JobStatus
from contracts.onboarding import STAGE_ORDER
from contracts.onboarding_policy import ALLOWED_ACTIONS as ONBOARDING_ALLOWED_ACTIONS
from contracts.states import LIVE_ALLOCATION_STATUSES, AllocationStatus, NodeStatus
from gateway import allocations, audit, decommissions, onboardings, timeline
from gateway.auth import Principal, principal_for_token
from gateway.console import session
from gateway.console.links import TemporalWeb
from gateway.console.temporal_web import PUBLIC_PATH as TEMPORAL_WEB_PATH
from gateway.console.temporal_web import temporal_web, temporal_web_base
from gateway.console.views import StageLine, allowed_actions, stage_line, time_axis
from gateway.controllers import decommissions as decommission_routes
from gateway.controllers import onboardings as onboarding_routes
from gateway.controllers.admin import detach_audited, force_release_audited
from gateway.controllers.nodes import node_detail, node_page, slot_counts_by_node
from gateway.controllers.reconciliation import drift_list, reconciliation_status, resolve_drift
from gateway.errors import Forbidden, InvalidRequest, NotFound, exception_handler
from gateway.lifecycle_jobs import checked_reason
from gateway.onboarding_schemas import MAX_BATCH_NODES
from gateway.runtime import Runtime
from gateway.temporal import TemporalOps
from schema.models import MaasSite, Node, NodeDriftEvent

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
MAX_REASON_CHARS = 500
PAGE = 200  # rows per list page
SETTLED = TERMINAL_JOB_STATUSES | FAILED_JOB_STATUSES  # a batch page stops refreshing
ALERTS_SHOWN = 50  # the drift page's newest drift events


@dataclass
class ReasonForm:
    """An action form: why (audited), and the form token."""

    reason: str = ""
    csrf_token: str = ""


@dataclass
class SignInForm:
    token: str = ""
    next: str = ""


AnyRequest = Request[Any, Any, Any]


def _reason(request: AnyRequest, form: ReasonForm) -> str:
    session.check_csrf(request, form.csrf_token)
    reason = checked_reason(form.reason)
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidRequest(
            f"reason may be at most {MAX_REASON_CHARS} characters",
            details={"errors": [{"key": "reason", "source": "body", "message": "too long"}]},
        )
    return reason


def _done(path: str, **notice: str) -> Redirect:
    """Back to the page the form was on, saying what was sent (303: the browser GETs it)."""
    return Redirect(f"{path}?{urlencode(notice)}", status_code=303)


def _page(request: AnyRequest, runtime: Runtime, name: str, **context: Any) -> Template:
    principal = request.state.get("principal")
    return Template(
        template_name=name,
        context={
            "admin": principal.name if isinstance(principal, Principal) else None,
            "form_token": session.csrf_for(request),
            "temporal": TemporalWeb(
                temporal_web_base(runtime), runtime.settings.temporal_namespace
            ),
            "notice": dict(request.query_params) if "sent" in request.query_params else None,
            **context,
        },
    )


def _as_uuid(value: str | None, name: str) -> uuid.UUID | None:
    if not value:
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be a UUID", details={"parameter": name}) from None


class JobActionAnswer(Protocol):
    """What every job kind's operator_action answers (the admin API's action routes' bodies)."""

    @property
    def action(self) -> str: ...
    @property
    def accepted(self) -> bool: ...
    @property
    def expected_status(self) -> str: ...
    @property
    def message(self) -> str: ...


@dataclass(frozen=True)
class JobKind:
    """A lifecycle job kind as the console shows it and acts on it: its operator actions as the
    admin API spells them in the URL, the job states its workflow admits each from, and the
    function the API's action route calls."""

    name: str  # onboarding | decommission; its pages are /console/<name>s/<id>
    paths: Mapping[str, StrEnum]
    allowed: Mapping[Any, Collection[JobStatus]]
    send: Callable[
        [AsyncSession, TemporalOps, Principal, uuid.UUID, Any, str], Awaitable[JobActionAnswer]
    ]

    def page(self, job_id: uuid.UUID) -> str:
        return f"/console/{self.name}s/{job_id}"


ONBOARDING = JobKind(
    "onboarding",
    onboarding_routes.ACTION_PATHS,
    ONBOARDING_ALLOWED_ACTIONS,
    partial(onboardings.operator_action, idempotency_key=None),
)
DECOMMISSION = JobKind(
    "decommission",
    decommission_routes.ACTION_PATHS,
    decommission_contract.ALLOWED_ACTIONS,
    decommissions.operator_action,
)


def _job_page(
    request: AnyRequest,
    runtime: Runtime,
    kind: JobKind,
    job: Any,
    *,
    job_id: uuid.UUID,
    ips: Sequence[str],
    stages: list[StageLine],
) -> Template:
    """A lifecycle job's page: its facts, its stages, and the actions its state allows."""
    return _page(
        request,
        runtime,
        "job.html",
        kind=kind.name,
        job=job,
        ips=ips,
        stages=stages,
        actions=allowed_actions(kind.paths, kind.allowed, job.status),
        action_base=kind.page(job_id),
    )


def _operator_action_route(kind: JobKind) -> HTTPRouteHandler:
    """The form post of a job kind's operator actions, one handler for every kind: sent as the
    admin API's action route sends it, then back to the job's page with the workflow's answer."""

    @post(f"/{kind.name}s/{{job_id:uuid}}/{{action:str}}", status_code=303)
    async def operator_action(
        self: Controller,
        data: Annotated[ReasonForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        job_id: FromPath[uuid.UUID],
        action: FromPath[str],
    ) -> Redirect:
        chosen = kind.paths.get(action)
        if chosen is None:
            raise NotFound(f"no action {action!r}; one of: {', '.join(kind.paths)}")
        answer = await kind.send(db, temporal, principal, job_id, chosen, _reason(request, data))
        return _done(
            kind.page(job_id),
            sent=answer.action,
            accepted=str(answer.accepted).lower(),
            expected=answer.expected_status,
            message=answer.message,
        )

    return operator_action


async def _force_release(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    allocation_id: uuid.UUID,
    reason: str,
) -> str:
    answer = await force_release_audited(db, temporal, principal, allocation_id, reason)
    return answer.expected_status or answer.status


async def _detach(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    allocation_id: uuid.UUID,
    reason: str,
) -> str:
    return (await detach_audited(db, temporal, principal, allocation_id, reason)).status


# An allocation's admin actions as the console's forms post them: the name its notice shows,
# and the admin API's operation (audited the same way), answering the state expected after it.
ALLOCATION_ACTIONS: Mapping[
    str,
    tuple[str, Callable[[AsyncSession, TemporalOps, Principal, uuid.UUID, str], Awaitable[str]]],
] = {"force-release": ("force_release", _force_release), "detach": ("detach", _detach)}


class SignInController(Controller):
    path = "/console"
    include_in_schema = False

    @get("/sign-in")
    async def sign_in_form(self, next: FromQuery[str] = "/console/inventory") -> Template:
        return Template(template_name="sign_in.html", context={"next": next, "admin": None})

    @post("/sign-in", status_code=303)
    async def sign_in(
        self,
        data: Annotated[SignInForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
        request: AnyRequest,
        runtime: NamedDependency[Runtime],
        db: NamedDependency[AsyncSession],
    ) -> Response[Any]:
        session.check_origin(request)
        principal = await principal_for_token(request, data.token.strip())
        if not principal.is_admin:
            raise Forbidden("the console is for admins; this token is a tenant's")
        audit.record_by(
            db,
            principal,
            action="console.session_create",
            target_type="api_token",
            target_id=str(principal.token_id),
            expected_state="console_session",
            details={"ttl_seconds": runtime.config.console_session_ttl_seconds},
        )
        await db.commit()
        # Only a console page or Temporal Web: never an open redirect to another site.
        target = (
            data.next
            if data.next.startswith(("/console/", f"{TEMPORAL_WEB_PATH}/"))
            else "/console/inventory"
        )
        cookie = session.session_cookie(runtime, principal, https=request.url.scheme == "https")
        return Redirect(target, status_code=303, cookies=[cookie])

    @post("/sign-out", status_code=303)
    async def sign_out(self) -> Response[Any]:
        return Redirect(session.SIGN_IN_PATH, status_code=303, cookies=[session.cleared_cookie()])


class ConsoleController(Controller):
    path = "/console"
    guards = [session.console_guard]
    include_in_schema = False

    @get("/")
    async def home(self) -> Redirect:
        return Redirect("/console/inventory", status_code=303)

    # --- inventory (docs/console.md) -------------------------------------------------------------

    @get("/inventory")
    async def inventory(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        site_id: FromQuery[str | None] = None,
        sku: FromQuery[str | None] = None,
        status: FromQuery[str | None] = None,
        drift: FromQuery[str | None] = None,
        cursor: FromQuery[str | None] = None,
    ) -> Template:
        drift_filter = {"yes": True, "no": False}.get(drift or "")
        page = await node_page(
            db,
            site_id=_as_uuid(site_id, "site_id"),
            sku=sku or None,
            status=status or None,
            drift=drift_filter,
            limit=PAGE,
            cursor=cursor or None,
        )
        slots = await slot_counts_by_node(db, [n.id for n in page.items])
        by_status = dict(
            (await db.execute(select(Node.status, func.count()).group_by(Node.status))).all()
        )
        sites = (await db.execute(select(MaasSite.id, MaasSite.name).order_by(MaasSite.name))).all()
        skus = list(await db.scalars(select(Node.sku).distinct().order_by(Node.sku)))
        return _page(
            request,
            runtime,
            "inventory.html",
            nodes=page.items,
            next_cursor=page.next_cursor,
            slots=slots,
            by_status=by_status,
            statuses=[s.value for s in NodeStatus],
            sites=sites,
            site_names={str(i): n for i, n in sites},
            skus=skus,
            filters={
                "site_id": site_id or "",
                "sku": sku or "",
                "status": status or "",
                "drift": drift or "",
            },
        )

    @get("/nodes/{node_id:uuid}")
    async def node(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        node_id: FromPath[uuid.UUID],
    ) -> Template:
        detail = await node_detail(db, node_id)
        return _page(
            request,
            runtime,
            "node.html",
            node=detail,
            onboardings=(
                await onboardings.list_rows(
                    db,
                    batch_id=None,
                    status=None,
                    site_id=None,
                    hostname=detail.hostname,
                    limit=10,
                    cursor=None,
                )
            ).items,
            decommissions=(
                await decommissions.list_rows(
                    db, node_id=node_id, status=None, mode=None, limit=10, cursor=None
                )
            ).items,
            allocations=(
                await allocations.list_rows(
                    db, project_id=None, node_id=node_id, status=None, limit=20, cursor=None
                )
            ).items,
        )

    # --- lifecycle jobs (docs/console.md) --------------------------------------------------------

    @get("/jobs")
    async def jobs(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        status: FromQuery[str | None] = None,
    ) -> Template:
        return _page(
            request,
            runtime,
            "jobs.html",
            onboardings=(
                await onboardings.list_rows(
                    db,
                    batch_id=None,
                    status=status or None,
                    site_id=None,
                    hostname=None,
                    limit=50,
                    cursor=None,
                )
            ).items,
            decommissions=(
                await decommissions.list_rows(
                    db, node_id=None, status=status or None, mode=None, limit=50, cursor=None
                )
            ).items,
            status=status or "",
            statuses=[s.value for s in JobStatus],
        )

    @get("/onboardings/{onboarding_id:uuid}")
    async def onboarding(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        onboarding_id: FromPath[uuid.UUID],
    ) -> Template:
        job = await onboardings.detail(db, onboarding_id)
        return _job_page(
            request,
            runtime,
            ONBOARDING,
            job,
            job_id=onboarding_id,
            ips=job.last_maas_ips,
            stages=stage_line(STAGE_ORDER, job.events, job.current_stage),
        )

    @get("/decommissions/{decommission_id:uuid}")
    async def decommission(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        decommission_id: FromPath[uuid.UUID],
    ) -> Template:
        job = await decommissions.detail(db, decommission_id)
        node = await node_detail(db, job.node_id)
        return _job_page(
            request,
            runtime,
            DECOMMISSION,
            job,
            job_id=decommission_id,
            ips=node.maas.last_maas_ips if node.maas else [],
            stages=stage_line(STAGES_BY_MODE[Mode(job.mode)], job.events, job.current_stage),
        )

    onboarding_action = _operator_action_route(ONBOARDING)
    decommission_action = _operator_action_route(DECOMMISSION)

    # --- batch progress (the gpucloud-onboard CLI's table, live) -------------------------------

    async def _batch(self, db: AsyncSession, batch_id: uuid.UUID) -> dict[str, Any]:
        rows, cursor, summary, total = [], None, None, 0
        while True:
            page = await onboardings.list_rows(
                db,
                batch_id=batch_id,
                status=None,
                site_id=None,
                hostname=None,
                # A batch holds at most this many: one page (and one count) per 2 s refresh.
                limit=MAX_BATCH_NODES,
                cursor=cursor,
            )
            rows += page.items
            summary, total = page.summary or {}, page.total or 0
            cursor = page.next_cursor
            if cursor is None:
                break
        if not rows:
            raise NotFound("no onboardings in this batch")
        rows.sort(key=lambda r: r.hostname)
        settled = all(r.status in SETTLED for r in rows)
        return {
            "batch_id": batch_id,
            "rows": rows,
            "summary": summary,
            "total": total,
            "settled": settled,
        }

    @get("/batches/{batch_id:uuid}")
    async def batch(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        batch_id: FromPath[uuid.UUID],
    ) -> Template:
        return _page(request, runtime, "batch.html", **await self._batch(db, batch_id))

    @get("/batches/{batch_id:uuid}/rows")
    async def batch_rows(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        batch_id: FromPath[uuid.UUID],
    ) -> Template:
        """The batch table alone: the page's script swaps it in every few seconds."""
        return _page(request, runtime, "batch_rows.html", **await self._batch(db, batch_id))

    # --- allocations ---------------------------------------------------------------------------

    @get("/allocations")
    async def allocation_list(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        status: FromQuery[str | None] = None,
        node_id: FromQuery[str | None] = None,
        cursor: FromQuery[str | None] = None,
    ) -> Template:
        page = await allocations.list_rows(
            db,
            project_id=None,
            node_id=_as_uuid(node_id, "node_id"),
            status=status or None,
            limit=PAGE,
            cursor=cursor or None,
        )
        return _page(
            request,
            runtime,
            "allocations.html",
            allocations=page.items,
            next_cursor=page.next_cursor,
            status=status or "",
            statuses=[s.value for s in AllocationStatus],
        )

    @get("/allocations/{allocation_id:uuid}")
    async def allocation(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
        temporal: NamedDependency[TemporalOps],
        allocation_id: FromPath[uuid.UUID],
    ) -> Template:
        detail = allocations.detail(await allocations.get_row(db, allocation_id, None))
        events = await timeline.build(db, temporal, allocation_id=allocation_id, project_id=None)
        return _page(
            request,
            runtime,
            "allocation.html",
            allocation=detail,
            # A force-release is for an allocation that may still hold its node.
            releasable=detail.status in LIVE_ALLOCATION_STATUSES,
            timeline=events,
            axis=time_axis(events, dt.datetime.now(dt.UTC)),
        )

    @post("/allocations/{allocation_id:uuid}/{action:str}", status_code=303)
    async def allocation_action(
        self,
        data: Annotated[ReasonForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
        principal: NamedDependency[Principal],
        allocation_id: FromPath[uuid.UUID],
        action: FromPath[str],
    ) -> Redirect:
        chosen = ALLOCATION_ACTIONS.get(action)
        if chosen is None:
            raise NotFound(f"no action {action!r}; one of: {', '.join(ALLOCATION_ACTIONS)}")
        name, send = chosen
        expected = await send(db, temporal, principal, allocation_id, _reason(request, data))
        return _done(
            f"/console/allocations/{allocation_id}", sent=name, accepted="true", expected=expected
        )

    # --- drift and alerts ----------------------------------------------------------------------

    @get("/drift")
    async def drift(
        self,
        request: AnyRequest,
        db: NamedDependency[AsyncSession],
        runtime: NamedDependency[Runtime],
    ) -> Template:
        alerts = (
            await db.execute(
                select(NodeDriftEvent, Node.hostname)
                .join(Node, Node.id == NodeDriftEvent.node_id)
                .order_by(NodeDriftEvent.occurred_at.desc())
                .limit(ALERTS_SHOWN)
            )
        ).all()
        return _page(
            request,
            runtime,
            "drift.html",
            status=await reconciliation_status(db, None),
            # Each with its severity (docs/lifecycles/node.md#reconciliation-rules alerts), as GET
            # /admin/reconciliation/drift.
            drifts=(await drift_list(db, None)).items,
            alerts=alerts,
        )

    @post("/drift/{node_id:uuid}/resolve", status_code=303)
    async def resolve(
        self,
        data: Annotated[ReasonForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
        request: AnyRequest,
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        node_id: FromPath[uuid.UUID],
    ) -> Redirect:
        resolved = await resolve_drift(runtime, principal, node_id, _reason(request, data))
        return _done(
            "/console/drift",
            sent="resolve_drift",
            accepted="true",
            expected=f"{resolved.hostname}: no open drift",
        )


def _error_page(request: AnyRequest, exc: Exception) -> Response[Any]:
    """Pages answer sign-in redirects and HTML error pages with the API's status and code."""
    if isinstance(exc, session.SignInRequired) and request.method == "GET":
        return Redirect(f"{session.SIGN_IN_PATH}?next={quote(request.url.path)}", status_code=303)
    answer = exception_handler(request, exc)
    error = answer.content["error"] if isinstance(answer.content, dict) else {}
    return Template(
        template_name="error.html",
        context={"admin": None, "error": error, "status": answer.status_code},
        status_code=answer.status_code or 500,
    )


def _filters(environment: Environment) -> None:
    def when(value: dt.datetime | None) -> str:
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "—"

    def seconds(value: float | None) -> str:
        if value is None:
            return "—"
        return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"

    environment.filters["when"] = when
    environment.filters["seconds"] = seconds


def console_template_config() -> TemplateConfig[JinjaTemplateEngine]:
    return TemplateConfig(
        directory=TEMPLATES,
        engine=JinjaTemplateEngine,
        engine_callback=lambda engine: _filters(engine.engine),
    )


def console_router() -> Router:
    return Router(
        path="/",
        route_handlers=[
            SignInController,
            ConsoleController,
            # Temporal Web (ui-server) for signed-in admins, under /temporal/.
            temporal_web,
            create_static_files_router(path="/console/static", directories=[STATIC]),
        ],
        exception_handlers={Exception: _error_page},
        include_in_schema=False,
    )
