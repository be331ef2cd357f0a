"""Usage metering and balance enforcement on real Temporal and PostgreSQL: charges right to the
minor unit, never twice, nothing for a failed release, and a depleted account's allocations
released through their own workflows."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from activities.billing import metering
from activities.billing.ledger import check_running_totals, ledger_sum_minor
from activities.billing.metering import BillingActivities, cumulative_charge
from contracts.allocation import allocation_workflow_id
from contracts.billing_meter import MeterInput
from contracts.host_tasks import SLICE_VM_RELEASE, HostErrorType
from schema.models import (
    Allocation,
    AllocationResourceClaim,
    BillingEvent,
    GpuSlot,
    LedgerEntry,
    UsageRecord,
)
from tests.factories import STARTING_CREDIT_MINOR
from tests.histories import record_history
from tests.lifecycle_support import baremetal_request, create_fleet, slice_request, wait_status
from workflows.billing_meter import BillingMeterWorkflow

pytestmark = pytest.mark.usefixtures("control_plane")
PRICE = 250  # minor units per GPU-hour in tests/factories.create_sku
WINDOW = dt.timedelta(seconds=metering.WINDOW_SECONDS)


async def meter(client: Any, settings: Any, until: dt.datetime, record: bool = False) -> Any:
    handle = await client.start_workflow(
        BillingMeterWorkflow.run,
        MeterInput(until=until.isoformat()),
        id=f"billing-meter-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    result = await handle.result()
    if record:
        await record_history(handle, "billing_meter", "meter_and_force_release")
    return result


async def usage_of(db_sessions: Any, allocation_id: str) -> UsageRecord:
    async with db_sessions() as session:
        record = await session.scalar(
            select(UsageRecord).where(UsageRecord.allocation_id == uuid.UUID(allocation_id))
        )
        assert record is not None
        return record


async def charged(db_sessions: Any, project_id: uuid.UUID) -> int:
    async with db_sessions() as session:
        total = await session.scalar(
            select(func.coalesce(func.sum(LedgerEntry.amount_minor), 0)).where(
                LedgerEntry.project_id == project_id, LedgerEntry.kind == "usage_debit"
            )
        )
    return -int(total or 0)


@pytest.fixture
async def tenant(api: Any, make_project: Any, make_token: Any) -> tuple[Any, Any]:
    project = await make_project()
    return project, await api(token=await make_token("tenant", project))


async def test_usage_is_charged_per_window_exactly_once(
    tenant: tuple[Any, Any], db_sessions: Any, start_node_agent: Any, temporal_client: Any,
    settings: Any,
) -> None:  # fmt: skip
    project, client = tenant
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    allocation_id = (await client.post("/api/v1/allocations", json=slice_request(2))).json()[
        "allocation_id"
    ]
    await wait_status(client, allocation_id, "active")
    record = await usage_of(db_sessions, allocation_id)
    assert record.ended_at is None
    assert record.price_per_gpu_hour_minor == PRICE

    ten_and_a_half = record.started_at + dt.timedelta(minutes=10, seconds=30)
    first = await meter(temporal_client, settings, ten_and_a_half)
    assert first.debits_posted == 10  # whole windows only while the allocation runs
    expected = cumulative_charge(PRICE, 2, dt.timedelta(minutes=10))
    assert await charged(db_sessions, project.id) == expected == 83  # ⌊500 · 10/60⌋
    # The same run again (a retry, a replay, an overlapping schedule run): nothing more.
    again = await meter(temporal_client, settings, ten_and_a_half)
    assert again.debits_posted == 0
    both = await asyncio.gather(
        BillingActivities(db_sessions).meter(MeterInput(until=ten_and_a_half.isoformat())),
        BillingActivities(db_sessions).meter(MeterInput(until=ten_and_a_half.isoformat())),
    )
    assert sum(r.debits_posted for r in both) == 0
    assert await charged(db_sessions, project.id) == expected

    # (The runs above billed ahead of the clock; in production `until` is now. A release now
    # ends the usage before what was already billed, so nothing more is charged.)
    await client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(client, allocation_id, "released")
    await meter(temporal_client, settings, ten_and_a_half + dt.timedelta(hours=5))
    assert await charged(db_sessions, project.id) == expected
    total = expected

    usage = (await client.get("/api/v1/billing/usage")).json()["items"]
    assert [(u["allocation_id"], u["charged_minor"]) for u in usage] == [(allocation_id, total)]


async def test_a_failed_release_is_not_charged(
    tenant: tuple[Any, Any], db_sessions: Any, start_node_agent: Any, temporal_client: Any,
    settings: Any,
) -> None:  # fmt: skip
    project, client = tenant
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    allocation_id = (await client.post("/api/v1/allocations", json=slice_request(1))).json()[
        "allocation_id"
    ]
    await wait_status(client, allocation_id, "active")
    agent.host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=3)
    await client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(client, allocation_id, "release_failed")
    closed = await usage_of(db_sessions, allocation_id)
    assert closed.ended_at is not None, "billing stops at release_failed"

    await client.post(f"/api/v1/allocations/{allocation_id}/release")  # retry succeeds later
    await wait_status(client, allocation_id, "released")
    assert (await usage_of(db_sessions, allocation_id)).ended_at == closed.ended_at
    await meter(temporal_client, settings, closed.ended_at + dt.timedelta(days=1))
    assert await charged(db_sessions, project.id) == cumulative_charge(
        PRICE, 1, closed.ended_at - closed.started_at
    )


async def test_low_then_depleted_force_releases_through_the_workflows(
    db_sessions: Any, start_node_agent: Any, temporal_client: Any, settings: Any, api: Any,
    make_token: Any, make_project: Any,
) -> None:  # fmt: skip
    project = await make_project(credit_minor=0)
    client = await api(token=await make_token("tenant", project))
    admin = await api(token=await make_token("admin"))
    credit = {"amount_minor": 1200, "idempotency_key": "topup-1", "reason": "trial credit"}
    url = f"/api/v1/admin/billing/accounts/{project.id}/credits"
    first = await admin.post(url, json=credit)
    assert first.status_code == 201, first.text
    assert (await admin.post(url, json=credit)).json()["created"] is False  # idempotent
    assert (await client.get("/api/v1/billing/balance")).json()["balance_minor"] == 1200
    assert (await client.post(url, json=credit)).status_code == 403

    nodes = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(nodes[0].id)
    ids = [
        (await client.post("/api/v1/allocations", json=slice_request(2))).json()["allocation_id"]
        for _ in range(2)
    ]
    for allocation_id in ids:
        await wait_status(client, allocation_id, "active")
    start = (await usage_of(db_sessions, ids[0])).started_at

    # 2 allocations x 2 GPUs x 250/h = 1000/h: 15 minutes later 250 are spent, 950 left.
    await meter(temporal_client, settings, start + dt.timedelta(minutes=15, seconds=30))
    balance = (await client.get("/api/v1/billing/balance")).json()
    assert balance["state"] == "low_balance"
    assert 940 <= balance["balance_minor"] <= 960
    await meter(temporal_client, settings, start + dt.timedelta(minutes=20, seconds=30))

    # Past 72 minutes the credit is gone: depleted, and both are released by their workflows.
    result = await meter(
        temporal_client, settings, start + dt.timedelta(minutes=75, seconds=30), record=True
    )
    assert sorted(result.allocations_to_release) == sorted(ids)
    for allocation_id in ids:
        final = await wait_status(client, allocation_id, "released")
        assert final["release_requested_by"] == "billing"
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(ids[0])),
        "allocation",
        "billing_force_release",
    )
    assert (await client.get("/api/v1/billing/balance")).json()["state"] == "depleted"
    refused = await client.post("/api/v1/allocations", json=slice_request(1))
    assert refused.status_code == 402
    assert refused.json()["error"]["code"] == "balance_depleted"

    await meter(temporal_client, settings, start + dt.timedelta(minutes=80))
    async with db_sessions() as session:
        notices = await session.scalar(
            select(func.count()).where(
                BillingEvent.project_id == project.id, BillingEvent.event == "low_balance_notified"
            )
        )
    assert notices == 1, "one low-balance notice per episode"
    # The outbox the tenant reads: each kind once in this episode, newest first, however often
    # the meter ran (no webhook: nothing to deliver).
    listed = (await client.get("/api/v1/notifications")).json()
    assert [(n["kind"], n["delivery_status"]) for n in listed["items"]] == [
        ("depleted", "none"),
        ("low_balance", "none"),
    ]
    assert listed["items"][0]["details"]["balance_minor"] <= 0
    assert listed["next_cursor"] is None

    # A top-up lifts `depleted` at once: the next POST is placed, with no meter run between.
    topup = {"amount_minor": 100_000, "idempotency_key": "topup-2", "reason": "paid by wire"}
    assert (await admin.post(url, json=topup)).status_code == 201
    assert (await client.get("/api/v1/billing/balance")).json()["state"] == "healthy"
    placed = await client.post("/api/v1/allocations", json=slice_request(1))
    assert placed.status_code == 201, placed.text


async def test_closed_usage_is_charged_through_its_last_partial_window(
    tenant: tuple[Any, Any], db_sessions: Any, start_node_agent: Any, temporal_client: Any,
    settings: Any,
) -> None:  # fmt: skip
    project, client = tenant
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    allocation_id = (await client.post("/api/v1/allocations", json=slice_request(2))).json()[
        "allocation_id"
    ]
    await wait_status(client, allocation_id, "active")
    # Stand in for 150 s of use: move the window's start back (nothing billed yet).
    async with db_sessions() as session, session.begin():
        record = await session.scalar(
            select(UsageRecord).where(UsageRecord.allocation_id == uuid.UUID(allocation_id))
        )
        assert record is not None
        record.started_at -= dt.timedelta(seconds=150)
        record.billed_until = record.started_at
    await client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(client, allocation_id, "released")
    record = await usage_of(db_sessions, allocation_id)
    assert record.ended_at is not None
    result = await meter(temporal_client, settings, record.ended_at + dt.timedelta(hours=1))
    assert result.debits_posted == 3  # two whole minutes and the partial third
    total = cumulative_charge(PRICE, 2, record.ended_at - record.started_at)
    assert await charged(db_sessions, project.id) == total >= 20  # ⌊500 · 150 s / 1 h⌋ = 20


async def test_a_project_never_credited_is_depleted_and_cannot_allocate(
    db_sessions: Any, start_node_agent: Any, api: Any, make_token: Any, make_project: Any,
    count_rows: Any,
) -> None:  # fmt: skip
    """docs/lifecycles/balance.md: a balance of 0 is depleted. A new project is refused (402,
    nothing reserved) until it is credited, and the credit lifts the state at once."""
    project = await make_project(credit_minor=0)
    client = await api(token=await make_token("tenant", project))
    admin = await api(token=await make_token("admin"))
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)

    balance = (await client.get("/api/v1/billing/balance")).json()
    assert (balance["balance_minor"], balance["state"]) == (0, "depleted")
    for body in (slice_request(1), baremetal_request()):
        refused = await client.post("/api/v1/allocations", json=body)
        assert refused.status_code == 402, refused.text
        assert refused.json()["error"]["code"] == "balance_depleted"
    assert await count_rows(Allocation) == 0
    assert await count_rows(GpuSlot, status="reserved") == 0
    assert await count_rows(AllocationResourceClaim) == 0

    url = f"/api/v1/admin/billing/accounts/{project.id}/credits"
    credit = {"amount_minor": 5000, "idempotency_key": "first", "reason": "welcome credit"}
    assert (await admin.post(url, json=credit)).status_code == 201
    balance = (await client.get("/api/v1/billing/balance")).json()
    assert (balance["balance_minor"], balance["state"]) == (5000, "healthy")
    placed = await client.post("/api/v1/allocations", json=slice_request(1))
    assert placed.status_code == 201, placed.text
    await wait_status(client, placed.json()["allocation_id"], "active")
    assert (await client.get("/api/v1/notifications")).json()["items"] == []


async def test_the_meter_bills_in_batches_and_the_usage_export_pages_as_json_and_csv(
    tenant: tuple[Any, Any], db_sessions: Any, start_node_agent: Any, temporal_client: Any,
    settings: Any, make_token: Any, api: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Issue 37 item 5: batches of records, one transaction each, still once per window; the
    balance is the running total and equals the ledger's sum; the usage export reads usage
    records (their charged_minor), a page at a time, as JSON or CSV."""
    project, client = tenant
    monkeypatch.setattr(metering, "BATCH_RECORDS", 2)  # three records: two batches
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    ids = []
    for gpus in (1, 2, 4):
        placed = await client.post("/api/v1/allocations", json=slice_request(gpus))
        assert placed.status_code == 201, placed.text
        ids.append(placed.json()["allocation_id"])
    for allocation_id in ids:
        await wait_status(client, allocation_id, "active")
    records = [await usage_of(db_sessions, a) for a in ids]
    until = max(r.started_at for r in records) + dt.timedelta(minutes=5, seconds=10)
    first = await meter(temporal_client, settings, until)
    assert first.records_billed == 3
    expected = {
        str(r.id): cumulative_charge(
            PRICE, r.gpu_count, ((until - r.started_at) // WINDOW) * WINDOW
        )
        for r in records
    }
    assert first.charged_minor == sum(expected.values()) == await charged(db_sessions, project.id)
    again = await meter(temporal_client, settings, until)
    assert (again.debits_posted, again.charged_minor) == (0, 0)
    async with db_sessions() as session:
        assert await check_running_totals(session) == []
        assert await ledger_sum_minor(session, project.id) == STARTING_CREDIT_MINOR - sum(
            expected.values()
        )
    balance = (await client.get("/api/v1/billing/balance")).json()
    assert balance["balance_minor"] == STARTING_CREDIT_MINOR - sum(expected.values())

    # JSON pages, newest first, following next_cursor.
    page = (await client.get("/api/v1/billing/usage", params={"limit": 2})).json()
    assert len(page["items"]) == 2
    assert page["next_cursor"] is not None
    rest = (
        await client.get(
            "/api/v1/billing/usage", params={"limit": 2, "cursor": page["next_cursor"]}
        )
    ).json()
    assert rest["next_cursor"] is None
    items = page["items"] + rest["items"]
    # Newest usage first: by when each allocation's usage started, which concurrent provisions
    # need not give in the order they were POSTed.
    assert sorted(u["allocation_id"] for u in items) == sorted(ids)
    starts = [u["started_at"] for u in items]
    assert starts == sorted(starts, reverse=True)
    assert {u["usage_record_id"]: u["charged_minor"] for u in items} == expected
    assert {u["currency"] for u in items} == {"usd"}

    # CSV: by ?format=csv or by Accept; the next cursor in X-Next-Cursor.
    as_csv = await client.get("/api/v1/billing/usage", params={"limit": 2, "format": "csv"})
    assert as_csv.status_code == 200, as_csv.text
    assert as_csv.headers["content-type"].startswith("text/csv")
    assert as_csv.headers["x-next-cursor"] == page["next_cursor"]
    assert 'rel="next"' in as_csv.headers["link"]
    rows = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [r["usage_record_id"] for r in rows] == [u["usage_record_id"] for u in page["items"]]
    assert [int(r["charged_minor"]) for r in rows] == [u["charged_minor"] for u in page["items"]]
    accepted = await client.get(
        "/api/v1/billing/usage",
        params={"cursor": page["next_cursor"], "limit": 2},
        headers={"Accept": "text/csv"},
    )
    assert accepted.headers["content-type"].startswith("text/csv")
    assert "x-next-cursor" not in accepted.headers
    assert [r["allocation_id"] for r in csv.DictReader(io.StringIO(accepted.text))] == [
        u["allocation_id"] for u in rest["items"]
    ]
    unknown = await client.get("/api/v1/billing/usage", params={"format": "xml"})
    assert unknown.status_code == 422
    assert unknown.json()["error"]["code"] == "unknown_format"
    bad_cursor = await client.get("/api/v1/billing/usage", params={"cursor": "nope"})
    assert bad_cursor.status_code == 400

    # Admins page any project's usage the same way.
    admin = await api(token=await make_token("admin"))
    url = f"/api/v1/admin/billing/accounts/{project.id}"
    account = (await admin.get(url)).json()
    assert account["balance"]["balance_minor"] == balance["balance_minor"]
    assert [u["allocation_id"] for u in account["usage"]] == [u["allocation_id"] for u in items]
    admin_csv = await admin.get(f"{url}/usage", params={"format": "csv"})
    assert len(list(csv.DictReader(io.StringIO(admin_csv.text)))) == 3
