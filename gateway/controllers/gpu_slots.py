"""Admin view of a node's GPU slots, and returning a quarantined slot to service. A slot is
quarantined (status `disabled` with a reason) when its GPU failed the health check after a slice
VM released it, or when a slice provision failed and the host did not prove its cleanup
(`provision_cleanup_unconfirmed`: a half-built VM may still hold the GPU). Only an operator puts
it back, after fixing or rebooting the host, or finishing that cleanup."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import (
    GPU_SLOT_RETURN,
    GpuSlotReturnInput,
    GpuSlotState,
)
from core.timestamps import parse_iso
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import Principal, admin_guard
from gateway.errors import NotFound
from gateway.openapi import errors
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from schema.models import GpuSlot, Node

AnyRequest = Request[Any, Any, Any]


class GpuSlotView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    gpu_index: int
    numa_node: int
    pci_address: str
    status: str
    allocation_id: uuid.UUID | None
    quarantine_reason: str | None
    quarantined_at: dt.datetime | None


class GpuSlotList(msgspec.Struct, kw_only=True):
    items: list[GpuSlotView]


class ReturnToService(RequestBody):
    reason: Reason


def _view(slot: GpuSlot) -> GpuSlotView:
    return GpuSlotView(
        id=slot.id,
        gpu_index=slot.gpu_index,
        numa_node=slot.numa_node,
        pci_address=slot.pci_address,
        status=slot.status,
        allocation_id=slot.allocation_id,
        quarantine_reason=slot.quarantine_reason,
        quarantined_at=slot.quarantined_at,
    )


class AdminGpuSlotsController(Controller):
    path = "/api/v1/admin/nodes/{node_id:uuid}/gpu-slots"
    guards = [admin_guard]
    tags = ["admin: nodes"]

    @get(
        "/",
        summary="A node's GPU slots, quarantined ones with their reason",
        responses=errors(403, 404),
    )
    async def list_slots(
        self, db: NamedDependency[AsyncSession], node_id: FromPath[uuid.UUID]
    ) -> GpuSlotList:
        if await db.get(Node, node_id) is None:
            raise NotFound("node not found")
        slots = await db.scalars(
            select(GpuSlot).where(GpuSlot.node_id == node_id).order_by(GpuSlot.gpu_index)
        )
        return GpuSlotList(items=[_view(s) for s in slots])

    @post(
        "/{slot_id:uuid}/return-to-service",
        status_code=200,
        summary="Put a quarantined slot back into placement (audited)",
        responses=errors(400, 403, 404, 409, 413),
    )
    async def return_to_service(
        self,
        data: JSONBody[ReturnToService],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
        node_id: FromPath[uuid.UUID],
        slot_id: FromPath[uuid.UUID],
    ) -> GpuSlotView:
        # disabled → free by the worker (AdminOperationWorkflow), compare-and-set and audited:
        # 404 for another node's or no slot, 409 `slot_not_quarantined`.
        state = await run_admin_operation(
            runtime.temporal,
            runtime.settings.control_plane_task_queue,
            GPU_SLOT_RETURN,
            GpuSlotReturnInput(
                actor=actor(principal, data.reason), node_id=str(node_id), slot_id=str(slot_id)
            ),
            key=f"{node_id}-{slot_id}",
            result_type=GpuSlotState,
        )
        return GpuSlotView(
            id=uuid.UUID(state.id),
            gpu_index=state.gpu_index,
            numa_node=state.numa_node,
            pci_address=state.pci_address,
            status=state.status,
            allocation_id=uuid.UUID(state.allocation_id) if state.allocation_id else None,
            quarantine_reason=state.quarantine_reason,
            quarantined_at=parse_iso(state.quarantined_at),
        )
