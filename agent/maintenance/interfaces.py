"""The small protocols behind which the node vendor or the OS does maintenance work:
`NodeGpuScrubber` (production on NVIDIA: `agent.gpu_tools.NvidiaSmiScrubber`; `WholeNodeScrubber`
adapts the bare-metal `GpuScrubber`), `ProcessLister` (default: `ProcProcessLister`, reading
`proc/<pid>/status` under the root), `GpuMemoryProbe` (production on NVIDIA:
`agent.gpu_tools.NvmlGpuMemoryProbe`, read-only), `RunningTaskCounter` and `UnitManager`
(production: systemd over D-Bus; not implemented here). Separate from the file backend so a
test or another host can supply each one without the backend's code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.backends.baremetal_users import GpuScrubber
from agent.backends.system_root import SystemRoot
from agent.gpu_tools import GpuMemoryUse, GpuQueryFailed, GpuToolUnavailable, unverified
from contracts.host_tasks import GpuScrubOutcome


class NodeGpuScrubber(Protocol):
    """Scrubs every GPU on the node, or verifies there is nothing to scrub (production on NVIDIA:
    agent.gpu_tools.NvidiaSmiScrubber, which checks that no compute process holds GPU memory and
    never resets a GPU). One outcome per GPU; a GPU that could not be scrubbed is an outcome with
    scrubbed=False, and one this host cannot verify has a message starting "unverified: "
    (agent.gpu_tools.unverified). Raises GpuToolUnavailable when nothing can be verified here,
    GpuQueryFailed (or anything else) when the scrub could not be attempted at all."""

    def scrub_each(self) -> list[GpuScrubOutcome]: ...


class WholeNodeScrubber:
    """Adapts the bare-metal `GpuScrubber` (one call for the whole node) to `NodeGpuScrubber`."""

    def __init__(self, scrubber: GpuScrubber) -> None:
        self._scrubber = scrubber

    def scrub_each(self) -> list[GpuScrubOutcome]:
        try:
            message = self._scrubber.scrub()
        except GpuToolUnavailable as err:
            return [GpuScrubOutcome(gpu="all", scrubbed=False, message=unverified(str(err)))]
        except GpuQueryFailed as err:
            return [GpuScrubOutcome(gpu="all", scrubbed=False, message=str(err))]
        except Exception as err:
            return [GpuScrubOutcome(gpu="all", scrubbed=False, message=type(err).__name__)]
        return [GpuScrubOutcome(gpu="all", scrubbed=True, message=message)]


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    uid: int  # the real uid
    other_uids: tuple[int, ...] = ()  # effective, saved set and filesystem uids, where known

    @property
    def uids(self) -> tuple[int, ...]:
        return (self.uid, *self.other_uids)


class ProcessLister(Protocol):
    """Every process on the node with its uids."""

    def processes(self) -> list[ProcessInfo]: ...


class ProcProcessLister:
    """Reads `proc/<pid>/status` under the system root ("Uid:" line: real, effective, saved set
    and filesystem uid). Read-only."""

    def __init__(self, root: SystemRoot) -> None:
        self._proc = root.host_path("/proc")

    def processes(self) -> list[ProcessInfo]:
        found: list[ProcessInfo] = []
        try:
            entries = list(os.scandir(self._proc))
        except FileNotFoundError:
            raise RuntimeError("no /proc under the system root") from None
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                text = Path(entry.path, "status").read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue  # the process ended while we looked
            for line in text.splitlines():
                if line.startswith("Uid:"):
                    uids = [int(u) for u in line.split()[1:] if u.isdigit()]
                    if uids:
                        found.append(ProcessInfo(int(entry.name), uids[0], tuple(uids[1:])))
                    break
        return found


class GpuMemoryProbe(Protocol):
    """GPU memory in use on each GPU (`GpuMemoryUse`, from agent.gpu_tools). Read-only: never
    resets a GPU or changes a setting. A GPU it cannot inspect has `unverified` set; raises
    GpuToolUnavailable when it cannot inspect any (no library, no driver), GpuQueryFailed when
    the query fails (production on NVIDIA: NvmlGpuMemoryProbe)."""

    def usage(self) -> list[GpuMemoryUse]: ...


class RunningTaskCounter(Protocol):
    """How many host tasks this agent is running now."""

    def running(self) -> int: ...


class UnitManager(Protocol):
    """systemd, for hw_sync_reseed (production: D-Bus daemon-reload and RestartUnit)."""

    def reload_and_restart(self, units: list[str]) -> None: ...
