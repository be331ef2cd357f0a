"""Reconciliation admin routes (docs/maas-nodes.md#drift-between-maas-and-the-platform): the drift
summary and list, resolving a drift (audited), and running a site's reconciler now (a trigger of its
schedule, so overlapping runs are still skipped)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client

from contracts.admin_operation import (
    DRIFT_RESOLVE,
    DriftResolveInput,
    DriftState,
)
from contracts.maas_reconciler import reconciler_schedule_id
from core.timestamps import parse_iso
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import Principal, admin_guard
from gateway.errors import Conflict, NotFound, unknown_query_value
from gateway.openapi import errors, one_of
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from gateway.temporal import TemporalOps
from schema.models import MaasSite, MaasSitePolicy, Node, NodeDriftEvent, NodeMaasState


class RefusedReconcile(msgspec.Struct, kw_only=True):
    """A site whose latest reconcile was refused (a `reconcile_suspect` alert: a machines list
    that cannot be whole, or more quarantines than the site's cap) and that no accepted run has
    reconciled since: its nodes' MAAS state is as old as the last accepted run."""

    site_id: uuid.UUID
    site_name: str
    reason: str  # list_failed, empty_list, missing_share, quarantine_cap
    message: str
    severity: str
    at: dt.datetime
    # The details the reconciler recorded with the alert (counts, sample of ids, error).
    details: dict[str, Any]


class ReconciliationStatus(msgspec.Struct, kw_only=True):
    nodes: int
    ok: int
    drifted: int
    # Never reconciled, or not within two of its site's reconcile intervals.
    unreconciled: int
    # Sites whose latest reconcile was refused, with its reason and time (none: all accepted).
    refused: list[RefusedReconcile] = msgspec.field(default_factory=list)


class DriftView(msgspec.Struct, kw_only=True):
    node_id: uuid.UUID
    hostname: str
    node_status: str
    site_id: uuid.UUID
    maas_system_id: str
    rule: str | None
    details: dict[str, Any] | None
    last_maas_status: str | None
    last_reconciled_at: dt.datetime | None
    # The §6.4 alert severity of the open drift (its rule's, as the reconciler recorded it in
    # node_drift_events): CRITICAL, WARN, INFO or DEBUG.
    severity: str | None = None


class DriftList(msgspec.Struct, kw_only=True):
    items: list[DriftView]


class ResolveDrift(RequestBody):
    reason: Reason


class RunReconcile(RequestBody):
    site_id: uuid.UUID


class RunAccepted(msgspec.Struct, kw_only=True):
    site_id: uuid.UUID
    schedule_id: str


async def reconciliation_status(
    db: AsyncSession, site_id: uuid.UUID | None
) -> ReconciliationStatus:
    """Nodes bound to MAAS: ok, drifted, unreconciled (the admin API's and the console's)."""
    stale = func.clock_timestamp() - func.make_interval(
        0, 0, 0, 0, 0, 0, 2 * MaasSitePolicy.reconcile_interval_seconds
    )
    query = select(
        func.count(),
        func.count().filter(NodeMaasState.drift_detected),
        func.count().filter(
            (NodeMaasState.last_reconciled_at.is_(None))
            | (NodeMaasState.last_reconciled_at < stale)
        ),
    ).join(MaasSitePolicy, MaasSitePolicy.site_id == NodeMaasState.site_id)
    if site_id is not None:
        query = query.where(NodeMaasState.site_id == site_id)
    total, drifted, unreconciled = (await db.execute(query)).one()
    return ReconciliationStatus(
        nodes=total,
        ok=total - drifted,
        drifted=drifted,
        unreconciled=unreconciled,
        refused=await refused_reconciles(db, site_id),
    )


# The alert a refused reconcile records (activities/maas_reconcile.py SUSPECT_EVENT).
REFUSED_EVENT = "maas.reconcile_suspect"
_REFUSED = text(
    "SELECT s.id, s.name, e.payload, e.occurred_at"
    " FROM maas_sites s"
    " CROSS JOIN LATERAL ("
    "   SELECT payload, occurred_at FROM domain_events"
    "   WHERE type = :event AND subject_type = 'maas_site' AND subject_id = s.id::text"
    "   ORDER BY occurred_at DESC, id DESC LIMIT 1"
    " ) e"
    " WHERE (CAST(:site AS uuid) IS NULL OR s.id = CAST(:site AS uuid))"
    " AND e.occurred_at > COALESCE("
    "   (SELECT max(m.last_reconciled_at) FROM node_maas_state m WHERE m.site_id = s.id),"
    "   '-infinity')"
    " ORDER BY e.occurred_at DESC"
)


async def refused_reconciles(db: AsyncSession, site_id: uuid.UUID | None) -> list[RefusedReconcile]:
    """Each site whose latest refused reconcile is newer than its last accepted one (an accepted
    run stamps its nodes' last_reconciled_at; a refused one writes nothing else)."""
    rows = await db.execute(_REFUSED, {"event": REFUSED_EVENT, "site": site_id})
    refused = []
    for sid, name, payload, at in rows:
        details = {
            k: v
            for k, v in dict(payload).items()
            if k not in ("rule", "reason", "message", "severity")
        }
        refused.append(
            RefusedReconcile(
                site_id=sid,
                site_name=name,
                reason=str(payload.get("reason", "unknown")),
                message=str(payload.get("message", "")),
                severity=str(payload.get("severity", "CRITICAL")),
                at=at,
                details=details,
            )
        )
    return refused


# The severities node_drift_events records (its check constraint), most urgent first.
DRIFT_SEVERITIES = ("CRITICAL", "WARN", "INFO", "DEBUG")


def _open_drift_severity() -> Any:
    """The severity the reconciler recorded when the node's open drift started: its latest
    drift event of that rule."""
    return (
        select(NodeDriftEvent.severity)
        .where(
            NodeDriftEvent.node_id == NodeMaasState.node_id,
            NodeDriftEvent.rule == NodeMaasState.drift_rule,
        )
        .order_by(NodeDriftEvent.occurred_at.desc(), NodeDriftEvent.id.desc())
        .limit(1)
        .correlate(NodeMaasState)
        .scalar_subquery()
    )


def checked_severity(value: str | None) -> str | None:
    """The severity filter, upper-cased; 422 unknown_severity outside DRIFT_SEVERITIES."""
    if value is None:
        return None
    if value.upper() not in DRIFT_SEVERITIES:
        raise unknown_query_value("severity", DRIFT_SEVERITIES)
    return value.upper()


async def drift_list(
    db: AsyncSession,
    site_id: uuid.UUID | None,
    *,
    severity: str | None = None,
    node_id: uuid.UUID | None = None,
) -> DriftList:
    """Nodes with unresolved drift, by hostname, with each drift's severity."""
    drift_severity = _open_drift_severity()
    query = (
        select(NodeMaasState, Node, drift_severity)
        .join(Node, Node.id == NodeMaasState.node_id)
        .where(NodeMaasState.drift_detected)
        .order_by(Node.hostname)
    )
    if site_id is not None:
        query = query.where(NodeMaasState.site_id == site_id)
    if severity is not None:
        query = query.where(drift_severity == severity)
    if node_id is not None:
        query = query.where(NodeMaasState.node_id == node_id)
    rows = (await db.execute(query)).all()
    return DriftList(
        items=[
            DriftView(
                node_id=state.node_id,
                hostname=node.hostname,
                node_status=node.status,
                site_id=state.site_id,
                maas_system_id=state.maas_system_id,
                rule=state.drift_rule,
                details=state.drift_details,
                last_maas_status=state.last_maas_status,
                last_reconciled_at=state.last_reconciled_at,
                severity=severity_of,
            )
            for state, node, severity_of in rows
        ]
    )


async def resolve_drift(
    runtime: Runtime, principal: Principal, node_id: uuid.UUID, reason: str
) -> DriftView:
    """Acknowledge a node's drift: resolved by the worker (AdminOperationWorkflow),
    compare-and-set and audited; 404 for a node bound to no site, 409 `no_drift`."""
    resolved = await run_admin_operation(
        runtime.temporal,
        runtime.settings.control_plane_task_queue,
        DRIFT_RESOLVE,
        DriftResolveInput(actor=actor(principal, reason), node_id=str(node_id)),
        key=str(node_id),
        result_type=DriftState,
    )
    return DriftView(
        node_id=uuid.UUID(resolved.node_id),
        hostname=resolved.hostname,
        node_status=resolved.node_status,
        site_id=uuid.UUID(resolved.site_id),
        maas_system_id=resolved.maas_system_id,
        rule=resolved.rule,
        details=resolved.details,
        last_maas_status=resolved.last_maas_status,
        last_reconciled_at=parse_iso(resolved.last_reconciled_at),
    )


class AdminReconciliationController(Controller):
    path = "/api/v1/admin/reconciliation"
    guards = [admin_guard]
    tags = ["admin: reconciliation"]

    @get(
        "/status",
        summary="Nodes bound to MAAS: ok, drifted, unreconciled; refused reconciles by site",
        responses=errors(),
    )
    async def status(
        self, db: NamedDependency[AsyncSession], site_id: FromQuery[uuid.UUID | None] = None
    ) -> ReconciliationStatus:
        return await reconciliation_status(db, site_id)

    @get(
        "/drift",
        summary="Nodes with unresolved drift, with its severity (?severity=CRITICAL|WARN|INFO|"
        "DEBUG filters; 422 unknown_severity otherwise)",
        responses=errors(422),
    )
    async def drift(
        self,
        db: NamedDependency[AsyncSession],
        site_id: FromQuery[uuid.UUID | None] = None,
        severity: Annotated[
            str | None, QueryParameter(schema_extra=one_of(DRIFT_SEVERITIES))
        ] = None,
    ) -> DriftList:
        return await drift_list(db, site_id, severity=checked_severity(severity))

    @get(
        "/drift/{node_id:uuid}",
        summary="One node's unresolved drift, with its severity (404 when it has none)",
        responses=errors(404),
    )
    async def drift_detail(
        self, db: NamedDependency[AsyncSession], node_id: FromPath[uuid.UUID]
    ) -> DriftView:
        found = (await drift_list(db, None, node_id=node_id)).items
        if not found:
            raise NotFound("this node has no unresolved drift")
        return found[0]

    @post(
        "/drift/{node_id:uuid}/resolve",
        status_code=200,
        summary="Acknowledge a drift after acting on it (audited)",
        responses=errors(400, 404, 409, 413),
    )
    async def resolve(
        self,
        data: JSONBody[ResolveDrift],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
        node_id: FromPath[uuid.UUID],
    ) -> DriftView:
        return await resolve_drift(runtime, principal, node_id, data.reason)

    @post(
        "/run",
        status_code=202,
        summary="Reconcile a site now",
        responses=errors(400, 404, 409, 413),
    )
    async def run(
        self,
        data: JSONBody[RunReconcile],
        db: NamedDependency[AsyncSession],
        temporal: NamedDependency[TemporalOps],
    ) -> RunAccepted:
        site = await db.get(MaasSite, data.site_id)
        if site is None:
            raise NotFound("MAAS site not found")
        if site.status != "active":
            raise Conflict("the site is disabled", code="site_disabled")
        await db.close()
        schedule_id = reconciler_schedule_id(str(data.site_id))

        async def trigger(client: Client) -> None:
            await client.get_schedule_handle(schedule_id).trigger()

        await temporal.update(trigger)
        return RunAccepted(site_id=data.site_id, schedule_id=schedule_id)
