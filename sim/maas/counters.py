"""Request counters per operation, so tests can assert e.g. "deploy called at most twice".

Every request that reaches a MAAS API resource is counted when it arrives, whatever its answer
(refusals, injected 5xx and auth failures included), under "<resource>.<op>": "machine.deploy",
"machines.read", "machine.read", "interface.link_subnet", "events.query" (an operation without
`op` is read/create/update/delete by its method). Unknown URLs count as "unknown". A machines
list read without any of MAAS's filters (hostname=, mac_address=, status=, id=, ...) is also
counted as "machines.read_unfiltered": the whole inventory, which a poll should not fetch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    ops: Counter[str] = field(default_factory=Counter)
    by_machine: dict[str, Counter[str]] = field(default_factory=dict)
    answers: dict[str, Counter[str]] = field(default_factory=dict)  # op -> status -> n

    def request(self, op: str, system_id: str | None) -> None:
        self.ops[op] += 1
        if system_id:
            self.by_machine.setdefault(system_id, Counter())[op] += 1

    def answer(self, op: str, status: int) -> None:
        self.answers.setdefault(op, Counter())[str(status)] += 1

    def reset(self) -> None:
        self.ops.clear()
        self.by_machine.clear()
        self.answers.clear()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": dict(self.ops),
            "machines": {sid: dict(c) for sid, c in self.by_machine.items()},
            "answers": {op: dict(c) for op, c in self.answers.items()},
        }
