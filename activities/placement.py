"""Which GPUs of a node a slice gets (seed 000: NUMA-fit, then best-fit). Ranking the nodes
themselves happens in SQL (activities/allocations.py); this picks slots among those locked."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class FreeSlot:
    slot_id: uuid.UUID
    gpu_index: int
    numa_node: int
    pci_address: str


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
