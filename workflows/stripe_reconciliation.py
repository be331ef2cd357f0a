"""StripeReconciliationWorkflow, run by the Temporal Schedule `stripe-reconciliation`.

One activity asks Stripe about our unsettled sessions (initiated, or expired unpaid); the
workflow then signals `checkout_completed` to each paid session's workflow (its credit activity
flags an amount mismatch as failed_reconcile) and expires the ones past their TTL whose workflow
did not (the expire activity is a compare-and-set, so it never races the workflow's own timer
into harm).

A paid session whose workflow has closed (the late-success window passed, issue 37, or it was
terminated) is settled here with the workflow's own activities: `payments.complete` (from
expired: flagged late_success for review) then `payments.credit`, whose ledger key
`payment:{id}` and row lock make it exactly once against any webhook, workflow or other run.
Histories recorded before this replay as they ran (workflow.patched).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.payment_session import (
        CHECKOUT_COMPLETED,
        COMPLETED_SIGNAL,
        CREDIT_FAILED,
        CREDITED,
        CheckoutCompletion,
        CompleteInput,
        CreditInput,
        ExpireInput,
        FailInput,
        SettleResult,
        payment_session_workflow_id,
    )
    from contracts.stripe_reconciliation import (
        WORKFLOW_NAME,
        PaidSession,
        ReconciliationInput,
        ReconciliationResult,
        ReconciliationScan,
    )

_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
_CREDIT_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    maximum_attempts=5,
    non_retryable_error_types=["not_found"],
)
_LOCAL = timedelta(seconds=30)
# A paid session whose workflow has closed is settled by the reconciliation itself.
SETTLE_CLOSED_PATCH = "stripe-reconciliation-settles-closed-sessions"


@workflow.defn(name=WORKFLOW_NAME)
class StripeReconciliationWorkflow:
    @workflow.run
    async def run(self, input: ReconciliationInput) -> ReconciliationResult:
        scan: ReconciliationScan = await workflow.execute_activity(
            "payments.reconciliation_scan",
            input,
            result_type=ReconciliationScan,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=60),
            retry_policy=_RETRY,
        )
        result = ReconciliationResult(listed=scan.listed, checked=scan.checked)
        for paid in scan.paid:
            if paid.amount_total != paid.requested_amount_minor:
                result.amount_mismatches.append(paid.payment_session_id)
            handle = workflow.get_external_workflow_handle(
                payment_session_workflow_id(paid.payment_session_id)
            )
            completion = CheckoutCompletion(
                stripe_checkout_session_id=paid.stripe_checkout_session_id,
                amount_total=paid.amount_total,
                currency=paid.currency,
                source="reconciliation",
            )
            try:
                await handle.signal(COMPLETED_SIGNAL, completion)
                result.signalled.append(paid.payment_session_id)
            except Exception:  # the workflow is gone (closed or never started)
                settled = None
                if workflow.patched(SETTLE_CLOSED_PATCH):
                    settled = await self._settle(paid, completion)
                if settled == CREDITED:
                    result.credited_directly.append(paid.payment_session_id)
                elif settled is None:
                    result.unreachable.append(paid.payment_session_id)
        for payment_session_id in scan.overdue:
            outcome: SettleResult = await workflow.execute_local_activity(
                "payments.expire",
                ExpireInput(payment_session_id),
                result_type=SettleResult,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=_RETRY,
            )
            if outcome.status == "expired":
                result.expired.append(payment_session_id)
        return result

    async def _settle(self, paid: PaidSession, completion: CheckoutCompletion) -> str | None:
        """What the session's own workflow would do with the completion, done here: record it,
        then credit it (or fail it: a mismatch, or a credit that failed all its retries). The
        session's status then (credited: by this run, another or a webhook), or None when it
        could not be settled now (the next run tries again)."""
        session_id = paid.payment_session_id
        try:
            completed = await self._local(
                "payments.complete", CompleteInput(session_id, completion), _RETRY
            )
            if completed.status != CHECKOUT_COMPLETED:
                return completed.status  # settled meanwhile
            try:
                credited = await self._local(
                    "payments.credit", CreditInput(session_id, completion), _CREDIT_RETRY
                )
            except (ActivityError, ApplicationError) as err:
                workflow.logger.warning("credit of %s failed after retries: %s", session_id, err)
                failed = await self._local(
                    "payments.fail",
                    FailInput(session_id, CREDIT_FAILED, completion.amount_total),
                    _RETRY,
                )
                return failed.status
        except (ActivityError, ApplicationError) as err:
            workflow.logger.warning("could not settle payment session %s: %s", session_id, err)
            return None
        return credited.status

    @staticmethod
    async def _local(name: str, arg: object, retry: RetryPolicy) -> SettleResult:
        outcome: SettleResult = await workflow.execute_local_activity(
            name,
            arg,
            result_type=SettleResult,
            start_to_close_timeout=_LOCAL,
            retry_policy=retry,
        )
        return outcome
