"""What maintenance acts on, from the agent's own config and never from task input
(docs/lifecycles/node.md#what-the-control-plane-asks-of-a-node): the scratch roots storage_cleanup
empties (`ScratchRoot`), the agent's own files that uninstall removes and the drain marker
(`AgentFiles`), and the tenant uid range and account config (`MaintenanceConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.backends.baremetal_users import UserAccountConfig
from agent.backends.system_root import SystemRoot
from contracts.node_files import HwSyncConfig


@dataclass(frozen=True)
class ScratchRoot:
    path: str  # as on the node, e.g. "/scratch"
    # Only top-level entries owned by a tenant uid are removed (shared dirs such as /tmp).
    tenant_owned_only: bool = False


DEFAULT_SCRATCH_ROOTS = (
    ScratchRoot("/scratch"),
    ScratchRoot("/tmp", tenant_owned_only=True),  # noqa: S108 - cleaned, not written to
    ScratchRoot("/var/tmp", tenant_owned_only=True),  # noqa: S108
)


@dataclass(frozen=True)
class AgentFiles:
    """Everything node.uninstall removes: the agent's own files, listed explicitly."""

    state_dir: str = "/var/lib/gpucloud-agent"  # identity.json lives here (agent/enrollment.py)
    files: tuple[str, ...] = (
        "/var/lib/gpucloud-agent/identity.json",
        "/etc/gpucloud/agent.toml",  # written by cloud-init
        "/etc/systemd/system/gpucloud-agent.service",
    )

    @property
    def drain_marker(self) -> str:
        return f"{self.state_dir.rstrip('/')}/draining"


@dataclass(frozen=True)
class MaintenanceConfig:
    users: UserAccountConfig = field(default_factory=UserAccountConfig)
    scratch_roots: tuple[ScratchRoot, ...] = DEFAULT_SCRATCH_ROOTS
    agent_files: AgentFiles = field(default_factory=AgentFiles)
    hw_sync: HwSyncConfig = field(default_factory=HwSyncConfig)
    mounts_file: str = "/proc/self/mounts"
    # Memory an idle GPU reports as used (driver/context overhead) and still counts as clean.
    gpu_idle_used_bytes: int = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        owned = [r.path for r in self.scratch_roots]
        owned += [self.agent_files.state_dir, *self.agent_files.files]
        owned += [self.hw_sync.service_unit, self.hw_sync.timer_unit]
        for path in owned:
            parts = SystemRoot.parts(path)  # refuses "..", "."
            if not path.startswith("/") or len(parts) < 1:
                raise ValueError(f"{path!r} must be an absolute path below /")
        if any(len(SystemRoot.parts(p)) < 2 for p in [*self.agent_files.files]):
            raise ValueError("agent files must lie in a directory below /")
