"""AdminOperationWorkflow `admin-op-{operation}-{discriminator}`: one admin mutation (or a MAAS
check), run in the worker by its single-purpose activity, which writes the change and its audit
row in one transaction. The gateway starts it and waits for the result, so the HTTP call still
gets its answer; a refusal (not found, conflict, MAAS said no, Vault down) fails the workflow
with an ApplicationError whose type is the API's error code.

Deliberately tiny: no signals, no timers, one activity. Only a database that is briefly away is
retried (bounded); every other failure is the answer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.admin_operation import (
        OPERATIONS,
        RETRYABLE_ERRORS,
        UNKNOWN_OPERATION,
        WORKFLOW_NAME,
        AdminOperationInput,
    )

# MAAS answers a credentials check within 5 s; Vault calls are bounded at 5 s each.
_START_TO_CLOSE = timedelta(seconds=60)
_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=2),
    maximum_attempts=4,
)


@workflow.defn(name=WORKFLOW_NAME)
class AdminOperationWorkflow:
    @workflow.run
    async def run(self, input: AdminOperationInput) -> Any:
        if input.operation not in OPERATIONS:
            raise ApplicationError(
                f"unknown admin operation {input.operation!r}",
                type=UNKNOWN_OPERATION,
                non_retryable=True,
            )
        try:
            return await workflow.execute_activity(
                input.operation,
                input.request,
                start_to_close_timeout=_START_TO_CLOSE,
                retry_policy=_RETRY,
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and (
                cause.non_retryable or cause.type in RETRYABLE_ERRORS
            ):
                # The activity's answer, as the workflow's: its type is the API's error code.
                raise ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                ) from None
            raise
