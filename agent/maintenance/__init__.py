"""Node maintenance for decommission (docs/lifecycles/decommission.md, docs/lifecycles/node.md):
node.gpu_scrub, node.storage_cleanup, node.validate_clean, node.drain, node.uninstall and
node.hw_sync_reseed.

Two layers, like the host activities, one module per job:

- `protocol`: `MaintenanceBackend` (a protocol, blocking) does the work and answers the outcomes
  defined beside it; `file_backend`: `FileMaintenanceBackend` implements it under a `SystemRoot`
  (a directory standing for "/", a temporary tree in tests). Everything the node vendor or the
  OS must do is behind a small protocol in `interfaces` (`NodeGpuScrubber`, `ProcessLister`,
  `GpuMemoryProbe`, `RunningTaskCounter`, `UnitManager`); what it acts on comes from `config`
  (scratch roots, the agent's own files, the tenant uid range). No operation runs a shell or
  takes a command, a script or a path to act on from the control plane
  (docs/lifecycles/node.md#what-the-control-plane-asks-of-a-node): paths come from the agent's own
  config.
- `activities`: `MaintenanceActivities` registers them as Temporal activities on the node's
  queue, heartbeats the phase list while the backend runs, maps `HostError` to `ApplicationError`
  and sanitises everything that leaves the node (`sanitising`): secret-looking text redacted,
  the system root's own location never shown, messages truncated.

Rules:

- storage_cleanup deletes the *contents* of configured scratch roots, never the roots; a root
  that is a symlink (or under one) is refused (`unsafe_path`), symlinks inside a root are
  unlinked, never followed; a filesystem mounted below a root is refused before anything is
  deleted (rmtree would cross into it). Roots marked `tenant_owned_only` (default: /tmp and
  /var/tmp) lose only top-level entries owned by a uid in the tenant range. scope "weka" is
  `unsupported` until the Weka integration (docs/lifecycles/storage-attachment.md#providers) exists.
- validate_clean answers each check with passed/failed and a reason; a failed check is a result,
  not an error. Checks: tenant accounts, groups and sudoers grants (etc/passwd, etc/group,
  etc/sudoers.d); processes with any tenant uid (real, effective, saved or filesystem); tenant
  mounts (below a home or scratch root, a tenant's /run/user/<uid>, a FUSE mount of a tenant
  uid); GPU memory and GPU processes (the probe). A check that cannot be carried out (no mount
  table, no /proc) fails.
- GPU state that this host cannot verify (no probe or scrubber tool, no NVML library, no driver,
  a GPU the driver cannot see) is reported as "unverified: <reason>" (agent.gpu_tools), never as
  clean: the check fails and the scrub outcome is not scrubbed, unless node policy accepts it
  (`FileMaintenanceBackend(allow_unverified_gpu=True)`: the check passes and the outcome counts as
  scrubbed, the reason still saying "unverified"). GPU state that is checked and wrong (memory or
  processes in use, a GPU fell off the bus) always fails.
- drain writes a marker in the agent's state dir (idempotent) and reports the running task count.
- uninstall removes only the paths listed in `AgentFiles` (the agent's own files).
- hw_sync_reseed writes the hardware-sync service and timer units from a fixed template; the
  command they run is agent config, never task input; the interval is validated.

The names below are the package's public surface, importable from `agent.maintenance` as
before the split (GpuMemoryUse and NvmlGpuMemoryProbe live with the other vendor tools in
agent.gpu_tools; importable from here too).
"""

from __future__ import annotations

from agent.gpu_tools import GpuMemoryUse, NvmlGpuMemoryProbe
from agent.maintenance.activities import (
    MAINTENANCE_INTERNAL_ERROR,
    MaintenanceActivities,
)
from agent.maintenance.config import (
    DEFAULT_SCRATCH_ROOTS,
    AgentFiles,
    MaintenanceConfig,
    ScratchRoot,
)
from agent.maintenance.file_backend import (
    CHECK_GPU_MEMORY,
    CHECK_TENANT_MOUNTS,
    CHECK_TENANT_PROCESSES,
    CHECK_TENANT_USERS,
    DRAIN_PHASES,
    GPU_SCRUB_PHASES,
    HW_SYNC_RESEED_PHASES,
    STORAGE_CLEANUP_PHASES,
    UNDRAIN_PHASES,
    UNINSTALL_PHASES,
    VALIDATE_CLEAN_PHASES,
    FileMaintenanceBackend,
    _unescape_mount,
)
from agent.maintenance.interfaces import (
    GpuMemoryProbe,
    NodeGpuScrubber,
    ProcessInfo,
    ProcessLister,
    ProcProcessLister,
    RunningTaskCounter,
    UnitManager,
    WholeNodeScrubber,
)
from agent.maintenance.protocol import (
    DrainOutcome,
    HwSyncOutcome,
    MaintenanceBackend,
    StorageOutcome,
    UninstallOutcome,
    ValidateOutcome,
)
from agent.maintenance.sanitising import sanitise, sanitise_strings

__all__ = [
    "CHECK_GPU_MEMORY",
    "CHECK_TENANT_MOUNTS",
    "CHECK_TENANT_PROCESSES",
    "CHECK_TENANT_USERS",
    "DEFAULT_SCRATCH_ROOTS",
    "DRAIN_PHASES",
    "GPU_SCRUB_PHASES",
    "HW_SYNC_RESEED_PHASES",
    "MAINTENANCE_INTERNAL_ERROR",
    "STORAGE_CLEANUP_PHASES",
    "UNDRAIN_PHASES",
    "UNINSTALL_PHASES",
    "VALIDATE_CLEAN_PHASES",
    "AgentFiles",
    "DrainOutcome",
    "FileMaintenanceBackend",
    "GpuMemoryProbe",
    "GpuMemoryUse",
    "HwSyncOutcome",
    "MaintenanceActivities",
    "MaintenanceBackend",
    "MaintenanceConfig",
    "NodeGpuScrubber",
    "NvmlGpuMemoryProbe",
    "ProcProcessLister",
    "ProcessInfo",
    "ProcessLister",
    "RunningTaskCounter",
    "ScratchRoot",
    "StorageOutcome",
    "UninstallOutcome",
    "UnitManager",
    "ValidateOutcome",
    "WholeNodeScrubber",
    "_unescape_mount",
    "sanitise",
    "sanitise_strings",
]
