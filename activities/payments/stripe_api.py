"""The one place that talks to Stripe. The API key is read from the secret store on every call;
the API base comes from settings (stripe-mock in tests and the dev stack). Calls are counted per
operation, so tests can prove that an idempotent retry made no second Stripe call."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import stripe

from core.payment_settings import STRIPE_API_KEY_PATH, PaymentSettings
from core.secrets import SecretStore


class StripeNotConfigured(Exception):
    """No Stripe API key in the secret store."""


@dataclass
class StripeCheckoutSession:
    id: str
    url: str | None
    status: str | None
    payment_status: str | None
    amount_total: int | None
    currency: str | None
    client_reference_id: str | None
    metadata: dict[str, str]
    created: int | None


def _session(resource: Any) -> StripeCheckoutSession:
    obj: dict[str, Any] = resource.to_dict() if hasattr(resource, "to_dict") else dict(resource)
    metadata = obj.get("metadata") or {}
    return StripeCheckoutSession(
        id=str(obj["id"]),
        url=obj.get("url"),
        status=obj.get("status"),
        payment_status=obj.get("payment_status"),
        amount_total=obj.get("amount_total"),
        currency=obj.get("currency"),
        client_reference_id=obj.get("client_reference_id"),
        metadata={str(k): str(v) for k, v in dict(metadata).items()},
        created=obj.get("created"),
    )


class StripeApi:
    def __init__(self, secrets: SecretStore, settings: PaymentSettings) -> None:
        self._secrets = secrets
        self._settings = settings
        self.calls: Counter[str] = Counter()

    async def _client(self) -> stripe.StripeClient:
        data = await self._secrets.read(STRIPE_API_KEY_PATH)
        key = (data or {}).get("key")
        if not key:
            raise StripeNotConfigured(f"no Stripe API key at {STRIPE_API_KEY_PATH}")
        return stripe.StripeClient(
            key,
            base_addresses={"api": self._settings.stripe_api_base},
            max_network_retries=0,  # Temporal retries the activity
            http_client=stripe.RequestsClient(timeout=self._settings.stripe_timeout_seconds),
        )

    async def create_checkout_session(
        self,
        *,
        payment_session_id: str,
        amount_minor: int,
        currency: str,
        idempotency_key: str,
        expires_at: int | None,
    ) -> StripeCheckoutSession:
        client = await self._client()
        params: dict[str, Any] = {
            "mode": "payment",
            "success_url": self._settings.success_url,
            "cancel_url": self._settings.cancel_url,
            "client_reference_id": payment_session_id,
            "metadata": {"payment_session_id": payment_session_id},
            "line_items": [
                {
                    "quantity": 1,
                    "price_data": {
                        "currency": currency,
                        "unit_amount": amount_minor,
                        "product_data": {"name": "gpucloud credit"},
                    },
                }
            ],
        }
        if expires_at is not None:
            params["expires_at"] = expires_at
        self.calls["checkout.sessions.create"] += 1
        created = await asyncio.to_thread(
            client.v1.checkout.sessions.create,
            params,  # type: ignore[arg-type]
            {"idempotency_key": idempotency_key},
        )
        return _session(created)

    async def retrieve_checkout_session(self, session_id: str) -> StripeCheckoutSession:
        client = await self._client()
        self.calls["checkout.sessions.retrieve"] += 1
        found = await asyncio.to_thread(client.v1.checkout.sessions.retrieve, session_id)
        return _session(found)

    async def list_checkout_sessions(
        self,
        *,
        created_after: int,
        status: str | None = None,
        limit: int = 100,
        max_pages: int = 1,
    ) -> list[StripeCheckoutSession]:
        """Checkout Sessions created at or after `created_after` (and in `status`, if given),
        newest first, following Stripe's cursor for at most `max_pages` pages."""
        client = await self._client()
        params: dict[str, Any] = {"created": {"gte": created_after}, "limit": limit}
        if status is not None:
            params["status"] = status
        found: list[StripeCheckoutSession] = []
        for _ in range(max_pages):
            self.calls["checkout.sessions.list"] += 1
            page = await asyncio.to_thread(
                client.v1.checkout.sessions.list,
                params,  # type: ignore[arg-type]
            )
            found.extend(_session(s) for s in page.data)
            if not page.has_more or not page.data:
                break
            params = {**params, "starting_after": page.data[-1].id}
        return found
