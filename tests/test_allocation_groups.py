"""Allocation groups end to end through the HTTP API (docs/lifecycles/allocation-group.md): every
group transition and side transition, idempotent creation and release under races, anti-affinity
under concurrent placement, on real Temporal, real PostgreSQL and nodes of the enrolled fleet
(tests/enrolled_fleet.py: onboarded through the admin API, each agent enrolled), whose agents'
simulated hosts inject the faults."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select, text

from contracts.allocation import allocation_workflow_id
from contracts.allocation_group import allocation_group_workflow_id
from contracts.host_tasks import SLICE_VM_PROVISION, SLICE_VM_RELEASE, HostErrorType
from contracts.states import AllocationGroupStatus
from schema.models import AllocationEvent, AllocationGroupEvent, AuditEntry, NodeTask
from sim.config import SimHostConfig
from tests.enrolled_fleet import EnrolledFleet
from tests.factories import BAREMETAL_SKU
from tests.histories import record_history
from tests.lifecycle_support import (
    Tenant,
    create_fleet,
    eventually,
    held_claims,
    slice_request,
    wait_status,
)

GROUPS = "/api/v1/allocation-groups"


def member(gpus: int = 1, ssh_key_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    return slice_request(gpus, ssh_key_id, **overrides)


async def create_group(
    tenant: Tenant,
    members: list[dict[str, Any]],
    *,
    spread: str = "same_node_forbidden",
    key: str | None = None,
) -> dict[str, Any]:
    headers = {"X-Idempotency-Key": key} if key else {}
    response = await tenant.client.post(
        f"{GROUPS}/", json={"members": members, "placement": {"spread": spread}}, headers=headers
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    assert created["status"] == "requested"
    return created


async def wait_group(
    tenant: Tenant, group_id: str, status: str, *, timeout: float = 30.0
) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        body: dict[str, Any] = (await tenant.client.get(f"{GROUPS}/{group_id}")).json()
        return body if body.get("status") == status else None

    try:
        return await eventually(check, timeout=timeout, interval=0.1)
    except AssertionError:
        current = (await tenant.client.get(f"{GROUPS}/{group_id}")).json()
        raise AssertionError(f"group never reached {status}: {current}") from None


async def group_events(db_sessions: Any, group_id: str) -> list[str]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(AllocationGroupEvent.event)
            .where(AllocationGroupEvent.group_id == uuid.UUID(group_id))
            .order_by(AllocationGroupEvent.id)
        )
        return list(rows)


async def group_closed(temporal_client: Any, group_id: str) -> str:
    handle = temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id))
    result = await asyncio.wait_for(handle.result(), timeout=30)
    return str(result["status"])


async def test_group_lifecycle_with_anti_affinity_and_merged_timeline(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    temporal_client: Any,
    admin: Any,
) -> None:
    nodes = await enrolled_fleet.create(slice_nodes=2)

    created = await create_group(
        tenant, [member(1, tenant.ssh_key_id), member(1, tenant.ssh_key_id)]
    )
    group_id = created["group_id"]
    member_ids = [m["allocation_id"] for m in created["members"]]
    assert [m["position"] for m in created["members"]] == [0, 1]

    active = await wait_group(tenant, group_id, "active")
    assert {m["status"] for m in active["members"]} == {"active"}
    # Best-fit alone would put both on one node: the group's anti-affinity keeps them apart.
    assert {m["node_id"] for m in active["members"]} == {str(n.id) for n in nodes}
    for allocation_id in member_ids:  # ordinary allocations, visible as such
        one = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}")).json()
        assert one["status"] == "active"
        assert one["allocation_group_id"] == group_id  # REVIEW.md: it was not shown
    in_list = (await tenant.client.get("/api/v1/allocations")).json()["items"]
    assert {i["allocation_id"]: i["allocation_group_id"] for i in in_list} == {
        allocation_id: group_id for allocation_id in member_ids
    }

    listed = (await tenant.client.get(GROUPS, params={"status": "active"})).json()
    assert [g["group_id"] for g in listed["items"]] == [group_id]
    other = await admin.get(f"/api/v1/admin/allocation-groups/{group_id}")
    assert other.status_code == 200
    assert other.json()["project_id"] == str(tenant.project_id)

    released = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert released.status_code == 202, released.text
    assert released.json()["prior_status"] == "active"
    assert released.json()["expected_status"] == "releasing"
    final = await wait_group(tenant, group_id, "released")
    assert final["release_requested_by"] == "user"
    assert {m["status"] for m in final["members"]} == {"released"}
    for allocation_id in member_ids:
        assert await held_claims(db_sessions, allocation_id) == 0
    assert await group_events(db_sessions, group_id) == [
        "requested",
        "provisioning",
        "active",
        "releasing",
        "released",
    ]
    assert await group_closed(temporal_client, group_id) == "released"
    again = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert again.status_code == 202
    assert again.json()["status"] == "released"

    timeline = (await tenant.client.get(f"{GROUPS}/{group_id}/timeline")).json()
    items = timeline["items"]
    assert [i["item"]["name"] for i in items if i["allocation_id"] is None] == [
        "requested",
        "provisioning",
        "active",
        "releasing",
        "released",
    ]
    for allocation_id in member_ids:
        names = [i["item"]["name"] for i in items if i["allocation_id"] == allocation_id]
        assert names[0] == "requested"
        assert SLICE_VM_PROVISION in names
        assert "released" in names
    starts = [i["item"]["started_at"] for i in items]
    assert starts == sorted(starts)
    assert tenant.ssh_public_key.split()[1] not in str(timeline)

    handle = temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id))
    history = (await handle.fetch_history()).to_json()
    assert tenant.ssh_public_key.split()[1] not in history, "SSH key in plaintext history"
    await record_history(handle, "allocation_group", "happy_path")
    await record_history(
        temporal_client.get_workflow_handle(allocation_workflow_id(member_ids[0])),
        "allocation",
        "group_member",
    )

    # Tenants see only their own project's groups.
    stranger = await tenant.client.get(f"{GROUPS}/{uuid.uuid4()}")
    assert stranger.status_code == 404


async def test_idempotent_creation(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=2)
    body = [member(1), member(2, required=False)]
    answers = await asyncio.gather(*(create_group(tenant, body, key="grp-1") for _ in range(5)))
    assert len({a["group_id"] for a in answers}) == 1
    assert len({tuple(m["allocation_id"] for m in a["members"]) for a in answers}) == 1

    replay = await tenant.client.post(
        f"{GROUPS}/",
        json={"members": body, "placement": {"spread": "same_node_forbidden"}},
        headers={"X-Idempotency-Key": "grp-1"},
    )
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["group_id"] == answers[0]["group_id"]

    changed = await tenant.client.post(
        f"{GROUPS}/",
        json={"members": [member(1)], "placement": {"spread": "same_node_forbidden"}},
        headers={"X-Idempotency-Key": "grp-1"},
    )
    assert changed.status_code == 422
    assert changed.json()["error"]["code"] == "idempotency_key_reused"

    async with db_sessions() as session:
        groups = await session.scalar(text("SELECT count(*) FROM allocation_groups"))
        members = await session.scalar(text("SELECT count(*) FROM allocation_group_members"))
    assert (groups, members) == (1, 2)


@pytest.mark.usefixtures("control_plane")
async def test_bad_requests_are_refused_with_codes(tenant: Tenant) -> None:
    no_required = await tenant.client.post(
        f"{GROUPS}/", json={"members": [member(1, required=False)]}
    )
    assert no_required.status_code == 422
    assert no_required.json()["error"]["code"] == "no_required_member"
    unknown_key = await tenant.client.post(
        f"{GROUPS}/", json={"members": [member(1, str(uuid.uuid4()))]}
    )
    assert unknown_key.status_code == 422
    assert unknown_key.json()["error"]["code"] == "ssh_key_not_found"
    bad_spread = await tenant.client.post(
        f"{GROUPS}/", json={"members": [member(1)], "placement": {"spread": "pack"}}
    )
    assert bad_spread.status_code == 400
    empty = await tenant.client.post(f"{GROUPS}/", json={"members": []})
    assert empty.status_code == 400
    unknown_status = await tenant.client.get(GROUPS, params={"status": "sleeping"})
    assert unknown_status.status_code == 400
    error = unknown_status.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == "unknown allocation group status"
    assert error["details"]["allowed"] == [s.value for s in AllocationGroupStatus]


async def test_group_fails_when_no_required_member_can_become_usable(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    await enrolled_fleet.create(slice_nodes=1)  # no bare-metal node at all
    created = await create_group(
        tenant,
        [member(8, sku=BAREMETAL_SKU), member(1, required=False)],
        spread="any",
    )
    group_id = created["group_id"]
    optional = created["members"][1]["allocation_id"]

    failed = await wait_group(tenant, group_id, "failed")
    rejected = failed["members"][0]
    assert (rejected["status"], rejected["failure_reason"]) == ("rejected", "sku_unavailable")
    # A failed group never leaves capacity behind: the member it still had is released, and
    # that release is the group's, not the tenant's (issue 37: it was recorded as `user`).
    released_member = await wait_status(tenant.client, optional, "released")
    assert released_member["release_requested_by"] == "group"
    assert await group_closed(temporal_client, group_id) == "failed"
    async with db_sessions() as session:
        actors = set(
            await session.scalars(
                select(AllocationEvent.actor).where(
                    AllocationEvent.allocation_id == uuid.UUID(optional),
                    AllocationEvent.actor.is_not(None),
                )
            )
        )
    assert actors == {"group"}
    events = await group_events(db_sessions, group_id)
    assert events[0] == "requested"
    assert events[-1] == "failed"
    assert "member_rejected" in events
    assert "active" not in events

    refused = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "allocation_group_not_releasable"
    await record_history(
        temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id)),
        "allocation_group",
        "failed_members_released_by_group",
    )


async def test_degraded_when_a_required_member_fails_while_another_is_usable(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    nodes = await enrolled_fleet.create(slice_nodes=2)
    agents = [node.agent for node in nodes]
    # Whichever member lands on the first node fails to provision there.
    agents[0].host.faults.inject(SLICE_VM_PROVISION, HostErrorType.IMAGE_ERROR, times=1)
    created = await create_group(tenant, [member(1), member(1)])
    group_id = created["group_id"]

    degraded = await wait_group(tenant, group_id, "degraded")
    by_node = {m["node_id"]: m for m in degraded["members"]}
    assert by_node[str(nodes[0].id)]["status"] == "failed"
    assert by_node[str(nodes[1].id)]["status"] == "active"
    assert await group_events(db_sessions, group_id) == ["requested", "provisioning", "degraded"]

    released = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert released.status_code == 202
    assert released.json()["prior_status"] == "degraded"
    await wait_group(tenant, group_id, "released")
    assert (await group_events(db_sessions, group_id))[-2:] == ["releasing", "released"]
    await record_history(
        temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id)),
        "allocation_group",
        "degraded",
    )


async def test_active_group_degrades_when_a_required_member_is_released_alone(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=2)
    created = await create_group(tenant, [member(1), member(1)])
    group_id = created["group_id"]
    await wait_group(tenant, group_id, "active")

    alone = created["members"][0]["allocation_id"]
    assert (await tenant.client.post(f"/api/v1/allocations/{alone}/release")).status_code == 202
    await wait_group(tenant, group_id, "degraded")
    assert (await group_events(db_sessions, group_id))[-2:] == ["active", "degraded"]


async def test_a_group_whose_members_all_ended_alone_completes(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    """Issue 37: each member released on its own left the group degraded forever, its
    workflow never finishing. Once the last member has ended, the group is released (by the
    group: nobody asked for the group's release) and its workflow completes."""
    await enrolled_fleet.create(slice_nodes=2)
    created = await create_group(tenant, [member(1), member(1, required=False)])
    group_id = created["group_id"]
    member_ids = [m["allocation_id"] for m in created["members"]]
    await wait_group(tenant, group_id, "active")

    first, last = member_ids
    assert (await tenant.client.post(f"/api/v1/allocations/{first}/release")).status_code == 202
    await wait_status(tenant.client, first, "released")
    await wait_group(tenant, group_id, "degraded")  # the required member is gone; one is left
    assert (await tenant.client.post(f"/api/v1/allocations/{last}/release")).status_code == 202
    await wait_status(tenant.client, last, "released")

    final = await wait_group(tenant, group_id, "released")
    assert {m["status"] for m in final["members"]} == {"released"}
    assert final["release_requested_by"] == "group"
    assert await group_closed(temporal_client, group_id) == "released"
    assert await group_events(db_sessions, group_id) == [
        "requested",
        "provisioning",
        "active",
        "degraded",
        "releasing",
        "released",
    ]
    for allocation_id in member_ids:  # each member's release is the tenant's own
        one = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}")).json()
        assert one["release_requested_by"] == "user"
        assert await held_claims(db_sessions, allocation_id) == 0
    again = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert again.status_code == 202
    assert again.json()["status"] == "released"
    await record_history(
        temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id)),
        "allocation_group",
        "members_ended_alone",
    )


