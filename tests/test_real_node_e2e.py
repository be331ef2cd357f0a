"""The real node, end to end: a MAAS-simulator machine is onboarded; its first boot writes the
cloud-init our worker rendered onto the machine's disk and starts the command of the rendered
systemd unit, a real `gpucloud-agent` process (production backend, on the machine's root); that
agent enrolls with the token from its own config, heartbeats its GPU inventory (the node becomes
active with GPU slots made from it) and serves every host task. Then, over the HTTP API:

- a bare-metal node: an allocation provisioned on it, a storage namespace attached to it (the
  agent bind-mounts it where its cloud-init config says the provider's tree is) and the
  allocation released (the attachment detached first), `soft_reset`, `reimage` (same node and
  slots; the agent re-enrolls from the fresh cloud-init) and `full_decommission` with erase,
  after which the node is deleted and the MAAS machine released and off;
- a GPU-slice node: a slice VM provisioned and released by the agent's libvirt backend (libvirt's
  test driver on the machine's host.xml), then `full_decommission` whose erase fails in MAAS, so
  the site's no-erase fallback releases the machine;
- a machine whose GPUs do not match its SKU never becomes an active node (hardware_mismatch).

Nothing here enrolls a node, registers an activity or writes lifecycle state: only the agent
process, the workflows and the HTTP API do."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from contracts.states import SkuShape
from schema.models import GpuSlot, Node, NodeTask
from sim.first_boot import BootRecord
from sim.libvirt_hosts import guest_address
from sim.machine_image import default_gpus
from tests.decommission_fixtures import DecommissionRig
from tests.factories import REGION, SLICE_SKU, create_sku
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU
from tests.test_storage_attachments import attach, create_namespace, mounted_points, wait_attachment

MACHINES = sim_scenario(
    sim_machine("real-a", "10.176.18.10"),
    # Its disks cannot be erased: a full decommission with erase takes the no-erase fallback.
    sim_machine("real-b", "10.176.18.11", faults=[{"kind": "erase_fails"}]),
    sim_machine("real-c", "10.176.18.12"),
)
# Every simulated machine has the image's 8 GPUs (sim/machine_image.py), 4 per NUMA node.
MACHINE_GPUS = [(g.pci_address, g.numa_node) for g in default_gpus()]
# The agent's slice backend state on the machine's disk (agent/backends/from_config.py defaults).
VM_LEASES = "var/lib/gpucloud/vms/leases"
VM_SEEDS = "var/lib/gpucloud/seeds"
# Where the agent mounts storage attachments on the machine (agent/storage_mounts.py default).
STORAGE_MOUNTS = "mnt/gpucloud/storage"


@pytest.fixture(autouse=True)
def storage_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shared directory provider's root, set before the worker starts: the worker writes it
    into each node's cloud-init as `[storage] export_root` (the agents get no environment)."""
    root = tmp_path / "storage-export"
    root.mkdir()
    monkeypatch.setenv("GPUCLOUD_STORAGE_ROOT", str(root))
    return root


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def decommission_via_api(admin: Any, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
    started = await admin.post(f"/api/v1/admin/nodes/{node_id}/decommission", json=body)
    assert started.status_code in (200, 201, 202), started.text
    job_id = started.json()["decommission_id"]

    async def done() -> dict[str, Any] | None:
        row: dict[str, Any] = (await admin.get(f"/api/v1/admin/decommissions/{job_id}")).json()
        if row["status"] in ("failed_retryable", "failed_manual_intervention"):
            raise AssertionError(f"{body['mode']} failed: {row}")
        return row if row["status"] in ("completed", "reconciled") else None

    return await until(done, f"{body['mode']} to complete", timeout=120)


async def onboard_via_api(
    admin: Any, decommission: DecommissionRig, hostname: str, ipmi_ip: str, sku: str
) -> dict[str, Any]:
    """POST /api/v1/admin/onboardings, then the job once it settles (completed or failed)."""
    rig = decommission.onboarding
    created = await admin.post(
        "/api/v1/admin/onboardings",
        json={
            "site_id": str(rig.site_id),
            "profile_id": str(rig.profile_id),
            "sku_id": sku,
            "hostname": hostname,
            "ipmi_ip": ipmi_ip,
        },
    )
    assert created.status_code == 201, created.text
    path = f"/api/v1/admin/onboardings/{created.json()['onboarding_id']}"

    async def settled() -> dict[str, Any] | None:
        row: dict[str, Any] = (await admin.get(path)).json()
        return row if row["status"] not in ("pending", "running") else None

    return await until(settled, f"the onboarding of {hostname}", timeout=90)


def agent_of(decommission: DecommissionRig, hostname: str) -> BootRecord:
    record = decommission.onboarding.first_boot.booted[hostname]
    assert record.agent_running, f"the agent process is not running: {record}"
    return record


async def slots_of(decommission: DecommissionRig, node_id: str) -> list[GpuSlot]:
    async with decommission.sessions() as session:
        return list(
            await session.scalars(
                select(GpuSlot)
                .where(GpuSlot.node_id == uuid.UUID(node_id))
                .order_by(GpuSlot.gpu_index)
            )
        )


async def node_row(decommission: DecommissionRig, node_id: str) -> Node:
    async with decommission.sessions() as session:
        node = await session.get(Node, uuid.UUID(node_id))
        assert node is not None
        return node


async def assert_slots_from_inventory(decommission: DecommissionRig, node_id: str) -> None:
    """The node's slots are the GPUs its agent reported (PCI address, NUMA node, index), and
    the agent's later heartbeats agree with them."""
    slots = await slots_of(decommission, node_id)
    assert [(s.gpu_index, s.pci_address, s.numa_node) for s in slots] == [
        (i, pci, numa) for i, (pci, numa) in enumerate(MACHINE_GPUS)
    ]
    node = await node_row(decommission, node_id)
    assert node.numa_layout == [{"numa_node": 0, "gpus": 4}, {"numa_node": 1, "gpus": 4}]
    assert [g["pci_address"] for g in node.gpu_inventory] == [pci for pci, _ in MACHINE_GPUS]
    assert node.inventory_matches is True


async def task_kinds(decommission: DecommissionRig, node_id: str) -> set[str]:
    async with decommission.sessions() as session:
        return set(
            await session.scalars(
                select(NodeTask.kind).where(NodeTask.node_id == uuid.UUID(node_id))
            )
        )


async def tenant_with_key(api: Any, make_token: Any, make_project: Any) -> tuple[Any, str]:
    tenant = await api(token=await make_token("tenant", await make_project()))
    key = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
    )
    assert key.status_code == 201, key.text
    return tenant, key.json()["id"]


