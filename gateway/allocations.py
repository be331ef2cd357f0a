"""Allocation use cases behind the tenant and admin controllers.

Creation is update-with-start on `allocation-{id}`: the workflow's first activity places and
reserves, and the `reserve` update hands the reservation (or a typed rejection) back to the HTTP
call. Release is the `request_release` update. The gateway reads the `allocations` read model and
never writes it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import asyncpg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import (
    BALANCE_DEPLETED,
    DETACH_UPDATE,
    IDEMPOTENCY_KEY_REUSED,
    NETWORK_POOL_EXHAUSTED,
    NOT_DETACHABLE,
    NOT_RELEASABLE,
    REJECTED,
    RELEASE_UPDATE,
    RESERVE_UPDATE,
    SKU_UNAVAILABLE,
    SSH_KEY_NOT_FOUND,
    STATUS_AT_START,
    WORKFLOW_NAME,
    AllocationInput,
    AllocationPolicy,
    AllocationResult,
    DetachRequest,
    DetachResult,
    ReleaseAccepted,
    ReleaseRequest,
    allocation_workflow_id,
)
from contracts.allocation_activities import Reservation
from contracts.states import AllocationStatus, ReleaseActor, SkuShape
from core import search_attributes
from core.build_id import build_ids_at_start
from core.config import Settings
from core.timestamps import parse_iso
from gateway.errors import (
    ApiError,
    Conflict,
    InvalidRequest,
    NotFound,
    Unprocessable,
)
from gateway.pagination import newest_first_page
from gateway.schemas import (
    AllocationCreate,
    AllocationCreated,
    AllocationDetail,
    AllocationList,
    AllocationSummary,
    DetachResponse,
    ReleaseResponse,
)
from gateway.temporal import TemporalOps
from schema.db import driver_connection
from schema.models import Allocation, Node

T = TypeVar("T")

# Fixed forever: allocation ids derived from idempotency keys must not change between releases.
ALLOCATION_ID_NAMESPACE = uuid.UUID("6f3c1f0e-5b7a-4d0c-9a61-2f8e9d4b7c15")
IDEMPOTENCY_HEADER = "X-Idempotency-Key"
MAX_IDEMPOTENCY_KEY_CHARS = 200

_REJECTIONS: dict[str, tuple[int, str]] = {
    SKU_UNAVAILABLE: (409, "no capacity for this SKU in this region right now"),
    SSH_KEY_NOT_FOUND: (422, "an SSH key in the request does not belong to this project"),
    BALANCE_DEPLETED: (402, "the project's balance is depleted; add credit to allocate"),
    NETWORK_POOL_EXHAUSTED: (409, "no slice network VLAN is free in this region right now"),
    IDEMPOTENCY_KEY_REUSED: (
        422,
        "this X-Idempotency-Key was already used with a different request body",
    ),
}


# --- pure helpers ---


def validate_idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY_CHARS or not all(
        "\x20" <= ch <= "\x7e" for ch in value
    ):
        raise InvalidRequest(
            f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII "
            "characters",
            details={"header": IDEMPOTENCY_HEADER},
        )
    return value


def allocation_id_for(project_id: uuid.UUID, idempotency_key: str | None) -> uuid.UUID:
    if idempotency_key is None:
        return uuid.uuid4()
    return uuid.uuid5(ALLOCATION_ID_NAMESPACE, f"{project_id}:{idempotency_key}")


def unique_ids(ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    return list(dict.fromkeys(ids))


def request_fingerprint(body: AllocationCreate) -> str:
    """sha256 of the canonical JSON of the validated body (sorted keys; key ids sorted, since
    their order means nothing)."""
    canonical = {
        "gpus": body.gpus,
        "region": body.region,
        "sku": body.sku,
        "ssh_key_ids": sorted(str(k) for k in unique_ids(body.ssh_key_ids)),
    }
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()


def refuse_unowned_keys(ssh_key_ids: Sequence[uuid.UUID], owned: set[uuid.UUID]) -> None:
    """422 ssh_key_not_found naming each requested key the project does not own."""
    missing = [str(k) for k in ssh_key_ids if k not in owned]
    if missing:
        raise Unprocessable(
            "an SSH key in the request does not belong to this project",
            code=SSH_KEY_NOT_FOUND,
            details={"ssh_key_ids": missing},
        )


def policy_from(settings: Settings) -> AllocationPolicy:
    return AllocationPolicy(
        node_schedule_to_start_seconds=settings.node_schedule_to_start_seconds,
        host_provision_timeout_seconds=settings.host_provision_timeout_seconds,
        host_heartbeat_timeout_seconds=settings.host_heartbeat_timeout_seconds,
        release_max_attempts=settings.release_max_attempts,
        release_retry_initial_seconds=settings.release_retry_initial_seconds,
        lease_conflict_max_attempts=settings.lease_conflict_max_attempts,
    )


def rejection(error_type: str | None, message: str | None = None) -> ApiError:
    if error_type in _REJECTIONS:
        status, default = _REJECTIONS[error_type]
        return ApiError(message or default, code=error_type, status_code=status)
    return ApiError(
        "the allocation workflow refused the request unexpectedly",
        code="workflow_error",
        status_code=502,
        details={"type": error_type or "unknown"},
    )


def created_from_reservation(reservation: Reservation) -> AllocationCreated:
    return AllocationCreated(
        allocation_id=uuid.UUID(reservation.allocation_id),
        status=reservation.status or AllocationStatus.REQUESTED.value,
        node_id=uuid.UUID(reservation.node_id),
        shape=reservation.shape,
        sku=reservation.sku,
        region=reservation.region,
        gpu_count=reservation.gpu_count,
        created_at=parse_iso(reservation.created_at),
    )


def created_from_row(row: KeyedAllocation) -> AllocationCreated:
    """The same answer the reservation gave (status `requested`): a retry with the same key gets
    the same answer; GET /allocations/{id} shows where the allocation is now."""
    return AllocationCreated(
        allocation_id=row.id,
        status=AllocationStatus.REQUESTED.value,
        node_id=row.node_id,
        shape=row.shape,
        sku=row.sku,
        region=row.region,
        gpu_count=row.gpu_count,
        created_at=row.created_at,
    )


def summary(row: Allocation) -> AllocationSummary:
    return AllocationSummary(
        allocation_id=row.id,
        project_id=row.project_id,
        status=row.status,
        sku=row.sku,
        region=row.region,
        shape=row.shape,
        gpu_count=row.gpu_count,
        node_id=row.node_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        allocation_group_id=row.allocation_group_id,
    )


def detail(row: Allocation) -> AllocationDetail:
    return AllocationDetail(
        allocation_id=row.id,
        project_id=row.project_id,
        status=row.status,
        sku=row.sku,
        region=row.region,
        shape=row.shape,
        gpu_count=row.gpu_count,
        node_id=row.node_id,
        ssh_key_ids=list(row.ssh_key_ids or []),
        idempotency_key=row.idempotency_key,
        workflow_id=row.workflow_id,
        failure_reason=row.failure_reason,
        failure_message=row.failure_message,
        connect_host=row.connect_host,
        hard_stopped=row.hard_stopped,
        release_requested_by=row.release_requested_by,
        release_attempts=row.release_attempts,
        created_at=row.created_at,
        provisioning_started_at=row.provisioning_started_at,
        active_at=row.active_at,
        releasing_at=row.releasing_at,
        released_at=row.released_at,
        release_failed_at=row.release_failed_at,
        failed_at=row.failed_at,
        detached_at=row.detached_at,
        updated_at=row.updated_at,
        allocation_group_id=row.allocation_group_id,
    )


def _same_request(row: KeyedAllocation, body: AllocationCreate) -> bool:
    return (
        row.sku == body.sku
        and row.region == body.region
        and row.gpu_count == body.gpus
        and set(row.ssh_key_ids or []) == set(body.ssh_key_ids)
    )


# --- reads ---


async def get_row(
    db: AsyncSession, allocation_id: uuid.UUID, project_id: uuid.UUID | None
) -> Allocation:
    """The allocation, scoped to a project for tenants: another project's id is a 404 exactly
    like an id that does not exist."""
    query = select(Allocation).where(Allocation.id == allocation_id)
    if project_id is not None:
        query = query.where(Allocation.project_id == project_id)
    row = await db.scalar(query)
    if row is None:
        raise NotFound("allocation not found")
    return row


def parse_status(
    status: str | None, statuses: type[StrEnum] = AllocationStatus, noun: str = "allocation"
) -> str | None:
    """The `status` filter of a list, one of `statuses` (a 400 naming them otherwise)."""
    allowed = [s.value for s in statuses]
    if status is not None and status not in allowed:
        raise InvalidRequest(
            f"unknown {noun} status", details={"parameter": "status", "allowed": allowed}
        )
    return status


async def list_rows(
    db: AsyncSession,
    *,
    project_id: uuid.UUID | None,
    status: str | None,
    limit: int,
    cursor: str | None,
    node_id: uuid.UUID | None = None,
) -> AllocationList:
    query = select(Allocation)
    if project_id is not None:
        query = query.where(Allocation.project_id == project_id)
    if node_id is not None:
        query = query.where(Allocation.node_id == node_id)
    if status is not None:
        query = query.where(Allocation.status == parse_status(status))
    rows, next_cursor = await newest_first_page(
        db, query, created=Allocation.created_at, row_id=Allocation.id, limit=limit, cursor=cursor
    )
    return AllocationList(items=[summary(r) for r in rows], next_cursor=next_cursor)


# --- create ---


@dataclass(frozen=True)
class KeyedAllocation:
    """What a retry with the same idempotency key is compared with and answered from."""

    id: uuid.UUID
    node_id: uuid.UUID
    shape: str
    sku: str
    region: str
    gpu_count: int
    ssh_key_ids: list[uuid.UUID]
    created_at: dt.datetime


# Everything a POST needs from the database before Temporal is asked, in one round trip: which
# of the requested SSH keys the project owns, and the allocation an earlier request with the same
# idempotency key created. Its id is derived from the project and the key (allocation_id_for),
# so it is found by primary key; $3 is NULL without a key.
_BEFORE_CREATE = """
SELECT ARRAY(SELECT k.id FROM ssh_keys k WHERE k.project_id = $1 AND k.id = ANY($2::uuid[])),
       a.id, a.node_id, a.shape, a.sku, a.region, a.gpu_count, a.ssh_key_ids, a.created_at
