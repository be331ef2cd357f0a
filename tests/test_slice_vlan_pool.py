"""The per-region slice VLAN pool, against real PostgreSQL: placement gives each project one VLAN
per region (unique, recorded, and what the node's agent is told), its allocations share it, the
release of its last one returns it, and an exhausted pool refuses the placement cleanly.
Allocations go through the API and the workflow to agents on simulated hosts that record the
VLAN each provision asked for; the races are run on the placement activity itself."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.exceptions import ApplicationError

from activities.allocations import AllocationActivities
from activities.placement_sql import DEFAULT_SLICE_VLAN_POOL
from agent.backend import Progress, ProvisionOutcome
from contracts.allocation import NETWORK_POOL_EXHAUSTED
from contracts.allocation_activities import PlaceInput
from contracts.host_tasks import (
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    HostErrorType,
    HostProvisionInput,
)
from contracts.states import SlotStatus
from schema.models import Allocation, DomainEvent, GpuSlot, ProjectSliceVlan, SliceVlanPool
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.factories import REGION, SLICE_SKU, create_project
from tests.lifecycle_support import (
    Tenant,
    baremetal_request,
    create_fleet,
    slice_request,
    wait_status,
)

Sessions = async_sessionmaker[AsyncSession]


class VlanRecordingHost(SimulatedHost):
    """A simulated host that notes the VLAN every slice provision was given."""

    def __init__(self, node_id: str, seen: dict[str, int | None]) -> None:
        super().__init__(node_id, config=SimHostConfig())
        self.seen = seen

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Progress) -> ProvisionOutcome:
        self.seen[spec.allocation_id] = spec.vlan_id
        return super().provision_slice_vm(spec, progress)


async def fleet(
    db_sessions: Sessions, start_node_agent: Any, *, slice_nodes: int = 2, baremetal: int = 0
) -> tuple[list[Any], dict[str, int | None]]:
    seen: dict[str, int | None] = {}
    nodes = await create_fleet(db_sessions, slice_nodes=slice_nodes, baremetal_nodes=baremetal)
    agents = [await start_node_agent(n.id, host=VlanRecordingHost(str(n.id), seen)) for n in nodes]
    return agents, seen


async def set_pool(db_sessions: Sessions, first: int, last: int) -> None:
    """The region's pool, as an operator configures it (what the switches trunk)."""
    async with db_sessions() as session, session.begin():
        await session.execute(
            insert(SliceVlanPool).values(region=REGION, first_vid=first, last_vid=last)
        )


async def vlans(db_sessions: Sessions) -> dict[uuid.UUID, int]:
    async with db_sessions() as session:
        rows = await session.execute(
            select(ProjectSliceVlan.project_id, ProjectSliceVlan.vlan_id).where(
                ProjectSliceVlan.region == REGION
            )
        )
        return {project_id: vid for project_id, vid in rows}


async def released_events(db_sessions: Sessions, project_id: uuid.UUID) -> list[dict[str, Any]]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(DomainEvent.payload)
            .where(
                DomainEvent.type == "project.slice_vlan_released",
                DomainEvent.subject_id == str(project_id),
            )
            .order_by(DomainEvent.id)
        )
        return list(rows)


async def allocate(tenant: Tenant, body: dict[str, Any]) -> str:
    response = await tenant.client.post("/api/v1/allocations", json=body)
    assert response.status_code == 201, response.text
    allocation_id: str = response.json()["allocation_id"]
    return allocation_id


async def release(tenant: Tenant, allocation_id: str) -> None:
    response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert response.status_code == 202, response.text
    await wait_status(tenant.client, allocation_id, "released")


@pytest.fixture
async def other_tenant(api: Any, make_project: Any, make_token: Any) -> Any:
    """Another project's API client (no SSH key needed for slices here)."""

    async def make() -> Tenant:
        project = await make_project()
        client = await api(token=await make_token("tenant", project))
        return Tenant(client, project.id, "", "")

    return make


# --- through the API and the workflow --------------------------------------------------------


