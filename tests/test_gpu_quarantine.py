"""A GPU that fails its health check after a slice VM released it quarantines its own slot only;
an operator returns it to service. Plus the sysfs health check itself on a fake sysfs tree (more
cases, on a tree laid out like the kernel's, in tests/test_agent_gpu_health.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from agent.gpu_health import SysfsGpuHealthCheck
from schema.models import AuditEntry, GpuSlot
from tests.lifecycle_support import create_fleet, events_of, slice_request, wait_status


@pytest.mark.usefixtures("control_plane")
async def test_unhealthy_gpu_quarantines_its_slot_until_an_operator_returns_it(
    api: Any, make_project: Any, make_token: Any, db_sessions: Any, start_node_agent: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    agent = await start_node_agent(node.id)
    tenant = await api(token=await make_token("tenant", await make_project()))
    admin = await api(token=await make_token("admin"))

    created = await tenant.post("/api/v1/allocations", json=slice_request(2))
    allocation_id = created.json()["allocation_id"]
    await wait_status(tenant, allocation_id, "active")
    async with db_sessions() as session:
        held = (
            await session.scalars(
                select(GpuSlot.pci_address)
                .where(GpuSlot.allocation_id == uuid.UUID(allocation_id))
                .order_by(GpuSlot.gpu_index)
            )
        ).all()
    broken = held[0]
    agent.host.fail_gpu_health_after_release(broken, "PCI config space reads all-ones")

    await tenant.post(f"/api/v1/allocations/{allocation_id}/release")
    await wait_status(tenant, allocation_id, "released")
    assert "gpu_quarantined" in await events_of(db_sessions, allocation_id)

    slots = (await admin.get(f"/api/v1/admin/nodes/{node.id}/gpu-slots")).json()["items"]
    by_address = {s["pci_address"]: s for s in slots}
    assert by_address[broken]["status"] == "disabled"
    assert by_address[broken]["quarantine_reason"] == "PCI config space reads all-ones"
    assert by_address[held[1]]["status"] == "free"
    assert sum(1 for s in slots if s["status"] == "free") == 7

    # Only 7 GPUs can be placed now.
    whole = await tenant.post("/api/v1/allocations", json=slice_request(8))
    assert whole.status_code == 409
    assert (await tenant.get(f"/api/v1/admin/nodes/{node.id}/gpu-slots")).status_code == 403

    slot_id = by_address[broken]["id"]
    url = f"/api/v1/admin/nodes/{node.id}/gpu-slots/{slot_id}/return-to-service"
    returned = await admin.post(url, json={"reason": "host rebooted, FLR fixed"})
    assert returned.status_code == 200, returned.text
    assert returned.json()["status"] == "free"
    assert returned.json()["quarantine_reason"] is None
    again = await admin.post(url, json={"reason": "twice"})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "slot_not_quarantined"
    async with db_sessions() as session:
        audit = await session.scalar(
            select(AuditEntry).where(AuditEntry.action == "gpu_slot.return_to_service")
        )
    assert audit is not None
    assert (audit.prior_state, audit.expected_state) == ("disabled", "free")

    whole = await tenant.post("/api/v1/allocations", json=slice_request(8))
    assert whole.status_code == 201, whole.text


def make_device(root: Path, address: str, config: bytes, driver: str | None) -> None:
    device = root / "bus" / "pci" / "devices" / address
    device.mkdir(parents=True)
    (device / "config").write_bytes(config)
    if driver is not None:
        target = root / "bus" / "pci" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(target)


def test_sysfs_health_check(tmp_path: Path) -> None:
    healthy_config = bytes.fromhex("de103023") + b"\0" * 60
    make_device(tmp_path, "0000:17:00.0", healthy_config, "vfio-pci")
    make_device(tmp_path, "0000:3d:00.0", b"\xff" * 64, "vfio-pci")
    make_device(tmp_path, "0000:63:00.0", healthy_config, "nvidia")
    make_device(tmp_path, "0000:86:00.0", healthy_config, None)
    make_device(tmp_path, "0000:b8:00.0", healthy_config, "nouveau")
    check = SysfsGpuHealthCheck(tmp_path)
    assert check.check("0000:17:00.0") is None
    assert "all-ones" in (check.check("0000:3d:00.0") or "")
    # libvirt's managed hostdevs hand a released GPU back to its host driver: healthy.
    assert check.check("0000:63:00.0") is None
    assert check.check("0000:86:00.0") == "bound to no driver (expected nvidia or vfio-pci)"
    assert check.check("0000:b8:00.0") == "bound to nouveau (expected nvidia or vfio-pci)"
    assert check.check("0000:9a:00.0") == "device not present in sysfs (removed from the PCI bus)"
    vfio_only = SysfsGpuHealthCheck(tmp_path, expected_drivers={"vfio-pci"})
    assert vfio_only.check("0000:63:00.0") == "bound to nvidia (expected vfio-pci)"
