"""The MaasSiteReconcilerWorkflow contract (seed 003 §6): one run reconciles one site; a
Temporal Schedule `maas-reconciler-{site_id}` starts it (created with the site, paused while the
site is disabled, overlapping runs skipped)."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKFLOW_NAME = "MaasSiteReconcilerWorkflow"
DEFAULT_INTERVAL_SECONDS = 300


def reconciler_schedule_id(site_id: str) -> str:
    return f"maas-reconciler-{site_id}"


@dataclass
class ReconcileInput:
    site_id: str


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
