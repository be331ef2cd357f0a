"""The node health probe's name, id and types (workflows/node_health_probe.py runs it;
activities/node_admin.py starts it for activate and reactivate)."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKFLOW_NAME = "NodeHealthProbeWorkflow"


def node_health_probe_workflow_id(node_id: str, request: str) -> str:
    return f"node-health-probe-{node_id}-{request}"


@dataclass
class HealthProbeInput:
    node_id: str
    task_id: str
    # A live agent long-polls its queue: it picks a task up at once. Not picked up in this long
    # means no agent is polling now.
    pickup_seconds: float = 5.0
    run_seconds: float = 20.0


@dataclass
class HealthProbeResult:
    answered: bool  # the agent ran the check now and reported back
    clean: bool = False  # validate_clean found no tenant residue
    answered_at: str | None = None  # ISO time the workflow received the agent's answer
    failed_checks: list[str] = field(default_factory=list)
    error: str = ""  # why the agent did not answer (timeout, failure)
