"""Per-site onboarding permits (docs/lifecycles/onboarding.md#batches, open question 5): the site
policy's batch_max_parallel bounds the onboardings whose stages run on a site at once, across every
batch and single onboarding, because MAAS's rack controllers (PXE, image sync) are shared.

A permit is a row of onboarding_site_slots, taken with a compare-and-set under the site policy
row's lock (so two acquirers of one site decide one after the other) and given back by the
workflow on every way its run stops. Nothing is kept in a worker's memory: a restarted worker
goes on from the table. A permit whose job no longer runs (its workflow was terminated before
it could give it back) is reclaimed by the next acquirer that finds the site full."""

from __future__ import annotations

import uuid

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from contracts.lifecycle import JobStatus
from contracts.onboarding import (
    ACQUIRE_SITE_SLOT_ACTIVITY,
    RELEASE_SITE_SLOT_ACTIVITY,
    SITE_AT_CAPACITY,
    SiteSlotGrant,
    SiteSlotRequest,
)
from schema.models import MaasSitePolicy, NodeOnboarding, OnboardingSiteSlot

# A job in one of these may be running stages; any other state means its permit is stale.
HOLDING_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING, JobStatus.COMPENSATING)


class SiteSlotActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    @activity.defn(name=ACQUIRE_SITE_SLOT_ACTIVITY)
    async def acquire(self, request: SiteSlotRequest) -> SiteSlotGrant:
        """Take a permit for the job, or raise SITE_AT_CAPACITY (retryable, benign: waiting
        is normal). Idempotent: a job that holds one already is answered as granted."""
        site_id, onboarding_id = uuid.UUID(request.site_id), uuid.UUID(request.onboarding_id)
        slots = OnboardingSiteSlot
        async with self.sessions() as session, session.begin():
            limit = await session.scalar(
                select(MaasSitePolicy.batch_max_parallel)
                .where(MaasSitePolicy.site_id == site_id)
                .with_for_update()
            )
            if limit is None:
                raise ApplicationError(
                    f"site {site_id} has no policy", type="site_policy_missing", non_retryable=True
                )
            holders = select(func.count()).select_from(slots).where(slots.site_id == site_id)
            held = await session.get(slots, onboarding_id)
            in_flight = int(await session.scalar(holders) or 0)
            if held is None and in_flight >= limit:
                await session.execute(
                    delete(slots).where(
                        slots.site_id == site_id,
                        slots.onboarding_id.in_(
                            select(NodeOnboarding.onboarding_id).where(
                                NodeOnboarding.site_id == site_id,
                                NodeOnboarding.status.not_in([s.value for s in HOLDING_STATUSES]),
                            )
                        ),
                    )
                )
                in_flight = int(await session.scalar(holders) or 0)
                if in_flight >= limit:
                    raise ApplicationError(
                        f"{in_flight} of {limit} onboardings already run on the site",
                        type=SITE_AT_CAPACITY,
                        category=ApplicationErrorCategory.BENIGN,
                    )
            if held is None:
                await session.execute(
                    insert(slots)
                    .values(onboarding_id=onboarding_id, site_id=site_id)
                    .on_conflict_do_nothing()
                )
                in_flight += 1
        return SiteSlotGrant(in_flight=in_flight, limit=limit)

    @activity.defn(name=RELEASE_SITE_SLOT_ACTIVITY)
    async def release(self, request: SiteSlotRequest) -> None:
        async with self.sessions() as session, session.begin():
            await session.execute(
                delete(OnboardingSiteSlot).where(
                    OnboardingSiteSlot.onboarding_id == uuid.UUID(request.onboarding_id)
                )
            )
