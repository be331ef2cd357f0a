"""Delivery of the tenant notification outbox (`notifications`) to project webhooks.

BillingMeterWorkflow runs `billing.deliver_notifications` after a metering run that left notices
due. Each attempt is claimed first (one statement: the due rows, locked SKIP LOCKED, get their
attempt counted and `next_attempt_at` pushed out as a lease), then POSTed with no transaction
open, then recorded: delivered, or due again after a backoff, or failed once its attempts are
spent. A worker that dies mid-attempt leaves the lease to expire and the next run tries again;
the receiver dedupes on Gpucloud-Notification-Id (the same id on every attempt), so a notice is
acted on once per episode.

The body is signed with the project's secret (secret store, `secret_path` of its webhook):
Gpucloud-Signature: t=<unix>,v1=HMAC-SHA256(secret, "<t>.<body>"). Webhooks that resolve to
loopback, private, link-local or reserved addresses are refused unless the settings allow them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from contracts.billing_meter import (
    NOTIFICATION_ID_HEADER,
    SIGNATURE_HEADER,
    DeliverNotificationsInput,
    DeliverNotificationsResult,
    sign_notification,
)
from core.payment_settings import NotificationSettings
from core.secrets import SecretStore, SecretStoreError
from schema.models import Notification, NotificationWebhook

log = logging.getLogger(__name__)
CLOCK = func.clock_timestamp()
MAX_ERROR = 300


class DeliveryFailed(Exception):
    """One attempt did not land; the message is safe to store (no response body, no secret)."""


@dataclass(frozen=True)
class _Claimed:
    id: uuid.UUID
    project_id: uuid.UUID
    kind: str
    episode: int
    details: dict[str, object]
    created_at: dt.datetime
    attempts: int


def notification_body(n: _Claimed) -> bytes:
    return json.dumps(
        {
            "id": str(n.id),
            "type": f"billing.{n.kind}",
            "project_id": str(n.project_id),
            "episode": n.episode,
            "created_at": n.created_at.isoformat(),
            "data": n.details,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def _refused_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone is not part of it
    return not ip.is_global or ip.is_multicast


class NotificationActivities:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        secrets: SecretStore,
        settings: NotificationSettings | None = None,
    ) -> None:
        self._sessions = sessions
        self._secrets = secrets
        self._settings = settings or NotificationSettings()

    @activity.defn(name="billing.deliver_notifications")
    async def deliver(self, input: DeliverNotificationsInput) -> DeliverNotificationsResult:
        result = DeliverNotificationsResult()
        claimed = await self._claim(input.max_notifications)
        if not claimed:
            return result
        async with httpx.AsyncClient(
            timeout=self._settings.timeout_seconds, follow_redirects=False
        ) as http:
            for notice in claimed:
                activity.heartbeat(str(notice.id))
                try:
                    await self._attempt(http, notice)
                except DeliveryFailed as err:
                    final = await self._failed(notice, str(err))
                    (result.failed if final else result.retrying).append(str(notice.id))
                    log.info(
                        "notification %s (%s) not delivered, attempt %d: %s",
                        notice.id, notice.kind, notice.attempts, err,
                    )  # fmt: skip
                else:
                    await self._delivered(notice)
                    result.delivered.append(str(notice.id))
        return result

    async def _claim(self, limit: int) -> list[_Claimed]:
        lease = dt.timedelta(seconds=self._settings.timeout_seconds * 4 + 30)
        due = (
            select(Notification.id)
            .where(Notification.delivery_status == "pending", Notification.next_attempt_at <= CLOCK)
            .order_by(Notification.next_attempt_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        async with self._sessions() as session, session.begin():
            rows = (
                await session.execute(
                    update(Notification)
                    .where(Notification.id.in_(due.scalar_subquery()))
                    .values(
                        delivery_attempts=Notification.delivery_attempts + 1,
                        next_attempt_at=CLOCK + lease,
                    )
                    .returning(
                        Notification.id,
                        Notification.project_id,
                        Notification.kind,
                        Notification.episode,
                        Notification.details,
                        Notification.created_at,
                        Notification.delivery_attempts,
                    )
                )
            ).all()
        return sorted((_Claimed(*row) for row in rows), key=lambda n: n.created_at)

    async def _attempt(self, http: httpx.AsyncClient, notice: _Claimed) -> None:
        async with self._sessions() as session:
            webhook = await session.get(NotificationWebhook, notice.project_id)
        if webhook is None:
            raise DeliveryFailed("the project has no notification webhook any more")
        try:
            stored = await self._secrets.read(webhook.secret_path)
        except SecretStoreError as err:
            message = f"the signing secret could not be read ({type(err).__name__})"
            raise DeliveryFailed(message) from None
        secret = (stored or {}).get("secret")
        if not secret:
            raise DeliveryFailed("the webhook has no signing secret")
        await self._check_target(webhook.url)
        body = notification_body(notice)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gpucloud-notifications/1",
            SIGNATURE_HEADER: sign_notification(secret, int(time.time()), body),
            NOTIFICATION_ID_HEADER: str(notice.id),
        }
        try:
            response = await http.post(webhook.url, content=body, headers=headers)
        except httpx.HTTPError as err:
            raise DeliveryFailed(f"request failed ({type(err).__name__})") from None
        if not 200 <= response.status_code < 300:
            raise DeliveryFailed(f"the webhook answered HTTP {response.status_code}")

    async def _check_target(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("https", "http") or not parsed.hostname:
            raise DeliveryFailed("the webhook URL is not an http(s) URL")
        if self._settings.allow_private_targets:
            return
        if parsed.scheme != "https":
            raise DeliveryFailed("the webhook URL must use https")
        port = parsed.port or 443
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(parsed.hostname, port)
        except OSError:
            raise DeliveryFailed("the webhook host does not resolve") from None
        if any(_refused_address(str(info[4][0])) for info in infos):
            raise DeliveryFailed("the webhook host resolves to a non-public address")

    async def _delivered(self, notice: _Claimed) -> None:
        async with self._sessions() as session, session.begin():
            await session.execute(
                update(Notification)
                .where(Notification.id == notice.id)
                .values(
                    delivery_status="delivered",
                    delivered_at=CLOCK,
                    next_attempt_at=None,
                    last_error=None,
                )
            )

    async def _failed(self, notice: _Claimed, error: str) -> bool:
        """Due again after a backoff, or failed for good; True when this was the last try."""
        final = notice.attempts >= self._settings.max_attempts
        backoff = min(
            self._settings.initial_backoff_seconds * 2 ** max(0, notice.attempts - 1),
            self._settings.max_backoff_seconds,
        )
        async with self._sessions() as session, session.begin():
            await session.execute(
                update(Notification)
                .where(Notification.id == notice.id)
                .values(
                    delivery_status="failed" if final else "pending",
                    next_attempt_at=None if final else CLOCK + dt.timedelta(seconds=backoff),
                    last_error=error[:MAX_ERROR],
                )
            )
        return final
