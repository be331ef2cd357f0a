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
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import SlotStatus
from gateway import audit
from gateway.auth import Principal, admin_guard
from gateway.controllers.common import errors
from gateway.errors import Conflict, NotFound
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
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        node_id: FromPath[uuid.UUID],
        slot_id: FromPath[uuid.UUID],
    ) -> GpuSlotView:
        slot = await db.get(GpuSlot, slot_id)
        if slot is None or slot.node_id != node_id:
            raise NotFound("GPU slot not found")
        prior_reason = slot.quarantine_reason
        returned = await db.scalar(
            update(GpuSlot)
            .where(
                GpuSlot.id == slot_id,
                GpuSlot.status == SlotStatus.DISABLED,
                GpuSlot.quarantine_reason.is_not(None),
            )
            .values(
                status=SlotStatus.FREE,
                quarantine_reason=None,
                quarantined_at=None,
                updated_at=func.clock_timestamp(),
            )
            .returning(GpuSlot)
            .execution_options(populate_existing=True)
        )
        if returned is None:
            raise Conflict("this GPU slot is not quarantined", code="slot_not_quarantined")
        audit.record_by(
            db,
            principal,
            action="gpu_slot.return_to_service",
            target_type="gpu_slot",
            target_id=str(slot_id),
            reason=data.reason,
            prior_state=SlotStatus.DISABLED.value,
            expected_state=SlotStatus.FREE.value,
            details={"node_id": str(node_id), "quarantine_reason": prior_reason},
        )
        await db.commit()
        return _view(returned)
