"""Admin node inventory and lifecycle actions (docs/lifecycles/node.md#who-moves-it,
docs/console.md).

- `GET /api/v1/admin/nodes`: the inventory view (§9.1), the coarse state only, newest first,
  filtered by site, SKU, status and open drift, paginated like every list.
- `GET /api/v1/admin/nodes/{id}`: the detail view: coarse state, MAAS binding (system id, last
  observed MAAS status and power), open drift, GPU slot counts and the node's current lifecycle
  job (a live onboarding, decommission or drain: its state and stage, §9.2).
- `POST …/{id}/activate` (quarantined → active, after the worker's health proof),
  `POST …/{id}/retire` (→ draining → retired, by the node's drain lifecycle) and
  `POST …/{id}/reactivate` (retired → active, after the same proof): each an audited
  AdminOperationWorkflow operation with a required reason (activities/node_admin.py); the
  gateway writes no node state.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import (
    NODE_ACTIVATE,
    NODE_LIFECYCLE_IN_PROGRESS,
    NODE_NOT_PROVEN_HEALTHY,
    NODE_REACTIVATE,
    NODE_RETIRE,
    NODE_STATUS_CONFLICT,
    NodeActionInput,
    NodeActionResult,
)
from contracts.lifecycle import LIVE_JOB_STATUSES
from contracts.node_drain import DrainStatus
from contracts.states import NodeStatus, SlotStatus
from gateway import audit
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import admin_guard
from gateway.controllers.common import AdminCall, provide_admin_call
from gateway.errors import Conflict, NotFound, unknown_query_value
from gateway.lifecycle_jobs import checked_reason
from gateway.openapi import errors, one_of
from gateway.pagination import newest_first_page
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from schema.models import (
    GpuSlot,
    Node,
    NodeDecommission,
    NodeDrain,
    NodeMaasState,
    NodeOnboarding,
)

_ACTION_STATUSES = {
    NODE_STATUS_CONFLICT: 409,
    NODE_NOT_PROVEN_HEALTHY: 409,
    NODE_LIFECYCLE_IN_PROGRESS: 409,
}
_LIVE_JOB = [s.value for s in LIVE_JOB_STATUSES]


class NodeSummary(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    hostname: str
    region: str
    sku: str
    status: str  # the coarse node state (docs/lifecycles/node.md#states-and-transitions)
    gpu_count: int
    free_gpus: int
    site_id: uuid.UUID | None
    maas_system_id: str | None
    drift: bool
    last_agent_contact_at: dt.datetime | None
    created_at: dt.datetime
    # Ironic-style protection: while set, every destructive step on the node is refused.
    protected: bool = False


class NodeList(msgspec.Struct, kw_only=True):
    items: list[NodeSummary]
    next_cursor: str | None


class MaasBinding(msgspec.Struct, kw_only=True):
    site_id: uuid.UUID
    system_id: str
    last_maas_status: str | None
    last_maas_power_state: str | None
    last_maas_ips: list[str]
    last_reconciled_at: dt.datetime | None


class OpenDrift(msgspec.Struct, kw_only=True):
    rule: str | None
    details: dict[str, Any] | None


class GpuSlotCounts(msgspec.Struct, kw_only=True):
    total: int
    free: int
    reserved: int
    quarantined: int


class LifecycleJob(msgspec.Struct, kw_only=True):
    kind: str  # onboarding | decommission | drain
    id: uuid.UUID
    status: str
    stage: str | None
    mode: str | None
    workflow_id: str
    requested_at: dt.datetime


class NodeDetail(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    hostname: str
    region: str
    sku: str
    status: str
    host_address: str | None
    # How an operator reaches the host (docs/lifecycles/node.md#access-fields; `host` is
    # host_address by that name).
    host: str | None
    port: int
    ssh_username: str
    access_method: str
    gpu_count: int
    agent_version: str | None
    last_agent_contact_at: dt.datetime | None
    inventory_matches: bool | None
    maas: MaasBinding | None
    drift: OpenDrift | None
    gpu_slots: GpuSlotCounts
    lifecycle_job: LifecycleJob | None
    created_at: dt.datetime
    updated_at: dt.datetime
    protected: bool = False
    protected_reason: str | None = None


class NodeAction(RequestBody):
    reason: Reason


class NodeProtectionView(msgspec.Struct, kw_only=True):
    node_id: uuid.UUID
    protected: bool
    protected_reason: str | None
    changed: bool  # False: it already was so (a repeated call changes nothing)


class HealthCheckView(msgspec.Struct, kw_only=True):
    name: str
    passed: bool
    detail: str


class NodeActionView(msgspec.Struct, kw_only=True):
    node_id: uuid.UUID
    prior_status: str
    status: str
    health: list[HealthCheckView]
    drain_id: uuid.UUID | None


def _summary(node: Node, binding: NodeMaasState | None) -> NodeSummary:
    return NodeSummary(
        id=node.id,
        hostname=node.hostname,
        region=node.region,
        sku=node.sku,
        status=node.status,
        gpu_count=node.gpu_count,
        free_gpus=node.free_gpus,
        site_id=binding.site_id if binding else None,
        maas_system_id=binding.maas_system_id if binding else None,
        drift=bool(binding and binding.drift_detected),
        last_agent_contact_at=node.last_agent_contact_at,
        created_at=node.created_at,
        protected=bool(node.protected),
    )


async def slot_counts_by_node(
    db: AsyncSession, node_ids: list[uuid.UUID]
) -> dict[uuid.UUID, GpuSlotCounts]:
    """Each node's GPU slots: total, free, reserved and quarantined (disabled with a reason)."""
    quarantined = (GpuSlot.status == SlotStatus.DISABLED) & GpuSlot.quarantine_reason.is_not(None)
    rows = await db.execute(
        select(
            GpuSlot.node_id,
            func.count(),
            func.count().filter(GpuSlot.status == SlotStatus.FREE),
            func.count().filter(GpuSlot.status == SlotStatus.RESERVED),
            func.count().filter(quarantined),
        )
        .where(GpuSlot.node_id.in_(node_ids))
        .group_by(GpuSlot.node_id)
    )
    counts = {
        node_id: GpuSlotCounts(total=0, free=0, reserved=0, quarantined=0) for node_id in node_ids
    }
    for node_id, total, free, reserved, held in rows:
        counts[node_id] = GpuSlotCounts(total=total, free=free, reserved=reserved, quarantined=held)
    return counts


