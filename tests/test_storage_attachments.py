"""Storage namespaces and attachments (docs/lifecycles/storage-attachment.md) end to end: the tenant
API, the worker's StorageAttachmentWorkflow, the shared directory provider on a real directory, and
a real node agent worker whose storage.mount / storage.unmount bind-mount into its simulated
machine's disk (the kernel's mount table shows it; a file written through the mount lands in the
namespace).

Every transition of docs/lifecycles/storage-attachment.md's machine is driven through production
paths: the happy path, each precheck refusal, a grant that fails, a mount the node cannot do, an
unmount the kernel refuses (a busy mount), the tenant's and the admin's retried detach, and the
allocation's release fencing the tenant first and detaching after (failing, with the tenant fenced,
while a detach fails). Histories are recorded for replay. One test
runs the deployed agent instead (`python -m agent.main`, its `[storage]` table as cloud-init
writes it), so the production config path mounts too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import httpx
import libvirt
import pytest
from sqlalchemy import select
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from activities.cloud_init import AgentBootstrap, render_agent_toml
from agent.backends.domain_xml import filesystem_element, parse_domain
from agent.backends.system_root import SystemRoot
from agent.heartbeat import send_heartbeat
from agent.maintenance import _unescape_mount
from agent.node_worker import NodeServices, build_node_worker
from agent.storage_mounts import MOUNT_PHASES, KernelBindMounter, MountFailed
from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import STORAGE_MOUNT, STORAGE_UNMOUNT
from contracts.node_liveness import LivenessInput
from contracts.storage import (
    DETACH_FOR_RELEASE,
    STORAGE_DETACH_FAILED,
    AttachmentView,
    attachment_workflow_id,
    virtiofs_tag,
)
from core.task_queues import node_task_queue
from schema.models import AuditEntry, Node, StorageAttachmentEvent, UsageRecord
from sim.config import SimHostConfig
from sim.demo_fleet import Fleet, NodeSpec, build_node, seed_fleet
from sim.fleet import AgentNode, LibvirtTestHosts
from sim.host import SimulatedHost
from sim.libvirt_hosts import GpuPlacement
from sim.machine_image import build_machine
from sim.node_services import machine_services, simulated_storage
from tests.factories import REGION, SLICE_SKU, create_sku
from tests.histories import record_history
from tests.lifecycle_support import Tenant, create_fleet, eventually, slice_request, wait_status
from tests.terminal_fixtures import TerminalRig, start_agent_process, wait_polled
from tests.test_allocation_release_steps import release_steps
from workflows.node_liveness import NodeLivenessWorkflow

pytestmark = [
    pytest.mark.usefixtures("control_plane"),
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root"),
]


@pytest.fixture(autouse=True)
def storage_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shared directory provider's root, for the worker (set before it starts) and agents."""
    root = tmp_path / "storage-export"
    root.mkdir()
    monkeypatch.setenv("GPUCLOUD_STORAGE_ROOT", str(root))
    return root


def mounted_points() -> set[str]:
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        points.add(_unescape_mount(fields[4]))
    return points


@dataclass
class StorageNode:
    node_id: str
    machine_root: Path
    stop: Callable[[], Awaitable[None]]
    host: SimulatedHost

    def mount_dir(self, attachment_id: str) -> Path:
        return self.machine_root / "mnt/gpucloud/storage" / attachment_id


StartStorageAgent = Callable[..., Awaitable[StorageNode]]


@pytest.fixture
async def start_storage_agent(
    temporal_client: Client, tmp_path: Path, storage_root: Path
) -> AsyncIterator[StartStorageAgent]:
    """A node agent registered as production registers it (node_activities), with the storage
    mount backend on its machine's disk; `export=False`: a node with no [storage] config."""
    nodes: list[StorageNode] = []

    async def start(node_id: uuid.UUID | str, *, export: bool = True) -> StorageNode:
        key = str(node_id)
        machine = build_machine(tmp_path / f"machine-{key}", address="127.0.0.1", machine_key=key)
        host = SimulatedHost(key, config=SimHostConfig())
        # What the simulated fleet mounts with: the provider's tree from GPUCLOUD_STORAGE_ROOT,
        # and the simulated host's VMs for a slice's virtiofs filesystem.
        storage = simulated_storage(SystemRoot(machine.root), guests=host)
        assert storage is not None
        assert storage.config.export_root == storage_root
        services = NodeServices(
            host, machine_services(machine).maintenance, storage=storage if export else None
        )
        worker = build_node_worker(temporal_client, key, services)
        run = asyncio.create_task(worker.run())

        async def stop() -> None:
            if not run.done():
                await worker.shutdown()
            await asyncio.gather(run, return_exceptions=True)

        node = StorageNode(key, machine.root, stop, host)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        await node.stop()
        base = node.machine_root / "mnt/gpucloud/storage"
        for point in sorted(p for p in mounted_points() if p.startswith(str(base))):
            with contextlib.suppress(MountFailed):
                await asyncio.to_thread(KernelBindMounter().unmount, Path(point))


