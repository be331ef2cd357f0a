"""What stands in the way of onboarding a hostname at a site: a live onboarding of it there, or a
live node that has it. Read by the gateway (the answer before anything is submitted) and by the
worker's submission record (again, under the submission's key, and after losing a race on the
live-hostname index)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.lifecycle import LIVE_JOB_STATUSES
from contracts.lifecycle_submissions import HostnameConflict
from contracts.states import NodeStatus
from schema.models import Node, NodeOnboarding

ONBOARDING_IN_PROGRESS = "onboarding_in_progress"
NODE_EXISTS = "node_exists"
_LIVE = [s.value for s in LIVE_JOB_STATUSES]


async def live_conflicts(
    db: AsyncSession, site_id: uuid.UUID, hostnames: Sequence[str]
) -> list[HostnameConflict]:
    """Live onboardings of these hostnames at this site, then live nodes that have them, in the
    order of `hostnames`."""
    onboardings = await db.execute(
        select(NodeOnboarding.hostname, NodeOnboarding.onboarding_id).where(
            NodeOnboarding.site_id == site_id,
            NodeOnboarding.hostname.in_(hostnames),
            NodeOnboarding.status.in_(_LIVE),
        )
    )
    found = [HostnameConflict(h, ONBOARDING_IN_PROGRESS, str(i)) for h, i in onboardings]
    busy = {c.hostname for c in found}
    nodes = await db.execute(
        select(Node.hostname, Node.id).where(
            Node.hostname.in_(hostnames), Node.status != NodeStatus.DELETED.value
        )
    )
    found += [HostnameConflict(h, NODE_EXISTS, str(i)) for h, i in nodes if h not in busy]
    order = {h: n for n, h in enumerate(hostnames)}
    return sorted(found, key=lambda c: order.get(c.hostname, 0))
