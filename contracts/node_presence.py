"""The NodePresenceWorkflow contract: agents signal-with-start `node-presence-{node_id}` with a
heartbeat carrying their GPU inventory; the workflow records liveness and inventory."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKFLOW_NAME = "NodePresenceWorkflow"
HEARTBEAT_SIGNAL = "heartbeat"
# History stays bounded: the workflow continues as new after this many heartbeats.
HEARTBEATS_PER_RUN = 500


def node_presence_workflow_id(node_id: str) -> str:
    return f"node-presence-{node_id}"


@dataclass
class ReportedGpu:
    pci_address: str
    numa_node: int | None = None
    model: str = ""
    memory_mib: int | None = None


@dataclass
class Heartbeat:
    node_id: str
    sent_at: str  # ISO-8601 from the agent's clock; the control plane records its own time
    agent_version: str = ""
    gpus: list[ReportedGpu] | None = None  # None: inventory not probed this time


@dataclass
class NodePresenceInput:
    node_id: str
    heartbeats_seen: int = 0


@dataclass
class RecordHeartbeatInput:
    heartbeat: Heartbeat


@dataclass
class PresenceView:
    node_id: str
    heartbeats_seen: int
    last_sent_at: str = ""
    mismatched_pci_addresses: list[str] = field(default_factory=list)