async def test_release_failed_then_admin_force_release_of_the_group(
    tenant: Tenant,
    db_sessions: Any,
    enrolled_fleet: EnrolledFleet,
    temporal_client: Any,
    admin: Any,
) -> None:
    nodes = await enrolled_fleet.create(slice_nodes=2)
    agents = [node.agent for node in nodes]
    created = await create_group(tenant, [member(1), member(1)])
    group_id = created["group_id"]
    active = await wait_group(tenant, group_id, "active")
    stuck = next(m for m in active["members"] if m["node_id"] == str(nodes[0].id))
    agents[0].host.faults.inject(
        SLICE_VM_RELEASE,
        HostErrorType.RELEASE_ERROR,
        times=3,
        allocation_id=stuck["allocation_id"],
    )

    assert (await tenant.client.post(f"{GROUPS}/{group_id}/release")).status_code == 202
    failed = await wait_group(tenant, group_id, "release_failed")
    assert {m["status"] for m in failed["members"]} == {"release_failed", "released"}
    listed = await admin.get(
        "/api/v1/admin/allocation-groups/", params={"status": "release_failed"}
    )
    assert [g["group_id"] for g in listed.json()["items"]] == [group_id]

    missing_reason = await admin.post(
        f"/api/v1/admin/allocation-groups/{group_id}/force-release", json={}
    )
    assert missing_reason.status_code == 400
    forced = await admin.post(
        f"/api/v1/admin/allocation-groups/{group_id}/force-release",
        json={"reason": "OPS-7 cleanup retried"},
    )
    assert forced.status_code == 202, forced.text
    assert forced.json()["prior_status"] == "release_failed"
    assert forced.json()["members_asked"] is True
    final = await wait_group(tenant, group_id, "released")
    assert final["release_requested_by"] == "admin"
    assert await group_events(db_sessions, group_id) == [
        "requested",
        "provisioning",
        "active",
        "releasing",
        "release_failed",
        "releasing",
        "released",
    ]
    async with db_sessions() as session:
        audit = (
            await session.scalars(
                select(AuditEntry).where(AuditEntry.action == "allocation_group.force_release")
            )
        ).one()
    assert (audit.target_id, audit.reason, audit.role) == (
        group_id,
        "OPS-7 cleanup retried",
        "admin",
    )
    assert audit.prior_state == "release_failed"
    assert audit.workflow_ids == [allocation_group_workflow_id(group_id)]
    await record_history(
        temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id)),
        "allocation_group",
        "release_failed_then_force_release",
    )


