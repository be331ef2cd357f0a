"""Simulated-host settings: how long each phase takes and which faults are armed at start.

From the environment (what the embedded stack and `python -m sim.fleet` read):

    GPUCLOUD_SIM_PHASE_DELAY_S   seconds per phase, or {"default": 2, "guest_reachable": 20}
    GPUCLOUD_SIM_PHASE_JITTER    fraction, e.g. 0.2 for +-20% per phase
    GPUCLOUD_SIM_FAULTS          JSON list of faults (sim.faults.FaultSpec fields), e.g.
                                 [{"activity": "slice.vm_provision", "kind": "lease_conflict",
                                   "times": 2, "node_id": "<uuid>"}]
    GPUCLOUD_SIM_CONFIG          one JSON document with all of the above and per-node overrides:
                                 {"phase_delay_s": 1, "phase_delays_s": {...}, "jitter": 0.1,
                                  "faults": [...], "nodes": {"<node uuid>": {"phase_delay_s": 5}}}

The separate variables override GPUCLOUD_SIM_CONFIG. Zero delay (the default) is for tests and
benchmarks.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sim.faults import FaultSpec

ENV_CONFIG = "GPUCLOUD_SIM_CONFIG"
ENV_PHASE_DELAY = "GPUCLOUD_SIM_PHASE_DELAY_S"
ENV_JITTER = "GPUCLOUD_SIM_PHASE_JITTER"
ENV_FAULTS = "GPUCLOUD_SIM_FAULTS"


@dataclass(frozen=True)
class SimHostConfig:
    phase_delay_s: float = 0.0
    phase_delays_s: Mapping[str, float] = field(default_factory=dict)  # per-phase overrides
    jitter: float = 0.0  # each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    faults: tuple[FaultSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.phase_delay_s < 0 or any(v < 0 for v in self.phase_delays_s.values()):
            raise ValueError("phase delays must not be negative")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter is a fraction between 0 and 1")

    def delay_for(self, phase: str, rng: random.Random) -> float:
        base = self.phase_delays_s.get(phase, self.phase_delay_s)
        if base <= 0 or self.jitter == 0:
            return base
        return base * rng.uniform(1 - self.jitter, 1 + self.jitter)

    def for_node(self, node_id: str) -> SimHostConfig:
        """Only the faults meant for this node (or for every node)."""
        faults = tuple(f for f in self.faults if f.node_id in (None, node_id))
        return replace(self, faults=faults)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], node_id: str | None = None) -> SimHostConfig:
        merged = dict(data)
        overrides = merged.pop("nodes", {}) or {}
        if node_id is not None and node_id in overrides:
            merged.update(overrides[node_id])
        unknown = set(merged) - {"phase_delay_s", "phase_delays_s", "jitter", "faults"}
        if unknown:
            raise ValueError(f"unknown simulator settings: {', '.join(sorted(unknown))}")
        config = cls(
            phase_delay_s=float(merged.get("phase_delay_s", 0.0)),
            phase_delays_s={k: float(v) for k, v in (merged.get("phase_delays_s") or {}).items()},
            jitter=float(merged.get("jitter", 0.0)),
            faults=tuple(FaultSpec.from_dict(f) for f in merged.get("faults") or ()),
        )
        return config.for_node(node_id) if node_id is not None else config

    @classmethod
    def from_json(cls, text: str, node_id: str | None = None) -> SimHostConfig:
        return cls.from_dict(json.loads(text) if text.strip() else {}, node_id)

    @classmethod
    def from_env(
        cls, node_id: str | None = None, env: Mapping[str, str] | None = None
    ) -> SimHostConfig:
        e = os.environ if env is None else env
        data: dict[str, Any] = json.loads(e.get(ENV_CONFIG) or "{}")
        delay = (e.get(ENV_PHASE_DELAY) or "").strip()
        if delay:
            parsed = json.loads(delay)
            if isinstance(parsed, dict):
                per_phase = {k: float(v) for k, v in parsed.items()}
                data["phase_delay_s"] = per_phase.pop("default", data.get("phase_delay_s", 0.0))
                data["phase_delays_s"] = per_phase
            else:
                data["phase_delay_s"] = float(parsed)
        if (e.get(ENV_JITTER) or "").strip():
            data["jitter"] = float(e[ENV_JITTER])
        if (e.get(ENV_FAULTS) or "").strip():
            data["faults"] = json.loads(e[ENV_FAULTS])
        return cls.from_dict(data, node_id)
