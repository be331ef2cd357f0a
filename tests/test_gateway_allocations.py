"""Allocation reads and the paths of POST /allocations that need no control-plane worker: the read
model (lists, keyset pagination, detail), the idempotent fast path, and key reuse. Lifecycle
behaviour behind update-with-start is covered with the real worker elsewhere."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import allocation_workflow_id
from contracts.states import AllocationStatus
from gateway.allocations import allocation_id_for, request_fingerprint
from gateway.schemas import AllocationCreate
from schema.models import Allocation
from tests.factories import REGION, SLICE_SKU
from tests.test_gateway_auth import assert_error

DETAIL_FIELDS = {
    "allocation_id", "project_id", "status", "sku", "region", "shape", "gpu_count", "node_id",
    "ssh_key_ids", "idempotency_key", "workflow_id", "failure_reason", "failure_message",
    "connect_host", "hard_stopped", "release_requested_by", "release_attempts", "created_at",
    "provisioning_started_at", "active_at", "releasing_at", "released_at", "release_failed_at",
    "failed_at", "detached_at", "updated_at", "allocation_group_id",
}  # fmt: skip


@pytest.fixture
async def world(api, make_project, make_token, make_allocation):
    """Two projects; ours has five allocations a minute apart, theirs one."""
    ours, theirs = await make_project(), await make_project()
    base = dt.datetime(2026, 4, 18, 1, 0, tzinfo=dt.UTC)
    statuses = [
        AllocationStatus.ACTIVE,
        AllocationStatus.RELEASED,
        AllocationStatus.ACTIVE,
        AllocationStatus.FAILED,
        AllocationStatus.PROVISIONING,
    ]
    rows = [
        await make_allocation(ours, status=s, created_at=base + dt.timedelta(minutes=i))
        for i, s in enumerate(statuses)
    ]
    other = await make_allocation(theirs, status=AllocationStatus.ACTIVE)
    tenant = await api(token=await make_token("tenant", ours))
    admin = await api(token=await make_token("admin"))
    return {"ours": ours, "theirs": theirs, "rows": rows, "other": other,
            "tenant": tenant, "admin": admin}  # fmt: skip


async def test_tenant_list_is_scoped_newest_first_and_filtered(world):
    tenant = world["tenant"]
    listing = (await tenant.get("/api/v1/allocations")).json()
    expected = [str(r.id) for r in reversed(world["rows"])]
    assert [i["allocation_id"] for i in listing["items"]] == expected
    assert listing["next_cursor"] is None
    active = (await tenant.get("/api/v1/allocations", params={"status": "active"})).json()
    assert {i["allocation_id"] for i in active["items"]} == {
        str(world["rows"][0].id),
        str(world["rows"][2].id),
    }
    assert all(i["project_id"] == str(world["ours"].id) for i in listing["items"])


async def test_keyset_pagination_walks_every_row_once(world):
    tenant = world["tenant"]
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await tenant.get("/api/v1/allocations", params=params)).json()
        seen += [i["allocation_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [str(r.id) for r in reversed(world["rows"])]


async def test_admin_list_spans_projects_and_filters(world):
    admin = world["admin"]
    everything = (await admin.get("/api/v1/admin/allocations")).json()["items"]
    assert len(everything) == 6
    theirs = await admin.get(
        "/api/v1/admin/allocations", params={"project_id": str(world["theirs"].id)}
    )
    assert [i["allocation_id"] for i in theirs.json()["items"]] == [str(world["other"].id)]
    failed = await admin.get("/api/v1/admin/allocations", params={"status": "failed"})
    assert [i["allocation_id"] for i in failed.json()["items"]] == [str(world["rows"][3].id)]
    on_node = world["rows"][4]  # each allocation of the fixture has a node of its own
    there = await admin.get("/api/v1/admin/allocations", params={"node_id": str(on_node.node_id)})
    assert [(i["allocation_id"], i["node_id"]) for i in there.json()["items"]] == [
        (str(on_node.id), str(on_node.node_id))
    ]
    active_there = await admin.get(
        "/api/v1/admin/allocations",
        params={"node_id": str(on_node.node_id), "status": "active"},
    )
    assert active_there.json()["items"] == []
    page = (await admin.get("/api/v1/admin/allocations", params={"limit": 4})).json()
    assert len(page["items"]) == 4
    rest = await admin.get(
        "/api/v1/admin/allocations", params={"limit": 4, "cursor": page["next_cursor"]}
    )
    assert len(rest.json()["items"]) == 2


async def test_detail_is_the_full_read_model(world, make_allocation):
    tenant, admin = world["tenant"], world["admin"]
    failed = await make_allocation(
        world["ours"],
        status=AllocationStatus.FAILED,
        failure_reason="vfio_error",
        failure_message="VFIO bind required but host wrong",
        release_attempts=0,
        failed_at=dt.datetime.now(dt.UTC),
    )
    mine = await tenant.get(f"/api/v1/allocations/{failed.id}")
    assert mine.status_code == 200
    body = mine.json()
    assert set(body) == DETAIL_FIELDS
    assert body["status"] == "failed"
    assert body["failure_reason"] == "vfio_error"
    assert body["failure_message"] == "VFIO bind required but host wrong"
    assert body["failed_at"] is not None
    assert body["workflow_id"] == allocation_workflow_id(str(failed.id))
    assert body["allocation_group_id"] is None  # asked for alone, not in a group
    as_admin = await admin.get(f"/api/v1/admin/allocations/{failed.id}")
    assert as_admin.json() == body
    assert_error(await admin.get(f"/api/v1/admin/allocations/{uuid.uuid4()}"), 404, "not_found")


async def test_idempotent_replay_from_the_read_model(
    api, make_project, make_token, make_ssh_key, make_allocation, temporal_client, count_rows
):
    project = await make_project()
    key = await make_ssh_key(project)
    idem = "order-7781"
    allocation_id = allocation_id_for(project.id, idem)
    await make_allocation(
        project,
        allocation_id=allocation_id,
        idempotency_key=idem,
        gpus=2,
        ssh_key_ids=[key.id],
        status=AllocationStatus.ACTIVE,
    )
    client = await api(token=await make_token("tenant", project))
    body = {"sku": SLICE_SKU, "gpus": 2, "region": REGION, "ssh_key_ids": [str(key.id)]}

    replay = await client.post(
        "/api/v1/allocations", json=body, headers={"X-Idempotency-Key": idem}
    )
    assert replay.status_code == 201, replay.text
    assert replay.headers["idempotent-replayed"] == "true"
    answer = replay.json()
    assert answer["allocation_id"] == str(allocation_id)
    assert answer["status"] == "requested"  # the answer the reservation gave
    assert answer["gpu_count"] == 2
    assert answer["sku"] == SLICE_SKU
    # Answered from the read model: no workflow call was needed.
    with pytest.raises(RPCError) as missing:
        await temporal_client.get_workflow_handle(
            allocation_workflow_id(str(allocation_id))
        ).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND

    reused = await client.post(
        "/api/v1/allocations", json={**body, "gpus": 4}, headers={"X-Idempotency-Key": idem}
    )
    assert_error(reused, 422, "idempotency_key_reused")
    assert await count_rows(Allocation) == 1

    # The same key in another project is another allocation id.
    other = await make_project()
    assert allocation_id_for(other.id, idem) != allocation_id


def test_fingerprint_is_canonical():
    a, b = uuid.uuid4(), uuid.uuid4()
    first = AllocationCreate(sku="s", gpus=1, region="r", ssh_key_ids=[a, b])
    same = AllocationCreate(sku="s", gpus=1, region="r", ssh_key_ids=[b, a, b])
    other = AllocationCreate(sku="s", gpus=2, region="r", ssh_key_ids=[a, b])
    assert request_fingerprint(first) == request_fingerprint(same)
    assert request_fingerprint(first) != request_fingerprint(other)
    assert len(request_fingerprint(first)) == 64
