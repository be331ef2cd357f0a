"""MAAS onboarding use cases behind the admin controller (docs/lifecycles/onboarding.md).

Submitting is the worker's ONBOARDING_SUBMIT operation (contracts/lifecycle_submissions.py): it
writes the `node_onboardings` rows (status `pending`) and starts `MaasNodeOnboardWorkflow`
(single) or `MaasNodeBatchOnboardWorkflow` (batch; it starts the children itself), together;
then the gateway writes the audit entry (the audit log is append-only, so it is written once the
submission stands). If Temporal does not take the workflow, the worker withdraws the rows again,
so a 503 leaves nothing behind. The gateway never writes the rows; it reads them.

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

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import ONBOARDING_SUBMIT
from contracts.lifecycle_submissions import (
    HostnameConflict,
    OnboardingRecorded,
    OnboardingRow,
    OnboardingSubmission,
)
from contracts.onboarding import (
    LIVE_JOB_STATUSES,
    JobStatus,
    OperatorAction,
    Stage,
    batch_workflow_id,
    onboarding_workflow_id,
    profile_value,
)
from core.config import Settings
from gateway import audit
from gateway.admin_operations import per_request, run_admin_operation
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
from gateway.lifecycle_jobs import (
    LifecycleJob,
    checked_reason,
    recent_events,
    run_operator_action,
)
from gateway.maas_sites import usable_profile
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
    NodeOnboarding,
    Sku,
)
from schema.onboarding_conflicts import ONBOARDING_IN_PROGRESS

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
    profile: MaasSiteProfile | None  # None: unknown (a field error says so)


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
    profile, problem = await usable_profile(db, site_id, profile_id)
    if problem is not None:
        errors.append(problem)
    sku = await db.get(Sku, (sku_id, site.region_code))
    if sku is None or not sku.active:
        errors.append(
            FieldError(
                "sku_id",
                "unknown_sku",
                f"no active SKU with this name in the site's region {site.region_code!r}",
            )
        )
    return Target(site, policy, profile)


# --- conflicts ---------------------------------------------------------------------------------


def _conflict_dict(conflict: HostnameConflict) -> dict[str, str]:
    key = "onboarding_id" if conflict.code == ONBOARDING_IN_PROGRESS else "node_id"
    return {"hostname": conflict.hostname, "code": conflict.code, key: conflict.ref}


def conflict_error(conflicts: Sequence[HostnameConflict], *, batch: bool) -> Conflict:
    if not conflicts:  # the other submission has already ended: a retry may succeed
        return Conflict(
            "another onboarding of this hostname was submitted at the same time; retry",
            code=ONBOARDING_IN_PROGRESS,
        )
    if not batch:
        first = conflicts[0]
        if first.code == ONBOARDING_IN_PROGRESS:
            message = f"{first.hostname} is already being onboarded at this site ({first.ref})"
        else:
            message = f"a node named {first.hostname} already exists ({first.ref})"
        return Conflict(message, code=first.code, details=_conflict_dict(first))
    codes = {c.code for c in conflicts}
    code = next(iter(codes)) if len(codes) == 1 else "batch_conflict"
    hostnames = [c.hostname for c in conflicts]
    return Conflict(
        f"{len(hostnames)} hostname(s) are already onboarding or exist as nodes; nothing was "
        "submitted",
        code=code,
        details={"hostnames": hostnames, "conflicts": [_conflict_dict(c) for c in conflicts]},
    )


# --- idempotency -------------------------------------------------------------------------------


def _derived(*parts: str) -> uuid.UUID:
    return uuid.uuid5(ONBOARDING_ID_NAMESPACE, ":".join(parts))


def _key_reused() -> Unprocessable:
    return Unprocessable(
        "this X-Idempotency-Key was already used with a different request body",
        code="idempotency_key_reused",
    )


# --- submitting -------------------------------------------------------------------------------


async def _submit(
    temporal: TemporalOps,
    settings: Settings,
    site_id: uuid.UUID,
    rows: list[OnboardingRow],
    *,
    batch_max_parallel: int | None = None,
) -> OnboardingRecorded:
    """The worker writes the rows and starts the workflow (or finds the key's earlier rows, or
    the hostnames in the way). A request with a key runs under it: a concurrent retry joins the
    same operation."""
    key = rows[0].idempotency_key
    return await run_admin_operation(
        temporal,
        settings.control_plane_task_queue,
        ONBOARDING_SUBMIT,
        OnboardingSubmission(
            site_id=str(site_id), rows=rows, batch_max_parallel=batch_max_parallel
        ),
        key=str(_derived("submit", key)) if key is not None else per_request("onboarding"),
        result_type=OnboardingRecorded,
    )


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
) -> OnboardingRow:
    return OnboardingRow(
        onboarding_id=str(onboarding_id),
        batch_id=str(batch_id) if batch_id is not None else None,
        node_id=str(node_id),
        site_id=str(site_id),
        profile_id=str(profile_id),
        sku_id=sku_id,
        hostname=hostname,
        ipmi_ip=ipmi_ip,
        requested_by=principal.name,
        current_stage=_FIRST_STAGE,
        workflow_id=onboarding_workflow_id(str(onboarding_id)),
        idempotency_key=key,
    )


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
    await db.close()  # never hold a database connection across a Temporal call

    onboarding_id = _derived("single", key) if key is not None else uuid.uuid4()
    node_id = _derived("node", str(onboarding_id)) if key is not None else uuid.uuid4()
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
    recorded = await _submit(temporal, settings, body.site_id, [row])
    if not recorded.rows:
        raise conflict_error(recorded.conflicts, batch=False)
    if recorded.replayed:
        (earlier,) = recorded.rows if len(recorded.rows) == 1 else (None,)
        same = (
            earlier is not None
            and earlier.batch_id is None
            and (earlier.site_id, earlier.profile_id, earlier.sku_id, earlier.hostname)
            == (row.site_id, row.profile_id, row.sku_id, row.hostname)
            and earlier.ipmi_ip == row.ipmi_ip
        )
        if not same or earlier is None:
            raise _key_reused()
        return Outcome(
            _created(uuid.UUID(earlier.onboarding_id), uuid.UUID(earlier.node_id)), replayed=True
        )

    audit.record_by(
        db,
        principal,
        action="onboarding.create",
        target_type="onboarding",
        target_id=str(onboarding_id),
        expected_state=JobStatus.PENDING.value,
        workflow_ids=[row.workflow_id],
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
    await db.close()  # never hold a database connection across a Temporal call
    hostnames = [h for h, _ in nodes]
    max_parallel = profile_value(target.profile, target.policy, "batch_max_parallel")

    batch_id = _derived("batch", key) if key is not None else uuid.uuid4()
    rows: list[OnboardingRow] = []
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
    recorded = await _submit(
        temporal, settings, body.site_id, rows, batch_max_parallel=max_parallel
    )
    if not recorded.rows:
        raise conflict_error(recorded.conflicts, batch=True)
    if recorded.replayed:
        earlier = recorded.rows
        batch_ids = {r.batch_id for r in earlier}
        same = (
            len(batch_ids) == 1
            and None not in batch_ids
            and {(r.hostname, r.ipmi_ip) for r in earlier} == set(nodes)
            and len(earlier) == len(nodes)
            and all(
                (r.site_id, r.profile_id, r.sku_id) == (rows[0].site_id, rows[0].profile_id,
                                                        rows[0].sku_id)
                for r in earlier
            )
        )  # fmt: skip
        if not same:
            raise _key_reused()
        by_host = {r.hostname: r for r in earlier}
        in_order = [by_host[h] for h in hostnames]
        earlier_batch = in_order[0].batch_id
        assert earlier_batch is not None
        return Outcome(
            BatchCreated(
                batch_id=uuid.UUID(earlier_batch), onboardings=[_batch_item(r) for r in in_order]
            ),
            replayed=True,
        )

    audit.record_by(
        db,
        principal,
        action="onboarding.batch_create",
        target_type="onboarding_batch",
        target_id=str(batch_id),
        expected_state=JobStatus.RUNNING.value,
        workflow_ids=[batch_workflow_id(str(batch_id))],
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


def _batch_item(row: OnboardingRow) -> BatchOnboarding:
    return BatchOnboarding(
        hostname=row.hostname,
        onboarding_id=uuid.UUID(row.onboarding_id),
        node_id=uuid.UUID(row.node_id),
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