async def active_allocation(tenant: Tenant, db_sessions: Any, start: StartStorageAgent,
                            **agent: Any) -> tuple[str, StorageNode]:  # fmt: skip
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    storage_node = await start(node.id, **agent)
    response = await tenant.client.post("/api/v1/allocations", json=slice_request(1))
    assert response.status_code == 201, response.text
    allocation_id: str = response.json()["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")
    return allocation_id, storage_node


async def create_namespace(client: httpx.AsyncClient, name: str, **body: Any) -> dict[str, Any]:
    response = await client.post(
        "/api/v1/storage/namespaces", json={"name": name, "quota_bytes": 1 << 20, **body}
    )
    assert response.status_code == 201, response.text
    namespace: dict[str, Any] = response.json()
    return namespace


async def attach(
    client: httpx.AsyncClient, allocation_id: str, namespace_id: str, mode: str
) -> dict[str, Any]:
    response = await client.post(
        f"/api/v1/allocations/{allocation_id}/attachments",
        json={"namespace_id": namespace_id, "mode": mode},
    )
    assert response.status_code == 201, response.text
    attachment: dict[str, Any] = response.json()
    assert attachment["status"] in {"requested", "prechecking", "grant_applying", "mounting",
                                    "grant_applied", "mounted", "failed"}  # fmt: skip
    return attachment


async def wait_attachment(
    client: httpx.AsyncClient, allocation_id: str, attachment_id: str, status: str,
    timeout: float = 30.0,
) -> dict[str, Any]:  # fmt: skip
    url = f"/api/v1/allocations/{allocation_id}/attachments/{attachment_id}"

    async def check() -> dict[str, Any] | None:
        body: dict[str, Any] = (await client.get(url)).json()
        return body if body.get("status") == status else None

    try:
        return await eventually(check, timeout=timeout, interval=0.1)
    except AssertionError:
        raise AssertionError(f"never {status}: {(await client.get(url)).json()}") from None


async def transitions(db_sessions: Any, attachment_id: str) -> list[str]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(StorageAttachmentEvent.to_status)
            .where(StorageAttachmentEvent.attachment_id == uuid.UUID(attachment_id))
            .order_by(StorageAttachmentEvent.id)
        )
        return list(rows)


async def record(temporal_client: Client, attachment_id: str, name: str) -> None:
    handle = temporal_client.get_workflow_handle(attachment_workflow_id(attachment_id))
    await record_history(handle, "storage_attachment", name)


def cloud_init_storage_table(storage_root: Path) -> str:
    """agent.toml's `[storage]` table as activities/cloud_init.py renders it for this export."""
    rendered = render_agent_toml(
        AgentBootstrap("https://api.invalid", "unused", storage_export_root=str(storage_root))
    )
    return "\n" + rendered[rendered.index("[storage]") :]


async def seed_slice_node(db_sessions: Any) -> NodeSpec:
    """A demo-fleet slice node (its GPUs' PCI addresses and NUMA layout) and its SKU."""
    await create_sku(db_sessions)
    node = build_node(f"gpu-{uuid.uuid4().hex[:8]}.libvirt.test", sku=SLICE_SKU, region=REGION)
    async with db_sessions() as session, session.begin():
        await seed_fleet(session, Fleet(skus=(), nodes=(node,)))
    return node


# A release that fences before it detaches writes its patch marker (and the SDK's change-version
# search attribute with it).
FENCE_MARKERS = {"core_patch", "TemporalChangeVersion"}

ATTACH_PATH = ["requested", "prechecking", "grant_applying", "grant_applied", "mounting", "mounted"]


