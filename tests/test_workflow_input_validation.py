"""A workflow can never be wedged by its input (issue 38 item 2): a malformed update is refused
by its validator before it enters history (no UpdateAccepted event, the workflow goes on), and a
malformed signal is dropped by its handler without failing a workflow task or the workflow.

The gateway refuses all of this at the edge (422 invalid_text, tests/test_hostile_input.py);
these messages are sent straight to Temporal, as any other client of the namespace (an old
gateway, a script, a compromised node's agent) could, to workflows started through the API.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError

from contracts.allocation import (
    DETACH_UPDATE,
    RELEASE_UPDATE,
    RESERVE_UPDATE,
    DetachRequest,
    ReleaseRequest,
    allocation_workflow_id,
)
from contracts.allocation_group import (
    MEMBER_STATUS_SIGNAL,
    MemberStatus,
    allocation_group_workflow_id,
)
from contracts.allocation_group import RELEASE_UPDATE as GROUP_RELEASE_UPDATE
from contracts.host_tasks import HOST_TASK_PROGRESS_SIGNAL, HostPhase, HostTaskProgress
from contracts.payment_session import (
    COMPLETED_SIGNAL,
    STATUS_QUERY,
    CheckoutCompletion,
    payment_session_workflow_id,
)
from contracts.workflow_input import INVALID_INPUT
from tests.enrolled_fleet import EnrolledFleet
from tests.lifecycle_support import Tenant, eventually, slice_request, wait_status
from tests.stripe_fixtures import PaymentsFactory, checkout_event

GROUPS = "/api/v1/allocation-groups"


async def _refused(handle: WorkflowHandle[Any, Any], update: str, arg: Any) -> ApplicationError:
    with pytest.raises(WorkflowUpdateFailedError) as failed:
        await handle.execute_update(update, arg)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError), cause
    return cause


async def _accepted_updates(handle: WorkflowHandle[Any, Any]) -> int:
    history = await handle.fetch_history()
    accepted = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    return sum(1 for e in history.events if e.event_type == accepted)


async def _task_failures(handle: WorkflowHandle[Any, Any]) -> int:
    history = await handle.fetch_history()
    failed = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    return sum(1 for e in history.events if e.event_type == failed)


async def _running(handle: WorkflowHandle[Any, Any]) -> None:
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING


async def test_malformed_updates_and_signals_leave_a_group_and_its_member_releasable(
    tenant: Tenant, temporal_client: Client, enrolled_fleet: EnrolledFleet
) -> None:
    await enrolled_fleet.create(slice_nodes=1)
    created = await tenant.client.post(
        f"{GROUPS}/", json={"members": [slice_request(1, tenant.ssh_key_id)]}
    )
    assert created.status_code == 201, created.text
    group_id = created.json()["group_id"]
    member_id = created.json()["members"][0]["allocation_id"]

    async def group_is(wanted: str) -> bool:
        return bool((await tenant.client.get(f"{GROUPS}/{group_id}")).json()["status"] == wanted)

    await eventually(lambda: group_is("active"), timeout=30, interval=0.1)
    group = temporal_client.get_workflow_handle(allocation_group_workflow_id(group_id))
    member = temporal_client.get_workflow_handle(allocation_workflow_id(member_id))
    group_accepted, member_accepted = (
        await _accepted_updates(group),
        await _accepted_updates(member),
    )

    # Updates: refused by their validators, nothing written to history.
    nul = "maintenance\x00window"
    for handle, update, arg in [
        (group, GROUP_RELEASE_UPDATE, ReleaseRequest(actor="admin", reason=nul, force=True)),
        (member, RELEASE_UPDATE, ReleaseRequest(actor="admin", reason=nul, force=True)),
        (member, RELEASE_UPDATE, ReleaseRequest(actor="user", reason="two\nlines")),
        (member, RELEASE_UPDATE, ReleaseRequest(actor="user", reason="x" * 10_000)),
        (member, DETACH_UPDATE, DetachRequest(reason="bell\x07")),
    ]:
        refusal = await _refused(handle, update, arg)
        assert refusal.type == INVALID_INPUT, refusal
        assert "\x00" not in str(refusal)  # the refusal names the rule, never the value
    refusal = await _refused(member, RESERVE_UPDATE, "not-the-fingerprint")
    assert refusal.type == "idempotency_key_reused"
    assert await _accepted_updates(group) == group_accepted
    assert await _accepted_updates(member) == member_accepted

    # Signals: dropped by their handlers; no workflow task fails, neither workflow ends.
    await group.signal(MEMBER_STATUS_SIGNAL, MemberStatus(member_id, "not-a-status"))
    await member.signal(
        HOST_TASK_PROGRESS_SIGNAL,
        HostTaskProgress(task_id="not-a-uuid", attempt=1, started_at="now"),
    )
    await member.signal(
        HOST_TASK_PROGRESS_SIGNAL,
        HostTaskProgress(
            task_id=str(uuid.uuid4()),
            attempt=1,
            started_at="2024-01-01T00:00:00+00:00",
            phases=[HostPhase(phase="mount\x00", status="started", at="")],
        ),
    )
    # A query answers only after the signals before it were applied.
    assert (await group.query("status"))["status"] == "active"
    assert (await member.query("status"))["status"] == "active"
    for handle in (group, member):
        await _running(handle)
        assert await _task_failures(handle) == 0

    # Still releasable by its tenant, and released.
    released = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert released.status_code == 202, released.text
    await eventually(lambda: group_is("released"), timeout=30, interval=0.1)
    await wait_status(tenant.client, member_id, "released")


async def test_a_malformed_checkout_completion_is_dropped_and_the_real_one_credits(
    payments: PaymentsFactory, make_project: Any, temporal_client: Client
) -> None:
    """Before: a completion whose source held a NUL became the session's one completion; its
    recording failed twenty times and the workflow failed, the payment never credited. One with
    an empty currency used up the slot and left the session failed_reconcile."""
    project = await make_project(credit_minor=0)
    plane = await payments(project=project)
    created = (await plane.checkout(2500, key="malformed-signal")).json()
    session_id, checkout_id = created["payment_session_id"], created["stripe_checkout_session_id"]
    handle = temporal_client.get_workflow_handle(payment_session_workflow_id(session_id))

    for completion in [
        CheckoutCompletion(checkout_id, 2500, "usd", source="web\x00hook"),
        CheckoutCompletion(checkout_id, 2500, "", source="webhook"),
        CheckoutCompletion(checkout_id, -2500, "usd", source="webhook"),
        CheckoutCompletion("", 2500, "usd", source="webhook"),
    ]:
        await handle.signal(COMPLETED_SIGNAL, completion)
    assert (await handle.query(STATUS_QUERY))["status"] == "initiated"
    await _running(handle)
    assert await _task_failures(handle) == 0

    delivered = await plane.deliver(checkout_event(checkout_id, 2500))
    assert delivered.status_code == 200, delivered.text
    result = await handle.result()
    assert (result["status"], result["failure_reason"]) == ("credited", None)
    balance = (await plane.client.get("/api/v1/billing/balance")).json()
    assert balance["balance_minor"] == 2500