async def _slot_counts(db: AsyncSession, node_id: uuid.UUID) -> GpuSlotCounts:
    return (await slot_counts_by_node(db, [node_id]))[node_id]


async def _current_job(db: AsyncSession, node_id: uuid.UUID) -> LifecycleJob | None:
    """The live onboarding, decommission or drain of the node (at most one owns it)."""
    decommission = await db.scalar(
        select(NodeDecommission)
        .where(NodeDecommission.node_id == node_id, NodeDecommission.status.in_(_LIVE_JOB))
        .order_by(NodeDecommission.requested_at.desc())
        .limit(1)
    )
    if decommission is not None:
        return LifecycleJob(
            kind="decommission",
            id=decommission.decommission_id,
            status=decommission.status,
            stage=decommission.current_stage,
            mode=decommission.mode,
            workflow_id=decommission.workflow_id,
            requested_at=decommission.requested_at,
        )
    onboarding = await db.scalar(
        select(NodeOnboarding)
        .where(NodeOnboarding.node_id == node_id, NodeOnboarding.status.in_(_LIVE_JOB))
        .order_by(NodeOnboarding.requested_at.desc())
        .limit(1)
    )
    if onboarding is not None:
        return LifecycleJob(
            kind="onboarding",
            id=onboarding.onboarding_id,
            status=onboarding.status,
            stage=onboarding.current_stage,
            mode=None,
            workflow_id=onboarding.workflow_id,
            requested_at=onboarding.requested_at,
        )
    drain = await db.scalar(
        select(NodeDrain).where(
            NodeDrain.node_id == node_id, NodeDrain.status == DrainStatus.RUNNING
        )
    )
    if drain is not None:
        return LifecycleJob(
            kind="drain",
            id=drain.drain_id,
            status=drain.status,
            stage=f"waiting for {drain.live_allocations} allocation(s) to end",
            mode=None,
            workflow_id=drain.workflow_id,
            requested_at=drain.requested_at,
        )
    return None


def _action_view(result: NodeActionResult) -> NodeActionView:
    return NodeActionView(
        node_id=uuid.UUID(result.node_id),
        prior_status=result.prior_status,
        status=result.status,
        health=[
            HealthCheckView(name=c.name, passed=c.passed, detail=c.detail) for c in result.health
        ],
        drain_id=uuid.UUID(result.drain_id) if result.drain_id else None,
    )


