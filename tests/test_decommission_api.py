"""The decommission admin API (docs/lifecycles/decommission.md;
docs/lifecycles/decommission.md#actions): request validation (422 field errors for invalid
combinations), node checks (404, 410, 409), one live job per node (the same request replays it,
another is 409), reads and filters, operator actions through the workflow's update (409 when not
allowed), the audit trail, and 503 leaving nothing behind."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from contracts.admin_operation import DECOMMISSION_SUBMIT
from contracts.states import NodeStatus
from schema.models import AuditEntry, NodeDecommission
from tests.admin_operation_support import nth_run, record
from tests.decommission_fixtures import DecommissionRig


@pytest.fixture
async def admin(api: Any, make_token: Any, decommission: DecommissionRig) -> Any:
    return await api(token=await make_token("admin"))


def _codes(response: Any) -> set[str]:
    return {e["code"] for e in response.json()["error"]["details"]["errors"]}


async def test_invalid_combinations_are_422_with_field_errors(
    admin: Any, decommission: DecommissionRig
) -> None:
    node_id = await decommission.plain_node()
    url = f"/api/v1/admin/nodes/{node_id}/decommission"
    cases = [
        ({"mode": "soft_reset", "erase": "quick", "reason": "x"}, {"erase_not_allowed"}),
        ({"mode": "soft_reset", "erase": True, "reason": "x"}, {"erase_not_allowed"}),
        ({"mode": "explode", "reason": "x"}, {"invalid_mode"}),
        ({"mode": "reimage", "erase": "shred", "reason": "x"}, {"invalid_erase"}),
        ({"mode": "reimage", "storage_cleanup": "nfs", "reason": "x"}, {"invalid_storage_scope"}),
        (
            {"mode": "full_decommission", "storage_cleanup": "local", "reason": "x"},
            {"storage_cleanup_not_allowed"},
        ),
        (
            {"mode": "soft_reset", "remove_maas_record": True, "reason": "x"},
            {"remove_maas_record_not_allowed"},
        ),
        ({"mode": "storage_cleanup", "reason": "x"}, {"invalid_mode"}),
    ]
    for body, codes in cases:
        response = await admin.post(url, json=body)
        assert response.status_code == 422, (body, response.text)
        assert _codes(response) == codes, body
    response = await admin.post(
        f"/api/v1/admin/nodes/{node_id}/storage-cleanup", json={"scope": "share", "reason": "x"}
    )
    assert response.status_code == 422
    assert _codes(response) == {"invalid_storage_scope"}
    async with decommission.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(NodeDecommission)) == 0


async def test_node_checks_404_410_409(admin: Any, decommission: DecommissionRig) -> None:
    body = {"mode": "soft_reset", "reason": "tenant_transition"}
    missing = await admin.post(f"/api/v1/admin/nodes/{uuid.uuid4()}/decommission", json=body)
    assert missing.status_code == 404
    deleted = await decommission.plain_node(NodeStatus.DELETED)
    gone = await admin.post(f"/api/v1/admin/nodes/{deleted}/decommission", json=body)
    assert gone.status_code == 410
    assert gone.json()["error"]["code"] == "node_deleted"
    enrolling = await decommission.plain_node(NodeStatus.ENROLLING)
    busy = await admin.post(f"/api/v1/admin/nodes/{enrolling}/decommission", json=body)
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "node_not_decommissionable"
    plain = await decommission.plain_node()
    reimage = await admin.post(
        f"/api/v1/admin/nodes/{plain}/decommission", json={"mode": "reimage", "reason": "x"}
    )
    assert reimage.status_code == 409
    assert reimage.json()["error"]["code"] == "node_not_maas_managed"


async def test_start_replay_conflict_read_act_and_audit(
    admin: Any, decommission: DecommissionRig
) -> None:
    node_id = await decommission.plain_node()  # no agent: the drain waits, then fails
    body = {"mode": "full_decommission", "reason": "hardware_removal"}
    url = f"/api/v1/admin/nodes/{node_id}/decommission"
    created = await admin.post(url, json=body)
    assert created.status_code == 201, created.text
    answer = created.json()
    assert answer["status"] == "started"
    job = decommission.track(answer["decommission_id"], node_id, "full_decommission")
    settings = decommission.onboarding.settings
    await record(
        await nth_run(decommission.client, settings, DECOMMISSION_SUBMIT, 0), "submit_decommission"
    )

    again = await admin.post(url, json=body)
    assert again.status_code == 200  # the same request: the live job, not a conflict
    assert again.json()["decommission_id"] == answer["decommission_id"]
    assert again.json()["replayed"] is True
    other = await admin.post(url, json={"mode": "soft_reset", "reason": "x"})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "decommission_in_progress"

    # Settings give the node 5 s to pick up its task; nothing runs on it.
    row = await decommission.wait_status(job, "failed_manual_intervention", timeout=30)
    assert row.error_code == "agent_unreachable"
    detail = (await admin.get(f"/api/v1/admin/decommissions/{job.decommission_id}")).json()
    assert detail["status"] == "failed_manual_intervention"
    assert detail["recommended_action"] == "resume"
    assert {e["stage"] for e in detail["events"]} >= {"disable_node", "drain_node"}
    listed = (await admin.get("/api/v1/admin/decommissions", params={"status": "failed"})).json()
    assert [i["decommission_id"] for i in listed["items"]] == [job.decommission_id]
    by_node = await admin.get("/api/v1/admin/decommissions", params={"node_id": node_id})
    assert len(by_node.json()["items"]) == 1
    bad = await admin.get("/api/v1/admin/decommissions", params={"mode": "nope"})
    assert bad.status_code == 422

    base = f"/api/v1/admin/decommissions/{job.decommission_id}"
    not_now = await admin.post(f"{base}/adopt", json={"reason": "x"})
    assert not_now.status_code == 200  # failed: adopt is allowed (the operator vouches)
    await decommission.wait_status(job, "running", "failed_manual_intervention", "reconciled")
    cancelled = await admin.post(f"{base}/cancel", json={"reason": "changed my mind"})
    assert cancelled.status_code in (200, 409), cancelled.text
    async with decommission.sessions() as session:
        actions = list(
            await session.scalars(
                select(AuditEntry.action).order_by(AuditEntry.id).where(
                    AuditEntry.action.like("node.decommission.%")
                )
            )
        )  # fmt: skip
    assert actions[0] == "node.decommission.full_decommission"
    assert "node.decommission.adopt_observed_state" in actions


async def test_action_not_allowed_is_409(admin: Any, decommission: DecommissionRig) -> None:
    node_id = await decommission.plain_node()
    await decommission.agent(node_id)
    job = await decommission.start(node_id, "soft_reset")
    await decommission.wait_status(job, "completed")
    response = await admin.post(
        f"/api/v1/admin/decommissions/{job.decommission_id}/retry", json={"reason": "x"}
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] in ("action_not_allowed", "decommission_closed")


async def test_temporal_unreachable_is_503_and_leaves_no_row(
    api: Any, make_token: Any, unreachable_settings: Any, decommission: DecommissionRig
) -> None:
    node_id = await decommission.plain_node()
    client = await api(
        token=await make_token("admin"),
        settings=unreachable_settings(temporal=True),
        temporal_client=None,  # the app connects (lazily) to where nothing listens
    )
    response = await client.post(
        f"/api/v1/admin/nodes/{node_id}/decommission",
        json={"mode": "soft_reset", "reason": "x"},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "temporal_unavailable"
    async with decommission.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(NodeDecommission)) == 0
