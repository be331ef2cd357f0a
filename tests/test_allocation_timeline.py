"""The timeline of docs/lifecycles/allocation.md#task-timeline as production writes it: real agent
workers report each attempt of a host task and its phase changes to the allocation workflow, which
records them, so the timeline reads a running task as `running` with its phases while the host
works; a failed task keeps the phases it went through; retries are counted; every free-text field is
sanitised."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select

from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import SLICE_VM_PROVISION, HostErrorType
from contracts.states import NodeTaskStatus
from schema.models import NodeTask, NodeTaskEvent
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from tests.histories import record_history
from tests.lifecycle_support import Tenant, create_fleet, eventually, slice_request, wait_status

pytestmark = pytest.mark.usefixtures("control_plane")

SLICE_PHASES = [
    "image_prepared",
    "cloud_init_seed_generated",
    "domain_defined",
    "vm_started",
    "guest_reachable",
    "driver_ready",
]
# A fake key, assembled so that no private-key block stands in the repository.
_MARKER = "OPENSSH PRIVATE " + "KEY"
PRIVATE_KEY = f"-----BEGIN {_MARKER}-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END {_MARKER}-----"
SECRETS = ["hunter2", "b3BlbnNzaC1rZXktdjEAAAAA", "gpc_live0123456789", "passwd: root"]
LEAKY_MESSAGE = (
    f"guest said password=hunter2 with token gpc_live0123456789 and {PRIVATE_KEY} "
    "#cloud-config\nchpasswd: {list: 'root:passwd: root'}"
)


async def allocate(tenant: Tenant, body: dict[str, Any]) -> str:
    response = await tenant.client.post("/api/v1/allocations", json=body)
    assert response.status_code == 201, response.text
    allocation_id: str = response.json()["allocation_id"]
    return allocation_id


async def provision_item(tenant: Tenant, allocation_id: str) -> dict[str, Any]:
    response = await tenant.client.get(f"/api/v1/allocations/{allocation_id}/timeline")
    assert response.status_code == 200, response.text
    item: dict[str, Any] = next(
        i for i in response.json()["items"] if i.get("name") == SLICE_VM_PROVISION
    )
    return item


ProvisionWithFault = Callable[..., Awaitable[tuple[str, dict[str, Any]]]]


@pytest.fixture
def provision_with_fault(
    tenant: Tenant, db_sessions: Any, start_node_agent: Any
) -> ProvisionWithFault:
    """`(error_type, until_status, **fault)`: a slice allocation on a fresh node whose agent's
    provision fails with `error_type` as `fault` says; its id and its body once it reaches
    `until_status`."""

    async def provision(
        error_type: HostErrorType, until_status: str, **fault: Any
    ) -> tuple[str, dict[str, Any]]:
        (node,) = await create_fleet(db_sessions, slice_nodes=1)
        agent = await start_node_agent(node.id)
        agent.host.faults.inject(SLICE_VM_PROVISION, error_type, **fault)
        allocation_id = await allocate(tenant, slice_request(1))
        reached = await wait_status(tenant.client, allocation_id, until_status, timeout=30)
        return allocation_id, reached

    return provision


async def record(temporal_client: Any, allocation_id: str, name: str) -> None:
    handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
    await record_history(handle, "allocation", name)


async def test_a_running_host_task_reads_running_with_its_phases(
    tenant: Tenant, db_sessions: Any, start_node_agent: Any, temporal_client: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    # A slow host: each phase takes a while, as a real VM provision does.
    await start_node_agent(
        node.id, SimulatedHost(str(node.id), config=SimHostConfig(phase_delay_s=0.6))
    )
    allocation_id = await allocate(tenant, slice_request(1))

    async def running_with_phases() -> dict[str, Any] | None:
        item = await provision_item(tenant, allocation_id)
        done = [p["phase"] for p in item["phases"] if p["status"] == "succeeded"]
        return item if item["status"] == "running" and len(done) >= 2 else None

    item = await eventually(running_with_phases, timeout=20, interval=0.1)
    # Recorded by the control plane from the agent's reports, not read from a heartbeat (the
    # heartbeat timeout of 30 s throttles those to one every 24 s).
    assert item["phases_source"] == "database"
    assert item["completed_at"] is None
    assert item["attempts"] == 1
    succeeded = [p["phase"] for p in item["phases"] if p["status"] == "succeeded"]
    assert succeeded == SLICE_PHASES[: len(succeeded)]
    assert all(p["attempt"] == 1 for p in item["phases"])
    async with db_sessions() as session:
        row = await session.get(NodeTask, uuid.UUID(item["task_id"]))
        assert row is not None
        assert row.status == NodeTaskStatus.DISPATCHED
        assert row.dispatched_at is not None

    await wait_status(tenant.client, allocation_id, "active", timeout=30)
    done = await provision_item(tenant, allocation_id)
    assert done["status"] == "succeeded"
    assert done["attempts"] == 1
    assert [p["phase"] for p in done["phases"] if p["status"] == "succeeded"] == SLICE_PHASES
    await record(temporal_client, allocation_id, "provision_progress_reported")


async def test_a_failed_host_task_keeps_its_phases_and_the_failed_one(
    tenant: Tenant, provision_with_fault: ProvisionWithFault, temporal_client: Any
) -> None:
    allocation_id, _ = await provision_with_fault(
        HostErrorType.READINESS_TIMEOUT, "failed", phase="guest_reachable"
    )

    item = await provision_item(tenant, allocation_id)
    assert item["status"] == "failed"
    assert item["error_type"] == HostErrorType.READINESS_TIMEOUT
    succeeded = [p["phase"] for p in item["phases"] if p["status"] == "succeeded"]
    assert succeeded == SLICE_PHASES[:4]
    failed = [p["phase"] for p in item["phases"] if p["status"] == "failed"]
    assert failed == ["guest_reachable"]
    assert item["phases"][-1]["status"] == "failed"
    await record(temporal_client, allocation_id, "provision_failed_phases_kept")


async def test_a_retried_host_task_counts_its_attempts(
    tenant: Tenant, provision_with_fault: ProvisionWithFault, temporal_client: Any
) -> None:
    allocation_id, _ = await provision_with_fault(
        HostErrorType.LEASE_CONFLICT, "active", times=2, phase="domain_defined"
    )

    item = await provision_item(tenant, allocation_id)
    assert item["status"] == "succeeded"
    assert item["attempts"] == 3
    # The attempts that failed are kept with the one that succeeded.
    failed = [(p["attempt"], p["phase"]) for p in item["phases"] if p["status"] == "failed"]
    assert failed == [(1, "domain_defined"), (2, "domain_defined")]
    last = [p["phase"] for p in item["phases"] if p["attempt"] == 3 and p["status"] == "succeeded"]
    assert last == SLICE_PHASES
    await record(temporal_client, allocation_id, "provision_retried_attempts_counted")


async def test_secrets_in_a_host_failure_message_are_stripped_where_they_are_recorded(
    tenant: Tenant, db_sessions: Any, provision_with_fault: ProvisionWithFault, admin: Any
) -> None:
    allocation_id, failed = await provision_with_fault(
        HostErrorType.VFIO_ERROR, "failed", phase="vm_started", message=LEAKY_MESSAGE
    )
    assert failed["failure_reason"] == HostErrorType.VFIO_ERROR
    assert failed["failure_message"].startswith("guest said [redacted]")

    item = await provision_item(tenant, allocation_id)
    (phase,) = [p for p in item["phases"] if p["status"] == "failed"]
    assert phase["phase"] == "vm_started"
    assert phase["message"].startswith("guest said [redacted]")
    timeline = await admin.get(f"/api/v1/admin/allocations/{allocation_id}/timeline")
    detail = await admin.get(f"/api/v1/admin/allocations/{allocation_id}")
    async with db_sessions() as session:
        stored = [
            *(await session.scalars(select(NodeTaskEvent.message))).all(),
            *(await session.scalars(select(NodeTask.error_message))).all(),
        ]
    for text in (timeline.text, detail.text, json.dumps(stored), json.dumps(failed)):
        for secret in [*SECRETS, "#cloud-config", "BEGIN OPENSSH"]:
            assert secret not in text
