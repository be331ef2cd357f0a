"""Issue 35: an attachment in `detach_failed` on a node that never comes back has an exit.

`POST /api/v1/admin/storage/attachments/{id}/abandon` (reason required, audited) asks the
attachment's workflow to abandon it: the workflow observes the node now (its agent not heard from
within the liveness window, by recorded contact and by the pollers Temporal reports on its
`node-{id}` queue) and only then revokes the grant, unmounts nothing, and ends the attachment
`detached` with failure_reason `abandoned`, so the namespace takes a new writer and can be
deleted. While the agent is alive the abandon is refused (409 `node_alive`) and nothing changes.

Everything runs through production paths: the tenant API, the worker's StorageAttachmentWorkflow,
the shared directory provider on a real directory, real node agent workers whose storage tasks
bind-mount (a file held open in the mount makes the kernel refuse the unmount), and the node
liveness sweep.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from temporalio.client import Client

from agent.heartbeat import send_heartbeat
from contracts.node_liveness import LivenessInput
from core.config import Settings
from schema.models import AuditEntry
from tests.factories import SLICE_SKU, create_node
from tests.lifecycle_support import Tenant, eventually, slice_request, wait_status
from tests.test_storage_attachments import (
    ATTACH_PATH,
    StartStorageAgent,
    StorageNode,
    active_allocation,
    attach,
    create_namespace,
    mounted_points,
    record,
    start_storage_agent,
    storage_root,
    transitions,
    wait_attachment,
)
from workflows.node_liveness import NodeLivenessWorkflow

__all__ = ["start_storage_agent", "storage_root"]  # fixtures, used by name

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root"),
]

LIVENESS_WINDOW_S = 2.0


async def busy_detach_failed(
    tenant: Tenant, db_sessions: Any, start: StartStorageAgent, name: str
) -> tuple[str, StorageNode, dict[str, Any], str]:
    """A mounted single_writer attachment whose tenant detach the kernel refused (a file held
    open in the mount): detach_failed, storage_unmount_failed, still mounted on the node."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start)
    namespace = await create_namespace(tenant.client, name)
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    (node.mount_dir(aid) / "data.txt").write_text("kept\n")
    with (node.mount_dir(aid) / "open.log").open("w"):
        response = await tenant.client.delete(
            f"/api/v1/allocations/{allocation_id}/attachments/{aid}"
        )
        assert response.status_code == 202, response.text
        body = await wait_attachment(tenant.client, allocation_id, aid, "detach_failed")
    assert body["failure_reason"] == "storage_unmount_failed"
    assert str(node.mount_dir(aid)) in mounted_points()
    return allocation_id, node, namespace, aid


def grant_file(storage_root: Path, namespace_id: str, aid: str) -> Path:
    return storage_root / "grants" / namespace_id / f"{aid}.json"


async def abandon_audits(db_sessions: Any, aid: str) -> list[AuditEntry]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(AuditEntry).where(
                AuditEntry.action == "storage_attachment.abandon", AuditEntry.target_id == aid
            )
        )
        return list(rows)