async def node_page(
    db: AsyncSession,
    *,
    site_id: uuid.UUID | None,
    sku: str | None,
    status: str | None,
    drift: bool | None,
    limit: int,
    cursor: str | None,
) -> NodeList:
    """The inventory (docs/console.md), newest first: the admin API's and the console's."""
    query = select(Node).outerjoin(NodeMaasState, NodeMaasState.node_id == Node.id)
    if status is not None:
        if status not in NodeStatus.__members__.values():
            raise unknown_query_value("status", [s.value for s in NodeStatus])
        query = query.where(Node.status == status)
    if site_id is not None:
        query = query.where(NodeMaasState.site_id == site_id)
    if sku is not None:
        query = query.where(Node.sku == sku)
    if drift is not None:
        # IS [NOT] TRUE: a node bound to no site (no row joined) has no open drift.
        drifted = NodeMaasState.drift_detected
        query = query.where(drifted.is_(True) if drift else drifted.is_not(True))
    nodes, next_cursor = await newest_first_page(
        db, query, created=Node.created_at, row_id=Node.id, limit=limit, cursor=cursor
    )
    bindings = {
        b.node_id: b
        for b in await db.scalars(
            select(NodeMaasState).where(NodeMaasState.node_id.in_([n.id for n in nodes]))
        )
    }
    return NodeList(items=[_summary(n, bindings.get(n.id)) for n in nodes], next_cursor=next_cursor)


async def node_detail(db: AsyncSession, node_id: uuid.UUID) -> NodeDetail:
    """One node with its MAAS binding, drift, GPU slots and live lifecycle job (§9.2)."""
    node = await db.get(Node, node_id)
    if node is None:
        raise NotFound("node not found")
    binding = await db.get(NodeMaasState, node_id)
    return NodeDetail(
        id=node.id,
        hostname=node.hostname,
        region=node.region,
        sku=node.sku,
        status=node.status,
        host_address=node.host_address,
        host=node.host_address,
        port=node.port,
        ssh_username=node.ssh_username,
        access_method=node.access_method,
        gpu_count=node.gpu_count,
        agent_version=node.agent_version,
        last_agent_contact_at=node.last_agent_contact_at,
        inventory_matches=node.inventory_matches,
        maas=MaasBinding(
            site_id=binding.site_id,
            system_id=binding.maas_system_id,
            last_maas_status=binding.last_maas_status,
            last_maas_power_state=binding.last_maas_power_state,
            last_maas_ips=list(binding.last_maas_ips or []),
            last_reconciled_at=binding.last_reconciled_at,
        )
        if binding is not None
        else None,
        drift=OpenDrift(rule=binding.drift_rule, details=binding.drift_details)
        if binding is not None and binding.drift_detected
        else None,
        gpu_slots=await _slot_counts(db, node_id),
        lifecycle_job=await _current_job(db, node_id),
        created_at=node.created_at,
        updated_at=node.updated_at,
        protected=bool(node.protected),
        protected_reason=node.protected_reason,
    )


