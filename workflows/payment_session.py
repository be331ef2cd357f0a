"""PaymentSessionWorkflow `payment-session-{id}` (docs/lifecycles/payment-session.md): initiated →
checkout_completed → credited | failed_reconcile | expired.

The gateway starts it with update-with-start: the first (local) activity creates the Stripe
Checkout Session and records the row, and the `checkout` update hands the URL back to the HTTP
call. The workflow then waits for the `checkout_completed` signal (webhook route or Stripe
reconciliation) or its TTL (a durable timer). The first completion wins; later ones are ignored,
and the credit activity is idempotent besides (ledger key `payment:{id}`). A completion is
recorded (checkout_completed) before the credit is tried; a credit that still fails after its
retries leaves the session failed_reconcile.

At the TTL the session expires, and the workflow keeps listening for the late-success window: a
delayed payment method that settles after the session expired is credited (once, like any other)
and flagged `late_success` for review, not dropped.

Histories recorded before the checkout_completed step and the late-success window replay as they
ran (workflow.patched).
"""

from __future__ import annotations

import re
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.payment_session import (
        CHECKOUT_UPDATE,
        COMPLETED_SIGNAL,
        CREDIT_FAILED,
        IDEMPOTENCY_KEY_REUSED,
        STATUS_QUERY,
        STRIPE_ERROR,
        WORKFLOW_NAME,
        CheckoutCompletion,
        CheckoutCreated,
        CompleteInput,
        CreateCheckoutInput,
        CreditInput,
        ExpireInput,
        FailInput,
        PaymentSessionInput,
        PaymentSessionView,
        SettleResult,
    )
    from contracts.workflow_input import MAX_ID_CHARS, text_problem

_LOCAL = timedelta(seconds=30)
_DB_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=20)
# The completion is recorded (checkout_completed) in its own activity before the credit.
COMPLETE_STEP_PATCH = "payment-session-checkout-completed-step"
# After expiry, a late success is still credited (flagged for review).
LATE_SUCCESS_PATCH = "payment-session-late-success-window"
# A malformed checkout_completed signal is dropped (issue 38).
COMPLETION_CHECKED_PATCH = "payment-session-completion-checked"
# Bounds of what a completion may say (gateway.controllers.payments reads Stripe's event so).
_MAX_AMOUNT_MINOR = 10**12
_CURRENCY = re.compile(r"[A-Za-z]{3}")


