"""Allocation activities: placement and every state transition, each one short transaction that
applies a compare-and-set on `allocations.status` together with its append-only event row.

They run as local activities of AllocationWorkflow (no extra task-queue round trip), so each must
be idempotent: a worker that crashes after the commit but before the workflow recorded the result
runs it again, and the second run must find the work done and answer the same.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any

import asyncpg
from sqlalchemy import Select, and_, delete, exists, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from activities import placement_sql
from activities.billing.usage import close_usage, open_usage
from activities.node_lifecycle import transition_node
from activities.node_task_log import queue_task, record_task_outcome
from activities.placement_sql import DEFAULT_SLICE_VLAN_POOL, PlacementRequest, SkuSizing
from contracts.allocation import (
    BALANCE_DEPLETED,
    NETWORK_POOL_EXHAUSTED,
    NODE_UNAVAILABLE,
    NOT_DETACHABLE,
    PROVISION_CLEANUP_UNCONFIRMED,
    REJECTION_TYPES,
    RELEASE_CLEANUP_UNCONFIRMED,
    SKU_UNAVAILABLE,
    DetachResult,
)
from contracts.allocation_activities import (
    ActivateInput,
    BeginProvisioningInput,
    BeginReleaseInput,
    DetachInput,
    FailProvisioningInput,
    FinishReleaseInput,
    PlaceInput,
    Placement,
    ProvisioningStart,
    ProvisionPlan,
    ReleasePlan,
    Reservation,
)
from contracts.billing_meter import BalanceState
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    GpuAssignment,
    HostProvisionInput,
)
from contracts.states import (
    ALLOCATION_TRANSITIONS,
    AllocationStatus,
    ClaimStatus,
    NodeStatus,
    NodeTaskStatus,
    SkuShape,
    SlotStatus,
)
from contracts.storage import AttachmentStatus
from contracts.terminal_session import LIVE_TERMINAL_STATUSES
from core.redaction import redact_optional
from schema.db import driver_connection, session_factory
from schema.models import (
    Allocation,
    AllocationEvent,
    AllocationResourceClaim,
    DomainEvent,
    GpuSlot,
    Node,
    ProjectSliceVlan,
    Sku,
    SshKey,
    StorageAttachment,
    TerminalSession,
)

log = logging.getLogger(__name__)
CLOCK = func.clock_timestamp()
MAX_MESSAGE = 500
# Who moves a node into quarantine after a failed provision (node.status_changed's actor).
NODE_ACTOR = "allocation"
# The allocation event a failed provision (or an admin detach after a failed release) records
# when its cleanup was not proven: such an allocation may still have a VM on its project's VLAN,
# so the VLAN stays with the project.
CLEANUP_UNCONFIRMED_EVENT = "cleanup_unconfirmed"
# The event of an admin detach: release_failed → released (docs/lifecycles/allocation.md).
DETACHED_EVENT = "detached"


class PlacementContention(Exception):
    """Every ranked candidate was locked by a concurrent placement: retry, do not reject."""


def _reject(type_: str, message: str) -> ApplicationError:
    """Non-retryable. A placement refusal the POST answers as it is (REJECTION_TYPES: 409
    sku_unavailable, 402 balance_depleted, …) is an ordinary outcome, not a fault: BENIGN, so the
    SDK logs it at debug level without a traceback, and `place` logs one info line instead."""
    category = (
        ApplicationErrorCategory.BENIGN
        if type_ in REJECTION_TYPES
        else ApplicationErrorCategory.UNSPECIFIED
    )
    return ApplicationError(message, type=type_, non_retryable=True, category=category)


def _truncate(message: str | None) -> str | None:
    """Free text bound for a record: bounded, and through the one sanitiser
    (docs/lifecycles/allocation.md#task-timeline)."""
    return redact_optional(message, limit=MAX_MESSAGE)


def username_for(allocation_id: str) -> str:
    return f"gpu-{allocation_id.replace('-', '')[:12]}"


class AllocationActivities:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        placement_deadline_seconds: float = 20,
        default_slice_vlan_pool: tuple[int, int] = DEFAULT_SLICE_VLAN_POOL,
    ) -> None:
        self._engine = engine  # placement's plain SQL (schema.db.driver_connection)
        self._sessions = session_factory(engine)  # the transitions, through the ORM
        self._placement_deadline = placement_deadline_seconds
        # The VLAN ids of a region without a slice_vlan_pools row.
        self._default_slice_vlan_pool = default_slice_vlan_pool

    # ------------------------------------------------------------------ placement

    @activity.defn(name="allocation.place")
    async def place(self, input: PlaceInput) -> Placement:
        """Reserve capacity and queue the allocation's host task, in one transaction: the
        allocation row is created `requested` (docs/lifecycles/allocation.md: reserved, not yet
        provisioning), so the reservation the POST answers with and the host work the workflow
        dispatches after allocation.begin_provisioning can never disagree. Its SQL is in
        placement_sql."""
        deadline = time.monotonic() + self._placement_deadline
        attempt = 0
        while True:
            attempt += 1
            try:
                async with driver_connection(self._engine) as pg:
                    return await self._place_once(pg, input)
            except PlacementContention:
                pass
            except asyncpg.IntegrityConstraintViolationError:
                # Lost a race on the exclusion constraint, or this allocation was already
                # placed by an earlier run of this activity (a crash before the workflow saw it).
                existing = await self._existing_placement(input)
                if existing is not None:
                    return existing
            except ApplicationError as rejected:
                if rejected.type in (SKU_UNAVAILABLE, NETWORK_POOL_EXHAUSTED, BALANCE_DEPLETED):
                    # An earlier run may have taken the last capacity for this very allocation
                    # (or placed it before the account was depleted).
                    existing = await self._existing_placement(input)
                    if existing is not None:
                        return existing
                if rejected.type in REJECTION_TYPES:
                    log.info(
                        "allocation %s rejected: %s: %s",
                        input.allocation_id, rejected.type, rejected.message,
                    )  # fmt: skip
                raise
            if time.monotonic() > deadline:
                raise ApplicationError(
                    "placement kept colliding with concurrent placements", type="contention"
                )
            await asyncio.sleep(min(0.005 * attempt, 0.05) * random.uniform(0.5, 1.5))

    async def _place_once(self, pg: asyncpg.Connection, input: PlaceInput) -> Placement:
        project_id = uuid.UUID(input.project_id)
        ssh_key_ids = [uuid.UUID(k) for k in input.ssh_key_ids]
        offer = await placement_sql.load_offer(
            pg, sku=input.sku, region=input.region, project_id=project_id, ssh_key_ids=ssh_key_ids
        )
        _check_offer(offer, input, requested_keys=len(set(ssh_key_ids)))
        assert offer.shape is not None
        baremetal = offer.shape == SkuShape.BAREMETAL
        request = PlacementRequest(
            allocation_id=uuid.UUID(input.allocation_id),
            project_id=project_id,
            idempotency_key=input.idempotency_key,
            sku=input.sku,
            region=input.region,
            shape=offer.shape,
            gpus=input.gpus,
            ssh_key_ids=ssh_key_ids,
            workflow_id=input.workflow_id,
            task_id=uuid.UUID(input.provision_task_id),
            task_kind=BAREMETAL_PROVISION_USER if baremetal else SLICE_VM_PROVISION,
            allocation_group_id=(
                uuid.UUID(input.allocation_group_id) if input.allocation_group_id else None
            ),
            same_node_forbidden=input.same_node_forbidden,
        )
        if baremetal:
            placed = await placement_sql.place_baremetal(pg, request)
        else:
            placed = await placement_sql.place_slice(
                pg, request, default_vlan_pool=self._default_slice_vlan_pool
            )
        if not placed.written:
            if not placed.funded:
                # The account was depleted between the offer's read and the reservation.
                raise _reject(BALANCE_DEPLETED, "the project's balance is depleted")
            if placed.vlan_pool_exhausted:
                raise _reject(
                    NETWORK_POOL_EXHAUSTED,
                    f"no slice network VLAN is free in {input.region}; "
                    "release slice allocations of other projects or widen the region's pool",
                )
            if placed.any_room or placed.vlan_contended:
                raise PlacementContention()  # rank again
            if baremetal:
                raise _reject(SKU_UNAVAILABLE, f"no {input.sku} node is free in {input.region}")
            raise _reject(
                SKU_UNAVAILABLE,
                f"no {input.sku} node in {input.region} has {input.gpus} free GPUs",
            )
        assert placed.node_id is not None
        assert placed.created_at is not None
        gpus = [GpuAssignment(s.pci_address, s.numa_node, s.gpu_index) for s in placed.slots]
        reservation = _reservation(input, placed.node_id, placed.created_at, offer.shape, gpus)
        plan = _provision_plan(
            input.provision_task_id,
            request.task_kind,
            reservation,
            offer.sizing,
            offer.ssh_public_keys,
            placed.vlan_id,
        )
        return Placement(reservation, plan, AllocationStatus.REQUESTED)

    async def _existing_placement(self, input: PlaceInput) -> Placement | None:
        """What an earlier run of this activity placed, or None. An allocation an older build
        left `requested` without its host task (it reserved and queued the task in two
        transactions) gets the task here; a placement's own task is already there."""
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            allocation = await session.get(Allocation, allocation_id)
            if allocation is None:
                return None
            kind = (
                SLICE_VM_PROVISION
                if allocation.shape == SkuShape.GPU_SLICE
                else BAREMETAL_PROVISION_USER
            )
            if allocation.status == AllocationStatus.REQUESTED:
                await queue_task(
                    session,
                    input.provision_task_id,
                    allocation_id,
                    allocation.node_id,
                    kind,
                    input.workflow_id,
                )
            sku = await session.get(Sku, (allocation.sku, allocation.region))
            slots = (
                await session.execute(
                    select(GpuSlot.pci_address, GpuSlot.numa_node, GpuSlot.gpu_index)
                    .join(AllocationResourceClaim, AllocationResourceClaim.slot_id == GpuSlot.id)
                    .where(AllocationResourceClaim.allocation_id == allocation_id)
                    .order_by(GpuSlot.gpu_index)
                )
            ).all()
            keys = (
                await session.scalars(
                    select(SshKey.public_key)
                    .where(SshKey.id.in_(allocation.ssh_key_ids))
                    .order_by(SshKey.created_at)
                )
            ).all()
            # The placement took it with the reservation, and the allocation being live keeps it.
            vlan_id = (
                await session.scalar(
                    select(ProjectSliceVlan.vlan_id).where(
                        ProjectSliceVlan.region == allocation.region,
                        ProjectSliceVlan.project_id == allocation.project_id,
                    )
                )
                if allocation.shape == SkuShape.GPU_SLICE
                else None
            )
        assert sku is not None
        assert allocation.node_id is not None
        reservation = Reservation(
            allocation_id=str(allocation.id),
            status=AllocationStatus.REQUESTED,
            node_id=str(allocation.node_id),
            shape=allocation.shape,
            sku=allocation.sku,
            region=allocation.region,
            gpu_count=allocation.gpu_count,
            gpus=[GpuAssignment(*row) for row in slots],
            created_at=allocation.created_at.isoformat(),
        )
        sizing = SkuSizing(sku.vcpus_per_gpu, sku.memory_mb_per_gpu, sku.image, sku.image_sha256)
        plan = _provision_plan(
            input.provision_task_id, kind, reservation, sizing, list(keys), vlan_id
        )
        return Placement(reservation, plan, allocation.status)

    @activity.defn(name="allocation.begin_provisioning")
    async def begin_provisioning(self, input: BeginProvisioningInput) -> ProvisioningStart:
        """`requested` → `provisioning` while the reserved node is still in service (`active`);
        otherwise `requested` → `failed` as node_unavailable: nothing ran on the host, so the
        queued host task fails with the allocation and its claims are freed at once. A rerun
        answers from the row."""
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            allocation = await session.scalar(
                select(Allocation).where(Allocation.id == allocation_id).with_for_update()
            )
            if allocation is None:
                raise _reject("allocation_missing", f"allocation {allocation_id} does not exist")
            if allocation.status == AllocationStatus.FAILED:
                return ProvisioningStart(
                    False, allocation.failure_reason, allocation.failure_message
                )
            if allocation.status != AllocationStatus.REQUESTED:
                return ProvisioningStart(True)  # a rerun: provisioning already started
            node_status = await session.scalar(
                select(Node.status).where(Node.id == allocation.node_id)
            )
            if node_status == NodeStatus.ACTIVE:
                await _transition(
                    session,
                    allocation_id,
                    AllocationStatus.PROVISIONING,
                    event="provisioning_started",
                    values={"provisioning_started_at": CLOCK},
                )
                return ProvisioningStart(True)
            message = f"node {allocation.node_id} is {node_status}, no longer in service"
            await record_task_outcome(
                session,
                uuid.UUID(input.task_id),
                NodeTaskStatus.FAILED,
                error_type=NODE_UNAVAILABLE,
                error_message=message,
            )
            await _transition(
                session,
                allocation_id,
                AllocationStatus.FAILED,
                event="failed",
                reason=NODE_UNAVAILABLE,
                details={"node_status": node_status},
                values={
                    "failed_at": CLOCK,
                    "failure_reason": NODE_UNAVAILABLE,
                    "failure_message": message,
                },
            )
            await _free_claims(session, allocation_id)
            await _return_slice_vlan(session, allocation)  # last, as in fail_provisioning
        return ProvisioningStart(False, NODE_UNAVAILABLE, message)

    @activity.defn(name="allocation.activate")
    async def activate(self, input: ActivateInput) -> None:
        result = input.result
        async with self._sessions() as session, session.begin():
            await record_task_outcome(
                session,
                uuid.UUID(input.task_id),
                NodeTaskStatus.COMPLETED,
                started_at=result.started_at,
                finished_at=result.finished_at,
                phases=result.phases,
                output={
                    "connect_host": result.connect_host,
                    "adopted_existing": result.adopted_existing,
                },
            )
            await _transition(
                session,
                uuid.UUID(input.allocation_id),
                AllocationStatus.ACTIVE,
                event="active",
                values={"active_at": CLOCK, "connect_host": result.connect_host or None},
            )
            await open_usage(session, uuid.UUID(input.allocation_id))

    @activity.defn(name="allocation.fail_provisioning")
    async def fail_provisioning(self, input: FailProvisioningInput) -> None:
        """`failed`, with the claims freed only when the host proved the cleanup after the failed
        provision; otherwise what the allocation held stays out of placement: its GPU slots
        (slice) or its node (bare metal) are quarantined as `provision_cleanup_unconfirmed`,
        and the node is flagged with a CRITICAL domain event, until an operator finishes the
        cleanup and returns them to service."""
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            prior = await session.scalar(
                select(Allocation.status).where(Allocation.id == allocation_id).with_for_update()
            )
            if prior == AllocationStatus.FAILED:
                return  # a retried activity: all of it was committed together
            await record_task_outcome(
                session,
                uuid.UUID(input.task_id),
                NodeTaskStatus.FAILED,
                phases=input.phases,
                error_type=input.reason,
                error_message=input.message,
            )
            allocation = await _transition(
                session,
                allocation_id,
                AllocationStatus.FAILED,
                event="failed",
                reason=input.reason,
                values={
                    "failed_at": CLOCK,
                    "failure_reason": input.reason,
                    "failure_message": _truncate(input.message),
                },
            )
            if input.cleanup_proven:
                await _quarantine_slots(
                    session, allocation_id, {g.pci_address: g.reason for g in input.unhealthy_gpus}
                )
            else:
                await _quarantine_unconfirmed_cleanup(session, allocation, input.cleanup_error)
            await _free_claims(session, allocation_id)
            # Last: it locks the project's VLAN row after the node rows _free_claims touched,
            # in the order placement takes them.
            await _return_slice_vlan(session, allocation)

    # ------------------------------------------------------------------ release

    @activity.defn(name="allocation.begin_release")
    async def begin_release(self, input: BeginReleaseInput) -> ReleasePlan:
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            if input.transition:
                allocation = await _transition(
                    session,
                    allocation_id,
                    AllocationStatus.RELEASING,
                    event="releasing",
                    actor=input.actor,
                    reason=input.reason or None,
                    values={
                        "releasing_at": CLOCK,
                        "release_requested_by": input.actor,
                        "release_attempts": Allocation.release_attempts + 1,
                    },
                )
            else:
                found = await session.get(Allocation, allocation_id)
                assert found is not None
                allocation = found
            kind = (
                SLICE_VM_RELEASE
                if allocation.shape == SkuShape.GPU_SLICE
                else BAREMETAL_DEPROVISION_USER
            )
            await queue_task(
                session, input.task_id, allocation.id, allocation.node_id, kind, input.workflow_id
            )
            plan = ReleasePlan(
                task_id=input.task_id, task_kind=kind, username=username_for(input.allocation_id)
            )
            if input.transition:
                counts = (await session.execute(_release_prerequisites(allocation_id))).one()
                plan.live_terminal_sessions, plan.storage_attachments = counts
        return plan

    @activity.defn(name="allocation.finish_release")
    async def finish_release(self, input: FinishReleaseInput) -> None:
        allocation_id = uuid.UUID(input.allocation_id)
        result = input.result
        succeeded = input.error_type is None and result is not None
        async with self._sessions() as session, session.begin():
            if not input.task_recorded:
                await record_task_outcome(
                    session,
                    uuid.UUID(input.task_id),
                    NodeTaskStatus.COMPLETED if succeeded else NodeTaskStatus.FAILED,
                    started_at=result.started_at if result else None,
                    finished_at=result.finished_at if result else None,
                    phases=result.phases if result else input.phases,
                    output=(
                        {
                            "released": result.released,
                            "hard_stopped": result.hard_stopped,
                            "wiped": result.wiped,
                            "leases_released": result.leases_released,
                        }
                        if result
                        else {}
                    ),
                    error_type=input.error_type,
                    error_message=input.error_message,
                )
            if input.fenced:
                # Issue 37, fence first: the host release succeeded, so the tenant has no compute
                # left (VM stopped, user locked and its processes ended) and billing stops now,
                # before storage is detached; the transition comes after the detach.
                await close_usage(session, allocation_id)
                return
            if not input.transition:
                return
            # Billing stops here whatever the outcome: a failed release is not charged.
            await close_usage(session, allocation_id)
            if succeeded:
                assert result is not None
                allocation = await _transition(
                    session,
                    allocation_id,
                    AllocationStatus.RELEASED,
                    event="released",
                    details={"hard_stopped": result.hard_stopped},
                    values={"released_at": CLOCK, "hard_stopped": result.hard_stopped},
                )
                await _quarantine_slots(
                    session,
                    allocation_id,
                    {g.pci_address: g.reason for g in result.unhealthy_gpus},
                )
                await _free_claims(session, allocation_id)
                await _return_slice_vlan(session, allocation)  # last, as in fail_provisioning
            else:
                await _transition(
                    session,
                    allocation_id,
                    AllocationStatus.RELEASE_FAILED,
                    event="release_failed",
                    reason=input.error_type,
                    details={"message": _truncate(input.error_message)},
                    values={
                        "release_failed_at": CLOCK,
                        "failure_reason": input.error_type,
                        "failure_message": _truncate(input.error_message),
                    },
                )

    @activity.defn(name="allocation.detach")
    async def detach(self, input: DetachInput) -> DetachResult:
        """release_failed → released by an admin (the `detach` update): what the allocation held
        is quarantined as `release_cleanup_unconfirmed` (its GPU slots, or its node: active or
        offline → quarantined), then its claims are freed; nothing claims the host was cleaned.
        Billing stopped at release_failed and stays stopped (close_usage closes only an open
        window). The project's slice VLAN stays with it, as after any unproven cleanup. A rerun
        answers from the row."""
        allocation_id = uuid.UUID(input.allocation_id)
        async with self._sessions() as session, session.begin():
            current = await session.scalar(
                select(Allocation).where(Allocation.id == allocation_id).with_for_update()
            )
            if current is None:
                raise _reject("allocation_missing", f"allocation {allocation_id} does not exist")
            if current.detached_at is not None:
                return _detach_result(current)  # a retried activity: all of it was committed
            if current.status != AllocationStatus.RELEASE_FAILED:
                raise _reject(NOT_DETACHABLE, f"allocation {allocation_id} is {current.status}")
            cleanup_error = ": ".join(
                p for p in (current.failure_reason, current.failure_message) if p
            )
            allocation = await _transition(
                session,
                allocation_id,
                AllocationStatus.RELEASED,
                event=DETACHED_EVENT,
                actor=input.actor,
                reason=input.reason,
                details={"node_id": str(current.node_id), "shape": current.shape},
                values={"released_at": CLOCK, "detached_at": CLOCK},
            )
            await close_usage(session, allocation_id)
            await _quarantine_unconfirmed_cleanup(
                session, allocation, cleanup_error, reason=RELEASE_CLEANUP_UNCONFIRMED
            )
            await _free_claims(session, allocation_id)
            return _detach_result(allocation)