async def test_mount_write_detach_keeps_the_data_and_namespace_delete_waits_for_it(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "datasets")
    assert namespace["provider"] == "shared_directory"
    data_dir = storage_root / "namespaces" / namespace["id"]
    assert data_dir.is_dir()

    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    mounted = await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    assert mounted["mount_path"] == f"/mnt/gpucloud/storage/{aid}"
    assert str(node.mount_dir(aid)) in mounted_points()
    # Written on the node, through the mount: it is in the namespace.
    (node.mount_dir(aid) / "model.bin").write_bytes(b"weights")
    assert (data_dir / "model.bin").read_bytes() == b"weights"
    assert await transitions(db_sessions, aid) == ATTACH_PATH

    timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    (mount_task,) = [i for i in timeline["items"] if i.get("name") == STORAGE_MOUNT]
    assert mount_task["status"] == "succeeded"
    assert [p["phase"] for p in mount_task["phases"] if p["status"] == "succeeded"] == [
        "grant_checked", "mount_point_prepared", "mounted", "guest_attached"
    ]  # fmt: skip
    # A slice: its (simulated) VM has the mount as a virtiofs filesystem, tagged by the id.
    assert mounted["guest_mount_tag"] == aid
    vm = node.host.domain(allocation_id)
    assert vm is not None
    assert vm.filesystems == ((aid, str(node.mount_dir(aid))),)

    refused = await tenant.client.delete(f"/api/v1/storage/namespaces/{namespace['id']}")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "storage_namespace_attached"

    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    detached = await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert detached["mount_path"] is None
    assert detached["guest_mount_tag"] is None
    assert detached["detached_at"] is not None
    vm = node.host.domain(allocation_id)
    assert vm is not None
    assert vm.filesystems == ()
    assert str(node.mount_dir(aid)) not in mounted_points()
    assert not node.mount_dir(aid).exists()
    assert not (storage_root / "grants" / namespace["id"] / f"{aid}.json").exists()
    assert (data_dir / "model.bin").read_bytes() == b"weights"  # a detach deletes nothing
    assert await transitions(db_sessions, aid) == [*ATTACH_PATH, "detaching", "detached"]
    await record(temporal_client, aid, "mount_detach")

    # Detached: the owner may delete it now, data and all.
    deleted = await tenant.client.delete(f"/api/v1/storage/namespaces/{namespace['id']}")
    assert deleted.status_code == 202, deleted.text
    assert deleted.json()["status"] in {"deleting", "deleted"}
    url = f"/api/v1/storage/namespaces/{namespace['id']}"

    async def deleted_view() -> bool:
        return bool((await tenant.client.get(url)).json()["status"] == "deleted")

    await eventually(deleted_view, timeout=30)
    assert not data_dir.exists()  # deleted only once the data is gone
    listed = (await tenant.client.get("/api/v1/storage/namespaces")).json()["items"]
    assert namespace["id"] not in [n["id"] for n in listed]


async def test_read_only_mount_refuses_writes_and_is_allowed_over_quota(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent, storage_root: Path
) -> None:
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    response = await tenant.client.post(
        "/api/v1/storage/namespaces", json={"name": "full", "quota_bytes": 4096}
    )
    assert response.status_code == 201, response.text
    namespace = response.json()
    (storage_root / "namespaces" / namespace["id"] / "big").write_bytes(os.urandom(64 * 1024))

    writer = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    failed = await wait_attachment(tenant.client, allocation_id, writer["attachment_id"], "failed")
    assert failed["failure_reason"] == "quota_exceeded"
    assert await transitions(db_sessions, writer["attachment_id"]) == [
        "requested", "prechecking", "failed"
    ]  # fmt: skip

    reader = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    rid = reader["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, rid, "mounted")
    assert (node.mount_dir(rid) / "big").stat().st_size == 64 * 1024
    with pytest.raises(OSError, match="Read-only file system"):
        (node.mount_dir(rid) / "new").write_bytes(b"x")


async def test_multi_writer_needs_policy_and_writers_exclude_each_other(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, _ = await active_allocation(tenant, db_sessions, start_storage_agent)
    plain = await create_namespace(tenant.client, "plain")
    shared = await create_namespace(tenant.client, "shared", allow_multi_writer=True)

    refused = await attach(tenant.client, allocation_id, plain["id"], "multi_writer")
    body = await wait_attachment(tenant.client, allocation_id, refused["attachment_id"], "failed")
    assert body["failure_reason"] == "multi_writer_not_allowed"

    first = await attach(tenant.client, allocation_id, shared["id"], "multi_writer")
    second = await attach(tenant.client, allocation_id, shared["id"], "multi_writer")
    for a in (first, second):
        await wait_attachment(tenant.client, allocation_id, a["attachment_id"], "mounted")
    single = await attach(tenant.client, allocation_id, shared["id"], "single_writer")
    body = await wait_attachment(tenant.client, allocation_id, single["attachment_id"], "failed")
    assert body["failure_reason"] == "writer_conflict"

    # Recovery of a failed attachment: failed → detaching → detached (nothing was mounted).
    sid = single["attachment_id"]
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{sid}")
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, sid, "detached")
    assert await transitions(db_sessions, sid) == [
        "requested", "prechecking", "failed", "detaching", "detached"
    ]  # fmt: skip
    await record(temporal_client, sid, "precheck_failed_then_detached")


async def test_grant_failure_fails_the_attachment(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent, storage_root: Path
) -> None:
    allocation_id, _ = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "ungrantable")
    # The provider cannot write grants for this namespace (a file where its directory goes).
    (storage_root / "grants").mkdir()
    (storage_root / "grants" / namespace["id"]).write_text("not a directory")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    aid = attachment["attachment_id"]
    body = await wait_attachment(tenant.client, allocation_id, aid, "failed", timeout=40)
    assert body["failure_reason"] == "storage_grant_failed"
    assert await transitions(db_sessions, aid) == [
        "requested", "prechecking", "grant_applying", "failed"
    ]  # fmt: skip


