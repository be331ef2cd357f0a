"""The MaasSiteReconcilerWorkflow contract (docs/lifecycles/node.md#drift-with-maas): one run
reconciles one site; a Temporal Schedule `maas-reconciler-{site_id}` starts it (created with the
site, paused while the site is disabled, overlapping runs skipped). A run then re-seeds the hardware
sync of the nodes whose sync drift is new (§9.1: `node.hw_sync_reseed` on each node's queue) and
records each outcome on its drift event."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

WORKFLOW_NAME = "MaasSiteReconcilerWorkflow"
DEFAULT_INTERVAL_SECONDS = 300
# The local activity that writes re-seed outcomes onto their drift events.
RECORD_RESEEDS_ACTIVITY = "maas.record_reseed_outcomes"


class ReseedStatus(StrEnum):
    """`reseed.status` on an hw_sync_stale drift event (details and node_maas_state)."""

    DISPATCHED = "dispatched"  # claimed by a run: its workflow runs the host task
    SKIPPED = "skipped"  # not run: the node is not active, or has no agent ever heard from
    SUCCEEDED = "succeeded"  # the agent rewrote the units and restarted the timer
    FAILED = "failed"  # the task failed, or the agent could not restart the timer
    AGENT_UNREACHABLE = "agent_unreachable"  # no agent picked the task up in time


def reconciler_schedule_id(site_id: str) -> str:
    return f"maas-reconciler-{site_id}"


@dataclass
class ReconcileInput:
    site_id: str
    # The re-seed host task: how long it may wait for the node's agent to pick it up (an agent
    # that does not is recorded as unreachable), and how long it may run.
    reseed_schedule_to_start_seconds: float = 60.0
    reseed_timeout_seconds: float = 120.0


@dataclass
class ReseedRequest:
    """A node whose sync drift is new: its open hw_sync_stale drift event, claimed once."""

    node_id: str
    drift_event_id: int
    task_id: str
    interval_minutes: int


@dataclass
class ReseedOutcome:
    node_id: str
    drift_event_id: int
    task_id: str
    status: str  # a ReseedStatus
    error_type: str | None = None
    message: str = ""
    units_written: int = 0
    credentials_present: bool = False
    restarted: bool = False


@dataclass
class ReseedOutcomes:
    site_id: str
    outcomes: list[ReseedOutcome] = field(default_factory=list)


@dataclass
class ReconcileResult:
    site_id: str
    machines_seen: int = 0
    nodes_checked: int = 0
    drift_detected: int = 0
    drift_resolved: int = 0
    actions: list[str] = field(default_factory=list)  # e.g. "quarantined:<node>", "released:<node>"
    # MAAS machines bound to no node (§6.4 DEBUG: counted, nothing written per machine).
    unmanaged_machines: int = 0
    # The re-seeds this run's workflow runs (at most MAX_RESEEDS_PER_RUN; the rest next run).
    reseeds: list[ReseedRequest] = field(default_factory=list)
