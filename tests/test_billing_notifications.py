"""The tenant notification channel (docs/lifecycles/balance.md) against real Temporal, PostgreSQL,
the Vault simulator and a webhook receiver: the meter writes a low_balance and a depleted notice
once per episode, the tenant reads them at GET /api/v1/notifications, and the worker delivers each
to the project's webhook signed with HMAC-SHA256, retrying one that did not land, never twice once
it did."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from contracts.billing_meter import MeterInput, notification_webhook_secret_path
from core.config import Settings
from core.secrets import VaultSecretStore
from devstack.processes import free_port
from schema.models import NotificationWebhook, UsageRecord
from tests.histories import record_history
from tests.lifecycle_support import create_fleet, slice_request, wait_status
from tests.vault_fixtures import VaultServer
from workflows.billing_meter import BillingMeterWorkflow


@dataclass
class Receiver:
    url: str
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    # Notice types (billing.depleted, …) whose first delivery is answered 500.
    fail_first: set[str] = field(default_factory=set)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.received]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    port = free_port()
    box = Receiver(f"http://127.0.0.1:{port}/hooks/gpucloud")

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        box.received.append((dict(request.headers), body))
        kind = json.loads(body).get("type", "")
        if kind in box.fail_first:
            box.fail_first.discard(kind)
            return web.Response(status=500)
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks/gpucloud", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield box
    await runner.cleanup()


@pytest.fixture
async def plane(
    settings: Settings,
    temporal_client: Client,
    db_engine: AsyncEngine,
    vault_server: VaultServer,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Settings]:
    """The control-plane worker and the gateway's settings, both on the Vault simulator; webhooks
    on loopback allowed (the receiver), retries due at once."""
    from worker import build_worker

    monkeypatch.setenv("GPUCLOUD_NOTIFICATION_WEBHOOK_ALLOW_PRIVATE", "1")
    monkeypatch.setenv("GPUCLOUD_NOTIFICATION_WEBHOOK_RETRY_INITIAL_S", "0")
    app_settings = dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )
    async with build_worker(temporal_client, app_settings, db_engine):
        yield app_settings


async def meter(client: Client, settings: Settings, until: dt.datetime, name: str = "") -> Any:
    handle = await client.start_workflow(
        BillingMeterWorkflow.run,
        MeterInput(until=until.isoformat()),
        id=f"billing-meter-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    result = await handle.result()
    if name:
        await record_history(handle, "billing_meter", name)
    return result


def verify(secret: str, headers: dict[str, str], body: bytes) -> None:
    """What a receiver does with Gpucloud-Signature: t=<unix>,v1=<hex HMAC-SHA256>."""
    fields = dict(part.split("=", 1) for part in headers["Gpucloud-Signature"].split(","))
    expected = hmac.new(
        secret.encode(), f"{fields['t']}.".encode() + body, hashlib.sha256
    ).hexdigest()
    assert hmac.compare_digest(fields["v1"], expected)


async def test_notices_are_delivered_to_the_signed_webhook_once_per_episode(
    plane: Settings, receiver: Receiver, api: Any, make_project: Any, make_token: Any,
    db_sessions: Any, start_node_agent: Any, temporal_client: Client, vault_server: VaultServer,
) -> None:  # fmt: skip
    project = await make_project(credit_minor=0)
    client = await api(token=await make_token("tenant", project), settings=plane)
    admin = await api(token=await make_token("admin"), settings=plane)
    credit = {"amount_minor": 1200, "idempotency_key": "trial", "reason": "trial credit"}
    assert (
        await admin.post(f"/api/v1/admin/billing/accounts/{project.id}/credits", json=credit)
    ).status_code == 201

    # The webhook: a project setting; its secret shown once, kept in the secret store only.
    assert (await client.get("/api/v1/notifications/webhook")).status_code == 404
    refused = await client.put("/api/v1/notifications/webhook", json={"url": "ftp://x/y"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (422, "webhook_url_invalid")
    answer = await client.put("/api/v1/notifications/webhook", json={"url": receiver.url})
    assert answer.status_code == 200, answer.text
    secret = answer.json()["signing_secret"]
    assert secret.startswith("whsec_")
    shown = (await client.get("/api/v1/notifications/webhook")).json()
    assert shown["url"] == receiver.url
    assert "signing_secret" not in shown
    store = VaultSecretStore(vault_server.addr, token=vault_server.token, timeout=5.0)
    assert await store.read(notification_webhook_secret_path(project.id)) == {"secret": secret}
    async with db_sessions() as session:
        row = await session.get(NotificationWebhook, project.id)
        assert row is not None
        assert secret not in json.dumps({"url": row.url, "path": row.secret_path})

    [node] = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    ids = [
        (await client.post("/api/v1/allocations", json=slice_request(2))).json()["allocation_id"]
        for _ in range(2)
    ]
    for allocation_id in ids:
        await wait_status(client, allocation_id, "active")
    async with db_sessions() as session:
        start = await session.scalar(
            select(UsageRecord.started_at).where(UsageRecord.allocation_id == uuid.UUID(ids[0]))
        )
    assert start is not None

    # 1000/h: after 15 minutes 950 are left: low_balance, delivered by the same run.
    low = await meter(temporal_client, plane, start + dt.timedelta(minutes=15, seconds=30))
    assert low.notifications_due == 1
    [(headers, body)] = receiver.received
    verify(secret, headers, body)
    notice = json.loads(body)
    assert notice["type"] == "billing.low_balance"
    assert notice["project_id"] == str(project.id)
    assert 940 <= notice["data"]["balance_minor"] <= 960
    assert headers["Gpucloud-Notification-Id"] == notice["id"]

    # Depleted: the receiver fails the first attempt; the notice stays due, and the next run
    # delivers it (the same id: the receiver dedupes on it).
    listed = (await client.get("/api/v1/notifications")).json()["items"]
    assert [(n["kind"], n["delivery_status"]) for n in listed] == [("low_balance", "delivered")]
    await meter(temporal_client, plane, start + dt.timedelta(minutes=20))
    assert len(receiver.received) == 1, "once per episode, however often the meter runs"

    async def depleted_id() -> str | None:
        items = (await client.get("/api/v1/notifications")).json()["items"]
        return next((n["id"] for n in items if n["kind"] == "depleted"), None)

    receiver.fail_first.add("billing.depleted")
    depleted = await meter(
        temporal_client, plane, start + dt.timedelta(minutes=75, seconds=30),
        name="meter_notification_delivery_retried",
    )  # fmt: skip
    assert sorted(depleted.allocations_to_release) == sorted(ids)
    notice_id = await depleted_id()
    assert notice_id is not None
    items = {n["kind"]: n for n in (await client.get("/api/v1/notifications")).json()["items"]}
    assert (items["depleted"]["delivery_status"], items["depleted"]["delivery_attempts"]) == (
        "pending",
        1,
    )
    await meter(
        temporal_client, plane, start + dt.timedelta(minutes=76),
        name="meter_delivers_notifications",
    )  # fmt: skip
    for allocation_id in ids:
        await wait_status(client, allocation_id, "released")
    await meter(temporal_client, plane, start + dt.timedelta(minutes=80))

    for headers, body in receiver.received:
        verify(secret, headers, body)
    assert [(b["type"], b["id"]) for b in receiver.bodies()] == [
        ("billing.low_balance", notice["id"]),
        ("billing.depleted", notice_id),
        ("billing.depleted", notice_id),
    ]
    listed = (await client.get("/api/v1/notifications?limit=1")).json()
    assert [(n["kind"], n["delivery_status"], n["delivery_attempts"]) for n in listed["items"]] == [
        ("depleted", "delivered", 2)
    ]
    assert listed["next_cursor"] is not None
    rest = (await client.get(f"/api/v1/notifications?cursor={listed['next_cursor']}")).json()
    assert [(n["kind"], n["delivery_status"]) for n in rest["items"]] == [
        ("low_balance", "delivered")
    ]
    assert rest["next_cursor"] is None
    # Another project sees none of them.
    other = await api(token=await make_token("tenant", await make_project()), settings=plane)
    assert (await other.get("/api/v1/notifications")).json()["items"] == []

    assert (await client.delete("/api/v1/notifications/webhook")).status_code == 204
    assert await store.read(notification_webhook_secret_path(project.id)) is None
