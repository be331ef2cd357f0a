"""NodePresenceWorkflow `node-presence-{node_id}`: the control plane's side of an agent's
presence signal. Agents talk to Temporal only (ARCHITECTURE rule 7), so their version and GPU
inventory arrive as signals, at agent start, when the inventory changes and otherwise every half
hour (agent/heartbeat.py); each is recorded by a short local activity (last_agent_contact_at,
inventory and whether it matches the node's GPU slots). Signals that arrive while one is being
recorded are coalesced: only the newest matters. Between signals, liveness comes from the
agent's polls (activities/node_liveness.py)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.node_presence import (
        HEARTBEAT_SIGNAL,
        HEARTBEATS_PER_RUN,
        WORKFLOW_NAME,
        Heartbeat,
        NodePresenceInput,
        PresenceView,
        RecordHeartbeatInput,
    )

RECORD_ACTIVITY = "node.record_heartbeat"


@workflow.defn(name=WORKFLOW_NAME)
class NodePresenceWorkflow:
    @workflow.init
    def __init__(self, input: NodePresenceInput) -> None:
        self._node_id = input.node_id
        self._seen = input.heartbeats_seen
        self._pending: Heartbeat | None = None
        self._last_sent_at = ""
        self._mismatched: list[str] = []

    @workflow.signal(name=HEARTBEAT_SIGNAL)
    def heartbeat(self, beat: Heartbeat) -> None:
        self._pending = beat

    @workflow.query(name="presence")
    def presence(self) -> PresenceView:
        return PresenceView(self._node_id, self._seen, self._last_sent_at, self._mismatched)

    @workflow.run
    async def run(self, input: NodePresenceInput) -> None:
        recorded = 0
        while recorded < HEARTBEATS_PER_RUN:
            await workflow.wait_condition(lambda: self._pending is not None)
            beat, self._pending = self._pending, None
            assert beat is not None
            self._mismatched = await workflow.execute_local_activity(
                RECORD_ACTIVITY,
                RecordHeartbeatInput(beat),
                result_type=list[str],
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=5),
            )
            self._seen += 1
            recorded += 1
            self._last_sent_at = beat.sent_at
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(NodePresenceInput(self._node_id, self._seen))
