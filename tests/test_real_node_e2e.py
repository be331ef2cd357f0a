"""The real node, end to end: a MAAS-simulator machine is onboarded; its first boot writes the
cloud-init our worker rendered onto the machine's disk and starts the command of the rendered
systemd unit, a real `gpucloud-agent` process (production backend, on the machine's root); that
agent enrolls with the token from its own config and serves every host task. Then, over the HTTP
API: a bare-metal allocation provisioned and released on it, `soft_reset`, `reimage` (same node;
the agent re-enrolls from the fresh cloud-init) and `full_decommission` with erase, after which
the node is deleted and the MAAS machine released and off.

Nothing here enrolls a node or registers an activity: only the agent process does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select

from schema.models import Node, NodeTask
from sim.first_boot import BootRecord
from tests.decommission_fixtures import DecommissionRig
from tests.factories import REGION
from tests.gateway_fixtures import ed25519_public_key
from tests.lifecycle_support import wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU

MACHINES = sim_scenario(sim_machine("real-a", "10.176.18.10"))


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


def agent_of(decommission: DecommissionRig, hostname: str) -> BootRecord:
    record = decommission.onboarding.first_boot.booted[hostname]
    assert record.agent_running, f"the agent process is not running: {record}"
    return record


@pytest.mark.maas_scenario(MACHINES)
async def test_the_real_agent_serves_a_node_from_onboarding_to_deletion(
    decommission: DecommissionRig, api: Any, make_token: Any, make_project: Any
) -> None:
    node_id = await decommission.maas_node("real-a", "10.176.18.10")
    first = agent_of(decommission, "real-a")
    assert first.root is not None
    identity = first.root / "var/lib/gpucloud-agent/identity.json"
    assert node_id in identity.read_text()
    # The agent's config is the rendered one: a payload key file, no key in agent.toml.
    agent_toml = (first.root / "etc/gpucloud/agent.toml").read_text()
    assert "payload_key_file" in agent_toml
    assert (first.root / "etc/gpucloud/payload.key").stat().st_mode & 0o777 == 0o600

    async def heartbeat() -> bool:
        async with decommission.sessions() as session:
            node = await session.get(Node, uuid.UUID(node_id))
            return node is not None and node.last_agent_contact_at is not None

    await until(heartbeat, "the agent's first heartbeat")

    # A bare-metal allocation on the node, provisioned and released by the agent process.
    tenant = await api(token=await make_token("tenant", await make_project()))
    key = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "k", "public_key": ed25519_public_key()}
    )
    created = await tenant.post(
        "/api/v1/allocations",
        json={"sku": ONBOARD_SKU, "gpus": 8, "region": REGION, "ssh_key_ids": [key.json()["id"]]},
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    active = await wait_status(tenant, allocation_id, "active", timeout=60)
    assert active["node_id"] == node_id
    assert active["connect_host"] == first.address  # the deployed address MAAS gave it
    passwd = (first.root / "etc/passwd").read_text()
    tenant_users = [line for line in passwd.splitlines() if int(line.split(":")[2]) >= 20000]
    assert len(tenant_users) == 1, passwd
    released = await tenant.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202
    await wait_status(tenant, allocation_id, "released", timeout=60)
    assert (first.root / "etc/passwd").read_text().count("\n") == passwd.count("\n") - 1

    admin = await api(token=await make_token("admin"))
    await decommission_via_api(admin, node_id, {"mode": "soft_reset", "reason": "e2e"})

    # Reimage: MAAS redeploys with a fresh cloud-init; a fresh disk, the agent enrolls again.
    await decommission_via_api(admin, node_id, {"mode": "reimage", "reason": "e2e"})
    second = agent_of(decommission, "real-a")
    assert second is not first
    assert second.enrolled
    assert second.root is not None
    assert node_id in (second.root / "var/lib/gpucloud-agent/identity.json").read_text()

    final = await decommission_via_api(
        admin, node_id, {"mode": "full_decommission", "erase": "quick", "reason": "e2e"}
    )
    assert final["status"] == "completed"
    async with decommission.sessions() as session:
        node = await session.get(Node, uuid.UUID(node_id))
        assert node is not None
        assert node.status == "deleted"
        kinds = set(await session.scalars(select(NodeTask.kind).where(NodeTask.node_id == node.id)))
    # Every host task ran on the agent process (none other polled the node's queue); the full
    # decommission's uninstall is not dispatched: the agent went with its OS in the release.
    assert {
        "allocation.provision_user",
        "allocation.deprovision_user",
        "node.drain",
        "node.undrain",
        "node.gpu_scrub",
        "node.validate_clean",
    } <= kinds, kinds
    machine = await decommission.onboarding.maas_sim.machine(second.system_id)
    assert machine["status_name"] == "Ready"
    assert machine["power_state"] == "off"
    assert not second.agent_running  # the released machine powered off, its agent with it