async def test_a_node_that_cannot_mount_fails_then_admin_retry_detaches(
    tenant: Tenant, admin: httpx.AsyncClient, db_sessions: Any,
    start_storage_agent: StartStorageAgent, temporal_client: Client,
) -> None:  # fmt: skip
    # The node's agent has no [storage] export: its mount (and unmount) answer `unsupported`.
    allocation_id, node = await active_allocation(
        tenant, db_sessions, start_storage_agent, export=False
    )
    namespace = await create_namespace(tenant.client, "scratch")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    aid = attachment["attachment_id"]
    body = await wait_attachment(tenant.client, allocation_id, aid, "failed")
    assert body["failure_reason"] == "storage_mount_failed"
    assert "unsupported" in body["failure_message"]

    # The tenant's detach reaches the same node: failed → detaching → detach_failed.
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    body = await wait_attachment(tenant.client, allocation_id, aid, "detach_failed")
    assert body["failure_reason"] == "storage_unmount_failed"
    stuck = (await admin.get("/api/v1/admin/storage/attachments")).json()["items"]
    assert aid in [a["attachment_id"] for a in stuck]

    # The node gets its storage config; an operator retries the detach (audited).
    await node.stop()
    await start_storage_agent(node.node_id)
    response = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/retry-detach",
        json={"reason": "node storage export fixed; OPS-7"},
    )
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert await transitions(db_sessions, aid) == [
        "requested", "prechecking", "grant_applying", "grant_applied", "mounting", "failed",
        "detaching", "detach_failed", "detaching", "detached",
    ]  # fmt: skip
    async with db_sessions() as session:
        audit = (
            await session.scalars(
                select(AuditEntry).where(AuditEntry.action == "storage_attachment.retry_detach")
            )
        ).one()
    assert audit.target_id == aid
    assert audit.reason == "node storage export fixed; OPS-7"
    assert audit.prior_state == "detach_failed"
    again = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/retry-detach", json={"reason": "twice"}
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "attachment_not_stuck"
    await record(temporal_client, aid, "mount_failed_detach_failed_admin_retry")


async def test_release_fences_the_vm_then_detaches_storage_and_keeps_the_data(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "checkpoints")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    (node.mount_dir(aid) / "step-100.ckpt").write_bytes(b"state")

    response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert response.status_code == 202, response.text
    await wait_status(tenant.client, allocation_id, "released")
    body = await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert body["detached_at"] is not None
    assert str(node.mount_dir(aid)) not in mounted_points()
    data = storage_root / "namespaces" / namespace["id"] / "step-100.ckpt"
    assert data.read_bytes() == b"state"  # a release deletes no storage

    timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    tasks = {i["name"]: i for i in timeline["items"] if i.get("kind") == "node_task"}
    unmount, host_release = tasks[STORAGE_UNMOUNT], tasks["slice.vm_release"]
    assert unmount["status"] == host_release["status"] == "succeeded"
    # Fence first, then clean (issue 37): the VM is stopped before its storage is unmounted.
    assert host_release["completed_at"] <= unmount["started_at"]
    async with db_sessions() as session:
        actors = list(
            await session.scalars(
                select(StorageAttachmentEvent.actor).where(
                    StorageAttachmentEvent.attachment_id == uuid.UUID(aid),
                    StorageAttachmentEvent.to_status == "detaching",
                )
            )
        )
    assert actors == ["allocation_release"]
    await record(temporal_client, aid, "detached_by_release")
    handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
    # Its release plan counted the attachment: the detach ran after the fence (its patch marker).
    steps, markers = await release_steps(handle)
    assert steps == [DETACH_FOR_RELEASE]
    assert markers
    assert set(markers) <= FENCE_MARKERS
    await record_history(handle, "allocation", "release_fences_then_detaches_storage")