# ---------------------------------------------------------------------- shared steps


def _check_offer(offer: placement_sql.Offer, input: PlaceInput, *, requested_keys: int) -> None:
    """Rejections are non-retryable: the POST answers them as they are."""
    if offer.billing_state in (None, BalanceState.DEPLETED):
        # docs/lifecycles/balance.md: no positive balance (no account yet is a balance of 0), no
        # allocation. The placement statement checks it again, atomically with the reservation.
        raise _reject(BALANCE_DEPLETED, "the project's balance is depleted")
    if offer.shape is None or not offer.active:
        raise _reject(SKU_UNAVAILABLE, f"SKU {input.sku!r} is not offered in {input.region!r}")
    if input.gpus not in offer.allowed_gpu_counts:
        allowed = ", ".join(str(c) for c in sorted(offer.allowed_gpu_counts))
        raise _reject(
            SKU_UNAVAILABLE, f"SKU {input.sku!r} is offered with {allowed} GPUs, not {input.gpus}"
        )
    if len(offer.ssh_public_keys) != requested_keys:
        raise _reject("ssh_key_not_found", "one or more ssh_key_ids do not exist in this project")


def _provision_plan(
    task_id: str,
    kind: str,
    reservation: Reservation,
    sku: SkuSizing,
    ssh_public_keys: list[str],
    vlan_id: int | None,
) -> ProvisionPlan:
    is_slice = reservation.shape == SkuShape.GPU_SLICE
    spec = HostProvisionInput(
        task_id=task_id,
        allocation_id=reservation.allocation_id,
        node_id=reservation.node_id,
        shape=reservation.shape,
        username=username_for(reservation.allocation_id),
        ssh_public_keys=ssh_public_keys,
        gpus=list(reservation.gpus),
        vcpus=sku.vcpus_per_gpu * reservation.gpu_count if is_slice else 0,
        memory_mb=sku.memory_mb_per_gpu * reservation.gpu_count if is_slice else 0,
        image=sku.image if is_slice else "",
        image_sha256=sku.image_sha256 if is_slice else "",
        vlan_id=vlan_id if is_slice else None,
    )
    return ProvisionPlan(task_id=task_id, task_kind=kind, spec=spec)


