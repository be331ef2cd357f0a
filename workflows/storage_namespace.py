"""StorageNamespaceDeleteWorkflow `storage-namespace-delete-{namespace id}`: a namespace's delete,
which ends only when its data is gone (issue 37 item 3).

1. NAMESPACE_DELETE_BEGIN: active → deleting (billing closed, no new attachment), or the refusal
   (not found; attached: 409) that the gateway's ACCEPT_DELETE_UPDATE answers with; the run
   then ends having deleted nothing.
2. NAMESPACE_REMOVE_DATA, again and again: the provider removes the data in bounded chunks, the
   activity heartbeating after each, so neither a large tree nor a slow filesystem meets a
   timeout that kills the work while it goes on; a filesystem that refuses (an immutable file, a
   mount inside the namespace) fails the attempt, retried with backoff for as long as it takes,
   the namespace `deleting` meanwhile.
3. NAMESPACE_DELETE_FINISH: deleting → deleted, once the provider reported the data gone.

Every CONTINUE_AFTER attempts the run continues as new (carrying what it removed), so a
namespace whose removal takes days keeps a short history; a continued run begins with step 1
again, which answers the deleting namespace as it is.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.storage import (
        ACCEPT_DELETE_UPDATE,
        NAMESPACE_DELETE_BEGIN,
        NAMESPACE_DELETE_FINISH,
        NAMESPACE_DELETE_REFUSALS,
        NAMESPACE_DELETE_WORKFLOW,
        NAMESPACE_REMOVE_DATA,
        STATUS_QUERY,
        NamespaceDeleteFinishInput,
        NamespaceDeleteInput,
        NamespaceDeleteResult,
        NamespaceDeleteWorkflowInput,
        NamespaceRemoveDataResult,
        NamespaceState,
        NamespaceStatus,
    )

_DB = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
)
# An attempt removes for about 20 s (activities/storage.py REMOVE_BUDGET_SECONDS) plus the chunk
# it is in; it heartbeats after every chunk, so a worker lost mid-attempt is noticed within the
# heartbeat timeout, not the start-to-close one.
_REMOVE_START_TO_CLOSE = timedelta(minutes=10)
_REMOVE_HEARTBEAT = timedelta(seconds=60)
# Retried for as long as it takes: the namespace stays deleting, its data kept from no one.
_REMOVE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)
CONTINUE_AFTER = 200


@workflow.defn(name=NAMESPACE_DELETE_WORKFLOW)
class StorageNamespaceDeleteWorkflow:
    @workflow.init
    def __init__(self, input: NamespaceDeleteWorkflowInput) -> None:
        self._state: NamespaceState | None = None
        self._refusal: ApplicationError | None = None

    @workflow.update(name=ACCEPT_DELETE_UPDATE)
    async def accept(self) -> NamespaceState:
        """The namespace once it is deleting (or deleted), or the refusal."""
        await workflow.wait_condition(lambda: self._state is not None or self._refusal is not None)
        if self._refusal is not None:
            raise self._refusal
        assert self._state is not None
        return self._state

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> NamespaceState | None:
        return self._state

    @workflow.run
    async def run(self, input: NamespaceDeleteWorkflowInput) -> NamespaceDeleteResult:
        try:
            self._state = await workflow.execute_activity(
                NAMESPACE_DELETE_BEGIN,
                NamespaceDeleteInput(
                    actor=input.actor,
                    namespace_id=input.namespace_id,
                    project_id=input.project_id,
                ),
                result_type=NamespaceState,
                start_to_close_timeout=_DB,
                retry_policy=_DB_RETRY,
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type in NAMESPACE_DELETE_REFUSALS:
                self._refusal = ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                )
                await workflow.wait_condition(workflow.all_handlers_finished)
                return NamespaceDeleteResult(
                    namespace_id=input.namespace_id, status="refused", refusal=cause.type
                )
            raise
        removed, chunks = input.removed_entries, input.chunks
        attempts = 0
        while True:
            progress = await workflow.execute_activity(
                NAMESPACE_REMOVE_DATA,
                input.namespace_id,
                result_type=NamespaceRemoveDataResult,
                start_to_close_timeout=_REMOVE_START_TO_CLOSE,
                heartbeat_timeout=_REMOVE_HEARTBEAT,
                retry_policy=_REMOVE_RETRY,
            )
            removed += progress.removed_entries
            chunks += progress.chunks
            if progress.gone:
                break
            attempts += 1
            if attempts >= CONTINUE_AFTER:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    NamespaceDeleteWorkflowInput(
                        actor=input.actor,
                        namespace_id=input.namespace_id,
                        project_id=input.project_id,
                        removed_entries=removed,
                        chunks=chunks,
                    )
                )
        self._state = await workflow.execute_activity(
            NAMESPACE_DELETE_FINISH,
            NamespaceDeleteFinishInput(
                actor=input.actor,
                namespace_id=input.namespace_id,
                removed_entries=removed,
                chunks=chunks,
            ),
            result_type=NamespaceState,
            start_to_close_timeout=_DB,
            retry_policy=_DB_RETRY,
        )
        await workflow.wait_condition(workflow.all_handlers_finished)
        return NamespaceDeleteResult(
            namespace_id=input.namespace_id,
            status=NamespaceStatus.DELETED.value,
            removed_entries=removed,
            chunks=chunks,
        )
