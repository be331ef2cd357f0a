"""Balances and usage for tenants; any account's, manual credits and storage limits, for admins.
The balance is the account's running total (moved by the worker in the transaction of every
posting, activities/billing/ledger.py), never a sum over the ledger; the balance state is the one
the worker last computed: at every credit (at once) and every metering run.

The usage export pages over usage records, newest first (limit and cursor, as every list route),
each with what its windows were charged so far (usage_records.charged_minor, moved with each
posting); `?format=csv` or `Accept: text/csv` answers the same page as CSV, its next cursor in
the `X-Next-Cursor` header (and a `Link: <...>; rel="next"`)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import urllib.parse
import uuid
from typing import Annotated, Any, cast

import msgspec
from litestar import Controller, Request, Response, post, put
from litestar import get as get_route
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import (
    BILLING_CREDIT,
    CreditInput,
    CreditResult,
    credit_key,
)
from contracts.billing_meter import BalanceState
from contracts.storage import NamespaceStatus
from gateway import audit
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.errors import NotFound, unknown_query_value
from gateway.openapi import ALSO_SERVES, errors, one_of
from gateway.pagination import newest_first_page
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from schema.models import (
    DEFAULT_STORAGE_NAMESPACE_LIMIT,
    DEFAULT_STORAGE_QUOTA_LIMIT_BYTES,
    DEPLETED_THRESHOLD_MINOR,
    LOW_BALANCE_THRESHOLD_MINOR,
    BillingAccount,
    Project,
    StorageNamespace,
    UsageRecord,
)

USAGE_FORMATS = ("json", "csv")
NEXT_CURSOR_HEADER = "X-Next-Cursor"
_CSV_COLUMNS = (
    "usage_record_id",
    "allocation_id",
    "sku",
    "gpu_count",
    "price_per_gpu_hour_minor",
    "currency",
    "started_at",
    "ended_at",
    "billed_until",
    "charged_minor",
)


class Balance(msgspec.Struct, kw_only=True):
    project_id: uuid.UUID
    currency: str
    balance_minor: int
    state: str  # healthy | low_balance | depleted
    low_balance_threshold_minor: int
    depleted_threshold_minor: int


class UsageView(msgspec.Struct, kw_only=True):
    usage_record_id: uuid.UUID
    allocation_id: uuid.UUID
    sku: str
    gpu_count: int
    price_per_gpu_hour_minor: int
    started_at: dt.datetime
    ended_at: dt.datetime | None
    billed_until: dt.datetime
    charged_minor: int
    currency: str = "usd"


class UsageList(msgspec.Struct, kw_only=True):
    items: list[UsageView]
    # Pass back as ?cursor= for the next page; null on the last page.
    next_cursor: str | None = None


class AccountView(msgspec.Struct, kw_only=True):
    balance: Balance
    usage: list[UsageView]  # the first page (GET .../usage pages further)
    usage_next_cursor: str | None = None


class StorageLimits(msgspec.Struct, kw_only=True):
    """A project's storage limits (admin-set; the policy's defaults until then) and what its
    active namespaces use of them. A create beyond either limit is 403 quota_exceeded."""

    project_id: uuid.UUID
    namespace_limit: int
    quota_limit_bytes: int
    namespaces: int
    quota_bytes: int  # the sum of the active namespaces' quotas


class StorageLimitsSet(RequestBody):
    namespace_limit: Annotated[int, msgspec.Meta(ge=0, le=100_000)]
    quota_limit_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 60)]
    reason: Reason


class CreditCreate(RequestBody):
    amount_minor: Annotated[int, msgspec.Meta(gt=0, le=10**12)]
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=150)]
    reason: Reason


class CreditPosted(msgspec.Struct, kw_only=True):
    entry_id: uuid.UUID
    created: bool
    balance_minor: int


async def _balance(db: AsyncSession, project_id: uuid.UUID) -> Balance:
    account = await db.get(BillingAccount, project_id)
    if account is None:  # no usage and no payment yet: a balance of 0 is depleted
        # (docs/lifecycles/balance.md)
        account = BillingAccount(
            project_id=project_id,
            currency="usd",
            state=BalanceState.DEPLETED.value,
            low_balance_threshold_minor=LOW_BALANCE_THRESHOLD_MINOR,
            depleted_threshold_minor=DEPLETED_THRESHOLD_MINOR,
            balance_minor=0,
        )
    return Balance(
        project_id=project_id,
        currency=account.currency,
        balance_minor=account.balance_minor,  # the running total: no sum over the ledger
        state=account.state,
        low_balance_threshold_minor=account.low_balance_threshold_minor,
        depleted_threshold_minor=account.depleted_threshold_minor,
    )


async def _usage_page(
    db: AsyncSession, project_id: uuid.UUID, *, limit: int, cursor: str | None
) -> UsageList:
    """One keyset page of the project's usage records, newest first (usage_project_started);
    the ledger is not read."""
    rows, next_cursor = await newest_first_page(
        db,
        select(UsageRecord).where(UsageRecord.project_id == project_id),
        created=UsageRecord.started_at,
        row_id=UsageRecord.id,
        limit=limit,
        cursor=cursor,
    )
    return UsageList(
        items=[
            UsageView(
                usage_record_id=r.id,
                allocation_id=r.allocation_id,
                sku=r.sku,
                gpu_count=r.gpu_count,
                price_per_gpu_hour_minor=r.price_per_gpu_hour_minor,
                started_at=r.started_at,
                ended_at=r.ended_at,
                billed_until=r.billed_until,
                charged_minor=r.charged_minor,
                currency=r.currency,
            )
            for r in rows
        ],
        next_cursor=next_cursor,
    )


def _wants_csv(request: Request[Any, Any, Any], format: str | None) -> bool:
    if format is not None:
        if format not in USAGE_FORMATS:
            raise unknown_query_value("format", USAGE_FORMATS)
        return format == "csv"
    return request.accept.best_match(["application/json", "text/csv"]) == "text/csv"


def _usage_answer(
    request: Request[Any, Any, Any], page: UsageList, csv_form: bool
) -> Response[UsageList]:
    if not csv_form:
        return Response(page)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(_CSV_COLUMNS)
    for u in page.items:
        writer.writerow(
            [
                ""
                if value is None
                else value.isoformat()
                if isinstance(value, dt.datetime)
                else value
                for value in (getattr(u, column) for column in _CSV_COLUMNS)
            ]
        )
    headers: dict[str, str] = {}
    if page.next_cursor is not None:
        query = {k: v for k, v in request.query_params.items() if k != "cursor"}
        query["cursor"] = page.next_cursor
        headers[NEXT_CURSOR_HEADER] = page.next_cursor
        headers["Link"] = f'<{request.url.path}?{urllib.parse.urlencode(query)}>; rel="next"'
    answer = Response(out.getvalue(), media_type="text/csv", headers=headers)
    return cast(Response[UsageList], answer)


async def storage_limits(db: AsyncSession, project_id: uuid.UUID) -> StorageLimits:
    """The project's limits (the policy's defaults for an account not opened yet) and what its
    active namespaces use of them."""
    limits = (
        await db.execute(
            select(
                BillingAccount.storage_namespace_limit, BillingAccount.storage_quota_limit_bytes
            ).where(BillingAccount.project_id == project_id)
        )
    ).first()
    namespace_limit, quota_limit = (
        (limits[0], limits[1])
        if limits is not None
        else (DEFAULT_STORAGE_NAMESPACE_LIMIT, DEFAULT_STORAGE_QUOTA_LIMIT_BYTES)
    )
    count, total = (
        await db.execute(
            select(func.count(), func.coalesce(func.sum(StorageNamespace.quota_bytes), 0)).where(
                StorageNamespace.project_id == project_id,
                StorageNamespace.status == NamespaceStatus.ACTIVE,
            )
        )
    ).one()
    return StorageLimits(
        project_id=project_id,
        namespace_limit=int(namespace_limit),
        quota_limit_bytes=int(quota_limit),
        namespaces=int(count),
        quota_bytes=int(total),
    )


_USAGE_DESCRIPTION = (
    "Usage records newest first, each with what its windows were charged so far; pages with "
    "limit and cursor (next_cursor). `?format=csv` or `Accept: text/csv`: the same page as CSV "
    "(columns: " + ", ".join(_CSV_COLUMNS) + "), the next cursor in the X-Next-Cursor header."
)


class BillingController(Controller):
    path = "/api/v1/billing"
    guards = [tenant_guard]
    tags = ["billing"]

    @get_route("/balance", summary="The project's balance and state", responses=errors(403))
    async def balance(
        self, db: NamedDependency[AsyncSession], principal: NamedDependency[Principal]
    ) -> Balance:
        return await _balance(db, principal.project)

    @get_route(
        "/usage",
        summary="Usage windows with what each was charged (paged; JSON or CSV)",
        description=_USAGE_DESCRIPTION,
        responses=errors(400, 403),
        opt={ALSO_SERVES: ["text/csv"]},
    )
    async def usage(
        self,
        request: Request[Any, Any, Any],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        cursor: FromQuery[str | None] = None,
        format: Annotated[str | None, QueryParameter(schema_extra=one_of(USAGE_FORMATS))] = None,
    ) -> Response[UsageList]:
        csv_form = _wants_csv(request, format)
        page = await _usage_page(db, principal.project, limit=limit, cursor=cursor)
        return _usage_answer(request, page, csv_form)

    @get_route(
        "/storage-limits",
        summary="The project's storage limits and what its namespaces use of them",
        responses=errors(403),
    )
    async def project_storage_limits(
        self, db: NamedDependency[AsyncSession], principal: NamedDependency[Principal]
    ) -> StorageLimits:
        return await storage_limits(db, principal.project)


class AdminBillingController(Controller):
    path = "/api/v1/admin/billing/accounts"
    guards = [admin_guard]
    tags = ["admin: billing"]

    @get_route(
        "/{project_id:uuid}", summary="Any project's balance and usage", responses=errors(403, 404)
    )
    async def account(
        self, db: NamedDependency[AsyncSession], project_id: FromPath[uuid.UUID]
    ) -> AccountView:
        if await db.get(Project, project_id) is None:
            raise NotFound("project not found")
        page = await _usage_page(db, project_id, limit=100, cursor=None)
        return AccountView(
            balance=await _balance(db, project_id),
            usage=page.items,
            usage_next_cursor=page.next_cursor,
        )

    @get_route(
        "/{project_id:uuid}/usage",
        summary="Any project's usage windows (paged; JSON or CSV)",
        description=_USAGE_DESCRIPTION,
        responses=errors(400, 403, 404),
        opt={ALSO_SERVES: ["text/csv"]},
    )
    async def account_usage(
        self,
        request: Request[Any, Any, Any],
        db: NamedDependency[AsyncSession],
        project_id: FromPath[uuid.UUID],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        cursor: FromQuery[str | None] = None,
        format: Annotated[str | None, QueryParameter(schema_extra=one_of(USAGE_FORMATS))] = None,
    ) -> Response[UsageList]:
        csv_form = _wants_csv(request, format)
        if await db.get(Project, project_id) is None:
            raise NotFound("project not found")
        page = await _usage_page(db, project_id, limit=limit, cursor=cursor)
        return _usage_answer(request, page, csv_form)

    @get_route(
        "/{project_id:uuid}/storage-limits",
        summary="Any project's storage limits and use",
        responses=errors(403, 404),
    )
    async def get_storage_limits(
        self, db: NamedDependency[AsyncSession], project_id: FromPath[uuid.UUID]
    ) -> StorageLimits:
        if await db.get(Project, project_id) is None:
            raise NotFound("project not found")
        return await storage_limits(db, project_id)

    @put(
        "/{project_id:uuid}/storage-limits",
        summary="Set a project's storage limits (namespace count, total quota); audited",
        description=(
            "Limits below what the project already has refuse further creates only: nothing "
            "existing is deleted or detached."
        ),
        responses=errors(400, 403, 404, 413),
    )
    async def set_storage_limits(
        self,
        data: JSONBody[StorageLimitsSet],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        project_id: FromPath[uuid.UUID],
    ) -> StorageLimits:
        if await db.get(Project, project_id) is None:
            raise NotFound("project not found")
        prior = await storage_limits(db, project_id)
        # An account not opened yet is opened as the ledger opens it (depleted, no credit).
        await db.execute(
            pg_insert(BillingAccount)
            .values(
                project_id=project_id,
                state=BalanceState.DEPLETED.value,
                storage_namespace_limit=data.namespace_limit,
                storage_quota_limit_bytes=data.quota_limit_bytes,
            )
            .on_conflict_do_update(
                index_elements=[BillingAccount.project_id],
                set_={
                    "storage_namespace_limit": data.namespace_limit,
                    "storage_quota_limit_bytes": data.quota_limit_bytes,
                },
            )
        )
        audit.record_by(
            db,
            principal,
            action="billing.storage_limits",
            target_type="project",
            target_id=str(project_id),
            reason=data.reason,
            details={
                "from": {
                    "namespace_limit": prior.namespace_limit,
                    "quota_limit_bytes": prior.quota_limit_bytes,
                },
                "to": {
                    "namespace_limit": data.namespace_limit,
                    "quota_limit_bytes": data.quota_limit_bytes,
                },
            },
        )
        await db.commit()
        return await storage_limits(db, project_id)

    @post(
        "/{project_id:uuid}/credits",
        status_code=201,
        summary="Credit an account by hand (idempotent on the key; audited)",
        responses=errors(400, 403, 404, 413),
    )
    async def credit(
        self,
        data: JSONBody[CreditCreate],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        runtime: NamedDependency[Runtime],
        project_id: FromPath[uuid.UUID],
    ) -> CreditPosted:
        # Posted by the worker (AdminOperationWorkflow, ledger key `admin:{project}:{key}`): a
        # retry with the same key, even one racing the first, posts nothing more.
        if await db.get(Project, project_id) is None:
            raise NotFound("project not found")
        await db.close()  # no connection held across the Temporal call
        posted = await run_admin_operation(
            runtime.temporal,
            runtime.settings.control_plane_task_queue,
            BILLING_CREDIT,
            CreditInput(
                actor=actor(principal, data.reason),
                project_id=str(project_id),
                amount_minor=data.amount_minor,
                idempotency_key=data.idempotency_key,
            ),
            key=credit_key(str(project_id), data.idempotency_key),
            result_type=CreditResult,
        )
        return CreditPosted(
            entry_id=uuid.UUID(posted.entry_id),
            created=posted.created,
            balance_minor=posted.balance_minor,
        )
