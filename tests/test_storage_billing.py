"""Storage as a billed product (issue 37 item 3), end to end on the real stack: namespaces
created and attached through the API, the real worker and node agent, the meter driven through
its `until` the way tests/test_billing.py drives it.

- A namespace is billed for its provisioned quota per GB-hour at the storage catalog's price, in
  the account's currency, per window under the idempotency key (storage record, window): the
  debits equal quota GB * hours * price within one window's rounding, and a meter run again
  (or two at once) charges nothing twice. The namespace view shows the provider's measure of
  the bytes stored, taken by the meter.
- A depleted project is refused a namespace; once depleted longer than its grace period, its
  attachments are detached through their own workflows (actor billing), and the data stays.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import Client

from activities.billing.ledger import check_running_totals
from activities.billing.metering import BillingActivities
from activities.billing.storage_usage import (
    DEFAULT_STORAGE_PRICES_MICRO_MINOR,
    storage_cumulative_charge,
)
from contracts.billing_meter import MeterInput, MeterResult
from schema.models import (
    BillingAccount,
    BillingEvent,
    LedgerEntry,
    StorageAttachmentEvent,
    StoragePrice,
    StorageUsageRecord,
)
from tests import test_storage_attachments as attachment_tests
from tests.histories import record_history
from tests.lifecycle_support import Tenant, wait_status
from tests.test_storage_attachments import (
    StartStorageAgent,
    active_allocation,
    attach,
    create_namespace,
    mounted_points,
    transitions,
    wait_attachment,
)
from workflows.billing_meter import BillingMeterWorkflow

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(__import__("os").geteuid() != 0, reason="bind mounts need root"),
]
GB = 10**9
MIB = 1 << 20
# The attachment tests' export (autouse: set for the worker before it starts) and node agents.
storage_root = attachment_tests.storage_root
start_storage_agent = attachment_tests.start_storage_agent


async def meter(
    client: Client, settings: Any, until: dt.datetime, record: str | None = None
) -> MeterResult:
    handle = await client.start_workflow(
        BillingMeterWorkflow.run,
        MeterInput(until=until.isoformat()),
        id=f"billing-meter-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    result: MeterResult = await handle.result()
    if record:
        await record_history(handle, "billing_meter", record)
    return result


async def storage_record(db_sessions: Any, namespace_id: str) -> StorageUsageRecord:
    async with db_sessions() as session:
        record = await session.scalar(
            select(StorageUsageRecord).where(
                StorageUsageRecord.namespace_id == uuid.UUID(namespace_id)
            )
        )
    assert record is not None
    found: StorageUsageRecord = record
    return found


async def storage_debits(db_sessions: Any, project_id: uuid.UUID) -> list[LedgerEntry]:
    async with db_sessions() as session:
        return list(
            await session.scalars(
                select(LedgerEntry).where(
                    LedgerEntry.project_id == project_id, LedgerEntry.kind == "storage_debit"
                )
            )
        )


async def set_catalog_price(db_sessions: Any, price: int) -> None:
    """The operator's storage catalog entry (catalog data, like tests/factories.create_sku)."""
    async with db_sessions() as session, session.begin():
        session.add(
            StoragePrice(
                provider="shared_directory", currency="usd", price_per_gb_hour_micro_minor=price
            )
        )


async def test_a_namespace_is_billed_per_gb_hour_of_its_quota_exactly_once(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client, settings: Any,
) -> None:  # fmt: skip
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    price = 20_000  # µ-minor per GB-hour: 0.02 cents, the catalog's, not the default
    await set_catalog_price(db_sessions, price)
    quota = 2_000 * GB
    namespace = await create_namespace(tenant.client, "billed", quota_bytes=quota)
    assert namespace["used_bytes"] is None
    assert namespace["usage_measured_at"] is None
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    (node.mount_dir(aid) / "data.bin").write_bytes(b"\x01" * (3 * MIB))

    record = await storage_record(db_sessions, namespace["id"])
    assert (record.quota_bytes, record.price_per_gb_hour_micro_minor, record.currency) == (
        quota,
        price,
        "usd",
    )
    hours = 10
    until = record.started_at + dt.timedelta(hours=hours, seconds=30)
    first = await meter(temporal_client, settings, until)
    debits = await storage_debits(db_sessions, tenant.project_id)
    charged = -sum(d.amount_minor for d in debits)
    # quota GB * hours * price, within one window's rounding (the windows add up exactly to the
    # whole usage rounded down once).
    exact = quota / GB * hours * price / 1e6
    assert charged == storage_cumulative_charge(price, quota, dt.timedelta(hours=hours))
    assert 0 <= exact - charged < 1, (exact, charged)
    assert charged > 0
    assert first.storage_charged_minor == charged
    assert first.storage_debits_posted == len(debits)
    assert {d.currency for d in debits} == {"usd"}
    assert all(d.storage_usage_record_id == record.id for d in debits)
    assert len({d.idempotency_key for d in debits}) == len(debits)

    # The same run again, and two at once (a retry, a replay, an overlapping schedule run):
    # nothing more.
    again = await meter(temporal_client, settings, until)
    assert (again.storage_debits_posted, again.storage_charged_minor) == (0, 0)
    both = await asyncio.gather(
        BillingActivities(db_sessions).meter(MeterInput(until=until.isoformat())),
        BillingActivities(db_sessions).meter(MeterInput(until=until.isoformat())),
    )
    assert sum(r.storage_debits_posted for r in both) == 0
    assert -sum(d.amount_minor for d in await storage_debits(db_sessions, tenant.project_id)) == (
        charged
    )
    assert (await storage_record(db_sessions, namespace["id"])).charged_minor == charged
    async with db_sessions() as session:
        assert await check_running_totals(session, project_id=tenant.project_id) == []

    # The meter measured the bytes stored (the provider's accounting, not on any tenant's path).
    view = (await tenant.client.get(f"/api/v1/storage/namespaces/{namespace['id']}")).json()
    assert view["used_bytes"] >= 3 * MIB
    assert view["usage_measured_at"] is not None
    assert view["quota_bytes"] == quota
    (listed,) = (await tenant.client.get("/api/v1/storage/namespaces")).json()["items"]
    assert listed["used_bytes"] == view["used_bytes"]

    # Deleted: billing stops there (the runs above billed ahead of the clock; a delete now ends
    # the usage before what was already billed, so nothing more is charged).
    await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    deleted = await tenant.client.delete(f"/api/v1/storage/namespaces/{namespace['id']}")
    assert deleted.status_code == 202, deleted.text
    assert (await storage_record(db_sessions, namespace["id"])).ended_at is not None
    later = await meter(temporal_client, settings, until + dt.timedelta(hours=5))
    assert later.storage_debits_posted == 0
    assert len(await storage_debits(db_sessions, tenant.project_id)) == len(debits)