@workflow.defn(name=WORKFLOW_NAME)
class PaymentSessionWorkflow:
    @workflow.init
    def __init__(self, input: PaymentSessionInput) -> None:
        self._input = input
        self._created: CheckoutCreated | None = None
        self._rejection: ApplicationError | None = None
        self._completion: CheckoutCompletion | None = None
        self._status = "creating"
        self._failure_reason: str | None = None

    @workflow.update(name=CHECKOUT_UPDATE)
    async def checkout(self, request_fingerprint: str) -> CheckoutCreated:
        await workflow.wait_condition(
            lambda: self._created is not None or self._rejection is not None
        )
        if self._rejection is not None:
            raise self._rejection
        assert self._created is not None
        return self._created

    @checkout.validator
    def _validate_checkout(self, request_fingerprint: str) -> None:
        if request_fingerprint != self._input.request_fingerprint:
            raise ApplicationError(
                "this idempotency key was already used with a different request body",
                type=IDEMPOTENCY_KEY_REUSED,
            )

    @workflow.signal(name=COMPLETED_SIGNAL)
    def checkout_completed(self, completion: CheckoutCompletion) -> None:
        if self._completion is not None:
            return
        problem = _completion_problem(completion)
        # A completion no activity could store (or credit) is dropped, not taken as the first
        # one: it would fail the workflow, or use up the slot of the real one (issue 38).
        if problem is not None and workflow.patched(COMPLETION_CHECKED_PATCH):
            workflow.logger.warning("checkout completion dropped: %s", problem)
            return
        self._completion = completion

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> PaymentSessionView:
        return PaymentSessionView(
            payment_session_id=self._input.payment_session_id,
            status=self._status,
            stripe_checkout_session_id=(
                self._created.stripe_checkout_session_id if self._created else None
            ),
            failure_reason=self._failure_reason,
        )

    @workflow.run
    async def run(self, input: PaymentSessionInput) -> SettleResult:
        result = await self._lifecycle(input)
        self._status = result.status
        self._failure_reason = result.failure_reason
        await workflow.wait_condition(workflow.all_handlers_finished)
        if result.status == "rejected":
            # Failed, so that a retry with the same key may start afresh
            # (ALLOW_DUPLICATE_FAILED_ONLY): nothing was created at Stripe or recorded.
            raise ApplicationError(
                "the Stripe Checkout Session could not be created", type=STRIPE_ERROR
            )
        return result

    async def _lifecycle(self, input: PaymentSessionInput) -> SettleResult:
        created = await self._create(input)
        if created is None:
            return SettleResult(input.payment_session_id, "rejected", None, STRIPE_ERROR)
        self._created = created
        self._status = created.status
        try:
            await workflow.wait_condition(
                lambda: self._completion is not None,
                timeout=timedelta(seconds=created.ttl_seconds),
            )
        except TimeoutError:
            expired = await self._local(
                "payments.expire", ExpireInput(input.payment_session_id), _DB_RETRY
            )
            if expired.status != "expired" or not workflow.patched(LATE_SUCCESS_PATCH):
                return expired
            self._status = expired.status
            try:
                await workflow.wait_condition(
                    lambda: self._completion is not None,
                    timeout=timedelta(seconds=created.late_success_window_seconds),
                )
            except TimeoutError:
                return expired
        assert self._completion is not None
        if workflow.patched(COMPLETE_STEP_PATCH):
            completed = await self._local(
                "payments.complete",
                CompleteInput(input.payment_session_id, self._completion),
                _DB_RETRY,
            )
            if completed.status != "checkout_completed":
                return completed  # settled already: nothing more to do
        self._status = "checkout_completed"
        try:
            return await self._local(
                "payments.credit",
                CreditInput(input.payment_session_id, self._completion),
                RetryPolicy(
                    initial_interval=timedelta(milliseconds=200),
                    maximum_attempts=max(1, input.policy.credit_max_attempts),
                    non_retryable_error_types=["not_found"],
                ),
            )
        except (ActivityError, ApplicationError) as err:
            workflow.logger.warning("credit failed after retries: %s", err)
            return await self._local(
                "payments.fail",
                FailInput(input.payment_session_id, CREDIT_FAILED, self._completion.amount_total),
                _DB_RETRY,
            )

    async def _create(self, input: PaymentSessionInput) -> CheckoutCreated | None:
        try:
            created: CheckoutCreated = await workflow.execute_local_activity(
                "payments.create_checkout",
                CreateCheckoutInput(
                    payment_session_id=input.payment_session_id,
                    project_id=input.project_id,
                    amount_minor=input.amount_minor,
                    currency=input.currency,
                    idempotency_key=input.idempotency_key,
                    workflow_id=workflow.info().workflow_id,
                ),
                result_type=CheckoutCreated,
                start_to_close_timeout=_LOCAL,
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=500),
                    maximum_attempts=max(1, input.policy.create_max_attempts),
                ),
            )
            return created
        except (ActivityError, ApplicationError) as err:
            cause = err.cause if isinstance(err, ActivityError) else err
            message = cause.message if isinstance(cause, ApplicationError) else str(err)
            self._rejection = ApplicationError(message, type=STRIPE_ERROR, non_retryable=True)
            return None

    async def _local(self, name: str, arg: object, retry: RetryPolicy) -> SettleResult:
        result: SettleResult = await workflow.execute_local_activity(
            name,
            arg,
            result_type=SettleResult,
            start_to_close_timeout=_LOCAL,
            retry_policy=retry,
        )
        return result


def _completion_problem(completion: CheckoutCompletion) -> str | None:
    """Why a checkout completion cannot be recorded and credited as it is, or None."""
    amount = completion.amount_total
    if (
        isinstance(amount, bool)
        or not isinstance(amount, int)
        or not 0 <= amount <= _MAX_AMOUNT_MINOR
    ):
        return "amount_total: not an amount in minor units"
    if not isinstance(completion.currency, str) or not _CURRENCY.fullmatch(completion.currency):
        return "currency: not a three-letter code"
    for name, value in (
        ("stripe_checkout_session_id", completion.stripe_checkout_session_id),
        ("source", completion.source),
    ):
        if (problem := text_problem(value, max_chars=MAX_ID_CHARS)) is not None or not value:
            return f"{name}: {problem or 'empty'}"
    event_id = completion.stripe_event_id
    if event_id is not None and (problem := text_problem(event_id, max_chars=MAX_ID_CHARS)):
        return f"stripe_event_id: {problem}"
    return None
