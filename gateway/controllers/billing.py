"""Balances and usage for tenants; any account's, and manual credits, for admins. Money is read
from the ledger (a sum, in minor units); the balance state is the one the worker last computed:
at every credit (at once) and every metering run."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

import msgspec
from litestar import Controller, post
from litestar import get as get_route
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import (
    BILLING_CREDIT,
    CreditInput,
    CreditResult,
    credit_key,
)
from contracts.billing_meter import BalanceState
from gateway.admin_operations import actor, run_admin_operation
from gateway.auth import Principal, admin_guard, tenant_guard
from gateway.errors import NotFound
from gateway.openapi import errors
from gateway.runtime import Runtime
from gateway.schemas import Reason
from gateway.schemas import Request as RequestBody
from schema.models import (
    DEPLETED_THRESHOLD_MINOR,
    LOW_BALANCE_THRESHOLD_MINOR,
    BillingAccount,
    LedgerEntry,
    Project,
    UsageRecord,
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


class UsageList(msgspec.Struct, kw_only=True):
    items: list[UsageView]


class AccountView(msgspec.Struct, kw_only=True):
    balance: Balance
    usage: list[UsageView]


class CreditCreate(RequestBody):
    amount_minor: Annotated[int, msgspec.Meta(gt=0, le=10**12)]
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=150)]
    reason: Reason


class CreditPosted(msgspec.Struct, kw_only=True):
    entry_id: uuid.UUID
    created: bool
    balance_minor: int


async def _balance_minor(db: AsyncSession, project_id: uuid.UUID) -> int:
    """The ledger's sum (a read; the ledger is written by the worker only)."""
    total = await db.scalar(
        select(func.coalesce(func.sum(LedgerEntry.amount_minor), 0)).where(
            LedgerEntry.project_id == project_id
        )
    )
    return int(total or 0)


async def _balance(db: AsyncSession, project_id: uuid.UUID) -> Balance:
    account = await db.get(BillingAccount, project_id)
    if account is None:  # no usage and no payment yet: a balance of 0 is depleted (seed 001 §4)
        account = BillingAccount(
            project_id=project_id,
            currency="usd",
            state=BalanceState.DEPLETED.value,
            low_balance_threshold_minor=LOW_BALANCE_THRESHOLD_MINOR,
            depleted_threshold_minor=DEPLETED_THRESHOLD_MINOR,
        )
    return Balance(
        project_id=project_id,
        currency=account.currency,
        balance_minor=await _balance_minor(db, project_id),
        state=account.state,
        low_balance_threshold_minor=account.low_balance_threshold_minor,
        depleted_threshold_minor=account.depleted_threshold_minor,
    )


async def _usage(db: AsyncSession, project_id: uuid.UUID) -> list[UsageView]:
    charged = (
        select(LedgerEntry.usage_record_id, func.coalesce(-func.sum(LedgerEntry.amount_minor), 0))
        .where(LedgerEntry.project_id == project_id, LedgerEntry.usage_record_id.is_not(None))
        .group_by(LedgerEntry.usage_record_id)
    )
    totals = {rid: int(total) for rid, total in (await db.execute(charged)).all()}
    records = await db.scalars(
        select(UsageRecord)
        .where(UsageRecord.project_id == project_id)
        .order_by(UsageRecord.started_at.desc())
        .limit(500)
    )
    return [
        UsageView(
            usage_record_id=r.id,
            allocation_id=r.allocation_id,
            sku=r.sku,
            gpu_count=r.gpu_count,
            price_per_gpu_hour_minor=r.price_per_gpu_hour_minor,
            started_at=r.started_at,
            ended_at=r.ended_at,
            billed_until=r.billed_until,
            charged_minor=totals.get(r.id, 0),
        )
        for r in records
    ]


class BillingController(Controller):
    path = "/api/v1/billing"
    guards = [tenant_guard]
    tags = ["billing"]

    @get_route("/balance", summary="The project's balance and state", responses=errors(403))
    async def balance(
        self, db: NamedDependency[AsyncSession], principal: NamedDependency[Principal]
    ) -> Balance:
        return await _balance(db, principal.project)

    @get_route("/usage", summary="Usage windows with what each was charged", responses=errors(403))
    async def usage(
        self, db: NamedDependency[AsyncSession], principal: NamedDependency[Principal]
    ) -> UsageList:
        return UsageList(items=await _usage(db, principal.project))


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
        return AccountView(
            balance=await _balance(db, project_id), usage=await _usage(db, project_id)
        )

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