async def test_a_depleted_project_keeps_its_data_and_loses_its_attachments_after_the_grace(
    api: Any, make_project: Any, make_token: Any, db_sessions: Any,
    start_storage_agent: StartStorageAgent, storage_root: Path, temporal_client: Client,
    settings: Any,
) -> None:  # fmt: skip
    project = await make_project(credit_minor=1_500)  # above the low-balance threshold
    client = await api(token=await make_token("tenant", project))
    tenant = Tenant(client, project.id, "", "")
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(client, "kept", quota_bytes=5_000 * GB)
    attachment = await attach(client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(client, allocation_id, aid, "mounted")
    (node.mount_dir(aid) / "model.bin").write_bytes(b"weights")
    data = storage_root / "namespaces" / namespace["id"] / "model.bin"
    record = await storage_record(db_sessions, namespace["id"])
    assert record.price_per_gb_hour_micro_minor == DEFAULT_STORAGE_PRICES_MICRO_MINOR["usd"]

    # A process on the node keeps the mount busy while the balance runs out: the billing release
    # fences the tenant, and the storage detach it then tries fails (detach_failed).
    with (node.mount_dir(aid) / "open.log").open("w"):
        depleting = await meter(
            temporal_client, settings, record.started_at + dt.timedelta(hours=6)
        )
        assert f"{project.id}:low_balance->depleted" in depleting.state_changes or (
            f"{project.id}:healthy->depleted" in depleting.state_changes
        ), depleting.state_changes
        assert depleting.storage_charged_minor > 0
        assert depleting.attachments_to_detach == []  # the grace has only begun
        await wait_status(client, allocation_id, "release_failed")
        failed = await wait_attachment(client, allocation_id, aid, "detach_failed")
    assert (await client.get("/api/v1/billing/balance")).json()["state"] == "depleted"

    # A depleted project is refused a namespace.
    refused = await client.post(
        "/api/v1/storage/namespaces", json={"name": "more", "quota_bytes": MIB}
    )
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["code"] == "balance_depleted"

    async with db_sessions() as session:
        account = await session.get(BillingAccount, project.id)
        assert account is not None
        depleted_since, grace = account.state_changed_at, account.storage_grace_seconds
    assert grace == 72 * 3600  # the policy's default
    grace_ends = depleted_since + dt.timedelta(seconds=grace)

    # Within the grace: nothing is detached (the storage is still billed).
    within = await meter(temporal_client, settings, grace_ends - dt.timedelta(minutes=1))
    assert within.attachments_to_detach == []
    assert within.storage_debits_posted > 0
    still = (await client.get(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")).json()
    assert still["status"] == "detach_failed"
    assert still["detach_attempts"] == failed["detach_attempts"]

    # After it: the attachment is detached through its own workflow; the data is kept.
    after = await meter(
        temporal_client, settings, grace_ends + dt.timedelta(minutes=1), record="storage_grace"
    )
    assert after.attachments_to_detach == [aid]
    await wait_attachment(client, allocation_id, aid, "detached")
    assert str(node.mount_dir(aid)) not in mounted_points()
    assert data.read_bytes() == b"weights"
    view = (await client.get(f"/api/v1/storage/namespaces/{namespace['id']}")).json()
    assert view["status"] == "active"
    assert (await transitions(db_sessions, aid))[-2:] == ["detaching", "detached"]
    async with db_sessions() as session:
        actors = list(
            await session.scalars(
                select(StorageAttachmentEvent.actor)
                .where(StorageAttachmentEvent.attachment_id == uuid.UUID(aid))
                .order_by(StorageAttachmentEvent.id)
            )
        )
        events = list(
            await session.scalars(
                select(BillingEvent).where(
                    BillingEvent.project_id == project.id,
                    BillingEvent.event == "storage_grace_detach",
                )
            )
        )
    assert actors[-2:] == ["billing", "billing"]
    assert [e.details["attachment_ids"] for e in events] == [[aid]]
    # On the allocation's timeline: the second unmount, the one that went through.
    timeline = (await client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    unmounts = [i for i in timeline["items"] if i.get("name") == "storage.unmount"]
    assert [u["status"] for u in unmounts][-1] == "succeeded"

    # Nothing left to detach: a later run asks for nothing.
    final = await meter(temporal_client, settings, grace_ends + dt.timedelta(minutes=5))
    assert final.attachments_to_detach == []