@pytest.mark.usefixtures("control_plane")
async def test_each_project_holds_one_vid_until_its_last_release(
    tenant: Tenant, other_tenant: Any, db_sessions: Sessions, start_node_agent: Any
) -> None:
    _, seen = await fleet(db_sessions, start_node_agent)
    await set_pool(db_sessions, 200, 209)
    p, q, r = tenant, await other_tenant(), await other_tenant()

    p1 = await allocate(p, slice_request(2))
    p2 = await allocate(p, slice_request(2))
    q1 = await allocate(q, slice_request(2))
    for tenant_, allocation_id in ((p, p1), (p, p2), (q, q1)):
        await wait_status(tenant_.client, allocation_id, "active")
    assert await vlans(db_sessions) == {p.project_id: 200, q.project_id: 201}
    assert (seen[p1], seen[p2], seen[q1]) == (200, 200, 201)  # what the agents were told

    # One of P's allocations goes: P keeps its VLAN while the other lives.
    await release(p, p1)
    assert (await vlans(db_sessions))[p.project_id] == 200
    assert await released_events(db_sessions, p.project_id) == []

    # P's last one goes: its VLAN returns to the pool, in the same transaction, on record.
    await release(p, p2)
    assert await vlans(db_sessions) == {q.project_id: 201}
    assert await released_events(db_sessions, p.project_id) == [
        {"region": REGION, "vlan_id": 200, "allocation_id": p2}
    ]

    # The next project takes the lowest free vid: P's old one. Q's never moved.
    r1 = await allocate(r, slice_request(2))
    await wait_status(r.client, r1, "active")
    assert seen[r1] == 200
    assert await vlans(db_sessions) == {q.project_id: 201, r.project_id: 200}

    # P comes back: a new VLAN, not one someone else holds.
    p3 = await allocate(p, slice_request(2))
    await wait_status(p.client, p3, "active")
    assert seen[p3] == 202


@pytest.mark.usefixtures("control_plane")
async def test_a_placement_racing_the_projects_last_release_keeps_the_vid_it_was_given(
    tenant: Tenant, db_sessions: Sessions, start_node_agent: Any
) -> None:
    _, seen = await fleet(db_sessions, start_node_agent)
    current = await allocate(tenant, slice_request(1))
    await wait_status(tenant.client, current, "active")
    for _ in range(4):
        # The project's only allocation is released while its next one is placed: whichever
        # commits first, the new one must end up on a VLAN the project still holds.
        releasing = asyncio.create_task(release(tenant, current))
        following = await allocate(tenant, slice_request(1))
        await releasing
        await wait_status(tenant.client, following, "active")
        assert await vlans(db_sessions) == {tenant.project_id: seen[following]}
        current = following


@pytest.mark.usefixtures("control_plane")
async def test_a_region_without_a_pool_draws_from_the_default_range_and_bare_metal_gets_none(
    tenant: Tenant, db_sessions: Sessions, start_node_agent: Any
) -> None:
    _, seen = await fleet(db_sessions, start_node_agent, slice_nodes=1, baremetal=1)
    sliced = await allocate(tenant, slice_request(1))
    whole = await allocate(tenant, baremetal_request())
    await wait_status(tenant.client, sliced, "active")
    await wait_status(tenant.client, whole, "active")
    assert seen == {sliced: DEFAULT_SLICE_VLAN_POOL[0]}
    assert await vlans(db_sessions) == {tenant.project_id: DEFAULT_SLICE_VLAN_POOL[0]}
    # Bare metal holds no VLAN: the project's slice release returns it.
    await release(tenant, sliced)
    assert await vlans(db_sessions) == {}


@pytest.mark.usefixtures("control_plane")
async def test_a_failed_provision_returns_the_vid_only_when_its_cleanup_is_proven(
    tenant: Tenant, other_tenant: Any, db_sessions: Sessions, start_node_agent: Any
) -> None:
    agents, seen = await fleet(db_sessions, start_node_agent, slice_nodes=1)
    host = agents[0].host
    fault = {"phase": "driver_ready"}

    # Proven cleanup: nothing of the project is left on the VLAN, so it goes back.
    host.faults.inject(SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT, **fault)
    proven = await allocate(tenant, slice_request(2))
    await wait_status(tenant.client, proven, "failed")
    assert seen[proven] is not None
    assert await vlans(db_sessions) == {}

    # Unproven cleanup: the half-built VM may still be on the VLAN, so the project keeps it.
    other = await other_tenant()
    host.faults.inject(SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT, **fault)
    host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
    unproven = await allocate(other, slice_request(2))
    await wait_status(other.client, unproven, "failed")
    held = await vlans(db_sessions)
    assert held == {other.project_id: seen[unproven]}
    # ... even after the project's other allocations come and go.
    later = await allocate(other, slice_request(2))
    await wait_status(other.client, later, "active")
    assert seen[later] == seen[unproven]
    await release(other, later)
    assert await vlans(db_sessions) == held


