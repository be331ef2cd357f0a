"""Tenant notifications (docs/lifecycles/balance.md's notification channel): the project's notices,
newest first, and the project's notification webhook.

The worker writes a notice to the outbox when the balance becomes low_balance or depleted (once
per kind and episode) and, when the project has a webhook, POSTs it there signed with
HMAC-SHA256 (contracts/billing_meter.py: Gpucloud-Signature, Gpucloud-Notification-Id). The
webhook is a project setting the tenant writes here; its signing secret is made here, shown once
in the answer to PUT, and kept in the secret store only.
"""

from __future__ import annotations

import datetime as dt
import secrets as secrets_lib
import urllib.parse
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromQuery, JSONBody, QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.admin_operation import NOTIFICATION_WEBHOOK_DELETE, NOTIFICATION_WEBHOOK_SET
from contracts.billing_meter import (
    NOTIFICATION_ID_HEADER,
    SIGNATURE_HEADER,
    WebhookDeleteInput,
    WebhookSetInput,
    WebhookState,
)
from core.payment_settings import NotificationSettings
from core.timestamps import parse_iso
from gateway.admin_operations import actor, per_request, run_admin_operation
from gateway.auth import Principal, tenant_guard
from gateway.errors import NotFound, Unprocessable
from gateway.openapi import errors
from gateway.pagination import newest_first_page
from gateway.runtime import Runtime
from gateway.schemas import Request as RequestBody
from gateway.temporal import TemporalOps
from schema.models import Notification, NotificationWebhook

WEBHOOK_URL_INVALID = "webhook_url_invalid"


class NotificationView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    kind: str  # low_balance | depleted
    created_at: dt.datetime
    details: dict[str, Any]  # balance_minor, currency, state, threshold_minor
    # none (no webhook when it was written) | pending | delivered | failed
    delivery_status: str
    delivery_attempts: int
    delivered_at: dt.datetime | None


class NotificationList(msgspec.Struct, kw_only=True):
    items: list[NotificationView]
    # Pass back as ?cursor= for the next page; null on the last page.
    next_cursor: str | None = None


class WebhookSet(RequestBody):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2000)]


class WebhookView(msgspec.Struct, kw_only=True):
    url: str
    created_at: dt.datetime
    updated_at: dt.datetime
    signature_header: str = SIGNATURE_HEADER
    notification_id_header: str = NOTIFICATION_ID_HEADER


class WebhookCreated(WebhookView, kw_only=True):
    # Shown only in this answer: verify Gpucloud-Signature with it. A new PUT makes a new one.
    signing_secret: str


def _view(n: Notification) -> NotificationView:
    return NotificationView(
        id=n.id,
        kind=n.kind,
        created_at=n.created_at,
        details=n.details,
        delivery_status=n.delivery_status,
        delivery_attempts=n.delivery_attempts,
        delivered_at=n.delivered_at,
    )


def _webhook_view(row: NotificationWebhook) -> WebhookView:
    return WebhookView(url=row.url, created_at=row.created_at, updated_at=row.updated_at)


def validate_webhook_url(url: str, *, allow_plain_http: bool) -> str:
    """An absolute https URL (http too where private targets are allowed: the dev stack), with
    a host and no credentials or fragment. Where it resolves is checked at each delivery."""
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        parsed = None
    schemes = ("https", "http") if allow_plain_http else ("https",)
    if (
        parsed is None
        or parsed.scheme not in schemes
        or not parsed.hostname
        or parsed.username is not None
        or parsed.password is not None
        or parsed.fragment
        or any(c.isspace() for c in url)
    ):
        raise Unprocessable(
            "the webhook URL must be an absolute "
            + ("http(s)" if allow_plain_http else "https")
            + " URL with a host and no credentials",
            code=WEBHOOK_URL_INVALID,
            details={"field": "url"},
        )
    return url


class NotificationsController(Controller):
    path = "/api/v1/notifications"
    guards = [tenant_guard]
    tags = ["notifications"]

    @get("/", summary="The project's notifications, newest first", responses=errors(400, 403))
    async def list_notifications(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> NotificationList:
        rows, next_cursor = await newest_first_page(
            db,
            select(Notification).where(Notification.project_id == principal.project),
            created=Notification.created_at,
            row_id=Notification.id,
            limit=limit,
            cursor=cursor,
        )
        return NotificationList(items=[_view(n) for n in rows], next_cursor=next_cursor)

    @get("/webhook", summary="The project's notification webhook", responses=errors(403, 404))
    async def get_webhook(
        self, db: NamedDependency[AsyncSession], principal: NamedDependency[Principal]
    ) -> WebhookView:
        row = await db.get(NotificationWebhook, principal.project)
        if row is None:
            raise NotFound("this project has no notification webhook")
        return _webhook_view(row)

    @put(
        "/webhook",
        status_code=200,
        summary="Set the project's notification webhook (answers a new signing secret, once)",
        description=(
            "Notices (low_balance, depleted; once per episode) are POSTed to the URL as JSON "
            f"with {SIGNATURE_HEADER}: t=<unix>,v1=<hex HMAC-SHA256(secret, '<t>.<body>')> and "
            f"{NOTIFICATION_ID_HEADER} (the same on every retry). Each PUT replaces the URL "
            "and the secret."
        ),
        responses=errors(400, 403, 413, 422),
    )
    async def set_webhook(
        self,
        data: JSONBody[WebhookSet],
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
    ) -> WebhookCreated:
        project_id = principal.project
        url = validate_webhook_url(
            data.url, allow_plain_http=NotificationSettings.from_env().allow_private_targets
        )
        # Shown once, in this answer; the worker writes it to the secret store.
        signing_secret = "whsec_" + secrets_lib.token_urlsafe(32)
        state = await run_admin_operation(
            temporal,
            runtime.settings.control_plane_task_queue,
            NOTIFICATION_WEBHOOK_SET,
            WebhookSetInput(
                actor=actor(principal, None),
                project_id=str(project_id),
                url=url,
                signing_secret=signing_secret,
            ),
            key=per_request(project_id),  # it carries a secret
            result_type=WebhookState,
        )
        created_at, updated_at = parse_iso(state.created_at), parse_iso(state.updated_at)
        assert created_at is not None
        assert updated_at is not None
        return WebhookCreated(
            url=state.url,
            created_at=created_at,
            updated_at=updated_at,
            signing_secret=signing_secret,
        )

    @delete(
        "/webhook",
        status_code=204,
        summary="Remove the project's notification webhook",
        responses=errors(403, 404),
    )
    async def delete_webhook(
        self,
        temporal: NamedDependency[TemporalOps],
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
    ) -> None:
        await run_admin_operation(
            temporal,
            runtime.settings.control_plane_task_queue,
            NOTIFICATION_WEBHOOK_DELETE,
            WebhookDeleteInput(actor=actor(principal, None), project_id=str(principal.project)),
            key=str(principal.project),
            result_type=type(None),
        )