async def test_a_busy_mount_fences_the_tenant_then_fails_the_release_until_retried(
    tenant: Tenant, admin: httpx.AsyncClient, db_sessions: Any,
    start_storage_agent: StartStorageAgent, temporal_client: Client,
) -> None:  # fmt: skip
    """Issue 37: a mount kept busy no longer keeps the compute running. The VM is stopped and
    billing closed before the unmount is tried; the busy unmount then ends the release
    release_failed (storage_detach_failed) with the tenant fenced, never usable and unbilled."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "busy")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")

    # A process on the node holds a file open in the mount: the kernel refuses the unmount.
    with (node.mount_dir(aid) / "open.log").open("w"):
        response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
        assert response.status_code == 202, response.text
        failed = await wait_status(tenant.client, allocation_id, "release_failed")
        attached = await wait_attachment(tenant.client, allocation_id, aid, "detach_failed")
        assert attached["failure_reason"] == "storage_unmount_failed"
        assert str(node.mount_dir(aid)) in mounted_points()  # nothing under it was touched
    # The tenant is fenced: its VM was stopped by the host release, which succeeded.
    domain = node.host.domain(allocation_id)
    assert domain is None or domain.state != "running"
    assert failed["failure_reason"] == STORAGE_DETACH_FAILED
    timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    tasks = {i["name"]: i for i in timeline["items"] if i.get("kind") == "node_task"}
    host_release, unmount = tasks["slice.vm_release"], tasks[STORAGE_UNMOUNT]
    assert host_release["status"] == "succeeded"
    assert unmount["status"] == "failed"
    assert host_release["completed_at"] <= unmount["started_at"]
    # Billing stopped when the tenant was fenced, before the detach was tried.
    async with db_sessions() as session:
        ended_at = await session.scalar(
            select(UsageRecord.ended_at).where(
                UsageRecord.allocation_id == uuid.UUID(allocation_id)
            )
        )
    assert ended_at is not None
    assert ended_at <= datetime.fromisoformat(unmount["started_at"].replace("Z", "+00:00"))

    response = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/retry-detach", json={"reason": "log closed"}
    )
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert (await transitions(db_sessions, aid))[len(ATTACH_PATH):] == [
        "detaching", "detach_failed", "detaching", "detached"
    ]  # fmt: skip
    # The release runs again and now goes through (the host release again finds nothing).
    response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert response.status_code == 202, response.text
    await wait_status(tenant.client, allocation_id, "released")
    await record(temporal_client, aid, "mounted_detach_failed_retried")
    handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
    # The second release found the attachment detached already: it detached nothing again.
    steps, markers = await release_steps(handle)
    assert steps == [DETACH_FOR_RELEASE]
    assert markers
    assert set(markers) <= FENCE_MARKERS
    await record_history(handle, "allocation", "release_failed_on_storage_detach_after_fence")


async def test_attach_refusals_answer_typed_errors(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent
) -> None:
    allocation_id, _ = await active_allocation(tenant, db_sessions, start_storage_agent)
    missing = await tenant.client.post(
        f"/api/v1/allocations/{allocation_id}/attachments",
        json={"namespace_id": str(uuid.uuid4()), "mode": "read_only"},
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "storage_namespace_not_found"
    namespace = await create_namespace(tenant.client, "twice")
    duplicate = await tenant.client.post(
        "/api/v1/storage/namespaces", json={"name": "twice", "quota_bytes": 10}
    )
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["code"] == "storage_namespace_exists"
    bad_mode = await tenant.client.post(
        f"/api/v1/allocations/{allocation_id}/attachments",
        json={"namespace_id": namespace["id"], "mode": "everyone"},
    )
    assert bad_mode.status_code in (400, 422)
    await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(tenant.client, allocation_id, "released")
    late = await tenant.client.post(
        f"/api/v1/allocations/{allocation_id}/attachments",
        json={"namespace_id": namespace["id"], "mode": "read_only"},
    )
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "allocation_not_attachable"


async def test_a_release_during_the_tenants_detach_is_answered_by_that_detach(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "racing")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")
    # The provider cannot revoke the grant for now (a directory where its file is): the tenant's
    # detach unmounts, then retries the revoke, and the release asks for a detach meanwhile.
    grant = storage_root / "grants" / namespace["id"] / f"{aid}.json"
    grant.unlink()
    grant.mkdir()
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    await eventually(
        lambda: asyncio.sleep(0, result=str(node.mount_dir(aid)) not in mounted_points()),
        timeout=30,
    )
    response = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert response.status_code == 202, response.text
    handle = temporal_client.get_workflow_handle(
        attachment_workflow_id(aid), result_type=AttachmentView
    )

    async def both_detaches_accepted() -> bool:
        accepted = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        events = (await handle.fetch_history()).events
        return sum(e.event_type == accepted for e in events) == 3  # open, tenant, release

    await eventually(both_detaches_accepted, timeout=10, interval=0.1)
    grant.rmdir()
    # The tenant's detach run ends detached and answers the release's request too: the
    # attachment's workflow ends, and the release goes on at once (not after its detach times out).
    final = await asyncio.wait_for(handle.result(), timeout=15)
    assert final.status == "detached"
    await wait_status(tenant.client, allocation_id, "released", timeout=15)
    assert await transitions(db_sessions, aid) == [*ATTACH_PATH, "detaching", "detached"]
    await record(temporal_client, aid, "release_answered_by_running_detach")


async def test_the_deployed_agent_mounts_with_the_storage_table_cloud_init_writes(
    terminal_rig: Callable[..., Awaitable[TerminalRig]], storage_root: Path, db_sessions: Any
) -> None:
    """`gpucloud-agent` as a node runs it (its own process, the `host` backend, agent.toml's
    `[storage]` table as activities/cloud_init.py renders it) mounts, and its release unmounts."""
    rig = await terminal_rig(agent_config=cloud_init_storage_table(storage_root))
    namespace = await create_namespace(rig.tenant, "deployed")
    attachment = await attach(rig.tenant, rig.allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    try:
        mounted = await wait_attachment(rig.tenant, rig.allocation_id, aid, "mounted")
    except AssertionError as err:
        raise AssertionError(f"{err}\nagent log:\n{rig.agent.log_tail()}") from None
    point = rig.agent.root / mounted["mount_path"].lstrip("/")
    try:
        assert str(point) in mounted_points()
        (point / "written-on-the-node").write_bytes(b"x")
        assert (storage_root / "namespaces" / namespace["id"] / "written-on-the-node").exists()

        response = await rig.tenant.post(f"/api/v1/allocations/{rig.allocation_id}/release")
        assert response.status_code == 202, response.text
        await wait_status(rig.tenant, rig.allocation_id, "released", timeout=60)
        await wait_attachment(rig.tenant, rig.allocation_id, aid, "detached")
        assert str(point) not in mounted_points()
        assert await transitions(db_sessions, aid) == [*ATTACH_PATH, "detaching", "detached"]
    finally:
        if str(point) in mounted_points():  # a failed run leaves no mount behind
            with contextlib.suppress(MountFailed):
                await asyncio.to_thread(KernelBindMounter().unmount, point)


async def test_a_namespace_the_provider_cannot_measure_fails_while_requested(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    """requested → failed: the precheck never began, as the namespace could not be measured (its
    directory is not in the export, as when the export is not mounted on the worker)."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "unmounted-export")
    data_dir = storage_root / "namespaces" / namespace["id"]
    (data_dir / "kept").write_bytes(b"data")
    away = storage_root / "away"
    data_dir.rename(away)
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    body = await wait_attachment(tenant.client, allocation_id, aid, "failed", timeout=40)
    assert body["failure_reason"] == "storage_provider_unavailable"
    assert "not a directory in the storage export" in body["failure_message"]
    assert await transitions(db_sessions, aid) == ["requested", "failed"]
    assert not (storage_root / "grants" / namespace["id"]).exists()  # no grant was applied

    # The export is back; the tenant detaches the failed attachment: nothing to unmount.
    away.rename(data_dir)
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert await transitions(db_sessions, aid) == ["requested", "failed", "detaching", "detached"]
    assert not node.mount_dir(aid).exists()
    assert (data_dir / "kept").read_bytes() == b"data"
    # It held no grant, so it is no writer: a single writer attaches next.
    writer = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    await wait_attachment(tenant.client, allocation_id, writer["attachment_id"], "mounted")
    await record(temporal_client, aid, "provider_unavailable_then_detached")


