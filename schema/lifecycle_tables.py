"""Where each node lifecycle job kind (onboarding, decommission) keeps its read model: the job
table, its append-only stage-event table and the job's subject type in domain_events. The
activities write these tables (activities/lifecycle_read_model.py); the gateway reads them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import SQLColumnExpression

from schema.models import (
    NodeDecommission,
    NodeDecommissionEvent,
    NodeOnboarding,
    NodeOnboardingEvent,
)


@dataclass(frozen=True)
class LifecycleTables:
    job: Any  # the job model (NodeOnboarding, NodeDecommission)
    job_id: SQLColumnExpression[uuid.UUID]  # the job table's id column
    event: Any  # its event model
    event_job_column: str  # the event table's column naming the job
    subject_type: str  # domain_events.subject_type


ONBOARDING_TABLES = LifecycleTables(
    job=NodeOnboarding,
    job_id=NodeOnboarding.onboarding_id,
    event=NodeOnboardingEvent,
    event_job_column="onboarding_id",
    subject_type="node_onboarding",
)
DECOMMISSION_TABLES = LifecycleTables(
    job=NodeDecommission,
    job_id=NodeDecommission.decommission_id,
    event=NodeDecommissionEvent,
    event_job_column="decommission_id",
    subject_type="node_decommission",
)
