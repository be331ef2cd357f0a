"""A submitted onboarding (single or batch) or decommission, run by the worker
(AdminOperationWorkflow operations, contracts/lifecycle_submissions.py): the job rows are written
and the lifecycle's workflow is started here, together. A start Temporal refuses withdraws the
rows again (unless the workflow evidently ran: a row moved on or has events) and fails the
attempt, so the operation's retry tries the whole submission again. The audit row of the
submission is the gateway's, written once the operation answered."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy.exc
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from activities.operation_support import transaction
from contracts import decommission as decommission_contract
from contracts import onboarding as onboarding_contract
from contracts.admin_operation import DECOMMISSION_SUBMIT, ONBOARDING_SUBMIT
from contracts.lifecycle import JobStatus
from contracts.lifecycle_submissions import (
    DecommissionRecorded,
    DecommissionSubmission,
    OnboardingRecorded,
    OnboardingRow,
    OnboardingSubmission,
)
from core import search_attributes
from schema.constraints import constraint_name
from schema.lifecycle_tables import DECOMMISSION_TABLES, ONBOARDING_TABLES, LifecycleTables
from schema.models import (
    NodeDecommission,
    NodeOnboarding,
)
from schema.onboarding_conflicts import live_conflicts

log = logging.getLogger(__name__)

_LIVE_HOSTNAME_INDEX = "node_onboardings_live_hostname"
_LIVE_NODE_INDEX = "node_decommissions_live_node"


@dataclass(frozen=True)
class _Start:
    """A lifecycle workflow to start."""

    workflow: str
    arg: Any
    workflow_id: str
    attributes: list[SearchAttributePair[str]]


def _onboarding(row: OnboardingRow) -> NodeOnboarding:
    return NodeOnboarding(
        onboarding_id=uuid.UUID(row.onboarding_id),
        batch_id=uuid.UUID(row.batch_id) if row.batch_id else None,
        node_id=uuid.UUID(row.node_id),
        site_id=uuid.UUID(row.site_id),
        profile_id=uuid.UUID(row.profile_id),
        sku_id=row.sku_id,
        hostname=row.hostname,
        ipmi_ip=row.ipmi_ip,
        requested_by=row.requested_by,
        current_stage=row.current_stage,
        current_attempt=0,
        status=JobStatus.PENDING.value,
        workflow_id=row.workflow_id,
        idempotency_key=row.idempotency_key,
    )


def _onboarding_row(row: NodeOnboarding) -> OnboardingRow:
    return OnboardingRow(
        onboarding_id=str(row.onboarding_id),
        node_id=str(row.node_id),
        site_id=str(row.site_id),
        profile_id=str(row.profile_id),
        sku_id=row.sku_id,
        hostname=row.hostname,
        ipmi_ip=str(row.ipmi_ip),  # asyncpg hands INET back as an ipaddress object
        requested_by=row.requested_by or "",
        current_stage=row.current_stage,
        workflow_id=row.workflow_id,
        batch_id=str(row.batch_id) if row.batch_id else None,
        idempotency_key=row.idempotency_key,
        status=row.status,
    )


def _onboarding_start(rows: Sequence[OnboardingRow], batch_max_parallel: int | None) -> _Start:
    first = rows[0]
    if first.batch_id is None:
        return _Start(
            onboarding_contract.WORKFLOW_NAME,
            onboarding_contract.OnboardInput(
                onboarding_id=first.onboarding_id,
                site_id=first.site_id,
                profile_id=first.profile_id,
                sku_id=first.sku_id,
                hostname=first.hostname,
                ipmi_ip=first.ipmi_ip,
                node_id=first.node_id,
                requested_by=first.requested_by,
            ),
            first.workflow_id,
            [
                SearchAttributePair(search_attributes.SITE_ID, first.site_id),
                SearchAttributePair(search_attributes.HOSTNAME, first.hostname),
                SearchAttributePair(search_attributes.LIFECYCLE_STATUS, JobStatus.PENDING.value),
                SearchAttributePair(search_attributes.CURRENT_STAGE, first.current_stage),
                SearchAttributePair(search_attributes.NODE_ID, first.node_id),
            ],
        )
    assert batch_max_parallel is not None, "a batch submission names its parallelism"
    return _Start(
        onboarding_contract.BATCH_WORKFLOW_NAME,
        onboarding_contract.BatchInput(
            batch_id=first.batch_id,
            site_id=first.site_id,
            profile_id=first.profile_id,
            sku_id=first.sku_id,
            nodes=[
                onboarding_contract.BatchNode(
                    hostname=r.hostname,
                    ipmi_ip=r.ipmi_ip,
                    onboarding_id=r.onboarding_id,
                    node_id=r.node_id,
                )
                for r in rows
            ],
            max_parallel=batch_max_parallel,
            requested_by=first.requested_by,
        ),
        onboarding_contract.batch_workflow_id(first.batch_id),
        [
            SearchAttributePair(search_attributes.SITE_ID, first.site_id),
            SearchAttributePair(search_attributes.BATCH_ID, first.batch_id),
            SearchAttributePair(search_attributes.LIFECYCLE_STATUS, JobStatus.RUNNING.value),
        ],
    )


def _decommission_start(arg: decommission_contract.DecommissionInput) -> _Start:
    return _Start(
        decommission_contract.WORKFLOW_NAME,
        arg,
        decommission_contract.decommission_workflow_id(arg.decommission_id),
        [
            SearchAttributePair(search_attributes.NODE_ID, arg.node_id),
            SearchAttributePair(search_attributes.LIFECYCLE_STATUS, JobStatus.PENDING.value),
            SearchAttributePair(search_attributes.CURRENT_STAGE, _first_stage(arg.mode)),
        ],
    )


def _first_stage(mode: str) -> str:
    return decommission_contract.STAGES_BY_MODE[decommission_contract.Mode(mode)][0].value


async def _lock_key(session: AsyncSession, key: str) -> None:
    """Submissions with the same key run one at a time (until this transaction ends)."""
    await session.execute(
        select(func.pg_advisory_xact_lock(func.hashtextextended(f"onboarding-idem:{key}", 0)))
    )


class LifecycleSubmissionActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        return [self.submit_onboarding, self.submit_decommission]

    async def _start(self, start: _Start) -> None:
        """Start on the queue this operation runs on (the control plane's); a workflow already
        started with this id (an earlier attempt's) is the one asked for."""
        try:
            await self._client.start_workflow(
                start.workflow,
                start.arg,
                id=start.workflow_id,
                task_queue=activity.info().task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes(start.attributes),
            )
        except WorkflowAlreadyStartedError:
            log.info("workflow %s was already started", start.workflow_id)

    async def _start_or_withdraw(
        self, start: _Start, tables: LifecycleTables, ids: Sequence[str]
    ) -> None:
        try:
            await self._start(start)
        except Exception:
            keys = [uuid.UUID(i) for i in ids]
            event_job = getattr(tables.event, tables.event_job_column)
            async with transaction(self._sessions) as session:
                statuses = await session.scalars(
                    select(tables.job.status).where(tables.job_id.in_(keys)).with_for_update()
                )
                moved = any(s != JobStatus.PENDING.value for s in statuses)
                ran = await session.scalar(select(exists().where(event_job.in_(keys))))
                if moved or ran:
                    log.warning("workflow %s answered late but runs", start.workflow_id)
                    return
                await session.execute(delete(tables.job).where(tables.job_id.in_(keys)))
            raise

    @activity.defn(name=ONBOARDING_SUBMIT)
    async def submit_onboarding(self, input: OnboardingSubmission) -> OnboardingRecorded:
        """All the submission's rows and its workflow, or nothing: what its key already holds
        (replayed), or the hostnames in the way, or the rows written and the workflow started."""
        recorded = await self._record_onboardings(input)
        if not recorded.rows:
            return recorded
        start = _onboarding_start(recorded.rows, input.batch_max_parallel)
        if recorded.replayed:
            # The earlier request may have ended between its rows and its start: rows that have
            # not moved get their workflow (already running: nothing happens).
            if all(r.status == JobStatus.PENDING.value for r in recorded.rows):
                await self._start(start)
            return recorded
        ids = [r.onboarding_id for r in recorded.rows]
        await self._start_or_withdraw(start, ONBOARDING_TABLES, ids)
        return recorded

    async def _record_onboardings(self, input: OnboardingSubmission) -> OnboardingRecorded:
        site_id = uuid.UUID(input.site_id)
        hostnames = [r.hostname for r in input.rows]
        key = input.rows[0].idempotency_key if input.rows else None
        try:
            async with transaction(self._sessions) as session:
                if key is not None:
                    await _lock_key(session, key)
                    previous = await session.scalars(
                        select(NodeOnboarding).where(NodeOnboarding.idempotency_key == key)
                    )
                    rows = [_onboarding_row(r) for r in previous]
                    if rows:
                        mine = {r.onboarding_id for r in rows} == {
                            r.onboarding_id for r in input.rows
                        }
                        # A retried attempt finds the rows its first attempt wrote.
                        retried = activity.info().attempt > 1 and mine
                        return OnboardingRecorded(rows=rows, replayed=not retried)
                conflicts = await live_conflicts(session, site_id, hostnames)
                if conflicts:
                    return OnboardingRecorded(conflicts=conflicts)
                session.add_all([_onboarding(r) for r in input.rows])
                await session.flush()
        except sqlalchemy.exc.IntegrityError as err:
            # Another submission of one of these hostnames got in first; name it if it is live.
            if constraint_name(err) != _LIVE_HOSTNAME_INDEX:
                raise
            async with transaction(self._sessions) as session:
                return OnboardingRecorded(
                    conflicts=await live_conflicts(session, site_id, hostnames)
                )
        return OnboardingRecorded(rows=list(input.rows))

    @activity.defn(name=DECOMMISSION_SUBMIT)
    async def submit_decommission(self, input: DecommissionSubmission) -> DecommissionRecorded:
        arg = input.start
        start = _decommission_start(arg)
        row = NodeDecommission(
            decommission_id=uuid.UUID(arg.decommission_id),
            node_id=uuid.UUID(arg.node_id),
            hostname=input.hostname,
            mode=arg.mode,
            erase=arg.erase,
            storage_cleanup=arg.storage_cleanup,
            remove_maas_record=arg.remove_maas_record,
            force_release_allocations=arg.force_release_allocations,
            reason=arg.reason,
            status=JobStatus.PENDING.value,
            current_stage=_first_stage(arg.mode),
            requested_by=arg.requested_by,
            requested_by_token_id=(
                uuid.UUID(input.requested_by_token_id) if input.requested_by_token_id else None
            ),
            workflow_id=start.workflow_id,
        )
        try:
            async with transaction(self._sessions) as session:
                if await session.get(NodeDecommission, row.decommission_id) is None:
                    session.add(row)  # a retried attempt finds the row it wrote
        except sqlalchemy.exc.IntegrityError as err:
            if constraint_name(err) != _LIVE_NODE_INDEX:
                raise
            return DecommissionRecorded(recorded=False)
        await self._start_or_withdraw(start, DECOMMISSION_TABLES, [arg.decommission_id])
        return DecommissionRecorded(recorded=True)