async def test_a_detach_before_the_mount_began_stops_the_attach_once_the_grant_is_applied(
    tenant: Tenant, db_sessions: Any, start_storage_agent: StartStorageAgent,
    storage_root: Path, temporal_client: Client,
) -> None:  # fmt: skip
    """grant_applied → failed: the tenant detached while the provider was still granting (its
    grant directory briefly unwritable). The attach stops there, mounts nothing, and the detach
    revokes the grant."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "changed-my-mind")
    blocker = storage_root / "grants" / namespace["id"]
    blocker.parent.mkdir()
    blocker.write_text("not a directory yet")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "grant_applying")
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    handle = temporal_client.get_workflow_handle(
        attachment_workflow_id(aid), result_type=AttachmentView
    )

    async def detach_accepted() -> bool:
        accepted = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        events = (await handle.fetch_history()).events
        return sum(e.event_type == accepted for e in events) == 2  # open, the tenant's detach

    await eventually(detach_accepted, timeout=5, interval=0.05)
    blocker.unlink()  # the provider's next try grants
    final = await asyncio.wait_for(handle.result(), timeout=30)
    assert final.status == "detached"
    assert await transitions(db_sessions, aid) == [
        "requested", "prechecking", "grant_applying", "grant_applied", "failed",
        "detaching", "detached",
    ]  # fmt: skip
    async with db_sessions() as session:
        reasons = list(
            await session.scalars(
                select(StorageAttachmentEvent.details["failure_reason"].astext).where(
                    StorageAttachmentEvent.attachment_id == uuid.UUID(aid),
                    StorageAttachmentEvent.to_status == "failed",
                )
            )
        )
    assert reasons == ["detached_before_mount"]
    timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    assert not [i for i in timeline["items"] if i.get("kind") == "node_task"
                and i.get("name") in (STORAGE_MOUNT, STORAGE_UNMOUNT)]  # fmt: skip
    assert not node.mount_dir(aid).exists()
    assert not (storage_root / "grants" / namespace["id"] / f"{aid}.json").exists()
    await record(temporal_client, aid, "detach_before_mount_cancels")


async def test_a_detach_on_an_offline_node_fails_at_once_and_is_retried_once_it_is_back(
    tenant: Tenant, admin: httpx.AsyncClient, db_sessions: Any,
    start_storage_agent: StartStorageAgent, temporal_client: Client, settings: Any,
) -> None:  # fmt: skip
    """mounted → detach_failed: the node's agent went silent and liveness took the node offline,
    so nothing can unmount there; the detach says so at once rather than after the unmount's
    schedule-to-start timeout, leaves the mount alone, and an operator's retry detaches once the
    agent is back."""
    allocation_id, node = await active_allocation(tenant, db_sessions, start_storage_agent)
    namespace = await create_namespace(tenant.client, "on-a-lost-node")
    attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
    aid = attachment["attachment_id"]
    await wait_attachment(tenant.client, allocation_id, aid, "mounted")

    queue = settings.control_plane_task_queue
    await send_heartbeat(temporal_client, node.node_id, control_plane_queue=queue)
    await node.stop()
    await asyncio.sleep(2.5)  # silent for longer than the sweep's threshold below
    sweep = await temporal_client.execute_workflow(
        NodeLivenessWorkflow.run,
        LivenessInput(offline_after_seconds=2),
        id=f"node-liveness-test-{uuid.uuid4()}",
        task_queue=queue,
    )
    assert node.node_id in sweep.went_offline

    started = asyncio.get_running_loop().time()
    response = await tenant.client.delete(f"/api/v1/allocations/{allocation_id}/attachments/{aid}")
    assert response.status_code == 202, response.text
    body = await wait_attachment(tenant.client, allocation_id, aid, "detach_failed")
    assert asyncio.get_running_loop().time() - started < 10  # no schedule-to-start wait
    assert body["failure_reason"] == "node_offline"
    assert await transitions(db_sessions, aid) == [*ATTACH_PATH, "detach_failed"]
    assert str(node.mount_dir(aid)) in mounted_points()  # nothing on the node was touched
    stuck = (await admin.get("/api/v1/admin/storage/attachments")).json()["items"]
    assert aid in [a["attachment_id"] for a in stuck]

    # The agent is back (its presence brings the node back); the operator retries the detach.
    await start_storage_agent(node.node_id)
    await send_heartbeat(temporal_client, node.node_id, control_plane_queue=queue)

    async def node_active() -> bool:
        async with db_sessions() as session:
            row = await session.get(Node, uuid.UUID(node.node_id))
            return row is not None and row.status == "active"

    await eventually(node_active, timeout=15)
    response = await admin.post(
        f"/api/v1/admin/storage/attachments/{aid}/retry-detach",
        json={"reason": "agent restarted; OPS-12"},
    )
    assert response.status_code == 202, response.text
    await wait_attachment(tenant.client, allocation_id, aid, "detached")
    assert await transitions(db_sessions, aid) == [
        *ATTACH_PATH, "detach_failed", "detaching", "detached"
    ]  # fmt: skip
    assert str(node.mount_dir(aid)) not in mounted_points()
    await record(temporal_client, aid, "offline_node_detach_failed_admin_retry")


async def test_a_slice_vm_gets_the_mount_as_virtiofs_and_gives_it_back_first(
    tenant: Tenant, db_sessions: Any, temporal_client: Client, tmp_path: Path,
    storage_root: Path,
) -> None:  # fmt: skip
    """A gpu_slice tenant works inside its VM: on a node whose slice VMs are the production
    libvirt backend (on libvirt's test driver), the mount reaches the allocation's domain as a
    virtiofs filesystem (read-only when the mount is), and the detach takes it out of the domain
    before the host unmounts. The test driver has no device hot-plug, so the domain's persistent
    definition carries it, as the task's phase says; on QEMU the same call hot-plugs."""
    node = await seed_slice_node(db_sessions)
    hosts = LibvirtTestHosts(tmp_path / "libvirt-hosts")
    run: asyncio.Task[None] | None = None
    points: list[Path] = []
    try:
        async with db_sessions() as session:
            await hosts.load(session, [str(node.id)])
        services = hosts(AgentNode(str(node.id), node.hostname))
        assert services.storage is not None
        worker = build_node_worker(temporal_client, str(node.id), services)
        run = asyncio.create_task(worker.run())
        created = await tenant.client.post("/api/v1/allocations", json=slice_request(2))
        assert created.status_code == 201, created.text
        allocation_id = created.json()["allocation_id"]
        await wait_status(tenant.client, allocation_id, "active", timeout=60)
        domain = hosts.hosts[str(node.id)].connection.lookupByName(f"gpc-{allocation_id}")
        namespace = await create_namespace(tenant.client, "vm-datasets")
        attachment = await attach(tenant.client, allocation_id, namespace["id"], "read_only")
        aid = attachment["attachment_id"]
        mounted = await wait_attachment(tenant.client, allocation_id, aid, "mounted")

        tag = virtiofs_tag(aid)
        assert mounted["guest_mount_tag"] == tag
        point = services.storage.root.host_path(mounted["mount_path"])
        points.append(point)
        assert str(point) in mounted_points()  # the host's read-only bind mount
        definition = domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert parse_domain(definition).filesystems == {tag: str(point)}
        device = filesystem_element(definition, tag)
        assert device is not None
        assert "virtiofs" in device
        # No <readonly/>: libvirt 9.0 refuses it on virtiofs; the host's read-only bind mount is
        # the guard (tests/test_qemu_guest_virtiofs.py shows a real guest's write refused).
        assert "<readonly" not in device
        access = ElementTree.fromstring(definition).find("memoryBacking/access")  # noqa: S314
        assert access is not None
        assert access.get("mode") == "shared"  # virtiofs needs the guest's memory shared
        timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
        (mount_task,) = [i for i in timeline["items"] if i.get("name") == STORAGE_MOUNT]
        phases = {p["phase"]: p for p in mount_task["phases"] if p["status"] == "succeeded"}
        assert list(phases) == [*MOUNT_PHASES, "guest_attached"]
        assert phases["guest_attached"]["message"] == (
            f"virtiofs {tag} attached in the definition (this driver has no hot-plug)"
        )

        response = await tenant.client.delete(
            f"/api/v1/allocations/{allocation_id}/attachments/{aid}"
        )
        assert response.status_code == 202, response.text
        detached = await wait_attachment(tenant.client, allocation_id, aid, "detached")
        assert detached["guest_mount_tag"] is None
        assert parse_domain(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)).filesystems == {}
        assert str(point) not in mounted_points()
        timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
        (unmount_task,) = [i for i in timeline["items"] if i.get("name") == STORAGE_UNMOUNT]
        assert [p["phase"] for p in unmount_task["phases"] if p["status"] == "succeeded"] == [
            "guest_detached", "unmounted", "mount_point_removed"
        ]  # fmt: skip
        await record(temporal_client, aid, "slice_vm_virtiofs_mount_detach")

        released = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
        assert released.status_code == 202, released.text
        await wait_status(tenant.client, allocation_id, "released", timeout=60)
    finally:
        if run is not None and not run.done():
            await worker.shutdown()
            await asyncio.gather(run, return_exceptions=True)
        for point in points:
            if str(point) in mounted_points():
                with contextlib.suppress(MountFailed):
                    await asyncio.to_thread(KernelBindMounter().unmount, point)
        hosts.close()


