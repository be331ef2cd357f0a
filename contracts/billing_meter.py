"""BillingMeterWorkflow's run and its local activities' inputs and results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MeterInput:
    # Bill windows that ended by this instant (ISO-8601); None: now, by the database's clock.
    until: str | None = None


@dataclass
class MeterResult:
    debits_posted: int = 0
    charged_minor: int = 0
    records_billed: int = 0
    state_changes: list[str] = field(default_factory=list)
    allocations_to_release: list[str] = field(default_factory=list)


@dataclass
class BillingForceReleaseInput:
    allocation_ids: list[str]
    reason: str = "billing account depleted"


@dataclass
class BillingForceReleaseResult:
    requested: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
