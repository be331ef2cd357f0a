"""Looking at a running workflow from a test, through Temporal itself: has an activity
completed, has an update been admitted; and ending the workflows a test leaves behind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import UpdateRef, WaitPolicy
from temporalio.api.workflowservice.v1 import PollWorkflowExecutionUpdateRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

_ADMITTED = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ADMITTED


async def activity_completed(handle: WorkflowHandle[Any, Any], activity_type: str) -> bool:
    """An activity of this type has completed in the workflow's history (its result may still
    wait for a workflow worker)."""
    events = (await handle.fetch_history()).events
    scheduled = {
        e.event_id
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    }
    return any(
        e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id in scheduled
        for e in events
    )


async def update_admitted(client: Client, workflow_id: str, update_id: str) -> bool:
    """Whether Temporal has admitted the update: it waits in the workflow's update registry
    for the next workflow task (which a test may be holding back by keeping the worker away)."""
    request = PollWorkflowExecutionUpdateRequest(
        namespace=client.namespace,
        update_ref=UpdateRef(
            workflow_execution=WorkflowExecution(workflow_id=workflow_id), update_id=update_id
        ),
        identity="tests",
        wait_policy=WaitPolicy(lifecycle_stage=_ADMITTED),
    )
    try:
        response = await client.workflow_service.poll_workflow_execution_update(request)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:  # not (yet) in the registry
            return False
        raise
    return response.stage >= _ADMITTED


async def terminate_quietly(client: Client, workflow_ids: Iterable[str]) -> None:
    """End what a test left running (failed lifecycle jobs wait for operators forever), so
    that workers can stop; workflows already closed are skipped."""
    for workflow_id in workflow_ids:
        with contextlib.suppress(Exception):
            await client.get_workflow_handle(workflow_id).terminate()
