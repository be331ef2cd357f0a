"""NodeLivenessWorkflow's sweep input and result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LivenessInput:
    offline_after_seconds: float = 300.0


@dataclass
class LivenessResult:
    went_offline: list[str] = field(default_factory=list)
    came_back: list[str] = field(default_factory=list)
