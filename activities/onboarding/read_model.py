"""node_onboardings / node_onboarding_events / domain_events writes
(docs/lifecycles/onboarding.md#monitoring).

Two writers: each stage activity records its own `started` and `succeeded`/`failed` events
(`stage_started`, `stage_finished`), and the workflow records what only it knows (job status,
failure classification, operator actions, completion) through the `record_progress` local
activity. Both only ever move the row forward; nothing here reads Temporal."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from activities.lifecycle_read_model import JobTables
from contracts.onboarding import OnboardState, ProgressRecord
from schema.lifecycle_tables import ONBOARDING_TABLES

ONBOARDING = JobTables.of(ONBOARDING_TABLES)
add_event = ONBOARDING.add_event
stage_started = ONBOARDING.stage_started


def state_columns(state: OnboardState) -> dict[str, Any]:
    """The job row's columns that mirror the run's state (§4.5)."""
    values: dict[str, Any] = {
        "maas_system_id": state.system_id,
        "boss_disk_id": state.boss_disk_id,
        "deploy_attempts": state.deploy_attempts,
        "last_maas_status": state.observed.maas_status,
        "last_maas_power_state": state.observed.power_state,
        "last_maas_ips": list(state.observed.ip_addresses),
    }
    if state.cloud_init_version is not None:
        values["cloud_init_version"] = state.cloud_init_version
    return values


async def stage_finished(
    session: AsyncSession,
    onboarding_id: uuid.UUID,
    stage: str,
    attempt: int,
    *,
    status: str,
    state: OnboardState | None,
    message: str = "",
    details: dict[str, Any] | None = None,
) -> None:
    await ONBOARDING.stage_finished(
        session,
        onboarding_id,
        stage,
        attempt,
        status=status,
        columns=state_columns(state) if state is not None else {},
        message=message,
        details=details,
    )


async def record_progress(session: AsyncSession, record: ProgressRecord) -> None:
    await ONBOARDING.record_progress(
        session,
        uuid.UUID(record.onboarding_id),
        record,
        columns=state_columns(record.state) if record.state is not None else {},
        domain_payload={"node_id": record.details.get("node_id")},
    )