@pytest.mark.usefixtures("control_plane")
async def test_an_exhausted_pool_refuses_the_placement_and_reserves_nothing(
    tenant: Tenant, other_tenant: Any, db_sessions: Sessions, start_node_agent: Any
) -> None:
    await fleet(db_sessions, start_node_agent, slice_nodes=1)
    await set_pool(db_sessions, 300, 300)
    first = await allocate(tenant, slice_request(2))
    await wait_status(tenant.client, first, "active")

    other = await other_tenant()
    refused = await other.client.post("/api/v1/allocations", json=slice_request(2))
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == NETWORK_POOL_EXHAUSTED
    async with db_sessions() as session:
        allocations = await session.scalar(
            select(func.count())
            .select_from(Allocation)
            .where(Allocation.project_id == other.project_id)
        )
    assert allocations == 0
    assert await vlans(db_sessions) == {tenant.project_id: 300}
    # The project that holds the pool's one vid still places.
    again = await allocate(tenant, slice_request(2))
    await wait_status(tenant.client, again, "active")


# --- the placement activity itself -----------------------------------------------------------


def place_input(project_id: uuid.UUID, *, gpus: int = 1) -> PlaceInput:
    allocation_id = str(uuid.uuid4())
    return PlaceInput(
        allocation_id=allocation_id,
        project_id=str(project_id),
        sku=SLICE_SKU,
        gpus=gpus,
        region=REGION,
        ssh_key_ids=[],
        idempotency_key=None,
        workflow_id=f"allocation-{allocation_id}",
        provision_task_id=str(uuid.uuid4()),
    )


async def free_slots(db_sessions: Sessions) -> int:
    async with db_sessions() as session:
        count = await session.scalar(
            select(func.count()).select_from(GpuSlot).where(GpuSlot.status == SlotStatus.FREE)
        )
        return int(count or 0)


async def test_pool_exhaustion_is_a_non_retryable_rejection_that_writes_nothing(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    await create_fleet(db_sessions, slice_nodes=1)
    placing = AllocationActivities(db_engine, default_slice_vlan_pool=(7, 7))
    holder = await create_project(db_sessions)
    first = await placing.place(place_input(holder))
    assert first.plan.spec.vlan_id == 7
    free_before = await free_slots(db_sessions)

    late = place_input(await create_project(db_sessions))
    with pytest.raises(ApplicationError) as refused:
        await placing.place(late)
    assert refused.value.type == NETWORK_POOL_EXHAUSTED
    assert refused.value.non_retryable
    assert await free_slots(db_sessions) == free_before  # no capacity taken
    async with db_sessions() as session:
        assert await session.get(Allocation, uuid.UUID(late.allocation_id)) is None
    assert await vlans(db_sessions) == {holder: 7}

    # The holder still places, and a rerun of its placement answers the same VLAN.
    second = place_input(holder)
    assert (await placing.place(second)).plan.spec.vlan_id == 7
    assert (await placing.place(second)).plan.spec.vlan_id == 7


async def test_concurrent_first_placements_never_share_a_vid_nor_split_a_project(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    await create_fleet(db_sessions, slice_nodes=4)  # 32 GPUs
    projects = [await create_project(db_sessions) for _ in range(8)]
    placing = AllocationActivities(db_engine, default_slice_vlan_pool=(500, 599))
    requests = [place_input(project) for project in projects for _ in range(3)]

    placements = await asyncio.gather(*(placing.place(r) for r in requests))

    by_project: dict[str, set[int | None]] = {}
    for request, placement in zip(requests, placements, strict=True):
        by_project.setdefault(request.project_id, set()).add(placement.plan.spec.vlan_id)
    assert all(len(vids) == 1 for vids in by_project.values()), by_project
    held = await vlans(db_sessions)
    assert {str(k): {v} for k, v in held.items()} == by_project
    assert sorted(held.values()) == list(range(500, 508))  # the lowest free, none twice
