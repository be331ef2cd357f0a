"""Stripe fixtures: stripe-mock as real subprocesses (one answering with its bundled fixtures,
where a new Checkout Session is `open`/`unpaid`, and one whose Checkout Session fixture is
`complete`/`paid` for 5000 usd, standing in for "the customer paid"), the Stripe secrets in the
Vault simulator, Stripe-style webhook signing, and a payments worker whose Stripe client counts
its calls.

    async def test_x(payments):
        plane = await payments()                       # worker + app, default stripe-mock
        created = await plane.checkout(5000, key="k1")
        await plane.deliver(completed_event(created["stripe_checkout_session_id"], 5000))
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from activities.payments.stripe_api import StripeApi
from core.config import Settings
from core.payment_settings import (
    STRIPE_API_KEY_PATH,
    STRIPE_WEBHOOK_SECRET_PATH,
    PaymentSettings,
)
from core.secrets import VaultSecretStore
from devstack.processes import free_port
from devstack.stripe_mock import stripe_mock_argv, write_fixtures
from tests.vault_fixtures import VaultServer

PAID_AMOUNT = 5000  # what the "paid" stripe-mock reports for every Checkout Session
READY_TIMEOUT_S = 30.0


@dataclass
class StripeMock:
    api_base: str
    process: subprocess.Popen[bytes]
    log_file: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch_stripe_mock(workdir: Path, fixtures: Path | None = None) -> StripeMock:
    workdir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        port = free_port()
        log_file = workdir / f"stripe-mock-{port}.log"
        with log_file.open("wb") as log:
            process = subprocess.Popen(
                stripe_mock_argv(port, free_port(), fixtures),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        mock = StripeMock(f"http://127.0.0.1:{port}", process, log_file)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            try:
                httpx.get(f"{mock.api_base}/v1/balance", timeout=1.0,
                          headers={"Authorization": "Bearer sk_test_123"})  # fmt: skip
                return mock
            except httpx.HTTPError:
                time.sleep(0.05)
        mock.stop()
    raise RuntimeError(f"stripe-mock did not start:\n{log_file.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def stripe_mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StripeMock]:
    mock = launch_stripe_mock(tmp_path_factory.mktemp("stripe-mock"))
    yield mock
    mock.stop()


@pytest.fixture(scope="session")
def stripe_mock_paid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StripeMock]:
    workdir = tmp_path_factory.mktemp("stripe-mock-paid")
    fixtures = write_fixtures(
        workdir / "fixtures.json",
        status="complete",
        payment_status="paid",
        amount_total=PAID_AMOUNT,
        currency="usd",
    )
    mock = launch_stripe_mock(workdir, fixtures)
    yield mock
    mock.stop()


# --- webhooks signed exactly as Stripe signs them ---


def sign(payload: bytes, secret: str, timestamp: int | None = None) -> str:
    """Stripe-Signature: t=<unix>,v1=HMAC-SHA256(secret, "<t>.<payload>")."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def checkout_event(
    checkout_session_id: str,
    amount_total: int,
    *,
    event_type: str = "checkout.session.completed",
    event_id: str | None = None,
    payment_status: str = "paid",
    currency: str = "usd",
) -> dict[str, Any]:
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:24]}",
        "object": "event",
        "api_version": "2024-06-20",
        "created": int(time.time()),
        "livemode": False,
        "pending_webhooks": 1,
        "type": event_type,
        "data": {
            "object": {
                "id": checkout_session_id,
                "object": "checkout.session",
                "amount_total": amount_total,
                "currency": currency,
                "payment_status": payment_status,
                "status": "complete" if payment_status == "paid" else "open",
                "mode": "payment",
            }
        },
    }


@dataclass
class PaymentsPlane:
    client: httpx.AsyncClient  # tenant-authenticated gateway client
    stripe: StripeApi
    webhook_secret: str
    settings: Settings
    payment_settings: PaymentSettings
    temporal: Client

    async def checkout(
        self, amount_minor: int, *, key: str, currency: str = "usd"
    ) -> httpx.Response:
        return await self.client.post(
            "/api/v1/payments/checkout-session",
            json={"amount_minor": amount_minor, "currency": currency},
            headers={"X-Idempotency-Key": key},
        )

    async def deliver(
        self, event: dict[str, Any], *, secret: str | None = None, timestamp: int | None = None
    ) -> httpx.Response:
        payload = json.dumps(event).encode()
        return await self.client.post(
            "/api/v1/webhooks/stripe",
            content=payload,
            headers={
                "Content-Type": "application/json",
                "Stripe-Signature": sign(payload, secret or self.webhook_secret, timestamp),
            },
        )


PaymentsFactory = Callable[..., Awaitable[PaymentsPlane]]


@pytest.fixture
async def payments(
    api: Any,
    make_token: Any,
    make_project: Any,
    settings: Settings,
    temporal_client: Client,
    db_engine: AsyncEngine,
    vault_server: VaultServer,
    stripe_mock: StripeMock,
) -> AsyncIterator[PaymentsFactory]:
    """A factory: the control-plane worker (with a counting Stripe client) and the gateway, both
    reading the Stripe secrets from the Vault simulator."""
    from worker import build_worker

    store = VaultSecretStore(vault_server.addr, token=vault_server.token, timeout=5.0)
    webhook_secret = "whsec_" + secrets.token_hex(16)
    await store.write(STRIPE_API_KEY_PATH, {"key": "sk_test_" + secrets.token_hex(12)})
    await store.write(STRIPE_WEBHOOK_SECRET_PATH, {"secret": webhook_secret})
    app_settings = dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )
    async with AsyncExitStack() as stack:

        async def build(
            *,
            mock: StripeMock | None = None,
            ttl_seconds: float = 3600.0,
            late_window_seconds: float = 3600.0,
            project: Any = None,
        ) -> PaymentsPlane:
            payment_settings = PaymentSettings(
                stripe_api_base=(mock or stripe_mock).api_base,
                session_ttl_seconds=ttl_seconds,
                late_success_window_seconds=late_window_seconds,
            )
            stripe_api = StripeApi(store, payment_settings)
            worker = build_worker(
                temporal_client,
                app_settings,
                db_engine,
                stripe_api=stripe_api,
                payment_settings=payment_settings,
            )
            await stack.enter_async_context(worker)
            token = await make_token("tenant", project or await make_project(credit_minor=0))
            client = await api(token=token, settings=app_settings)
            return PaymentsPlane(
                client, stripe_api, webhook_secret, app_settings, payment_settings, temporal_client
            )

        yield build