async def test_concurrent_group_releases_release_each_member_once(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet, temporal_client: Any
) -> None:
    nodes = await enrolled_fleet.create(slice_nodes=2)
    for node in nodes:
        # Slow hosts: the releases arrive while the members are still provisioning.
        node.agent.host.config = SimHostConfig(phase_delay_s=0.2)
    created = await create_group(tenant, [member(1), member(1)])
    group_id = created["group_id"]
    member_ids = [m["allocation_id"] for m in created["members"]]

    url = f"{GROUPS}/{group_id}/release"
    answers = await asyncio.gather(*(tenant.client.post(url) for _ in range(100)))
    # Temporal admits 10 concurrent updates per workflow; beyond that, once the SDK's own
    # retries run out (a loaded machine), the answer is a retryable 503 that says so, never a
    # 500. A client repeats it, as Retry-After asks.
    refused = [a for a in answers if a.status_code != 202]
    codes = {a.json()["error"]["code"] for a in refused}
    assert codes <= {"temporal_busy", "temporal_unavailable"}, codes
    assert all(a.headers["Retry-After"] for a in refused)
    for _ in refused:
        for _attempt in range(20):
            again = await tenant.client.post(url)
            if again.status_code == 202:
                answers.append(again)
                break
            assert again.status_code == 503, again.text
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("a release was refused 20 times in a row")
    asked = sum(a.json()["members_asked"] for a in answers if a.status_code == 202)
    # temporal_busy means nothing was applied; only a timed-out call may have asked the
    # members with its answer lost.
    assert asked == 1 or (asked == 0 and "temporal_unavailable" in codes)
    await wait_group(tenant, group_id, "released", timeout=60)
    events = await group_events(db_sessions, group_id)
    assert events[0] == "requested"
    assert events[-2:] == ["releasing", "released"]
    assert events.count("releasing") == 1

    async with db_sessions() as session:
        for allocation_id in member_ids:
            allocation = uuid.UUID(allocation_id)
            releasing = await session.scalar(
                select(func.count()).where(
                    AllocationEvent.allocation_id == allocation,
                    AllocationEvent.to_status == "releasing",
                )
            )
            releases = await session.scalar(
                select(func.count()).where(
                    NodeTask.allocation_id == allocation, NodeTask.kind == SLICE_VM_RELEASE
                )
            )
            assert (releasing, releases) == (1, 1), allocation_id
    await record_history(
        temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id)),
        "allocation_group",
        "released_while_provisioning",
    )


