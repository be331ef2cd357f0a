"""A namespace's delete ends only when its data is gone (issue 37 item 3), on the production
path: namespaces made, attached, written (through the node's mount) and deleted through the
tenant API; StorageNamespaceDeleteWorkflow in the real worker removes the data through the
shared-directory provider; run as root (bind mounts, chattr).

- A delete is refused (409 storage_namespace_attached, the attachment named) while attached, and
  changes nothing then; once detached it answers 202 `deleting`, the tree is removed in bounded
  chunks (a tree of thousands of entries takes several, each heartbeating), and only then is the
  namespace `deleted` with its directory, grants and gid gone. Billing stops at the request.
- Data the filesystem refuses to remove (a file the tenant made immutable through its mount)
  keeps the namespace `deleting`, retried, for as long as it is there: never `deleted` with data
  left behind. Meanwhile it takes no attachment (409 storage_namespace_deleting), is listed as
  deleting, and no longer counts against the project's storage limits.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import Client

from contracts.storage import NamespaceDeleteResult, namespace_delete_workflow_id
from schema.models import AuditEntry, StorageUsageRecord
from tests import test_storage_attachments as attachment_tests
from tests.histories import record_history
from tests.lifecycle_support import Tenant, eventually
from tests.test_storage_attachments import (
    StartStorageAgent,
    StorageNode,
    active_allocation,
    attach,
    create_namespace,
    wait_attachment,
)

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(__import__("os").geteuid() != 0, reason="bind mounts need root"),
]
# The attachment tests' export (autouse: set for the worker before it starts) and node agents.
storage_root = attachment_tests.storage_root
start_storage_agent = attachment_tests.start_storage_agent

HISTORIES = "storage_namespace_delete"


async def namespace(client: Any, namespace_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/v1/storage/namespaces/{namespace_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def wait_namespace(
    client: Any, namespace_id: str, status: str, timeout: float = 60.0
) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        body = await namespace(client, namespace_id)
        return body if body["status"] == status else None

    try:
        return await eventually(check, timeout=timeout, interval=0.1)
    except AssertionError:
        raise AssertionError(f"never {status}: {await namespace(client, namespace_id)}") from None


async def mounted_writer(
    tenant: Tenant, db_sessions: Any, start: StartStorageAgent, name: str
) -> tuple[str, StorageNode, dict[str, Any], str]:
    allocation_id, node = await active_allocation(tenant, db_sessions, start)
    created = await create_namespace(tenant.client, name, quota_bytes=1 << 30)
    attachment = await attach(tenant.client, allocation_id, created["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    return allocation_id, node, created, aid


async def detach(tenant: Tenant, allocation_id: str, aid: str) -> None:
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")


async def usage_record(db_sessions: Any, namespace_id: str) -> StorageUsageRecord:
    async with db_sessions() as session:
        record: StorageUsageRecord = (
            await session.scalars(
                select(StorageUsageRecord).where(
                    StorageUsageRecord.namespace_id == uuid.UUID(namespace_id)
                )
            )
        ).one()
        return record


async def audits(db_sessions: Any, namespace_id: str) -> list[AuditEntry]:
    async with db_sessions() as session:
        return list(
            await session.scalars(
                select(AuditEntry)
                .where(AuditEntry.target_id == namespace_id)
                .order_by(AuditEntry.id)
            )
        )


def gid_claims(storage_root: Path, namespace_id: str) -> list[Path]:
    gids = storage_root / "gids"
    return [p for p in gids.iterdir() if p.read_text() == namespace_id] if gids.is_dir() else []


async def test_delete_waits_for_detach_then_removes_a_large_tree_in_chunks_before_deleted(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, node, created, aid = await mounted_writer(
        tenant, db_sessions, start_storage_agent, "big"
    )
    ns_id = created["id"]
    data_dir = storage_root / "namespaces" / ns_id
    # The tenant writes a tree of 2,400 files through its mount: more than two chunks' worth.
    mount = node.mount_dir(aid)
    for shard in range(12):
        directory = mount / f"shard-{shard:02}" / "inner"
        directory.mkdir(parents=True)
        for index in range(200):
            (directory / f"part-{index:04}.bin").write_bytes(b"x" * 64)
    assert len(list(data_dir.rglob("*.bin"))) == 2400
    assert len(gid_claims(storage_root, ns_id)) == 1

    refused = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "storage_namespace_attached"
    assert error["details"] == {"attachment_ids": [aid]}
    # Refused: nothing changed, billing goes on, the data is there.
    assert (await namespace(tenant.client, ns_id))["status"] == "active"
    assert (await usage_record(db_sessions, ns_id)).ended_at is None
    assert len(list(data_dir.rglob("*.bin"))) == 2400
    refused_run = temporal_client.get_workflow_handle(
        namespace_delete_workflow_id(ns_id), result_type=NamespaceDeleteResult
    )
    outcome = await refused_run.result()
    assert (outcome.status, outcome.refusal) == ("refused", "storage_namespace_attached")
    await record_history(refused_run, HISTORIES, "refused_attached")

    await detach(tenant, allocation_id, aid)
    accepted = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["status"] in {"deleting", "deleted"}
    # Billing stopped at the request: the tenant can no longer use the namespace.
    assert (await usage_record(db_sessions, ns_id)).ended_at is not None

    deleted = await wait_namespace(tenant.client, ns_id, "deleted")
    assert deleted["id"] == ns_id
    assert not data_dir.exists()
    assert not (storage_root / "grants" / ns_id).exists()
    assert gid_claims(storage_root, ns_id) == []
    handle = temporal_client.get_workflow_handle(
        namespace_delete_workflow_id(ns_id), result_type=NamespaceDeleteResult
    )
    result = await handle.result()
    # 2,400 files, 25 directories and the namespace's own: removed 1,000 at a time.
    assert result.status == "deleted"
    assert result.removed_entries == 2400 + 24 + 1
    assert result.chunks >= 3
    actions = [
        (a.action, a.prior_state, a.expected_state) for a in await audits(db_sessions, ns_id)
    ]
    assert actions == [
        ("storage_namespace.create", None, "active"),
        ("storage_namespace.delete", "active", "deleted"),
        ("storage_namespace.data_removed", "deleting", "deleted"),
    ]
    await record_history(handle, HISTORIES, "large_tree_in_chunks")

    again = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
    assert again.status_code == 202, again.text
    assert again.json()["status"] == "deleted"
    listed = (await tenant.client.get("/api/v1/storage/namespaces")).json()["items"]
    assert ns_id not in [n["id"] for n in listed]


async def test_data_the_filesystem_will_not_remove_keeps_the_namespace_deleting_until_gone(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    allocation_id, node, created, aid = await mounted_writer(
        tenant, db_sessions, start_storage_agent, "sticky"
    )
    ns_id = created["id"]
    data_dir = storage_root / "namespaces" / ns_id
    mount = node.mount_dir(aid)
    (mount / "plain.txt").write_text("plain")
    (mount / "kept").mkdir()
    stuck = mount / "kept" / "immutable.bin"
    stuck.write_bytes(b"mine forever")
    # A root tenant on its node makes a file immutable through its mount.
    made = await asyncio.to_thread(
        subprocess.run, ["chattr", "+i", str(stuck)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"the export's filesystem takes no immutable flag: {made.stderr.strip()}")
    try:
        await detach(tenant, allocation_id, aid)
        accepted = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["status"] == "deleting"
        handle = temporal_client.get_workflow_handle(
            namespace_delete_workflow_id(ns_id), result_type=NamespaceDeleteResult
        )

        async def retried() -> bool:
            pending = (await handle.describe()).raw_description.pending_activities
            return any(a.attempt >= 2 and a.last_failure.message for a in pending)

        # The rest is removed; the immutable file fails the removal, which is retried.
        await eventually(retried, timeout=30, interval=0.2)
        assert not (data_dir / "plain.txt").exists()
        assert (data_dir / "kept" / "immutable.bin").read_bytes() == b"mine forever"
        view = await namespace(tenant.client, ns_id)
        assert view["status"] == "deleting"
        listed = (await tenant.client.get("/api/v1/storage/namespaces")).json()["items"]
        assert [(n["id"], n["status"]) for n in listed] == [(ns_id, "deleting")]
        # Deleting: no new attachment, not billed, not counted against the limits.
        refused = await tenant.client.post(
            f"/api/v1/allocations/{allocation_id}/attachments",
            json={"namespace_id": ns_id, "mode": "read_only"},
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "storage_namespace_deleting"
        assert (await usage_record(db_sessions, ns_id)).ended_at is not None
        limits = (await tenant.client.get("/api/v1/billing/storage-limits")).json()
        assert (limits["namespaces"], limits["quota_bytes"]) == (0, 0)
        # A second delete joins the one in progress.
        joined = await tenant.client.delete(f"/api/v1/storage/namespaces/{ns_id}")
        assert joined.status_code == 202, joined.text
        assert joined.json()["status"] == "deleting"
    finally:
        stuck_at_provider = str(data_dir / "kept" / "immutable.bin")
        await asyncio.to_thread(subprocess.run, ["chattr", "-i", stuck_at_provider], check=False)

    await wait_namespace(tenant.client, ns_id, "deleted")
    assert not data_dir.exists()
    assert gid_claims(storage_root, ns_id) == []
    result = await handle.result()
    assert result.status == "deleted"
    await record_history(handle, HISTORIES, "retried_until_gone")