FROM (SELECT 1) AS one
LEFT JOIN allocations a ON a.id = $3 AND a.project_id = $1
"""


@dataclass(frozen=True)
class CreateOutcome:
    allocation: AllocationCreated
    replayed: bool


async def _look_up(
    pg: asyncpg.Connection,
    project_id: uuid.UUID,
    ssh_key_ids: Sequence[uuid.UUID],
    keyed_allocation_id: uuid.UUID | None,
) -> tuple[set[uuid.UUID], KeyedAllocation | None]:
    """The requested SSH keys the project owns, and the keyed allocation if it exists."""
    record = await pg.fetchrow(_BEFORE_CREATE, project_id, list(ssh_key_ids), keyed_allocation_id)
    assert record is not None  # one row always: the LEFT JOIN's
    owned, earlier = set(record[0]), tuple(record)[1:]
    return owned, (KeyedAllocation(*earlier) if earlier[0] is not None else None)


def _replay(earlier: KeyedAllocation | None, body: AllocationCreate) -> CreateOutcome | None:
    """The answer an earlier request with this key got, if it created its allocation; a
    different body under the same key is refused."""
    if earlier is None:
        return None
    if not _same_request(earlier, body):
        raise rejection(IDEMPOTENCY_KEY_REUSED)
    return CreateOutcome(created_from_row(earlier), replayed=True)


async def create(
    engine: AsyncEngine,
    temporal: TemporalOps,
    settings: Settings,
    *,
    project_id: uuid.UUID,
    body: AllocationCreate,
    idempotency_key: str | None,
) -> CreateOutcome:
    key = validate_idempotency_key(idempotency_key)
    ssh_key_ids = unique_ids(body.ssh_key_ids)
    allocation_id = allocation_id_for(project_id, key)
    fingerprint = request_fingerprint(body)
    owned: set[uuid.UUID] = set()
    earlier: KeyedAllocation | None = None
    if ssh_key_ids or key is not None:
        # Plain SQL on a pooled connection (the path every POST takes), returned before the
        # Temporal call: a connection is never held across one.
        async with driver_connection(engine) as pg:
            owned, earlier = await _look_up(
                pg, project_id, ssh_key_ids, allocation_id if key is not None else None
            )
    refuse_unowned_keys(ssh_key_ids, owned)
    replay = _replay(earlier, body)
    if replay is not None:
        return replay

    workflow_id = allocation_workflow_id(str(allocation_id))
    workflow_input = AllocationInput(
        allocation_id=str(allocation_id),
        project_id=str(project_id),
        sku=body.sku,
        gpus=body.gpus,
        region=body.region,
        ssh_key_ids=[str(k) for k in ssh_key_ids],
        idempotency_key=key,
        request_fingerprint=fingerprint,
        policy=policy_from(settings),
    )

    # Known before placement, so set at start: the workflow then upserts only what changes
    # (nothing before the POST is answered; see AllocationWorkflow._set_status), and Temporal
    # has no BuildIds to record at its first workflow task (core.build_id).
    attributes = TypedSearchAttributes(
        [
            SearchAttributePair(search_attributes.ALLOCATION_STATUS, STATUS_AT_START),
            SearchAttributePair(search_attributes.PROJECT_ID, str(project_id)),
            SearchAttributePair(search_attributes.SKU, body.sku),
            build_ids_at_start(settings.build_id),
        ]
    )
    try:
        reservation = await update_with_start(
            temporal,
            lambda: WithStartWorkflowOperation(
                WORKFLOW_NAME,
                workflow_input,
                id=workflow_id,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                task_queue=settings.control_plane_task_queue,
                result_type=AllocationResult,
                search_attributes=attributes,
            ),
            RESERVE_UPDATE,
            fingerprint,
            result_type=Reservation,
            accepted_as=("allocation", allocation_id),
        )
    except WorkflowAlreadyStartedError:
        # The workflow for this key has already closed: answer what it answered.
        return await _answer_closed(engine, temporal, allocation_id, project_id, body)
    return CreateOutcome(created_from_reservation(reservation), replayed=False)


async def update_with_start(
    temporal: TemporalOps,
    start: Callable[[], WithStartWorkflowOperation[Any, Any]],
    update: str,
    arg: Any,
    *,
    result_type: type[T],
    accepted_as: tuple[str, uuid.UUID],
) -> T:
    """TemporalOps.update_with_start for an allocation or a group: the workflow's typed refusal
    is `rejection()`. A closed workflow under that id raises WorkflowAlreadyStartedError: the
    caller answers from its record."""
    try:
        return await temporal.update_with_start(
            start, update, arg, result_type=result_type, accepted_as=accepted_as
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError):
            raise rejection(cause.type, cause.message) from None
        raise


async def _answer_closed(
    engine: AsyncEngine,
    temporal: TemporalOps,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID,
    body: AllocationCreate,
) -> CreateOutcome:
    async with driver_connection(engine) as pg:
        _, earlier = await _look_up(pg, project_id, [], allocation_id)
    replay = _replay(earlier, body)
    if replay is not None:
        return replay
    workflow_id = allocation_workflow_id(str(allocation_id))

    outcome = await temporal.read(lambda client: _result(client, workflow_id, temporal))
    if outcome.status == REJECTED:
        raise rejection(outcome.reason)
    raise ApiError(
        "the allocation for this idempotency key has ended",
        code="allocation_closed",
        status_code=409,
        details={"allocation_id": str(allocation_id), "status": outcome.status},
    )


def _handle(client: Client, workflow_id: str) -> WorkflowHandle[Any, AllocationResult]:
    return client.get_workflow_handle(workflow_id, result_type=AllocationResult)


async def _result(client: Client, workflow_id: str, temporal: TemporalOps) -> AllocationResult:
    """The result of a closed allocation workflow."""
    outcome: AllocationResult = await _handle(client, workflow_id).result(
        follow_runs=False, rpc_timeout=temporal.read_timeout
    )
    return outcome


# --- release ---


async def release(
    db: AsyncSession,
    temporal: TemporalOps,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID | None,
    request: ReleaseRequest,
) -> tuple[ReleaseResponse, str, str]:
    """Ask the workflow to release. Returns the answer, the status the read model showed before
    and the workflow id (for audit)."""
    row = await get_row(db, allocation_id, project_id)
    prior, workflow_id = row.status, row.workflow_id
    await db.close()
    accepted = await update_running(
        temporal,
        workflow_id,
        RELEASE_UPDATE,
        request,
        result_type=ReleaseAccepted,
        refusals={NOT_RELEASABLE: lambda _: _not_releasable(prior)},
    )
    if accepted is None:
        # The workflow has completed: released is released (idempotent); anything else is not
        # releasable.
        try:
            outcome = await temporal.read(lambda client: _result(client, workflow_id, temporal))
        except Exception as closed_err:
            if isinstance(closed_err, ApiError):
                raise
            raise _not_releasable(prior) from None
        if outcome.status != AllocationStatus.RELEASED:
            raise _not_releasable(outcome.status)
        released = AllocationStatus.RELEASED.value
        accepted = ReleaseAccepted(str(allocation_id), released, released, False)
    return (
        ReleaseResponse(
            allocation_id=allocation_id,
            status=accepted.expected_status,
            prior_status=accepted.prior_status,
            expected_status=accepted.expected_status,
            release_pending=accepted.release_pending,
        ),
        prior,
        workflow_id,
    )


def _not_releasable(status: str) -> Conflict:
    return Conflict(
        "this allocation cannot be released", code=NOT_RELEASABLE, details={"status": status}
    )


async def update_running(
    temporal: TemporalOps,
    workflow_id: str,
    update: str,
    arg: Any,
    *,
    result_type: type[T],
    refusals: dict[str, Callable[[ApplicationError], ApiError]],
) -> T | None:
    """`update` with `arg` to the running workflow `workflow_id`, through TemporalOps.update;
    None when that workflow has closed (the caller answers from what it left). A refusal whose
    type `refusals` names is the error it builds from it; any other failure propagates."""

    async def call(client: Client) -> T:
        answer: T = await client.get_workflow_handle(workflow_id).execute_update(
            update, arg, result_type=result_type, rpc_timeout=temporal.rpc_timeout
        )
        return answer

    try:
        return await temporal.update(call)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.type in refusals:
            raise refusals[cause.type](cause) from None
        raise
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        return None


def user_release() -> ReleaseRequest:
    return ReleaseRequest(actor=ReleaseActor.USER.value)


def admin_force_release(reason: str) -> ReleaseRequest:
    return ReleaseRequest(actor=ReleaseActor.ADMIN.value, reason=reason, force=True)


# --- detach (admin) ---


async def detach(
    db: AsyncSession, temporal: TemporalOps, *, allocation_id: uuid.UUID, reason: str
) -> tuple[DetachResponse, str, str]:
    """Ask the workflow to detach a release_failed allocation (the `detach` update), and answer
    from the read model the workflow's activity wrote: a repeated detach, even after the
    workflow closed, gets the same answer. Returns the answer, the status the read model showed
    before and the workflow id (for audit)."""
    row = await get_row(db, allocation_id, None)
    prior, workflow_id = row.status, row.workflow_id
    if row.detached_at is None:
        await db.close()  # no connection held across the Temporal call
        # A completed workflow (None) answers only a detach it did (below).
        await update_running(
            temporal,
            workflow_id,
            DETACH_UPDATE,
            DetachRequest(reason=reason, actor=ReleaseActor.ADMIN.value),
            result_type=DetachResult,
            refusals={NOT_DETACHABLE: lambda cause: _not_detachable(prior, cause.message)},
        )
        row = await get_row(db, allocation_id, None)
    if row.detached_at is None:
        raise _not_detachable(row.status)
    node_status = await db.scalar(select(Node.status).where(Node.id == row.node_id))
    response = DetachResponse(
        allocation_id=row.id,
        status=row.status,
        detached_at=row.detached_at,
        node_id=row.node_id,
        quarantined="node" if row.shape == SkuShape.BAREMETAL else "gpu_slots",
        node_status=node_status or "",
    )
    return response, prior, workflow_id


def _not_detachable(status: str, message: str | None = None) -> Conflict:
    return Conflict(
        message or f"allocation is {status}; only a release_failed allocation can be detached",
        code=NOT_DETACHABLE,
        details={"status": status},
    )
