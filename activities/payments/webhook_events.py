"""A Stripe webhook event, handled in the worker (AdminOperationWorkflow operation
STRIPE_WEBHOOK_EVENT, keyed by the event id, so a redelivery while the first runs joins it):
the event is recorded once, a paid checkout completion is signalled to its payment session's
workflow, and only then is the event marked processed, so a redelivery after a failure tries
again and one after success changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.operation_support import transaction
from contracts.admin_operation import STRIPE_WEBHOOK_EVENT
from contracts.payment_session import (
    COMPLETED_SIGNAL,
    CheckoutCompletion,
    WebhookEventInput,
    WebhookEventResult,
)
from schema.models import PaymentSession, StripeWebhookEvent

# The events that say a Checkout Session was paid (synchronously, or later for delayed methods).
COMPLETION_EVENTS = frozenset(
    {"checkout.session.completed", "checkout.session.async_payment_succeeded"}
)


class StripeWebhookActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], client: Client) -> None:
        self._sessions = sessions
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        return [self.handle_event]

    @activity.defn(name=STRIPE_WEBHOOK_EVENT)
    async def handle_event(self, input: WebhookEventInput) -> WebhookEventResult:
        async with transaction(self._sessions) as session:
            await session.execute(
                pg_insert(StripeWebhookEvent)
                .values(
                    id=input.event_id,
                    type=input.event_type,
                    stripe_checkout_session_id=input.stripe_checkout_session_id,
                )
                .on_conflict_do_nothing(index_elements=[StripeWebhookEvent.id])
            )
            processed = await session.scalar(
                select(StripeWebhookEvent.processed).where(StripeWebhookEvent.id == input.event_id)
            )
            if processed:
                return WebhookEventResult(duplicate=True)
            completion = await self._completion(session, input)
        if completion is not None:
            workflow_id, signal = completion
            try:
                await self._client.get_workflow_handle(workflow_id).signal(COMPLETED_SIGNAL, signal)
            except RPCError as err:
                # Already finished (credited, expired, failed): nothing left to do.
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
        async with transaction(self._sessions) as session:
            await session.execute(
                update(StripeWebhookEvent)
                .where(StripeWebhookEvent.id == input.event_id)
                .values(processed=True, processed_at=func.clock_timestamp())
            )
        return WebhookEventResult(duplicate=False)

    @staticmethod
    async def _completion(
        session: AsyncSession, input: WebhookEventInput
    ) -> tuple[str, CheckoutCompletion] | None:
        """The payment session workflow to tell, and what: only for a paid completion of a
        checkout session we created."""
        checkout_id = input.stripe_checkout_session_id
        if input.event_type not in COMPLETION_EVENTS or not input.paid or not checkout_id:
            return None
        row = await session.scalar(
            select(PaymentSession).where(PaymentSession.stripe_checkout_session_id == checkout_id)
        )
        if row is None:
            return None
        return row.workflow_id, CheckoutCompletion(
            stripe_checkout_session_id=checkout_id,
            amount_total=input.amount_total,
            currency=(input.currency or row.currency).lower(),
            source="webhook",
            stripe_event_id=input.event_id,
        )