async def test_the_deployed_agent_gives_a_slice_vm_its_storage(
    tenant: Tenant, db_sessions: Any, settings: Any, temporal_client: Client, tmp_path: Path,
    storage_root: Path,
) -> None:  # fmt: skip
    """`gpucloud-agent` as a slice node runs it: its own process, the `host` backend built from
    its config (the machine image's `[libvirt]`, on libvirt's test driver; `[storage]` as
    cloud-init renders it), so the storage backend and the slice VMs it gives the mount to are
    wired as in production."""
    node = await seed_slice_node(db_sessions)
    agent = start_agent_process(
        settings,
        str(node.id),
        tmp_path / "machine",
        agent_config=cloud_init_storage_table(storage_root),
        gpus=[GpuPlacement(slot.pci_address, slot.numa_node) for slot in node.slots],
    )
    point: Path | None = None
    try:
        await wait_polled(temporal_client, node_task_queue(str(node.id)))
        created = await tenant.client.post("/api/v1/allocations", json=slice_request(2))
        assert created.status_code == 201, created.text
        allocation_id = created.json()["allocation_id"]
        await wait_status(tenant.client, allocation_id, "active", timeout=60)
        namespace = await create_namespace(tenant.client, "deployed-slice")
        attachment = await attach(tenant.client, allocation_id, namespace["id"], "single_writer")
        aid = attachment["attachment_id"]
        mounted = await wait_attachment(tenant.client, allocation_id, aid, "mounted")
        assert mounted["guest_mount_tag"] == aid
        point = agent.root / mounted["mount_path"].lstrip("/")
        assert str(point) in mounted_points()
        timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
        (mount_task,) = [i for i in timeline["items"] if i.get("name") == STORAGE_MOUNT]
        phases = {p["phase"]: p for p in mount_task["phases"] if p["status"] == "succeeded"}
        assert phases["guest_attached"]["message"] == (
            f"virtiofs {aid} attached in the definition (this driver has no hot-plug)"
        )

        released = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
        assert released.status_code == 202, released.text
        await wait_status(tenant.client, allocation_id, "released", timeout=60)
        await wait_attachment(tenant.client, allocation_id, aid, "detached")
        assert str(point) not in mounted_points()
        timeline = (await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
        (unmount_task,) = [i for i in timeline["items"] if i.get("name") == STORAGE_UNMOUNT]
        guest_detached = [p for p in unmount_task["phases"] if p["phase"] == "guest_detached"]
        # Fence first (issue 37): the release stopped and undefined the VM before the unmount,
        # so there is no guest left to take the filesystem out of.
        assert guest_detached[-1]["message"] == "no VM: nothing attached"
    except AssertionError as err:
        raise AssertionError(f"{err}\nagent log:\n{agent.log_tail()}") from None
    finally:
        agent.stop()
        if point is not None and str(point) in mounted_points():
            with contextlib.suppress(MountFailed):
                await asyncio.to_thread(KernelBindMounter().unmount, point)
