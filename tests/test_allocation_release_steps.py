"""What an allocation's release runs before its host task (docs/lifecycles/terminal-session.md,
docs/lifecycles/storage-attachment.md): a live terminal session is closed and storage attachments
are detached only when the allocation has them. `allocation.begin_release` counts both in the
transaction that makes the allocation `releasing`, so a release of an allocation with neither
schedules no extra activity and writes no patch marker (each marker also upserts
TemporalChangeVersion, a visibility write). A release with storage:
tests/test_storage_attachments.py; with a terminal session, test_terminal_sessions.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from contracts.allocation import allocation_workflow_id
from contracts.storage import DETACH_FOR_RELEASE
from contracts.terminal_session import CLOSE_FOR_ALLOCATION
from tests.histories import record_history
from tests.lifecycle_support import Tenant, create_fleet, slice_request, wait_status

pytestmark = pytest.mark.usefixtures("control_plane")

RELEASE_STEPS = {CLOSE_FOR_ALLOCATION, DETACH_FOR_RELEASE}


async def release_steps(handle: WorkflowHandle[Any, Any]) -> tuple[list[str], list[str]]:
    """The close/detach activities the workflow scheduled, and its markers other than local
    activities' (patch markers)."""
    steps, markers = [], []
    for event in (await handle.fetch_history()).events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            if name in RELEASE_STEPS:
                steps.append(name)
        elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            name = event.marker_recorded_event_attributes.marker_name
            if name != "core_local_activity":
                markers.append(name)
        elif event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes
            markers.extend(k for k in fields.indexed_fields if k == "TemporalChangeVersion")
    return steps, markers


async def test_a_release_with_no_session_and_no_storage_runs_neither_step(
    tenant: Tenant, db_sessions: Any, start_node_agent: Any, temporal_client: Any
) -> None:
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    created = await tenant.client.post("/api/v1/allocations", json=slice_request(1))
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")

    released = await tenant.client.post(f"/api/v1/allocations/{allocation_id}/release")
    assert released.status_code == 202, released.text
    await wait_status(tenant.client, allocation_id, "released")

    handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
    assert await release_steps(handle) == ([], [])
    await record_history(handle, "allocation", "release_with_nothing_to_close")