class AdminNodesController(Controller):
    path = "/api/v1/admin/nodes"
    guards = [admin_guard]
    tags = ["admin: nodes"]
    dependencies = {"admin": Provide(provide_admin_call)}

    @get("/", summary="Node inventory: coarse state, newest first", responses=errors(400, 403, 422))
    async def list_nodes(
        self,
        db: NamedDependency[AsyncSession],
        site_id: FromQuery[uuid.UUID | None] = None,
        sku: FromQuery[str | None] = None,
        status: Annotated[str | None, QueryParameter(schema_extra=one_of(NodeStatus))] = None,
        drift: FromQuery[bool | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> NodeList:
        """`drift=true`: nodes with an open MAAS drift; `drift=false`: without one (nodes bound
        to no MAAS site included)."""
        return await node_page(
            db, site_id=site_id, sku=sku, status=status, drift=drift, limit=limit, cursor=cursor
        )

    @get(
        "/{node_id:uuid}",
        summary="One node: state, MAAS binding, drift, GPU slots, lifecycle job",
        responses=errors(403, 404),
    )
    async def get_node(
        self, db: NamedDependency[AsyncSession], node_id: FromPath[uuid.UUID]
    ) -> NodeDetail:
        return await node_detail(db, node_id)

    async def _act(
        self, admin: AdminCall, operation: str, node_id: uuid.UUID, reason: str
    ) -> NodeActionView:
        result = await run_admin_operation(
            admin.temporal,
            admin.queue,
            operation,
            NodeActionInput(
                actor=actor(admin.principal, checked_reason(reason)), node_id=str(node_id)
            ),
            key=str(node_id),
            result_type=NodeActionResult,
            statuses=_ACTION_STATUSES,
        )
        return _action_view(result)

    @post(
        "/{node_id:uuid}/activate",
        status_code=200,
        summary="Return a quarantined node to service once proven healthy (audited)",
        responses=errors(400, 403, 404, 409, 413),
    )
    async def activate(
        self,
        data: JSONBody[NodeAction],
        admin: NamedDependency[AdminCall],
        node_id: FromPath[uuid.UUID],
    ) -> NodeActionView:
        """409 `node_not_proven_healthy` names the checks that failed and what was observed now
        (`maas_status`, `power_state`, `agent_seen_at`): the agent answering a check on its queue
        now, a GPU inventory that matches the slots, the node's MAAS site asked now for the
        machine (Deployed, power on), no open drift."""
        return await self._act(admin, NODE_ACTIVATE, node_id, data.reason)

    @post(
        "/{node_id:uuid}/retire",
        status_code=202,
        summary="Retire a node without removing it: draining, then retired (audited)",
        description="409 node_protected while the node is protected.",
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def retire(
        self,
        data: JSONBody[NodeAction],
        admin: NamedDependency[AdminCall],
        db: NamedDependency[AsyncSession],
        node_id: FromPath[uuid.UUID],
    ) -> NodeActionView:
        """202 with the node `draining` and its drain job: the drain waits until no allocation
        lives on the node, then retires it (GET the node for its progress)."""
        await refuse_if_protected(db, node_id, "retired")
        await db.close()  # never hold a database connection across a Temporal call
        return await self._act(admin, NODE_RETIRE, node_id, data.reason)

    @post(
        "/{node_id:uuid}/reactivate",
        status_code=200,
        summary="Reactivate a retired node (same identity) once proven healthy (audited)",
        responses=errors(400, 403, 404, 409, 413),
    )
    async def reactivate(
        self,
        data: JSONBody[NodeAction],
        admin: NamedDependency[AdminCall],
        node_id: FromPath[uuid.UUID],
    ) -> NodeActionView:
        """The same proof as activate, observed now (never a stored MAAS status or agent
        contact), and the agent's check must find no tenant residue: 409
        `node_not_proven_healthy` with `failed`, `maas_status`, `power_state`, `agent_seen_at`."""
        return await self._act(admin, NODE_REACTIVATE, node_id, data.reason)

    async def _protection(
        self,
        db: AsyncSession,
        admin: AdminCall,
        node_id: uuid.UUID,
        reason: str,
        *,
        protect: bool,
    ) -> NodeProtectionView:
        """Set or clear the flag under the node's row lock, audited in the same transaction."""
        reason = checked_reason(reason)
        async with db.begin():
            node = await db.scalar(select(Node).where(Node.id == node_id).with_for_update())
            if node is None or node.status == NodeStatus.DELETED:
                raise NotFound("node not found")
            prior = bool(node.protected)
            changed = prior != protect
            if changed:
                node.protected = protect
                node.protected_reason = reason if protect else None
            audit.record_by(
                db,
                admin.principal,
                action="node.protect" if protect else "node.unprotect",
                target_type="node",
                target_id=str(node_id),
                reason=reason,
                prior_state="protected" if prior else "unprotected",
                expected_state="protected" if protect else "unprotected",
                details={"changed": changed, "actor_role": admin.principal.role},
            )
            view = NodeProtectionView(
                node_id=node_id,
                protected=bool(node.protected),
                protected_reason=node.protected_reason,
                changed=changed,
            )
        return view

    @post(
        "/{node_id:uuid}/protect",
        status_code=200,
        summary="Protect a node: every destructive step refuses with node_protected (audited)",
        description="Body {reason}. While protected, decommission (every mode), retire and the "
        "admin force-release of its allocations answer 409 node_protected, and a running "
        "decommission's MAAS release, erase, power-off and delete fail with node_protected. "
        "Idempotent: protecting a protected node changes nothing (changed: false). 400 blank "
        "reason; 404 unknown or deleted node.",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def protect(
        self,
        data: JSONBody[NodeAction],
        admin: NamedDependency[AdminCall],
        db: NamedDependency[AsyncSession],
        node_id: FromPath[uuid.UUID],
    ) -> NodeProtectionView:
        return await self._protection(db, admin, node_id, data.reason, protect=True)

    @post(
        "/{node_id:uuid}/unprotect",
        status_code=200,
        summary="Clear a node's protection (audited)",
        description="Body {reason}. Idempotent: unprotecting an unprotected node changes "
        "nothing (changed: false). 400 blank reason; 404 unknown or deleted node.",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def unprotect(
        self,
        data: JSONBody[NodeAction],
        admin: NamedDependency[AdminCall],
        db: NamedDependency[AsyncSession],
        node_id: FromPath[uuid.UUID],
    ) -> NodeProtectionView:
        return await self._protection(db, admin, node_id, data.reason, protect=False)


async def refuse_if_protected(db: AsyncSession, node_id: uuid.UUID, what: str) -> None:
    """409 node_protected while the node's protection is set."""
    node = await db.get(Node, node_id)
    if node is not None and node.protected:
        raise Conflict(
            f"the node is protected ({node.protected_reason or 'no reason given'}); it cannot "
            f"be {what} until an operator unprotects it",
            code="node_protected",
            details={"protected_reason": node.protected_reason},
        )