async def test_abandon_on_a_dead_node_frees_the_namespace_for_a_new_writer_and_deletion(
    tenant: Tenant, api: Any, make_token: Any, db_sessions: Any, storage_root: Path,
    start_storage_agent: StartStorageAgent, temporal_client: Client, settings: Settings,
) -> None:  # fmt: skip
    allocation_id, node, namespace, aid = await busy_detach_failed(
        tenant, db_sessions, start_storage_agent, "dead-node"
    )
    assert grant_file(storage_root, namespace["id"], aid).exists()

    # The node dies: its agent stops and never comes back; liveness takes the node offline.
    queue = settings.control_plane_task_queue
    await send_heartbeat(temporal_client, node.node_id, control_plane_queue=queue)
    await node.stop()

    async def swept_offline() -> Any:  # liveness sweeps, as its schedule runs them
        sweep = await temporal_client.execute_workflow(
            NodeLivenessWorkflow.run,
            LivenessInput(offline_after_seconds=LIVENESS_WINDOW_S),
            id=f"node-liveness-test-{uuid.uuid4()}",
            task_queue=queue,
        )
        return sweep if node.node_id in sweep.went_offline else None

    await eventually(swept_offline, timeout=30, interval=0.25)

    # Until then the namespace takes no other writer (the stuck attachment is one).
    second = await create_node(db_sessions, sku=SLICE_SKU, gpus=8)
    second_node = await start_storage_agent(second.id)
    response = await tenant.client.post("/api/v1/allocations", json=slice_request(1))
    assert response.status_code == 201, response.text
    second_allocation = response.json()["allocation_id"]
    body = await wait_status(tenant.client, second_allocation, "active")
    assert body["node_id"] == second_node.node_id  # the offline node takes no allocation
    refused = await attach(tenant.client, second_allocation, namespace["id"], "single_writer")
    body = await wait_attachment(
        tenant.client, second_allocation, refused["attachment_id"], "failed"
    )
    assert body["failure_reason"] == "writer_conflict"

    # An admin whose gateway's liveness window is short enough for a test.
    admin = await api(
        token=await make_token("admin"),
        settings=dataclasses.replace(settings, node_offline_after_seconds=LIVENESS_WINDOW_S),
    )
    missing = await admin.post(f"/api/v1/admin/storage/attachments/{aid}/abandon", json={})
    assert missing.status_code == 400, missing.text  # the reason is required
    response = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/abandon",
        json={"reason": "node lost its boot disk; INC-7"},
    )
    assert response.status_code == 200, response.text
    abandoned = response.json()
    assert abandoned["status"] == "detached"
    assert abandoned["failure_reason"] == "abandoned"
    assert "INC-7" in abandoned["failure_message"]
    assert abandoned["mount_path"] is None
    assert await transitions(db_sessions, aid) == [
        *ATTACH_PATH, "detaching", "detach_failed", "detaching", "detached"
    ]  # fmt: skip
    # The grant is revoked; the dead node was not asked to unmount, and no data was touched.
    assert not grant_file(storage_root, namespace["id"], aid).exists()
    assert str(node.mount_dir(aid)) in mounted_points()
    assert (storage_root / "namespaces" / namespace["id"] / "data.txt").read_text() == "kept\n"
    (audit,) = await abandon_audits(db_sessions, aid)
    assert audit.reason == "node lost its boot disk; INC-7"
    assert audit.prior_state == "detach_failed"
    # The tenant sees it detached, abandoned, too; a second abandon is refused.
    seen = await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert seen["failure_reason"] == "abandoned"
    again = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/abandon", json={"reason": "again"}
    )
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "attachment_not_detach_failed"
    await record(temporal_client, aid, "detach_failed_abandoned_on_dead_node")

    # A new writer attaches on a live node and sees the data.
    writer = await attach(tenant.client, second_allocation, namespace["id"], "single_writer")
    wid = writer["attachment_id"]
    await wait_attachment(tenant.client, second_allocation, wid, "mounted")
    assert (second_node.mount_dir(wid) / "data.txt").read_text() == "kept\n"
    response = await tenant.client.delete(
        f"/api/v1/allocations/{second_allocation}/attachments/{wid}"
    )
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, second_allocation, wid, "detached")
    rid = refused["attachment_id"]  # a failed attachment is detached too before a delete
    response = await tenant.client.delete(
        f"/api/v1/allocations/{second_allocation}/attachments/{rid}"
    )
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, second_allocation, rid, "detached")
    # And the namespace can be deleted: nothing of it is attached any more.
    url = f"/api/v1/storage/namespaces/{namespace['id']}"
    response = await tenant.client.delete(url)
    assert response.status_code == 202, response.text  # a delete workflow removes the data
    assert response.json()["status"] in {"deleting", "deleted"}

    async def deleted() -> bool:
        return bool((await tenant.client.get(url)).json()["status"] == "deleted")

    await eventually(deleted, timeout=30)


async def test_abandon_is_refused_while_the_agent_is_alive_and_changes_nothing(
    tenant: Tenant, admin: httpx.AsyncClient, db_sessions: Any, storage_root: Path,
    start_storage_agent: StartStorageAgent, temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, node, namespace, aid = await busy_detach_failed(
        tenant, db_sessions, start_storage_agent, "live-node"
    )
    before = await transitions(db_sessions, aid)
    url = f"/api/v1/admin/storage/attachments/{aid}"

    # The agent is alive (the default liveness window, 300 s): the node is not gone.
    response = await admin.post(f"{url}/abandon", json={"reason": "looks dead to me"})
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "node_alive"
    assert error["details"]["node_id"] == node.node_id
    # Nothing changed: status, events, grant, mount, audit.
    body = await wait_attachment(tenant.client, allocation_id, aid, "detach_failed")
    assert body["failure_reason"] == "storage_unmount_failed"
    assert await transitions(db_sessions, aid) == before
    assert grant_file(storage_root, namespace["id"], aid).exists()
    assert str(node.mount_dir(aid)) in mounted_points()
    assert await abandon_audits(db_sessions, aid) == []

    # The way out while the node lives is the retried detach, which unmounts there.
    response = await admin.post(f"{url}/retry-detach", json={"reason": "log closed"})
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert str(node.mount_dir(aid)) not in mounted_points()
    assert not grant_file(storage_root, namespace["id"], aid).exists()
    await record(temporal_client, aid, "abandon_refused_node_alive_then_retried")


async def test_abandon_refuses_an_attachment_that_is_not_detach_failed(
    tenant: Tenant, admin: httpx.AsyncClient, db_sessions: Any,
    start_storage_agent: StartStorageAgent,
) -> None:  # fmt: skip
    allocation_id, _ = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "mounted-one")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    before = await transitions(db_sessions, aid)
    response = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/abandon", json={"reason": "not stuck"}
    )
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "attachment_not_detach_failed"
    assert await transitions(db_sessions, aid) == before
    missing = await admin.post(
        f"/api/v1/admin/storage/attachments/{uuid.uuid4()}/abandon", json={"reason": "x"}
    )
    assert missing.status_code == 404, missing.text
