"""NodeLivenessWorkflow's sweep input and result."""

from __future__ import annotations

from dataclasses import dataclass, field

# An active node's recorded contact is refreshed from its task queue's pollers once it is older
# than this share of the offline threshold: each idle node's queue is described about every
# half threshold, and a live agent is seen well before the threshold passes.
PROBE_AFTER_SHARE_OF_THRESHOLD = 0.5


@dataclass
class LivenessInput:
    offline_after_seconds: float = 300.0

    @property
    def probe_after_seconds(self) -> float:
        return self.offline_after_seconds * PROBE_AFTER_SHARE_OF_THRESHOLD


@dataclass
class LivenessResult:
    went_offline: list[str] = field(default_factory=list)
    came_back: list[str] = field(default_factory=list)
    # How many node task queues this sweep described (the agents' pollers it read).
    queues_described: int = 0