@pytest.mark.maas_scenario(MACHINES)
async def test_the_real_agent_serves_a_node_from_onboarding_to_deletion(
    decommission: DecommissionRig,
    api: Any,
    make_token: Any,
    make_project: Any,
    storage_root: Path,
) -> None:
    node_id = await decommission.maas_node("real-a", "10.176.18.10")
    first = agent_of(decommission, "real-a")
    assert first.root is not None
    identity = first.root / "var/lib/gpucloud-agent/identity.json"
    assert node_id in identity.read_text()
    # The agent's config is the rendered one: no payload key in it nor beside it; the node's own
    # key came with its enrollment, into the state dir (tests/test_node_payload_keys.py).
    agent_toml = (first.root / "etc/gpucloud/agent.toml").read_text()
    assert "payload_key" not in agent_toml
    assert not (first.root / "etc/gpucloud/payload.key").exists()
    assert (first.root / "var/lib/gpucloud-agent/payload.key").stat().st_mode & 0o777 == 0o600
    # Active with the GPU slots of the inventory the agent reported (a bare-metal node has them
    # too: its heartbeats are compared with them).
    await assert_slots_from_inventory(decommission, node_id)

    # A bare-metal allocation on the node, provisioned and released by the agent process.
    tenant, key_id = await tenant_with_key(api, make_token, make_project)
    created = await tenant.post(
        "/api/v1/allocations",
        json={"sku": ONBOARD_SKU, "gpus": 8, "region": REGION, "ssh_key_ids": [key_id]},
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(tenant, allocation_id, "active", timeout=60)
    assert active["node_id"] == node_id
    assert active["connect_host"] == first.address  # the deployed address MAAS gave it
    passwd = (first.root / "etc/passwd").read_text()
    tenant_users = [line for line in passwd.splitlines() if int(line.split(":")[2]) >= 20000]
    assert len(tenant_users) == 1, passwd
    # The agent learnt the storage provider's tree from the config its cloud-init wrote.
    assert f'export_root = "{storage_root}"' in agent_toml
    if os.geteuid() == 0:  # bind mounts need root
        # A namespace attached to the allocation: storage.mount, run by the agent process, bind
        # mounts it on the machine; a file written through the mount lands in the namespace.
        namespace = await create_namespace(tenant, "datasets")
        attachment = await attach(tenant, allocation_id, namespace["id"], "single_writer")
        aid = attachment["attachment_id"]
        await wait_attachment(tenant, allocation_id, aid, "mounted", timeout=60)
        mount_point = first.root / STORAGE_MOUNTS / aid
        assert str(mount_point) in mounted_points()
        (mount_point / "written-on-the-node").write_text("data")
        assert (storage_root / "namespaces" / namespace["id"] / "written-on-the-node").is_file()
    released = await tenant.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202
    await wait_status(tenant, allocation_id, "released", timeout=60)
    assert (first.root / "etc/passwd").read_text().count("\n") == passwd.count("\n") - 1
    if os.geteuid() == 0:
        # The release detached the attachment first (storage.unmount by the agent): unmounted,
        # the mount point gone, the data kept.
        await wait_attachment(tenant, allocation_id, aid, "detached")
        assert str(mount_point) not in mounted_points()
        assert not mount_point.exists()
        assert (storage_root / "namespaces" / namespace["id"] / "written-on-the-node").is_file()

    admin = await api(token=await make_token("admin"))
    await decommission_via_api(admin, node_id, {"mode": "soft_reset", "reason": "e2e"})

    # Reimage: MAAS redeploys with a fresh cloud-init; a fresh disk, the agent enrolls again and
    # reports its inventory again; the node keeps its slots.
    slot_ids = [s.id for s in await slots_of(decommission, node_id)]
    await decommission_via_api(admin, node_id, {"mode": "reimage", "reason": "e2e"})
    second = agent_of(decommission, "real-a")
    assert second is not first
    assert second.enrolled
    assert second.root is not None
    assert node_id in (second.root / "var/lib/gpucloud-agent/identity.json").read_text()
    assert [s.id for s in await slots_of(decommission, node_id)] == slot_ids
    assert (await node_row(decommission, node_id)).inventory_matches is True

    final = await decommission_via_api(
        admin, node_id, {"mode": "full_decommission", "erase": "quick", "reason": "e2e"}
    )
    assert final["status"] == "completed"
    assert (await node_row(decommission, node_id)).status == "deleted"
    # Every host task ran on the agent process (none other polled the node's queue); the full
    # decommission's uninstall is not dispatched: the agent went with its OS in the release.
    kinds = await task_kinds(decommission, node_id)
    assert {
        "allocation.provision_user",
        "allocation.deprovision_user",
        *(("storage.mount", "storage.unmount") if os.geteuid() == 0 else ()),
        "node.drain",
        "node.undrain",
        "node.gpu_scrub",
        "node.validate_clean",
    } <= kinds, kinds
    machine = await decommission.onboarding.maas_sim.machine(second.system_id)
    assert machine["status_name"] == "Ready"
    assert machine["power_state"] == "off"
    assert not second.agent_running  # the released machine powered off, its agent with it


@pytest.mark.maas_scenario(MACHINES)
async def test_the_real_agent_serves_gpu_slices_and_the_erase_fallback_ends_the_node(
    decommission: DecommissionRig, api: Any, make_token: Any, make_project: Any
) -> None:
    await create_sku(decommission.sessions, SLICE_SKU, shape=SkuShape.GPU_SLICE)
    admin = await api(token=await make_token("admin"))
    job = await onboard_via_api(admin, decommission, "real-b", "10.176.18.11", SLICE_SKU)
    assert job["status"] == "completed", job
    node_id = str(job["node_id"])
    agent = agent_of(decommission, "real-b")
    assert agent.root is not None
    await assert_slots_from_inventory(decommission, node_id)

    # A 2-GPU slice VM, placed on the slots made from the inventory, defined and started by the
    # agent's libvirt backend on the machine's test-driver host.
    tenant, key_id = await tenant_with_key(api, make_token, make_project)
    created = await tenant.post(
        "/api/v1/allocations",
        json={"sku": SLICE_SKU, "gpus": 2, "region": REGION, "ssh_key_ids": [key_id]},
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(tenant, allocation_id, "active", timeout=60)
    assert active["node_id"] == node_id
    # The guest's address: the drop-in's fixed readiness address of this machine.
    assert active["connect_host"] == guest_address(agent.system_id)
    reserved = sorted(
        s.pci_address
        for s in await slots_of(decommission, node_id)
        if s.allocation_id == uuid.UUID(allocation_id)
    )
    assert len(reserved) == 2
    # The backend's own GPU lease and the guest's cloud-init seed, on the machine's disk.
    lease = json.loads((agent.root / VM_LEASES / f"{allocation_id}.json").read_text())
    assert sorted(lease["gpus"]) == reserved
    assert (agent.root / VM_SEEDS / allocation_id).is_dir()
    timeline = (await tenant.get(f"/api/v1/allocations/{allocation_id}/timeline")).json()
    tasks = [i for i in timeline["items"] if i["kind"] == "node_task"]
    provision = next(i for i in tasks if i["name"] == "slice.vm_provision")
    defined = [p for p in provision["phases"] if p["phase"] == "domain_defined"]
    assert defined[-1]["status"] == "succeeded"
    assert f"gpc-{allocation_id}" in (defined[-1]["message"] or "")

    released = await tenant.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202
    await wait_status(tenant, allocation_id, "released", timeout=60)
    assert not (agent.root / VM_LEASES / f"{allocation_id}.json").exists()
    assert not (agent.root / VM_SEEDS / allocation_id).exists()
    assert all(s.status == "free" for s in await slots_of(decommission, node_id))

    # The machine's disks cannot be erased (its scenario fault); the site allows releasing it
    # without erase, so the decommission completes with that recorded as a follow-up.
    site = f"/api/v1/admin/maas-sites/{decommission.onboarding.site_id}"
    patched = await admin.patch(
        site, json={"policy": {"release_fallback_no_erase": True}, "reason": "e2e"}
    )
    assert patched.status_code == 200, patched.text
    final = await decommission_via_api(
        admin, node_id, {"mode": "full_decommission", "erase": "quick", "reason": "e2e"}
    )
    assert final["status"] == "completed"
    assert "erase_fallback" in [f["kind"] for f in final["followups"]], final["followups"]
    assert (await node_row(decommission, node_id)).status == "deleted"
    assert {s.status for s in await slots_of(decommission, node_id)} == {"disabled"}
    # The slice VM's tasks and the decommission's drain, all served by the agent process.
    kinds = await task_kinds(decommission, node_id)
    assert {"slice.vm_provision", "slice.vm_release", "node.drain"} <= kinds, kinds
    machine = await decommission.onboarding.maas_sim.machine(agent.system_id)
    assert machine["status_name"] == "Ready"
    assert machine["power_state"] == "off"
    counters = await decommission.onboarding.maas_sim.counters()
    assert counters["machines"][agent.system_id].get("machine.release") == 2  # erase, then none
    assert not agent.agent_running


@pytest.mark.maas_scenario(MACHINES)
async def test_a_node_whose_gpus_do_not_match_its_sku_is_never_activated(
    decommission: DecommissionRig, api: Any, make_token: Any
) -> None:
    # A 4-GPU SKU; the machine has 8 GPUs, which its agent reports.
    await create_sku(decommission.sessions, "h100.4x.slice", allowed=(1, 2, 4))
    admin = await api(token=await make_token("admin"))
    job = await onboard_via_api(admin, decommission, "real-c", "10.176.18.12", "h100.4x.slice")
    assert (job["status"], job["current_stage"]) == (
        "failed_manual_intervention",
        "wait_for_agent_enrollment",
    ), job
    assert (job["failure_class"], job["error_code"]) == ("hardware_mismatch", "gpu_count_mismatch")
    assert (job["error_details"]["reported"], job["error_details"]["expected"]) == (8, 4)
    node = await node_row(decommission, str(job["node_id"]))
    assert node.status == "enrolling"  # out of placement
    assert node.enrolled_at is not None
    assert await slots_of(decommission, str(job["node_id"])) == []
