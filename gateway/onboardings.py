"""MAAS onboarding use cases behind the admin controller (seed 003 §4.1, §4.2, §4.15).

Submitting writes the `node_onboardings` rows (status `pending`) and commits, then starts
`MaasNodeOnboardWorkflow` (single) or `MaasNodeBatchOnboardWorkflow` (batch; it starts the
children itself), then writes the audit entry (the audit log is append-only, so it is written
once the submission stands). If Temporal does not take the workflow, the rows are deleted again,
so a 503 leaves nothing behind. After that the workflow owns the rows; the gateway only reads
them.

Operator actions are the workflow's `operator_action` update. Its validator refuses an action
the job state does not allow (409 `action_not_allowed`); the update id is derived from the
request, so a repeated identical request gets the first answer instead of a second action.

Input errors are 422 with machine-readable field errors, in the shape of the 400 validation
errors plus a code: `details.errors = [{"key": "nodes[3].hostname", "source": "body",
"code": "invalid_hostname", "message": ...}]`; the top-level code is the errors' code when they
share one, else `validation_failed`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import sqlalchemy.exc
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from contracts.onboarding import (
    BATCH_WORKFLOW_NAME,
    LIVE_JOB_STATUSES,
    WORKFLOW_NAME,
    BatchInput,
    BatchNode,
    JobStatus,
    OnboardInput,
    OperatorAction,
    Stage,
    batch_workflow_id,
    onboarding_workflow_id,
)
from contracts.states import NodeStatus
from core import search_attributes
from core.config import Settings
from gateway import audit
from gateway.allocations import validate_idempotency_key
from gateway.auth import Principal
from gateway.errors import (
    Conflict,
    FieldError,
    NotFound,
    Unprocessable,
    unknown_query_value,
    unprocessable,
)
from gateway.identity import constraint_name
from gateway.lifecycle_jobs import (
    LifecycleJob,
    checked_reason,
    recent_events,
    run_operator_action,
)
from gateway.onboarding_schemas import (
    HOSTNAME,
    HOSTNAME_RULE,
    MAX_BATCH_NODES,
    BatchCreated,
    BatchOnboarding,
    OnboardingBatchCreate,
    OnboardingCreate,
    OnboardingCreated,
    OnboardingDetail,
    OnboardingList,
    OnboardingView,
    OperatorActionAnswer,
    canonical_ip,
)
from gateway.pagination import newest_first_page
from gateway.temporal import TemporalOps
from schema.lifecycle_tables import ONBOARDING_TABLES
from schema.models import (
    MaasSite,
    MaasSitePolicy,
    MaasSiteProfile,
    Node,
    NodeOnboarding,
    NodeOnboardingEvent,
    Sku,
)

log = logging.getLogger("gateway.onboardings")
T = TypeVar("T")

# Fixed forever: ids derived from idempotency keys must not change between releases.
ONBOARDING_ID_NAMESPACE = uuid.UUID("0b7e6a52-3f1d-4c8e-9e57-6d2a41c0f9b3")
_LIVE = [s.value for s in LIVE_JOB_STATUSES]
_FIRST_STAGE = Stage.LOAD_SITE_CONFIG.value

# --- field errors ----------------------------------------------------------------------------


def check_hostname(value: str, key: str, errors: list[FieldError]) -> str:
    if not HOSTNAME.match(value):
        errors.append(FieldError(key, "invalid_hostname", f"{key} must be {HOSTNAME_RULE}"))
    return value


def check_ip(value: str, key: str, errors: list[FieldError]) -> str:
    canonical = canonical_ip(value)
    if canonical is None:
        errors.append(FieldError(key, "invalid_ipmi_ip", f"{key} must be an IPv4 or IPv6 address"))
        return value
    return canonical


@dataclass(frozen=True)
class Target:
    site: MaasSite
    policy: MaasSitePolicy


async def check_target(
    db: AsyncSession,
    site_id: uuid.UUID,
    profile_id: uuid.UUID,
    sku_id: str,
    errors: list[FieldError],
) -> Target | None:
    """The site (active), its profile and the SKU in the site's region; a field error for each
    that is not so."""
    site = await db.get(MaasSite, site_id)
    policy = await db.get(MaasSitePolicy, site_id)
    if site is None or policy is None:
        errors.append(FieldError("site_id", "unknown_site", "no MAAS site has this id"))
        return None
    if site.status != "active":
        errors.append(
            FieldError("site_id", "site_disabled", "this site is disabled: it takes no onboardings")
        )
    profile = await db.get(MaasSiteProfile, profile_id)
    if profile is None or profile.site_id != site_id:
        errors.append(FieldError("profile_id", "unknown_profile", "this site has no such profile"))
    sku = await db.get(Sku, (sku_id, site.region_code))
    if sku is None or not sku.active:
        errors.append(
            FieldError(
                "sku_id",
                "unknown_sku",
                f"no active SKU with this name in the site's region {site.region_code!r}",
            )
        )
    return Target(site, policy)


# --- conflicts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Live:
    hostname: str
    code: str  # onboarding_in_progress | node_exists
    ref: uuid.UUID  # the live onboarding, or the node

    def as_dict(self) -> dict[str, str]:
        key = "onboarding_id" if self.code == "onboarding_in_progress" else "node_id"
        return {"hostname": self.hostname, "code": self.code, key: str(self.ref)}


async def live_conflicts(
    db: AsyncSession, site_id: uuid.UUID, hostnames: Sequence[str]
) -> list[Live]:
    """Live onboardings of these hostnames at this site, then live nodes that have them."""
    onboardings = await db.execute(
        select(NodeOnboarding.hostname, NodeOnboarding.onboarding_id).where(
            NodeOnboarding.site_id == site_id,
            NodeOnboarding.hostname.in_(hostnames),
            NodeOnboarding.status.in_(_LIVE),
        )
    )
    found = [Live(h, "onboarding_in_progress", i) for h, i in onboardings]
    busy = {c.hostname for c in found}
    nodes = await db.execute(
        select(Node.hostname, Node.id).where(
            Node.hostname.in_(hostnames), Node.status != NodeStatus.DELETED.value
        )
    )
    found += [Live(h, "node_exists", i) for h, i in nodes if h not in busy]
    order = {h: n for n, h in enumerate(hostnames)}
    return sorted(found, key=lambda c: order.get(c.hostname, 0))


def conflict_error(conflicts: Sequence[Live], *, batch: bool) -> Conflict:
    if not batch:
        (first,) = conflicts[:1]
        if first.code == "onboarding_in_progress":
            message = f"{first.hostname} is already being onboarded at this site ({first.ref})"
        else:
            message = f"a node named {first.hostname} already exists ({first.ref})"
        return Conflict(message, code=first.code, details=first.as_dict())
    codes = {c.code for c in conflicts}
    code = next(iter(codes)) if len(codes) == 1 else "batch_conflict"
    hostnames = [c.hostname for c in conflicts]
    return Conflict(
        f"{len(hostnames)} hostname(s) are already onboarding or exist as nodes; nothing was "
        "submitted",
        code=code,
        details={"hostnames": hostnames, "conflicts": [c.as_dict() for c in conflicts]},
    )


# --- idempotency -------------------------------------------------------------------------------


def _derived(*parts: str) -> uuid.UUID:
    return uuid.uuid5(ONBOARDING_ID_NAMESPACE, ":".join(parts))


async def _lock_key(db: AsyncSession, key: str) -> None:
    """Requests with the same key run one at a time (until this transaction ends)."""
    await db.execute(
        select(func.pg_advisory_xact_lock(func.hashtextextended(f"onboarding-idem:{key}", 0)))
    )


def _key_reused() -> Unprocessable:
    return Unprocessable(
        "this X-Idempotency-Key was already used with a different request body",
        code="idempotency_key_reused",
    )


async def _rows_for_key(db: AsyncSession, key: str) -> list[NodeOnboarding]:
    return list(
        await db.scalars(select(NodeOnboarding).where(NodeOnboarding.idempotency_key == key))
    )


# --- starting workflows and undoing a submission ---------------------------------------------


async def _start(
    temporal: TemporalOps,
    workflow: str,
    arg: Any,
    *,
    workflow_id: str,
    settings: Settings,
    attributes: Sequence[SearchAttributePair[str]],
) -> None:
    async def start(client: Client) -> None:
        await client.start_workflow(
            workflow,
            arg,
            id=workflow_id,
            task_queue=settings.control_plane_task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            search_attributes=TypedSearchAttributes(list(attributes)),
            rpc_timeout=temporal.rpc_timeout,
        )

    try:
        await temporal.update(start)
    except WorkflowAlreadyStartedError:
        # Our own id (fresh, or derived from the idempotency key): an earlier attempt started it
        # before Temporal stopped answering. It is the workflow this request asks for.
        log.info("workflow %s was already started; answering as started", workflow_id)


async def _undo(db: AsyncSession, ids: Sequence[uuid.UUID]) -> bool:
    """Delete the submission's rows, unless the workflow evidently runs (a row
    moved on or has events: the start did happen before Temporal stopped answering). True when
    deleted."""
    await db.rollback()
    statuses = await db.scalars(
        select(NodeOnboarding.status).where(NodeOnboarding.onboarding_id.in_(ids)).with_for_update()
    )
    moved = any(s != JobStatus.PENDING.value for s in statuses)
    has_events = await db.scalar(select(exists().where(NodeOnboardingEvent.onboarding_id.in_(ids))))
    if moved or has_events:
        await db.rollback()
        return False
    await db.execute(delete(NodeOnboarding).where(NodeOnboarding.onboarding_id.in_(ids)))
    await db.commit()
    return True


async def _start_or_undo(
    db: AsyncSession,
    temporal: TemporalOps,
    workflow: str,
    arg: Any,
    *,
    workflow_id: str,
    settings: Settings,
    attributes: Sequence[SearchAttributePair[str]],
    ids: Sequence[uuid.UUID],
) -> None:
    try:
        await _start(
            temporal,
            workflow,
            arg,
            workflow_id=workflow_id,
            settings=settings,
            attributes=attributes,
        )
    except Exception:
        try:
            undone = await _undo(db, ids)
        except Exception as undo_err:  # the database went too: the rows stay pending, say so
            log.warning(
                "could not undo onboarding rows %s after a failed start (%s)",
                [str(i) for i in ids],
                type(undo_err).__name__,
            )
            raise
        if undone:
            raise
        log.warning("workflow %s answered late but runs; keeping its rows", workflow_id)


def _row(
    *,
    onboarding_id: uuid.UUID,
    node_id: uuid.UUID,
    batch_id: uuid.UUID | None,
    site_id: uuid.UUID,
    profile_id: uuid.UUID,
    sku_id: str,
    hostname: str,
    ipmi_ip: str,
    principal: Principal,
    key: str | None,
) -> NodeOnboarding:
    return NodeOnboarding(
        onboarding_id=onboarding_id,
        batch_id=batch_id,
        node_id=node_id,
        site_id=site_id,
        profile_id=profile_id,
        sku_id=sku_id,
        hostname=hostname,
        ipmi_ip=ipmi_ip,
        requested_by=principal.name,
        current_stage=_FIRST_STAGE,
        current_attempt=0,
        status=JobStatus.PENDING.value,
        workflow_id=onboarding_workflow_id(str(onboarding_id)),
        idempotency_key=key,
    )


async def _insert(db: AsyncSession, rows: Sequence[NodeOnboarding], site_id: uuid.UUID) -> None:
    """Flush the rows; a live onboarding of one of their hostnames that appeared since the check
    (the partial unique index) is the same 409 as one found by the check."""
    db.add_all(rows)
    try:
        await db.flush()
    except sqlalchemy.exc.IntegrityError as err:
        if constraint_name(err) != "node_onboardings_live_hostname":
            raise
        await db.rollback()
        hostnames = [r.hostname for r in rows]
        conflicts = await live_conflicts(db, site_id, hostnames)
        if not conflicts:  # the other submission has already ended: a retry may succeed
            raise Conflict(
                "another onboarding of this hostname was submitted at the same time; retry",
                code="onboarding_in_progress",
                details={"hostnames": hostnames},
            ) from err
        raise conflict_error(conflicts, batch=rows[0].batch_id is not None) from err


# --- create ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome(Generic[T]):
    body: T
    replayed: bool


async def create(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    principal: Principal,
    body: OnboardingCreate,
    idempotency_key: str | None,
) -> Outcome[OnboardingCreated]:
    key = validate_idempotency_key(idempotency_key)
    errors: list[FieldError] = []
    hostname = check_hostname(body.hostname, "hostname", errors)
    ipmi_ip = check_ip(body.ipmi_ip, "ipmi_ip", errors)
    target = await check_target(db, body.site_id, body.profile_id, body.sku_id, errors)
    if errors or target is None:
        raise unprocessable(errors)

    if key is not None:
        await _lock_key(db, key)
        previous = await _rows_for_key(db, key)
        if previous:
            row = previous[0]
            same = (
                len(previous) == 1
                and row.batch_id is None
                and (row.site_id, row.profile_id, row.sku_id, row.hostname, str(row.ipmi_ip))
                == (body.site_id, body.profile_id, body.sku_id, hostname, ipmi_ip)
            )
            assert row.node_id is not None
            answer = _created(row.onboarding_id, row.node_id)
            await db.rollback()  # ends the key's lock (and expires the rows)
            if not same:
                raise _key_reused()
            return Outcome(answer, replayed=True)

    conflicts = await live_conflicts(db, body.site_id, [hostname])
    if conflicts:
        raise conflict_error(conflicts, batch=False)

    onboarding_id = _derived("single", key) if key is not None else uuid.uuid4()
    node_id = _derived("node", str(onboarding_id)) if key is not None else uuid.uuid4()
    workflow_id = onboarding_workflow_id(str(onboarding_id))
    row = _row(
        onboarding_id=onboarding_id,
        node_id=node_id,
        batch_id=None,
        site_id=body.site_id,
        profile_id=body.profile_id,
        sku_id=body.sku_id,
        hostname=hostname,
        ipmi_ip=ipmi_ip,
        principal=principal,
        key=key,
    )
    await _insert(db, [row], body.site_id)
    await db.commit()  # also ends the key's lock: the row now answers a retry

    await _start_or_undo(
        db,
        temporal,
        WORKFLOW_NAME,
        OnboardInput(
            onboarding_id=str(onboarding_id),
            site_id=str(body.site_id),
            profile_id=str(body.profile_id),
            sku_id=body.sku_id,
            hostname=hostname,
            ipmi_ip=ipmi_ip,
            node_id=str(node_id),
            requested_by=principal.name,
        ),
        workflow_id=workflow_id,
        settings=settings,
        attributes=[
            SearchAttributePair(search_attributes.SITE_ID, str(body.site_id)),
            SearchAttributePair(search_attributes.HOSTNAME, hostname),
            SearchAttributePair(search_attributes.LIFECYCLE_STATUS, JobStatus.PENDING.value),
            SearchAttributePair(search_attributes.CURRENT_STAGE, _FIRST_STAGE),
            SearchAttributePair(search_attributes.NODE_ID, str(node_id)),
        ],
        ids=[onboarding_id],
    )
    audit.record_by(
        db,
        principal,
        action="onboarding.create",
        target_type="onboarding",
        target_id=str(onboarding_id),
        expected_state=JobStatus.PENDING.value,
        workflow_ids=[workflow_id],
        details={
            "site_id": str(body.site_id),
            "profile_id": str(body.profile_id),
            "sku_id": body.sku_id,
            "hostname": hostname,
            "ipmi_ip": ipmi_ip,
            "node_id": str(node_id),
        },
    )
    await db.commit()
    return Outcome(_created(onboarding_id, node_id), replayed=False)


def _created(onboarding_id: uuid.UUID, node_id: uuid.UUID) -> OnboardingCreated:
    # The submission's answer, also on a replay; GET …/{id} shows where the job is now.
    return OnboardingCreated(
        onboarding_id=onboarding_id, status=JobStatus.PENDING.value, node_id=node_id
    )


def _check_batch(body: OnboardingBatchCreate, errors: list[FieldError]) -> list[tuple[str, str]]:
    if not body.nodes:
        errors.append(FieldError("nodes", "empty_batch", "nodes must list 1 to 500 nodes"))
    if len(body.nodes) > MAX_BATCH_NODES:
        errors.append(
            FieldError("nodes", "batch_too_large", f"at most {MAX_BATCH_NODES} nodes per batch")
        )
        return []
    nodes: list[tuple[str, str]] = []
    hostnames: dict[str, int] = {}
    ips: dict[str, int] = {}
    for index, node in enumerate(body.nodes):
        prefix = f"nodes[{index}]"
        hostname = check_hostname(node.hostname, f"{prefix}.hostname", errors)
        ip = check_ip(node.ipmi_ip, f"{prefix}.ipmi_ip", errors)
        if hostname in hostnames:
            errors.append(
                FieldError(
                    f"{prefix}.hostname",
                    "duplicate_hostname",
                    f"{prefix}.hostname repeats nodes[{hostnames[hostname]}].hostname",
                )
            )
        else:
            hostnames[hostname] = index
        if ip in ips:
            errors.append(
                FieldError(
                    f"{prefix}.ipmi_ip",
                    "duplicate_ipmi_ip",
                    f"{prefix}.ipmi_ip repeats nodes[{ips[ip]}].ipmi_ip",
                )
            )
        else:
            ips[ip] = index
        nodes.append((hostname, ip))
    return nodes


async def create_batch(
    db: AsyncSession,
    temporal: TemporalOps,
    settings: Settings,
    principal: Principal,
    body: OnboardingBatchCreate,
    idempotency_key: str | None,
) -> Outcome[BatchCreated]:
    key = validate_idempotency_key(idempotency_key)
    errors: list[FieldError] = []
    nodes = _check_batch(body, errors)
    target = await check_target(db, body.site_id, body.profile_id, body.sku_id, errors)
    if errors or target is None:
        raise unprocessable(errors)
    hostnames = [h for h, _ in nodes]

    if key is not None:
        await _lock_key(db, key)
        previous = await _rows_for_key(db, key)
        if previous:
            batch_ids = {r.batch_id for r in previous}
            same = (
                len(batch_ids) == 1
                and None not in batch_ids
                and {(r.hostname, str(r.ipmi_ip)) for r in previous} == set(nodes)
                and len(previous) == len(nodes)
                and all(
                    (r.site_id, r.profile_id, r.sku_id)
                    == (body.site_id, body.profile_id, body.sku_id)
                    for r in previous
                )
            )
            replay = None
            if same:
                by_host = {r.hostname: r for r in previous}
                batch_id = previous[0].batch_id
                assert batch_id is not None
                replay = BatchCreated(
                    batch_id=batch_id, onboardings=[_batch_item(by_host[h]) for h in hostnames]
                )
            await db.rollback()  # ends the key's lock (and expires the rows)
            if replay is None:
                raise _key_reused()
            return Outcome(replay, replayed=True)

    conflicts = await live_conflicts(db, body.site_id, hostnames)
    if conflicts:
        raise conflict_error(conflicts, batch=True)

    batch_id = _derived("batch", key) if key is not None else uuid.uuid4()
    rows: list[NodeOnboarding] = []
    for hostname, ip in nodes:
        if key is not None:
            onboarding_id = _derived("batch", key, hostname)
            node_id = _derived("node", str(onboarding_id))
        else:
            onboarding_id, node_id = uuid.uuid4(), uuid.uuid4()
        rows.append(
            _row(
                onboarding_id=onboarding_id,
                node_id=node_id,
                batch_id=batch_id,
                site_id=body.site_id,
                profile_id=body.profile_id,
                sku_id=body.sku_id,
                hostname=hostname,
                ipmi_ip=ip,
                principal=principal,
                key=key,
            )
        )
    await _insert(db, rows, body.site_id)
    workflow_id = batch_workflow_id(str(batch_id))
    max_parallel = target.policy.batch_max_parallel
    await db.commit()

    await _start_or_undo(
        db,
        temporal,
        BATCH_WORKFLOW_NAME,
        BatchInput(
            batch_id=str(batch_id),
            site_id=str(body.site_id),
            profile_id=str(body.profile_id),
            sku_id=body.sku_id,
            nodes=[
                BatchNode(
                    hostname=r.hostname,
                    ipmi_ip=str(r.ipmi_ip),
                    onboarding_id=str(r.onboarding_id),
                    node_id=str(r.node_id),
                )
                for r in rows
            ],
            max_parallel=max_parallel,
            requested_by=principal.name,
        ),
        workflow_id=workflow_id,
        settings=settings,
        attributes=[
            SearchAttributePair(search_attributes.SITE_ID, str(body.site_id)),
            SearchAttributePair(search_attributes.BATCH_ID, str(batch_id)),
            SearchAttributePair(search_attributes.LIFECYCLE_STATUS, JobStatus.RUNNING.value),
        ],
        ids=[r.onboarding_id for r in rows],
    )
    audit.record_by(
        db,
        principal,
        action="onboarding.batch_create",
        target_type="onboarding_batch",
        target_id=str(batch_id),
        expected_state=JobStatus.RUNNING.value,
        workflow_ids=[workflow_id],
        details={
            "site_id": str(body.site_id),
            "profile_id": str(body.profile_id),
            "sku_id": body.sku_id,
            "nodes": len(rows),
            "hostnames": hostnames,
            "max_parallel": max_parallel,
        },
    )
    await db.commit()
    return Outcome(
        BatchCreated(batch_id=batch_id, onboardings=[_batch_item(r) for r in rows]),
        replayed=False,
    )


def _batch_item(row: NodeOnboarding) -> BatchOnboarding:
    assert row.node_id is not None
    return BatchOnboarding(
        hostname=row.hostname, onboarding_id=row.onboarding_id, node_id=row.node_id
    )


# --- reads -------------------------------------------------------------------------------------


def view(row: NodeOnboarding) -> OnboardingView:
    return OnboardingView(**_fields(row))


def _fields(row: NodeOnboarding) -> dict[str, Any]:
    return {
        "onboarding_id": row.onboarding_id,
        "batch_id": row.batch_id,
        "site_id": row.site_id,
        "profile_id": row.profile_id,
        "sku_id": row.sku_id,
        "hostname": row.hostname,
        "ipmi_ip": str(row.ipmi_ip),  # asyncpg hands INET back as an ipaddress object
        "pxe_mac": row.pxe_mac,
        "node_id": row.node_id,
        "maas_system_id": row.maas_system_id,
        "requested_by": row.requested_by,
        "status": row.status,
        "current_stage": row.current_stage,
        "current_attempt": row.current_attempt,
        "failure_class": row.failure_class,
        "error_code": row.error_code,
        "error_message": row.error_message,
        "error_details": dict(row.error_details or {}),
        "recommended_action": row.recommended_action,
        "last_maas_status": row.last_maas_status,
        "last_maas_power_state": row.last_maas_power_state,
        "last_maas_ips": [str(ip) for ip in row.last_maas_ips or []],
        "boss_disk_id": row.boss_disk_id,
        "cloud_init_version": row.cloud_init_version,
        "deploy_attempts": row.deploy_attempts,
        "workflow_id": row.workflow_id,
        "workflow_run_id": row.workflow_run_id,
        "idempotency_key": row.idempotency_key,
        "requested_at": row.requested_at,
        "started_at": row.started_at,
        "completed_at": row.completed_at,
        "updated_at": row.updated_at,
    }


async def load(db: AsyncSession, onboarding_id: uuid.UUID) -> NodeOnboarding:
    row = await db.get(NodeOnboarding, onboarding_id)
    if row is None:
        raise NotFound("onboarding not found")
    return row


async def detail(db: AsyncSession, onboarding_id: uuid.UUID) -> OnboardingDetail:
    row = await load(db, onboarding_id)
    return OnboardingDetail(
        **_fields(row), events=await recent_events(db, ONBOARDING_TABLES, onboarding_id)
    )


def parse_status(status: str | None) -> str | None:
    allowed = [s.value for s in JobStatus]
    if status is None or status in allowed:
        return status
    raise unknown_query_value("status", allowed)


async def list_rows(
    db: AsyncSession,
    *,
    batch_id: uuid.UUID | None,
    status: str | None,
    site_id: uuid.UUID | None,
    hostname: str | None,
    limit: int,
    cursor: str | None,
) -> OnboardingList:
    status = parse_status(status)
    filters = []
    if batch_id is not None:
        filters.append(NodeOnboarding.batch_id == batch_id)
    if status is not None:
        filters.append(NodeOnboarding.status == status)
    if site_id is not None:
        filters.append(NodeOnboarding.site_id == site_id)
    if hostname is not None:
        filters.append(NodeOnboarding.hostname == hostname.strip().lower())
    rows, next_cursor = await newest_first_page(
        db,
        select(NodeOnboarding).where(*filters),
        created=NodeOnboarding.requested_at,
        row_id=NodeOnboarding.onboarding_id,
        limit=limit,
        cursor=cursor,
    )
    answer = OnboardingList(items=[view(r) for r in rows], next_cursor=next_cursor)
    if batch_id is not None:
        counts: dict[str, int] = dict.fromkeys((s.value for s in JobStatus), 0)
        grouped = await db.execute(
            select(NodeOnboarding.status, func.count())
            .where(NodeOnboarding.batch_id == batch_id)
            .group_by(NodeOnboarding.status)
        )
        for state, count in grouped:
            counts[state] = int(count)
        answer.summary = counts
        answer.total = sum(counts.values())
    return answer


# --- operator actions --------------------------------------------------------------------------


async def operator_action(
    db: AsyncSession,
    temporal: TemporalOps,
    principal: Principal,
    onboarding_id: uuid.UUID,
    action: OperatorAction,
    reason: str,
    idempotency_key: str | None,
) -> OperatorActionAnswer:
    key = validate_idempotency_key(idempotency_key)
    reason = checked_reason(reason)
    row = await load(db, onboarding_id)
    # A batch node the batch has not started yet has no workflow to act on.
    waiting_for_batch = row.batch_id is not None and row.status == JobStatus.PENDING.value
    job = LifecycleJob(
        kind="onboarding",
        job_id=onboarding_id,
        workflow_id=row.workflow_id,
        status=row.status,
        stage=row.current_stage,
        version=row.updated_at.isoformat() if row.updated_at else str(row.current_attempt),
        audit_action_prefix="onboarding",
        audit_target_type="onboarding",
        closed_code="onboarding_closed",
        not_started_code="onboarding_not_started" if waiting_for_batch else None,
    )
    await db.close()  # never hold a database connection across a Temporal call
    result = await run_operator_action(
        db, temporal, principal, job, action.value, reason, idempotency_key=key
    )
    return OperatorActionAnswer(
        onboarding_id=onboarding_id,
        action=result.action,
        accepted=result.accepted,
        prior_status=result.prior_status,
        prior_stage=result.prior_stage,
        expected_status=result.expected_status,
        message=result.message,
    )
