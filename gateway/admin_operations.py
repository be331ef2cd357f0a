"""Admin mutations the gateway does not write itself: it runs AdminOperationWorkflow (one
single-purpose activity in the worker writes the change and its audit row in one transaction)
and waits for the answer, so the HTTP call answers as it always did. A refusal fails the
workflow with an ApplicationError whose type is the API error code; this maps it to the same
status, code, message and details the gateway answered before the move.

Temporal not answering is 503 `temporal_unavailable` (gateway.temporal), like every other
Temporal call; a retry of the same request finds the same workflow id (see the contract).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from contracts.admin_operation import (
    CREDENTIALS_INVALID,
    CREDENTIALS_MISSING,
    DATABASE_UNAVAILABLE,
    MAAS_API_KEY_MALFORMED,
    MAAS_TOKEN_NOT_ADMIN,
    MAAS_TOKEN_REJECTED,
    MAAS_UNREACHABLE,
    NO_DRIFT,
    NOT_FOUND,
    OVERRIDE_EXISTS,
    SECRET_STORE_UNAVAILABLE,
    SLOT_NOT_QUARANTINED,
    WORKFLOW_NAME,
    Actor,
    AdminOperationInput,
    admin_operation_workflow_id,
)
from gateway.auth import Principal
from gateway.errors import (
    ApiError,
    Conflict,
    DatabaseUnavailable,
    NotFound,
    SecretStoreUnavailable,
    Unprocessable,
)
from gateway.temporal import TemporalOps

T = TypeVar("T")

# A workflow no worker ever picked up (none running) is dropped after this, so a request the
# gateway gave up on (503) cannot apply much later.
EXECUTION_TIMEOUT = timedelta(minutes=5)

# The API's status for each refusal; the operation may say otherwise (a probe answers MAAS
# trouble with 502).
STATUS_BY_CODE: dict[str, int] = {
    NOT_FOUND: 404,
    SLOT_NOT_QUARANTINED: 409,
    NO_DRIFT: 409,
    OVERRIDE_EXISTS: 409,
    CREDENTIALS_MISSING: 409,
    CREDENTIALS_INVALID: 409,
    MAAS_API_KEY_MALFORMED: 422,
    MAAS_TOKEN_REJECTED: 422,
    MAAS_TOKEN_NOT_ADMIN: 422,
    MAAS_UNREACHABLE: 422,
}


def actor(principal: Principal, reason: str | None) -> Actor:
    return Actor(
        name=principal.name,
        token_id=str(principal.token_id),
        role=principal.role,
        reason=reason,
    )


def per_request(scope: object) -> str:
    """The key of an operation whose request carries secrets: this request's own, so a
    concurrent change with other secrets never receives another request's answer."""
    return f"{scope}-{uuid.uuid4()}"


def _api_error(
    failure: WorkflowFailureError, statuses: Mapping[str, int], workflow_id: str
) -> ApiError:
    cause = failure.cause
    if isinstance(cause, ApplicationError) and cause.type:
        if cause.type == SECRET_STORE_UNAVAILABLE:
            return SecretStoreUnavailable()
        if cause.type == DATABASE_UNAVAILABLE:
            return DatabaseUnavailable()
        status = statuses.get(cause.type, STATUS_BY_CODE.get(cause.type))
        if status is not None:
            details = cause.details[0] if cause.details else None
            if status == 404:
                return NotFound(cause.message)
            error = Conflict if status == 409 else Unprocessable if status == 422 else ApiError
            return error(
                cause.message,
                code=cause.type,
                status_code=status,
                details=details if isinstance(details, dict) else None,
            )
    return ApiError(
        "the admin operation failed in the worker; see its workflow in Temporal",
        code="workflow_error",
        status_code=502,
        details={"workflow_id": workflow_id},
    )


async def run_admin_operation(
    temporal: TemporalOps,
    task_queue: str,
    operation: str,
    request: Any,
    *,
    key: str,
    result_type: type[T],
    statuses: Mapping[str, int] | None = None,
    answer_once: bool = False,
) -> T:
    """Run `operation` with `request` and return its result, or raise the ApiError its refusal
    maps to. `key` names what the operation acts on: a retried request with the same key joins
    the same workflow (admin_operation_workflow_id). With `answer_once`, a run that completed
    is never run again: a retry with its key gets its answer (for an operation whose effect
    cannot be asked for twice, like redeeming a single-use token, whose caller may have lost the
    first answer); a run that failed or timed out (no worker took it) runs again."""
    workflow_id = admin_operation_workflow_id(operation, key)
    reuse = (
        WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
        if answer_once
        else WorkflowIDReusePolicy.ALLOW_DUPLICATE
    )

    async def call(client: Client) -> T:
        try:
            result: T = await client.execute_workflow(
                WORKFLOW_NAME,
                AdminOperationInput(operation=operation, request=request),
                id=workflow_id,
                task_queue=task_queue,
                result_type=result_type,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=reuse,
                execution_timeout=EXECUTION_TIMEOUT,
                rpc_timeout=temporal.rpc_timeout,
            )
        except WorkflowAlreadyStartedError:
            if not answer_once:
                raise
            # It completed: its answer, again.
            earlier: T = await client.get_workflow_handle(
                workflow_id, result_type=result_type
            ).result(rpc_timeout=temporal.rpc_timeout)
            return earlier
        return result

    try:
        return await temporal.update(call)
    except WorkflowFailureError as failure:
        raise _api_error(failure, statuses or {}, workflow_id) from None
