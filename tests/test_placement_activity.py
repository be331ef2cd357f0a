"""The placement activity against real PostgreSQL, called directly: what one POST writes, in one
transaction (activities/placement_sql.py), what a rerun answers, and what it refuses."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import Range
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.exceptions import ApplicationError

from activities.allocations import AllocationActivities
from activities.billing.accounts import refresh_state
from activities.billing.ledger import EntryKind, post_entry
from contracts.allocation_activities import PlaceInput
from contracts.host_tasks import BAREMETAL_PROVISION_USER, SLICE_VM_PROVISION
from contracts.states import AllocationStatus, ClaimKind, SlotStatus
from schema.models import (
    Allocation,
    AllocationEvent,
    AllocationResourceClaim,
    GpuSlot,
    Node,
    NodeTask,
    Sku,
)
from tests.factories import BAREMETAL_SKU, REGION, SLICE_SKU, create_project
from tests.lifecycle_support import create_fleet, eventually

Sessions = async_sessionmaker[AsyncSession]
# Placement must NOT end while its capacity is held: a bounded window, not an event to wait
# for. Placement ranks again after a backoff of at most 0.075 s (activities/allocations.py), so
# this is several of its attempts.
HELD_WINDOW_S = 0.3


def _input(
    project_id: uuid.UUID, *, sku: str = SLICE_SKU, gpus: int = 2, keys: Any = ()
) -> PlaceInput:
    allocation_id = str(uuid.uuid4())
    return PlaceInput(
        allocation_id=allocation_id,
        project_id=str(project_id),
        sku=sku,
        gpus=gpus,
        region=REGION,
        ssh_key_ids=list(keys),
        idempotency_key=None,
        workflow_id=f"allocation-{allocation_id}",
        provision_task_id=str(uuid.uuid4()),
    )


async def _rows(sessions: Sessions, allocation_id: str) -> dict[str, Any]:
    aid = uuid.UUID(allocation_id)
    async with sessions() as session:
        allocation = await session.get(Allocation, aid)
        events = (
            await session.execute(
                select(
                    AllocationEvent.event, AllocationEvent.from_status, AllocationEvent.to_status
                )
                .where(AllocationEvent.allocation_id == aid)
                .order_by(AllocationEvent.id)
            )
        ).all()
        claims = (
            await session.execute(
                select(AllocationResourceClaim.kind, AllocationResourceClaim.footprint)
                .where(AllocationResourceClaim.allocation_id == aid)
                .order_by(AllocationResourceClaim.footprint)
            )
        ).all()
        slots = (
            await session.scalars(select(GpuSlot.gpu_index).where(GpuSlot.allocation_id == aid))
        ).all()
        tasks = (
            await session.execute(
                select(NodeTask.id, NodeTask.kind).where(NodeTask.allocation_id == aid)
            )
        ).all()
    return {
        "allocation": allocation,
        "events": events,
        "claims": claims,
        "slots": slots,
        "tasks": tasks,
    }


async def test_a_slice_placement_is_written_whole_in_one_statement(
    db_sessions: Sessions, db_engine: AsyncEngine, make_ssh_key: Any
) -> None:
    await create_fleet(db_sessions, slice_nodes=2)
    project = await create_project(db_sessions)
    newer = await make_ssh_key(project, age=dt.timedelta(seconds=10))
    older = await make_ssh_key(project, age=dt.timedelta(seconds=100))
    request = _input(project, gpus=2, keys=[str(newer.id), str(older.id)])

    placement = await AllocationActivities(db_engine).place(request)

    reservation, plan = placement.reservation, placement.plan
    assert reservation.status == AllocationStatus.REQUESTED  # what the POST answers with
    assert [g.numa_node for g in reservation.gpus] == [0, 0]  # one NUMA node fits two GPUs
    assert plan.task_id == request.provision_task_id
    assert plan.task_kind == SLICE_VM_PROVISION
    assert plan.spec.ssh_public_keys == [older.public_key, newer.public_key]  # oldest first
    assert plan.spec.gpus == reservation.gpus
    assert (plan.spec.vcpus, plan.spec.memory_mb) == (16, 2 * 65536)

    rows = await _rows(db_sessions, request.allocation_id)
    allocation = rows["allocation"]
    assert allocation.status == AllocationStatus.REQUESTED  # the workflow moves it on
    assert allocation.provisioning_started_at is None
    assert str(allocation.node_id) == reservation.node_id
    assert sorted(allocation.ssh_key_ids) == sorted([newer.id, older.id])
    assert rows["events"] == [
        ("requested", None, "requested"),
        ("placement_reserved", None, None),
    ]
    indexes = sorted(g.gpu_index for g in reservation.gpus)
    assert sorted(rows["slots"]) == indexes
    assert [(kind, (r.lower, r.upper)) for kind, r in rows["claims"]] == [
        (ClaimKind.GPU_SLOT, (i, i + 1)) for i in indexes
    ]
    assert [(str(t), kind) for t, kind in rows["tasks"]] == [(plan.task_id, SLICE_VM_PROVISION)]


@pytest.mark.parametrize("sku", [SLICE_SKU, BAREMETAL_SKU])
async def test_capacity_another_transaction_holds_is_waited_for_not_refused(
    db_sessions: Sessions, db_engine: AsyncEngine, sku: str
) -> None:
    """A node or slot that a concurrent placement or release holds locked is contention, not a
    lack of capacity: placement ranks again until it is let go, and never answers
    sku_unavailable for it."""
    slice_nodes, baremetal_nodes = (1, 0) if sku == SLICE_SKU else (0, 1)
    [node] = await create_fleet(
        db_sessions, slice_nodes=slice_nodes, baremetal_nodes=baremetal_nodes
    )
    project = await create_project(db_sessions)
    request = _input(project, sku=sku, gpus=8)

    async with db_sessions() as holder, holder.begin():
        if sku == SLICE_SKU:  # one of the eight slots: the node can lock only seven
            held = select(GpuSlot).where(GpuSlot.node_id == node.id, GpuSlot.gpu_index == 0)
        else:  # the node itself
            held = select(Node).where(Node.id == node.id)
        await holder.execute(held.with_for_update())
        placing = asyncio.create_task(AllocationActivities(db_engine).place(request))
        await asyncio.sleep(HELD_WINDOW_S)
        assert not placing.done()  # neither refused nor placed while it is held

    placement = await asyncio.wait_for(placing, timeout=10)
    assert placement.reservation.node_id == str(node.id)
    assert len((await _rows(db_sessions, request.allocation_id))["claims"]) == (
        8 if sku == SLICE_SKU else 1
    )


@pytest.mark.parametrize(
    ("busy", "gpus", "expected"),
    [
        # NUMA 0 has 2 free (2, 3), NUMA 1 has 4 (4-7): the fullest NUMA node that fits wins.
        ([0, 1], 2, [2, 3]),
        ([0, 1], 4, [4, 5, 6, 7]),
        # A tie goes to the lower NUMA node.
        ([0, 4], 2, [1, 2]),
        # NUMA 0 has 2 free (2, 3), NUMA 1 has 3 (5-7): none fits 4, so the request is spread,
        # the NUMA node with the most free slots first.
        ([0, 1, 4], 4, [5, 6, 7, 2]),
    ],
)
async def test_slots_come_from_the_best_fitting_numa_node_else_spread_from_the_freest(
    db_sessions: Sessions, db_engine: AsyncEngine, busy: list[int], gpus: int, expected: list[int]
) -> None:
    [node] = await create_fleet(db_sessions, slice_nodes=1)  # GPUs 0-3 on NUMA 0, 4-7 on NUMA 1
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(GpuSlot)
            .where(GpuSlot.node_id == node.id, GpuSlot.gpu_index.in_(busy))
            .values(status=SlotStatus.DISABLED)
        )
    project = await create_project(db_sessions)
    request = _input(project, gpus=gpus)

    placement = await AllocationActivities(db_engine).place(request)

    assert [g.gpu_index for g in placement.reservation.gpus] == expected
    assert sorted((await _rows(db_sessions, request.allocation_id))["slots"]) == sorted(expected)
    async with db_sessions() as session:
        details = await session.scalar(
            select(AllocationEvent.details).where(
                AllocationEvent.allocation_id == uuid.UUID(request.allocation_id),
                AllocationEvent.event == "placement_reserved",
            )
        )
    assert details == {
        "claim": "gpu_slots",
        "numa_nodes": sorted({0 if i < 4 else 1 for i in expected}),
    }


async def test_a_baremetal_placement_claims_the_whole_node(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    nodes = await create_fleet(db_sessions, slice_nodes=0, baremetal_nodes=1)
    project = await create_project(db_sessions)
    request = _input(project, sku=BAREMETAL_SKU, gpus=8)

    placement = await AllocationActivities(db_engine).place(request)

    assert placement.reservation.node_id == str(nodes[0].id)
    assert placement.reservation.gpus == []
    assert placement.plan.task_kind == BAREMETAL_PROVISION_USER
    rows = await _rows(db_sessions, request.allocation_id)
    assert [(kind, r.lower, r.upper) for kind, r in rows["claims"]] == [
        (ClaimKind.NODE_EXCLUSIVE, 0, 2**31 - 1)
    ]
    assert rows["slots"] == []
    # The only node is taken: the next bare-metal request is refused, not queued.
    with pytest.raises(ApplicationError) as refused:
        await AllocationActivities(db_engine).place(_input(project, sku=BAREMETAL_SKU, gpus=8))
    assert refused.value.type == "sku_unavailable"


async def test_a_rerun_answers_the_same_placement_and_writes_nothing_more(
    db_sessions: Sessions, db_engine: AsyncEngine, make_ssh_key: Any
) -> None:
    await create_fleet(db_sessions, slice_nodes=1)
    project = await create_project(db_sessions)
    key = await make_ssh_key(project)
    request = _input(project, gpus=4, keys=[str(key.id)])
    activities = AllocationActivities(db_engine)

    first = await activities.place(request)
    before = await _rows(db_sessions, request.allocation_id)
    # A crash after the commit but before the workflow recorded the result runs it again.
    second = await activities.place(request)

    assert second.reservation == first.reservation
    assert second.plan == first.plan
    after = await _rows(db_sessions, request.allocation_id)
    for table in ("events", "claims", "slots", "tasks"):
        assert after[table] == before[table], table


async def test_an_allocation_an_older_build_left_requested_gets_its_host_task(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    """Older builds reserved in one transaction and began provisioning in a second: a crash in
    between left the allocation `requested`, holding its slot, with no host task. The rerun
    queues the task rather than placing it again (allocation.begin_provisioning moves it on)."""
    nodes = await create_fleet(db_sessions, slice_nodes=1)
    project = await create_project(db_sessions)
    request = _input(project, gpus=1)
    aid = uuid.UUID(request.allocation_id)
    async with db_sessions() as session, session.begin():
        slot = await session.scalar(
            select(GpuSlot).where(GpuSlot.node_id == nodes[0].id, GpuSlot.gpu_index == 5)
        )
        assert slot is not None
        session.add(
            Allocation(
                id=aid,
                project_id=project,
                sku=SLICE_SKU,
                region=REGION,
                shape="gpu_slice",
                gpu_count=1,
                node_id=nodes[0].id,
                status=AllocationStatus.REQUESTED,
                workflow_id=request.workflow_id,
            )
        )
        await session.flush()
        session.add_all(
            [
                AllocationEvent(allocation_id=aid, event="requested", to_status="requested"),
                AllocationEvent(allocation_id=aid, event="placement_reserved"),
                AllocationResourceClaim(
                    id=uuid.uuid4(),
                    allocation_id=aid,
                    node_id=nodes[0].id,
                    slot_id=slot.id,
                    kind=ClaimKind.GPU_SLOT,
                    footprint=Range(5, 6),
                    status="held",
                ),
            ]
        )
        slot.status, slot.allocation_id = SlotStatus.RESERVED, aid

    rerun = await AllocationActivities(db_engine).place(request)

    assert [g.gpu_index for g in rerun.reservation.gpus] == [5]  # the slot it held, no other
    assert rerun.plan.task_id == request.provision_task_id
    rows = await _rows(db_sessions, request.allocation_id)
    assert rows["allocation"].status == AllocationStatus.REQUESTED
    assert [e[0] for e in rows["events"]] == ["requested", "placement_reserved"]
    assert rows["slots"] == [5]
    assert [str(t) for t, _ in rows["tasks"]] == [request.provision_task_id]


@pytest.mark.parametrize(
    ("world", "code"),
    [
        ("key_of_another_project", "ssh_key_not_found"),
        ("sku_withdrawn", "sku_unavailable"),
        ("balance_depleted", "balance_depleted"),
    ],
)
async def test_refusals_write_nothing(
    db_sessions: Sessions, db_engine: AsyncEngine, make_ssh_key: Any, world: str, code: str
) -> None:
    await create_fleet(db_sessions, slice_nodes=1)
    # A project never credited has a balance of 0: depleted (docs/lifecycles/balance.md).
    project = await create_project(
        db_sessions, **({"credit_minor": 0} if world == "balance_depleted" else {})
    )
    keys: list[str] = []
    async with db_sessions() as session, session.begin():
        if world == "key_of_another_project":
            keys = [str((await make_ssh_key(await create_project(db_sessions))).id)]
        elif world == "sku_withdrawn":
            await session.execute(update(Sku).where(Sku.name == SLICE_SKU).values(active=False))
    request = _input(project, gpus=1, keys=keys)

    with pytest.raises(ApplicationError) as refused:
        await AllocationActivities(db_engine).place(request)

    assert refused.value.type == code
    assert refused.value.non_retryable
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(Allocation)) == 0
        assert await session.scalar(select(func.count()).select_from(NodeTask)) == 0
        reserved = await session.scalar(
            select(func.count()).select_from(GpuSlot).where(GpuSlot.status != SlotStatus.FREE)
        )
        assert reserved == 0


async def _blocked_on_a_lock(sessions: Sessions) -> bool:
    async with sessions() as session:
        waiting = await session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )
    return bool(waiting)


@pytest.mark.parametrize("sku", [SLICE_SKU, BAREMETAL_SKU])
async def test_an_account_depleted_while_placing_is_refused_by_the_reserving_statement(
    db_sessions: Sessions, db_engine: AsyncEngine, sku: str
) -> None:
    """The balance check is part of the statement that reserves, not only of the offer's read:
    a metering run that depletes the account (debit, then reclassification with the account row
    locked) while a placement is between the two cannot let the placement slip through. The
    placement waits for it, then writes nothing and answers balance_depleted."""
    await create_fleet(db_sessions, slice_nodes=1, baremetal_nodes=1)
    project = await create_project(db_sessions, credit_minor=100)
    request = _input(project, sku=sku, gpus=8 if sku == BAREMETAL_SKU else 2)

    async with db_sessions() as meter, meter.begin():
        # What the meter does (activities/billing/metering.py), in one open transaction.
        await post_entry(
            meter,
            project_id=project,
            amount_minor=-100,
            kind=EntryKind.USAGE_DEBIT,
            idempotency_key=f"usage:test:{project}",
        )
        account = await refresh_state(meter, project)
        assert account is not None
        assert account.state == "depleted"
        # The offer reads the committed state (still healthy) and passes; the reservation waits.
        placing = asyncio.create_task(AllocationActivities(db_engine).place(request))
        await eventually(lambda: _blocked_on_a_lock(db_sessions), timeout=10)
        assert not placing.done()

    with pytest.raises(ApplicationError) as refused:
        await asyncio.wait_for(placing, timeout=10)
    assert refused.value.type == "balance_depleted"
    assert refused.value.non_retryable
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(Allocation)) == 0
        assert await session.scalar(select(func.count()).select_from(AllocationResourceClaim)) == 0
        reserved = await session.scalar(
            select(func.count()).select_from(GpuSlot).where(GpuSlot.status != SlotStatus.FREE)
        )
        assert reserved == 0


async def _disable_slots(sessions: Sessions, node_id: uuid.UUID, indexes: list[int]) -> None:
    async with sessions() as session, session.begin():
        await session.execute(
            update(GpuSlot)
            .where(GpuSlot.node_id == node_id, GpuSlot.gpu_index.in_(indexes))
            .values(status=SlotStatus.DISABLED)
        )


async def test_nodes_where_one_numa_node_fits_rank_first_then_the_fullest(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    """docs/lifecycles/allocation.md#placement's ranking, read from the nodes' free-GPU counters
    through the placement index: a node where two GPUs fit only across NUMA nodes comes last even
    though it is the fullest; of the nodes where they fit in one, the fullest first; none with room
    is sku_unavailable."""
    spread, roomy, snug = await create_fleet(db_sessions, slice_nodes=3)  # NUMA 0: 0-3, 1: 4-7
    await _disable_slots(db_sessions, spread.id, [0, 1, 2, 4, 5, 6])  # free 3 | 7
    await _disable_slots(db_sessions, roomy.id, [0, 1])  # free 2, 3 | 4-7
    await _disable_slots(db_sessions, snug.id, [0, 1, 4, 5])  # free 2, 3 | 6, 7
    project = await create_project(db_sessions)
    activities = AllocationActivities(db_engine)

    placed = [(await activities.place(_input(project, gpus=2))).reservation for _ in range(6)]

    expected = [snug, snug, roomy, roomy, roomy, spread]
    assert [r.node_id for r in placed] == [str(n.id) for n in expected]
    assert sorted(g.gpu_index for g in placed[-1].gpus) == [3, 7]
    with pytest.raises(ApplicationError) as refused:
        await activities.place(_input(project, gpus=2))
    assert refused.value.type == "sku_unavailable"


HELD_NODES = 140  # more than any fixed number of candidates (the ranking used to lock among 128)


async def test_nodes_other_transactions_hold_are_passed_over_however_many(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    """Placement walks the ranking past every node that concurrent placements or releases hold
    locked, however many, to the best free one: it neither waits for them nor retries."""
    nodes = await create_fleet(db_sessions, slice_nodes=HELD_NODES + 1)
    last = max(nodes, key=lambda n: n.id)  # ranked last: equal counters, then by id
    project = await create_project(db_sessions)
    activities = AllocationActivities(db_engine, placement_deadline_seconds=5)

    async with db_sessions() as holder, holder.begin():
        await holder.execute(select(Node).where(Node.id != last.id).with_for_update())
        placement = await asyncio.wait_for(activities.place(_input(project, gpus=1)), timeout=3)

    assert placement.reservation.node_id == str(last.id)


async def test_with_the_numa_fitting_nodes_held_the_rest_are_tried_and_none_free_is_waited_for(
    db_sessions: Sessions, db_engine: AsyncEngine
) -> None:
    """The nodes where no NUMA node fits are tried when every one where one fits is held; and
    when every node with room is held, placement waits for them (contention), never answering
    sku_unavailable."""
    spread, snug = await create_fleet(db_sessions, slice_nodes=2)
    await _disable_slots(db_sessions, spread.id, [0, 1, 2, 4, 5, 6])  # free 3 | 7
    await _disable_slots(db_sessions, snug.id, [0, 1, 4, 5])  # free 2, 3 | 6, 7
    project = await create_project(db_sessions)
    activities = AllocationActivities(db_engine)
    held = select(Node).where(Node.id == snug.id).with_for_update()

    async with db_sessions() as holder, holder.begin():
        await holder.execute(held)
        placement = await asyncio.wait_for(activities.place(_input(project, gpus=2)), timeout=3)
    assert placement.reservation.node_id == str(spread.id)

    async with db_sessions() as holder, holder.begin():  # the only node left with room
        await holder.execute(held)
        placing = asyncio.create_task(activities.place(_input(project, gpus=2)))
        await asyncio.sleep(HELD_WINDOW_S)
        assert not placing.done()  # neither refused nor placed while it is held
    placement = await asyncio.wait_for(placing, timeout=10)
    assert placement.reservation.node_id == str(snug.id)
