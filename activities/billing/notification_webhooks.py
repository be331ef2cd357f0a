"""A project's notification webhook, set and removed by the worker (AdminOperationWorkflow
operations NOTIFICATION_WEBHOOK_SET / _DELETE): the signing secret goes to the secret store and
the row with its audit row to the database, and a failure of either leaves both as they were."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.operation_support import (
    SecretChanges,
    record_audit,
    refusal,
    transaction,
    undone_on_failure,
)
from contracts.admin_operation import (
    NOT_FOUND,
    NOTIFICATION_WEBHOOK_DELETE,
    NOTIFICATION_WEBHOOK_SET,
)
from contracts.billing_meter import (
    WebhookDeleteInput,
    WebhookSetInput,
    WebhookState,
    notification_webhook_secret_path,
)
from core.secrets import SecretStore
from schema.models import NotificationWebhook


class NotificationWebhookActivities:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], secrets: SecretStore) -> None:
        self._sessions = sessions
        self._secrets = secrets

    def activities(self) -> list[Callable[..., Any]]:
        return [self.webhook_set, self.webhook_delete]

    @activity.defn(name=NOTIFICATION_WEBHOOK_SET)
    async def webhook_set(self, input: WebhookSetInput) -> WebhookState:
        project_id = uuid.UUID(input.project_id)
        path = notification_webhook_secret_path(project_id)
        changes = SecretChanges(self._secrets)
        await changes.write([(path, {"secret": input.signing_secret})])
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            prior = await session.get(NotificationWebhook, project_id)
            row = await session.scalar(
                pg_insert(NotificationWebhook)
                .values(project_id=project_id, url=input.url, secret_path=path)
                .on_conflict_do_update(
                    index_elements=[NotificationWebhook.project_id],
                    set_={
                        "url": input.url,
                        "secret_path": path,
                        "updated_at": func.clock_timestamp(),
                    },
                )
                .returning(NotificationWebhook)
            )
            assert row is not None
            record_audit(
                session,
                input.actor,
                action="notification_webhook.set",
                target_type="project",
                target_id=input.project_id,
                prior_state="set" if prior is not None else "unset",
                expected_state="set",
                details={"url": input.url},
            )
            return WebhookState(
                url=row.url,
                created_at=row.created_at.isoformat(),
                updated_at=row.updated_at.isoformat(),
            )

    @activity.defn(name=NOTIFICATION_WEBHOOK_DELETE)
    async def webhook_delete(self, input: WebhookDeleteInput) -> None:
        """The secret goes first (put back if the row's removal fails), so no row ever names a
        secret that is gone."""
        project_id = uuid.UUID(input.project_id)
        async with transaction(self._sessions) as session:
            row = await session.get(NotificationWebhook, project_id)
            if row is None:
                raise refusal(NOT_FOUND, "this project has no notification webhook")
            path = row.secret_path
        changes = SecretChanges(self._secrets)
        await changes.delete(path)
        async with undone_on_failure(changes), transaction(self._sessions) as session:
            row = await session.get(NotificationWebhook, project_id)
            if row is not None:
                await session.delete(row)
                record_audit(
                    session,
                    input.actor,
                    action="notification_webhook.delete",
                    target_type="project",
                    target_id=input.project_id,
                    prior_state="set",
                    expected_state="unset",
                    details={"url": row.url},
                )