def _reservation(
    input: PlaceInput,
    node_id: uuid.UUID,
    created_at: dt.datetime,
    shape: str,
    gpus: list[GpuAssignment],
) -> Reservation:
    return Reservation(
        allocation_id=input.allocation_id,
        status=AllocationStatus.REQUESTED,
        node_id=str(node_id),
        shape=shape,
        sku=input.sku,
        region=input.region,
        gpu_count=input.gpus,
        gpus=gpus,
        created_at=created_at.isoformat(),
    )


async def _record(
    session: AsyncSession,
    allocation_id: uuid.UUID,
    event: str,
    from_status: str | None = None,
    to_status: str | None = None,
    *,
    actor: str | None = None,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    await session.execute(
        insert(AllocationEvent).values(
            allocation_id=allocation_id,
            event=event,
            from_status=from_status,
            to_status=to_status,
            actor=actor,
            reason=redact_optional(reason, limit=MAX_MESSAGE),
            details=details or {},
        )
    )


async def _transition(
    session: AsyncSession,
    allocation_id: uuid.UUID,
    to: AllocationStatus,
    *,
    event: str,
    actor: str | None = None,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
) -> Allocation:
    """Compare-and-set to `to` from any state the transition table allows, plus its event row.
    Already in `to` means a retried activity: nothing is written and the row is returned."""
    sources = [s for s, targets in ALLOCATION_TRANSITIONS.items() if to in targets]
    # One statement: lock the row, read its prior status and set the new one only when the
    # transition table allows it (the compare-and-set), returning both.
    prior = (
        select(Allocation.id, Allocation.status)
        .where(Allocation.id == allocation_id)
        .with_for_update()
        .subquery("prior")
    )
    row = (
        await session.execute(
            update(Allocation)
            .where(Allocation.id == prior.c.id, prior.c.status.in_(sources))
            .values(status=to, updated_at=CLOCK, **(values or {}))
            .returning(Allocation, prior.c.status)
            .execution_options(populate_existing=True)
        )
    ).first()
    if row is None:
        current = await session.get(Allocation, allocation_id)
        if current is None:
            raise _reject("allocation_missing", f"allocation {allocation_id} does not exist")
        if current.status == to:
            return current  # a retried activity: the transition already happened
        raise _reject(
            "invalid_transition", f"allocation {allocation_id} is {current.status}, not {to}-able"
        )
    updated: Allocation = row[0]
    prior_status: str = row[1]
    await _record(
        session, allocation_id, event, prior_status, to, actor=actor, reason=reason, details=details
    )
    return updated


async def _quarantine_slots(
    session: AsyncSession, allocation_id: uuid.UUID, reasons: Mapping[str, str]
) -> None:
    """Quarantine slots the allocation holds, by PCI address: each goes `disabled` with its
    reason (an operator returns it to service: gateway/controllers/gpu_slots.py); slots not named
    are left to the caller (_free_claims frees them). The one way a slot leaves placement: a GPU
    that failed its health check after release, or a failed provision whose cleanup the host
    did not prove."""
    for pci_address, reason in reasons.items():
        slot_id = await session.scalar(
            update(GpuSlot)
            .where(GpuSlot.allocation_id == allocation_id, GpuSlot.pci_address == pci_address)
            .values(
                status=SlotStatus.DISABLED,
                allocation_id=None,
                quarantine_reason=_truncate(reason),
                quarantined_at=CLOCK,
                updated_at=CLOCK,
            )
            .returning(GpuSlot.id)
        )
        if slot_id is not None:
            await _record(
                session,
                allocation_id,
                "gpu_quarantined",
                reason=_truncate(reason),
                details={"pci_address": pci_address, "slot_id": str(slot_id)},
            )


async def _quarantine_unconfirmed_cleanup(
    session: AsyncSession,
    allocation: Allocation,
    cleanup_error: str,
    *,
    reason: str = PROVISION_CLEANUP_UNCONFIRMED,
) -> None:
    """A failed provision whose cleanup the host did not prove (it failed, reported no proof,
    or could not run: the node was unreachable), or a release_failed allocation an admin
    detached (`reason` says which), may have left a VM or a user holding what the
    allocation claimed. A slice's GPU slots are quarantined; a bare-metal allocation's claim is
    the node itself, so the node is (active or offline → quarantined; an operator brings it
    back through a decommission, e.g. soft_reset; a node already out of service stays as it
    is). Either way the allocation records it and the node gets a CRITICAL `node.{reason}`
    domain event."""
    details: dict[str, Any] = {
        "node_id": str(allocation.node_id),
        "shape": allocation.shape,
        "cleanup_error": _truncate(cleanup_error) or "",
    }
    if allocation.shape == SkuShape.GPU_SLICE:
        held = (
            await session.scalars(
                select(GpuSlot.pci_address)
                .where(GpuSlot.allocation_id == allocation.id)
                .order_by(GpuSlot.gpu_index)
            )
        ).all()
        await _quarantine_slots(session, allocation.id, dict.fromkeys(held, reason))
        details["pci_addresses"] = list(held)
    else:
        moved = await transition_node(
            session,
            allocation.node_id,
            [NodeStatus.ACTIVE, NodeStatus.OFFLINE],
            NodeStatus.QUARANTINED,
            actor=NODE_ACTOR,
            reason=f"{reason}: allocation {allocation.id}",
        )
        details["node_status"] = moved.current.value if moved.current else None
    await _record(session, allocation.id, CLEANUP_UNCONFIRMED_EVENT, reason=reason, details=details)
    await session.execute(
        insert(DomainEvent).values(
            type=f"node.{reason}",
            subject_type="node",
            subject_id=str(allocation.node_id),
            payload={"severity": "CRITICAL", "allocation_id": str(allocation.id), **details},
        )
    )


def _detach_result(allocation: Allocation) -> DetachResult:
    assert allocation.detached_at is not None
    return DetachResult(
        allocation_id=str(allocation.id),
        status=allocation.status,
        detached_at=allocation.detached_at.isoformat(),
    )


def _release_prerequisites(allocation_id: uuid.UUID) -> Select[int, int]:
    """The allocation's live terminal sessions and its storage attachments not yet detached:
    what its release ends first. One round trip, on the tables' allocation indexes."""
    sessions = select(func.count()).where(
        TerminalSession.allocation_id == allocation_id,
        TerminalSession.status.in_([s.value for s in LIVE_TERMINAL_STATUSES]),
    )
    attachments = select(func.count()).where(
        StorageAttachment.allocation_id == allocation_id,
        StorageAttachment.status != AttachmentStatus.DETACHED,
    )
    return select(sessions.scalar_subquery(), attachments.scalar_subquery())


async def _free_claims(session: AsyncSession, allocation_id: uuid.UUID) -> None:
    await session.execute(
        update(AllocationResourceClaim)
        .where(
            AllocationResourceClaim.allocation_id == allocation_id,
            AllocationResourceClaim.status == ClaimStatus.HELD,
        )
        .values(status=ClaimStatus.RELEASED, released_at=CLOCK)
    )
    await session.execute(
        update(GpuSlot)
        .where(GpuSlot.allocation_id == allocation_id)
        .values(status=SlotStatus.FREE, allocation_id=None, updated_at=CLOCK)
    )


async def _return_slice_vlan(session: AsyncSession, allocation: Allocation) -> None:
    """Give the project's slice VLAN in the allocation's region back to the pool when nothing of
    the project there can still be on it: no slice allocation of the project in the region that
    is not released, and none that ended (failed, or released by an admin detach) without its
    cleanup proven (its VM may live on). Safe against a concurrent placement of the project
    (activities/placement_sql.py, _SLICE_VLAN): the row is locked before anything is counted,
    and a placement that read it has committed by the time the lock is granted; one that comes
    later waits, then finds the row gone and takes a new vid."""
    if allocation.shape != SkuShape.GPU_SLICE:
        return
    mine = and_(
        ProjectSliceVlan.region == allocation.region,
        ProjectSliceVlan.project_id == allocation.project_id,
    )
    vlan_id = await session.scalar(select(ProjectSliceVlan.vlan_id).where(mine).with_for_update())
    if vlan_id is None:
        return  # placed before VLANs were assigned, or already returned (a retried activity)
    # A statement of its own, after the lock: its snapshot includes every placement that held
    # the row before us.
    still_on_it = await session.scalar(
        select(
            exists().where(
                Allocation.project_id == allocation.project_id,
                Allocation.region == allocation.region,
                Allocation.shape == SkuShape.GPU_SLICE,
                or_(
                    Allocation.status.not_in([AllocationStatus.RELEASED, AllocationStatus.FAILED]),
                    # Ended without proof of cleanup: failed, or released by an admin detach.
                    exists().where(
                        AllocationEvent.allocation_id == Allocation.id,
                        AllocationEvent.event == CLEANUP_UNCONFIRMED_EVENT,
                    ),
                ),
            )
        )
    )
    if still_on_it:
        return
    await session.execute(delete(ProjectSliceVlan).where(mine))
    await session.execute(
        insert(DomainEvent).values(
            type="project.slice_vlan_released",
            subject_type="project",
            subject_id=str(allocation.project_id),
            payload={
                "region": allocation.region,
                "vlan_id": vlan_id,
                "allocation_id": str(allocation.id),
            },
        )
    )
