"""StripeReconciliationWorkflow, run by the Temporal Schedule `stripe-reconciliation`.

One activity asks Stripe about our initiated sessions; the workflow then signals
`checkout_completed` to each paid session's workflow (its credit activity flags an amount
mismatch as failed_reconcile) and expires the ones past their TTL whose workflow did not (the
expire activity is a compare-and-set, so it never races the workflow's own timer into harm).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.payment_session import (
        COMPLETED_SIGNAL,
        CheckoutCompletion,
        ExpireInput,
        SettleResult,
        payment_session_workflow_id,
    )
    from contracts.stripe_reconciliation import (
        WORKFLOW_NAME,
        ReconciliationInput,
        ReconciliationResult,
        ReconciliationScan,
    )

_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)


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
            try:
                await handle.signal(
                    COMPLETED_SIGNAL,
                    CheckoutCompletion(
                        stripe_checkout_session_id=paid.stripe_checkout_session_id,
                        amount_total=paid.amount_total,
                        currency=paid.currency,
                        source="reconciliation",
                    ),
                )
                result.signalled.append(paid.payment_session_id)
            except Exception:  # the workflow is gone (closed or never started)
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
