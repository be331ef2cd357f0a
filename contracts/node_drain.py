"""The NodeDrainWorkflow contract `node-drain-{node_id}`: retiring a node without removing it
(docs/lifecycles/node.md#states-and-transitions, docs/lifecycles/node.md#who-moves-it). The admin
retire operation moves the node to `draining` and starts this workflow in the same step, so the
drain always has its owning lifecycle operation; the workflow waits until no allocation lives on the
node (each ends, or is released by its tenant or an admin), then moves it draining → retired.
Temporal keeps it across worker restarts (resumable); the node_drains row is its read model."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

WORKFLOW_NAME = "NodeDrainWorkflow"
CHECK_ACTIVITY = "node.drain_check"  # a look at the node's allocations
FINISH_ACTIVITY = "node.drain_finish"  # draining → retired
# How often the drain looks again at the node's allocations, and how many looks one run keeps in
# its history before it continues as new.
POLL_SECONDS = 15.0
POLLS_PER_RUN = 200


def node_drain_workflow_id(node_id: str) -> str:
    return f"node-drain-{node_id}"


class DrainStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # the node is retired
    STOPPED = "stopped"  # something else moved the node out of draining: nothing to finish


@dataclass
class NodeDrainInput:
    node_id: str
    drain_id: str
    poll_seconds: float = POLL_SECONDS


@dataclass
class DrainCheck:
    """One look at the node: still draining, and how many allocations still live on it."""

    draining: bool
    live_allocations: int


@dataclass
class NodeDrainResult:
    node_id: str
    status: str  # DrainStatus
    node_status: str | None