async def test_anti_affinity_holds_under_concurrent_placement(
    tenant: Tenant, db_sessions: Any, enrolled_fleet: EnrolledFleet
) -> None:
    """Placement is all this test needs. Four groups of three members each, all placed at once
    on three nodes with room for every member on any one of them."""
    await enrolled_fleet.create(slice_nodes=3)
    groups = await asyncio.gather(
        *(create_group(tenant, [member(1), member(1), member(2)]) for _ in range(4))
    )

    async def all_placed() -> bool:
        async with db_sessions() as session:
            placed = await session.scalar(
                text("SELECT count(*) FROM allocations WHERE allocation_group_id IS NOT NULL")
            )
        return placed == 12

    await eventually(all_placed, timeout=30)
    async with db_sessions() as session:
        shared = (
            await session.execute(
                text(
                    "SELECT allocation_group_id, node_id FROM allocations "
                    "WHERE same_node_forbidden GROUP BY 1, 2 HAVING count(*) > 1"
                )
            )
        ).all()
        nodes_per_group = (
            await session.execute(
                text(
                    "SELECT count(DISTINCT node_id) FROM allocations "
                    "WHERE allocation_group_id IS NOT NULL GROUP BY allocation_group_id"
                )
            )
        ).scalars()
        assert shared == []
        assert list(nodes_per_group) == [3, 3, 3, 3]
    assert len({g["group_id"] for g in groups}) == 4


