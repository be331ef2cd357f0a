"""`MaintenanceBackend`, the blocking interface the activities drive, and the outcomes each of
its operations answers. Separate so the activities and the simulator (sim.node_services) depend
on the interface only, not on the file-based implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agent.backend import Progress
from agent.backends.system_root import SystemRoot
from agent.maintenance.interfaces import RunningTaskCounter
from contracts.host_tasks import (
    CleanCheck,
    GpuScrubOutcome,
    HwSyncReseedInput,
    NodeMaintenanceInput,
    ScratchRootOutcome,
    StorageCleanupInput,
)


@dataclass
class StorageOutcome:
    scope: str
    roots: list[ScratchRootOutcome]


@dataclass
class ValidateOutcome:
    checks: list[CleanCheck]

    @property
    def clean(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class DrainOutcome:
    draining: bool
    already_draining: bool
    running_tasks: int


@dataclass
class UninstallOutcome:
    removed: list[str]
    absent: list[str]


@dataclass
class HwSyncOutcome:
    units_written: list[str]
    units_unchanged: list[str]
    credentials_present: bool
    restarted: bool


class MaintenanceBackend(Protocol):
    """Node maintenance. Methods block, raise HostError for classified failures and
    HostCancelled when `progress` says so; each is idempotent."""

    def gpu_scrub(
        self, spec: NodeMaintenanceInput, progress: Progress
    ) -> list[GpuScrubOutcome]: ...

    def storage_cleanup(self, spec: StorageCleanupInput, progress: Progress) -> StorageOutcome: ...

    def validate_clean(self, spec: NodeMaintenanceInput, progress: Progress) -> ValidateOutcome: ...

    def drain(
        self,
        spec: NodeMaintenanceInput,
        progress: Progress,
        tasks: RunningTaskCounter | None = None,
    ) -> DrainOutcome: ...

    def undrain(self, spec: NodeMaintenanceInput, progress: Progress) -> DrainOutcome: ...

    def uninstall(self, spec: NodeMaintenanceInput, progress: Progress) -> UninstallOutcome: ...

    def hw_sync_reseed(self, spec: HwSyncReseedInput, progress: Progress) -> HwSyncOutcome: ...

    def is_draining(self) -> bool:
        """Whether node.drain has run: host activities then refuse new tenant work."""
        ...

    def sanitise_root(self) -> SystemRoot | None:
        """The system root whose location `sanitise` strips from what leaves the node."""
        ...
