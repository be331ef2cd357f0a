"""Slice placement ranking (seed 000): candidates that fit on one NUMA node first, then best-fit
(the node with the fewest free GPUs that still fits), so large requests keep finding whole nodes.
Pure functions: the SQL that feeds them lives in activities/allocations.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class FreeSlot:
    slot_id: uuid.UUID
    gpu_index: int
    numa_node: int
    pci_address: str


@dataclass(frozen=True)
class NodeCandidate:
    node_id: uuid.UUID
    free_by_numa: dict[int, int]

    @property
    def total_free(self) -> int:
        return sum(self.free_by_numa.values())

    def numa_fit(self, gpus: int) -> bool:
        return any(free >= gpus for free in self.free_by_numa.values())


def rank_slice_candidates(candidates: list[NodeCandidate], gpus: int) -> list[NodeCandidate]:
    fitting = [c for c in candidates if c.total_free >= gpus]
    return sorted(fitting, key=lambda c: (not c.numa_fit(gpus), c.total_free, str(c.node_id)))


def choose_slots(free: list[FreeSlot], gpus: int) -> list[FreeSlot] | None:
    """Pick `gpus` slots from one node's free (and locked) slots: from a single NUMA node when one
    fits (the one with the fewest free slots that fits, best-fit again), else spread over the
    NUMA nodes with the most free slots first. None when the node no longer has enough."""
    if len(free) < gpus:
        return None
    by_numa: dict[int, list[FreeSlot]] = {}
    for slot in sorted(free, key=lambda s: s.gpu_index):
        by_numa.setdefault(slot.numa_node, []).append(slot)
    fitting = [slots for slots in by_numa.values() if len(slots) >= gpus]
    if fitting:
        best = min(fitting, key=lambda slots: (len(slots), slots[0].numa_node))
        return best[:gpus]
    chosen: list[FreeSlot] = []
    for slots in sorted(by_numa.values(), key=lambda s: (-len(s), s[0].numa_node)):
        chosen.extend(slots[: gpus - len(chosen)])
        if len(chosen) == gpus:
            break
    return chosen