@pytest.mark.usefixtures("control_plane")
async def test_a_depleted_projects_group_is_refused_402_before_anything_is_created(
    api: Any, make_project: Any, make_token: Any, db_sessions: Any, temporal_client: Any
) -> None:
    """Issue 37: a single allocation of a depleted project gets 402; its group did get 201 (and
    members that were each rejected). Now the group POST is 402 balance_depleted too, and no
    group row, member row or workflow exists. The catalog only: the refusal needs no node."""
    await create_fleet(db_sessions, slice_nodes=0)
    project = await make_project(credit_minor=0)
    client = await api(token=await make_token("tenant", project))
    body = {"members": [member(1)], "placement": {"spread": "same_node_forbidden"}}
    refused = await client.post(f"{GROUPS}/", json=body, headers={"X-Idempotency-Key": "dep-1"})
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["code"] == "balance_depleted"
    single = await client.post("/api/v1/allocations", json=member(1))
    assert single.status_code == 402, single.text  # the same answer a single allocation gets
    async with db_sessions() as session:
        groups = await session.scalar(
            text("SELECT count(*) FROM allocation_groups WHERE project_id = :p"),
            {"p": project.id},
        )
        allocations = await session.scalar(
            text("SELECT count(*) FROM allocations WHERE project_id = :p"), {"p": project.id}
        )
    assert (groups, allocations) == (0, 0)
    listed = (await client.get(GROUPS)).json()
    assert listed["items"] == []
