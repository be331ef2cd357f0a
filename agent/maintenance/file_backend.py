"""`FileMaintenanceBackend`: node maintenance under a `SystemRoot` ("/" on a node, a temporary
tree in tests): gpu_scrub through the scrubber, storage_cleanup of the configured scratch roots,
validate_clean's checks (tenant accounts, processes, mounts, GPU memory), drain/undrain's marker,
uninstall of the agent's own files and hw_sync_reseed's units. The rules each follows are in the
package docstring (agent/maintenance/__init__.py).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path, PurePosixPath

from agent.backend import HostCancelled, HostError, PhaseStatus, Progress
from agent.backends.system_root import SystemRoot, UnsafePath
from agent.gpu_tools import GpuQueryFailed, GpuToolUnavailable, is_unverified, unverified
from agent.maintenance.config import MaintenanceConfig, ScratchRoot
from agent.maintenance.interfaces import (
    GpuMemoryProbe,
    NodeGpuScrubber,
    ProcessLister,
    ProcProcessLister,
    RunningTaskCounter,
    UnitManager,
)
from agent.maintenance.protocol import (
    DrainOutcome,
    HwSyncOutcome,
    StorageOutcome,
    UninstallOutcome,
    ValidateOutcome,
)
from agent.maintenance.sanitising import sanitise, sanitise_strings
from agent.progress import utc_now_iso
from contracts.host_tasks import (
    STORAGE_SCOPE_LOCAL_SCRATCH,
    STORAGE_SCOPE_WEKA,
    CleanCheck,
    GpuScrubOutcome,
    HostErrorType,
    HwSyncReseedInput,
    NodeMaintenanceInput,
    ScratchRootOutcome,
    StorageCleanupInput,
)
from contracts.node_files import render_hw_sync_service, render_hw_sync_timer

# Phase names, in the order each activity runs them.
GPU_SCRUB_PHASES = ("gpus_scrubbed",)
STORAGE_CLEANUP_PHASES = ("mounts_checked", "scratch_cleaned")
VALIDATE_CLEAN_PHASES = (
    "users_checked",
    "processes_checked",
    "mounts_checked",
    "gpu_memory_checked",
)
DRAIN_PHASES = ("drain_marked", "running_tasks_counted")
UNDRAIN_PHASES = ("drain_unmarked",)
UNINSTALL_PHASES = ("agent_files_removed",)
HW_SYNC_RESEED_PHASES = ("credentials_checked", "units_written", "units_restarted")

CHECK_TENANT_USERS = "tenant_users"
CHECK_TENANT_PROCESSES = "tenant_processes"
CHECK_TENANT_MOUNTS = "tenant_mounts"
CHECK_GPU_MEMORY = "gpu_memory"

_MAX_NAMES = 5
_INTERVAL_RANGE = (1, 1440)


class FileMaintenanceBackend:
    """Maintenance under a `SystemRoot` ("/" on a node, a temporary tree in tests).

    allow_unverified_gpu: node policy for GPU state this host cannot verify (no GPU tool, library
    or driver; GPUs the driver cannot see): False (the default) makes such a scrub outcome not
    scrubbed and the gpu_memory check fail; True accepts them, the reason still saying
    "unverified". GPU state that was checked and found in use is never accepted."""

    def __init__(
        self,
        root: SystemRoot | Path | str,
        *,
        scrubber: NodeGpuScrubber,
        gpu_probe: GpuMemoryProbe | None = None,
        processes: ProcessLister | None = None,
        units: UnitManager | None = None,
        config: MaintenanceConfig | None = None,
        allow_unverified_gpu: bool = False,
    ) -> None:
        self.root = root if isinstance(root, SystemRoot) else SystemRoot(root)
        self.config = config or MaintenanceConfig()
        self._scrubber = scrubber
        self._gpu_probe = gpu_probe
        self._processes = processes or ProcProcessLister(self.root)
        self._units = units
        self.allow_unverified_gpu = allow_unverified_gpu

    def sanitise_root(self) -> SystemRoot | None:
        return self.root

    # ------------------------------------------------------------------ gpu_scrub

    def gpu_scrub(self, spec: NodeMaintenanceInput, progress: Progress) -> list[GpuScrubOutcome]:
        (phase,) = GPU_SCRUB_PHASES
        progress(phase, PhaseStatus.STARTED)
        try:
            outcomes = self._scrubber.scrub_each()
        except GpuToolUnavailable as err:
            outcomes = [GpuScrubOutcome(gpu="all", scrubbed=False, message=unverified(str(err)))]
        except GpuQueryFailed as err:
            raise HostError(HostErrorType.MAINTENANCE_ERROR, f"GPU scrub failed: {err}") from None
        except Exception as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR, f"GPU scrub could not run: {type(err).__name__}"
            ) from None
        outcomes = [sanitise_strings(self._gpu_policy(o), root=self.root) for o in outcomes]
        failed = [o.gpu for o in outcomes if not o.scrubbed]
        unsure = [o for o in outcomes if is_unverified(o.message)]
        if not outcomes:
            progress(phase, PhaseStatus.FAILED, "the scrubber reported no GPUs")
        elif failed:
            first = next(o for o in outcomes if not o.scrubbed)
            progress(
                phase,
                PhaseStatus.FAILED,
                f"not scrubbed: GPU {_few(failed)} ({first.gpu}: {first.message})",
            )
        elif unsure:
            progress(
                phase,
                PhaseStatus.SUCCEEDED,
                f"{len(outcomes) - len(unsure)} scrubbed, {len(unsure)} {unsure[0].message}",
            )
        else:
            progress(phase, PhaseStatus.SUCCEEDED, f"{len(outcomes)} scrubbed")
        return outcomes

    def _gpu_policy(self, outcome: GpuScrubOutcome) -> GpuScrubOutcome:
        """An unverified outcome counts as scrubbed only where node policy allows it."""
        if not is_unverified(outcome.message):
            return outcome
        if not self.allow_unverified_gpu:
            return replace(outcome, scrubbed=False)
        return replace(outcome, scrubbed=True, message=unverified(outcome.message, allowed=True))

    # ------------------------------------------------------------------ storage_cleanup

    def storage_cleanup(self, spec: StorageCleanupInput, progress: Progress) -> StorageOutcome:
        if spec.scope == STORAGE_SCOPE_WEKA:
            raise HostError(
                HostErrorType.UNSUPPORTED,
                "Weka storage cleanup is not supported on this node yet (no Weka integration)",
            )
        if spec.scope != STORAGE_SCOPE_LOCAL_SCRATCH:
            raise HostError(HostErrorType.INVALID_SPEC, "scope must be local_scratch or weka")
        configured = {r.path: r for r in self.config.scratch_roots}
        unknown = [r for r in spec.roots if r not in configured]
        if unknown:
            raise HostError(
                HostErrorType.UNSAFE_PATH,
                f"{len(unknown)} requested root(s) are not configured scratch roots",
            )
        roots = [configured[r] for r in spec.roots] if spec.roots else list(configured.values())

        mounts_phase, clean_phase = STORAGE_CLEANUP_PHASES
        progress(mounts_phase, PhaseStatus.STARTED)
        mounts = self._mount_points()
        if mounts is None:
            raise HostError(HostErrorType.MAINTENANCE_ERROR, "the mount table is unreadable")
        for r in roots:
            below = [m for m in mounts if _strictly_below(m, r.path)]
            if below:
                raise HostError(
                    HostErrorType.UNSAFE_PATH,
                    f"{len(below)} filesystem(s) mounted below {r.path}: unmount them first",
                )
        progress(mounts_phase, PhaseStatus.SUCCEEDED)

        progress(clean_phase, PhaseStatus.STARTED)
        results = [self._clean_root(r, progress) for r in roots]
        removed = sum(r.entries_removed for r in results)
        progress(clean_phase, PhaseStatus.SUCCEEDED, f"{removed} entries removed")
        return StorageOutcome(scope=spec.scope, roots=results)

    def _clean_root(self, scratch: ScratchRoot, progress: Progress) -> ScratchRootOutcome:
        users = self.config.users
        try:
            with self.root.open_dir(scratch.path) as dir_fd:
                removed = kept = 0
                for name in sorted(os.listdir(dir_fd)):
                    if progress.cancelled:
                        raise HostCancelled("cancelled while cleaning scratch")
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if scratch.tenant_owned_only and not (
                        users.uid_min <= st.st_uid <= users.uid_max
                    ):
                        kept += 1
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        # fd-based rmtree: never follows a symlink inside the tree.
                        shutil.rmtree(name, dir_fd=dir_fd)
                    else:
                        os.unlink(name, dir_fd=dir_fd)  # a symlink: the link, not its target
                    removed += 1
        except FileNotFoundError:
            return ScratchRootOutcome(root=scratch.path, present=False)
        except UnsafePath:
            raise HostError(
                HostErrorType.UNSAFE_PATH,
                f"scratch root {scratch.path} is or lies under a symlink: refused",
            ) from None
        except OSError as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR,
                f"cleaning {scratch.path} failed: {type(err).__name__} ({err.errno})",
            ) from None
        return ScratchRootOutcome(
            root=scratch.path, present=True, entries_removed=removed, entries_kept=kept
        )

    def _mount_points(self) -> list[str] | None:
        table = self._mount_table()
        return None if table is None else [point for point, _ in table]

    # ------------------------------------------------------------------ validate_clean

    def validate_clean(self, spec: NodeMaintenanceInput, progress: Progress) -> ValidateOutcome:
        users_phase, procs_phase, mounts_phase, gpu_phase = VALIDATE_CLEAN_PHASES
        checks = [
            self._check(progress, users_phase, self._check_users),
            self._check(progress, procs_phase, self._check_processes),
            self._check(progress, mounts_phase, self._check_mounts),
            self._check(progress, gpu_phase, self._check_gpu_memory),
        ]
        return ValidateOutcome(checks=checks)

    def _check(self, progress: Progress, phase: str, run: Callable[[], CleanCheck]) -> CleanCheck:
        progress(phase, PhaseStatus.STARTED)
        check = run()
        check.reason = sanitise(check.reason, root=self.root)
        # A failed check is a finding, not a failed step: the phase itself succeeded.
        if not check.passed:
            outcome = f"failed: {check.reason}"
        else:
            outcome = f"passed, {check.reason}" if is_unverified(check.reason) else "passed"
        progress(phase, PhaseStatus.SUCCEEDED, outcome)
        return check

    def _tenant_uid(self, uid: int) -> bool:
        return self.config.users.uid_min <= uid <= self.config.users.uid_max

    def _check_users(self) -> CleanCheck:
        """Tenant accounts (etc/passwd), tenant groups (etc/group) and the sudoers grants the
        bare-metal backend writes (etc/sudoers.d/<prefix><user>)."""
        try:
            passwd = self.root.read_text("/etc/passwd")
            group = self.root.read_text("/etc/group")
        except (OSError, ValueError) as err:
            return CleanCheck(
                CHECK_TENANT_USERS, False, f"account files unreadable: {type(err).__name__}"
            )
        if passwd is None:
            return CleanCheck(CHECK_TENANT_USERS, False, "no /etc/passwd")
        findings = []
        names = self._tenant_rows(passwd)
        if names:
            findings.append(f"{len(names)} tenant account(s) remain: {_few(names)}")
        groups = [g for g in self._tenant_rows(group or "") if g not in names]
        if groups:
            findings.append(f"{len(groups)} tenant group(s) remain: {_few(groups)}")
        grants = self._sudoers_grants()
        if grants is None:
            findings.append("/etc/sudoers.d is unreadable")
        elif grants:
            findings.append(f"{len(grants)} sudoers grant(s) remain: {_few(grants)}")
        if not findings:
            return CleanCheck(CHECK_TENANT_USERS, True, "no tenant accounts")
        return CleanCheck(CHECK_TENANT_USERS, False, "; ".join(findings))

    def _tenant_rows(self, table: str) -> list[str]:
        """Names in a passwd- or group-format table whose id is in the tenant range."""
        names = []
        for line in table.splitlines():
            row = line.split(":")
            if len(row) >= 3 and row[2].isdigit() and self._tenant_uid(int(row[2])):
                names.append(row[0])
        return names

    def _sudoers_grants(self) -> list[str] | None:
        prefix = self.config.users.sudoers_prefix
        try:
            with self.root.open_dir("/etc/sudoers.d") as fd:
                entries = os.listdir(fd)
        except FileNotFoundError:
            return []
        except (OSError, UnsafePath):
            return None
        return sorted(e for e in entries if prefix and e.startswith(prefix))

    def _check_processes(self) -> CleanCheck:
        try:
            procs = self._processes.processes()
        except Exception as err:
            return CleanCheck(
                CHECK_TENANT_PROCESSES, False, f"process list unavailable: {type(err).__name__}"
            )
        # Any tenant uid counts: a setuid helper a tenant started keeps its real uid, a process
        # that switched to a tenant uid keeps its saved one.
        found = [p for p in procs if any(self._tenant_uid(u) for u in p.uids)]
        if not found:
            return CleanCheck(CHECK_TENANT_PROCESSES, True, "no tenant processes")
        tenant = sorted({u for p in found for u in p.uids if self._tenant_uid(u)})
        return CleanCheck(
            CHECK_TENANT_PROCESSES,
            False,
            f"{len(found)} tenant process(es) running, uid(s) {_few([str(u) for u in tenant])}",
        )

    def _check_mounts(self) -> CleanCheck:
        """Mounts strictly below a home or scratch root, a tenant's runtime dir
        (/run/user/<tenant uid>: a login session left behind) and FUSE mounts of a tenant uid."""
        table = self._mount_table()
        if table is None:
            return CleanCheck(CHECK_TENANT_MOUNTS, False, "the mount table is unreadable")
        watched = [self.config.users.home_base] + [r.path for r in self.config.scratch_roots]
        tenant = []
        for point, options in table:
            below = any(_strictly_below(point, w) for w in watched)
            runtime = PurePosixPath(point).parent == PurePosixPath("/run/user") and (
                PurePosixPath(point).name.isdigit()
                and self._tenant_uid(int(PurePosixPath(point).name))
            )
            fuse_uid = re.search(r"(?:^|,)user_id=(\d+)(?:,|$)", options)
            fuse = fuse_uid is not None and self._tenant_uid(int(fuse_uid.group(1)))
            if below or runtime or fuse:
                tenant.append(point)
        if not tenant:
            return CleanCheck(CHECK_TENANT_MOUNTS, True, "no tenant mounts")
        return CleanCheck(
            CHECK_TENANT_MOUNTS, False, f"{len(tenant)} tenant mount(s): {_few(tenant)}"
        )

    def _mount_table(self) -> list[tuple[str, str]] | None:
        """(mount point, options) of each line of the mount table, None when unreadable."""
        try:
            text = self.root.read_text(self.config.mounts_file)
        except (OSError, ValueError):
            return None
        if text is None:
            return None
        table = []
        for line in text.splitlines():
            columns = line.split()
            if len(columns) >= 2:
                options = columns[3] if len(columns) >= 4 else ""
                table.append((_unescape_mount(columns[1]), options))
        return table

    def _check_gpu_memory(self) -> CleanCheck:
        """Memory and processes on every GPU, through the probe. Memory in use, processes on a
        GPU or a failed query fail; what this host cannot verify is "unverified" (node policy,
        `allow_unverified_gpu`, decides whether that passes)."""
        if self._gpu_probe is None:
            return self._unverified_gpu_check("no GPU memory probe configured")
        try:
            usage = self._gpu_probe.usage()
        except GpuToolUnavailable as err:
            return self._unverified_gpu_check(str(err))
        except GpuQueryFailed as err:
            return CleanCheck(CHECK_GPU_MEMORY, False, f"GPU probe failed: {err}")
        except Exception as err:
            return CleanCheck(CHECK_GPU_MEMORY, False, f"GPU probe failed: {type(err).__name__}")
        checked = [u for u in usage if not u.unverified]
        unsure = [u for u in usage if u.unverified]
        busy = [
            u.gpu
            for u in checked
            if u.processes > 0 or u.used_bytes > self.config.gpu_idle_used_bytes
        ]
        if busy:
            note = f" ({len(unsure)} more unverified)" if unsure else ""
            return CleanCheck(
                CHECK_GPU_MEMORY, False, f"GPU memory in use on GPU {_few(busy)}{note}"
            )
        if unsure:
            names = _few([u.gpu for u in unsure])
            return self._unverified_gpu_check(
                f"GPU {names}: {unsure[0].unverified} ({len(checked)} other GPU(s) idle)"
            )
        if not usage:
            return CleanCheck(CHECK_GPU_MEMORY, True, "no GPU found")
        return CleanCheck(CHECK_GPU_MEMORY, True, f"{len(usage)} GPU(s) idle")

    def _unverified_gpu_check(self, reason: str) -> CleanCheck:
        allowed = self.allow_unverified_gpu
        return CleanCheck(CHECK_GPU_MEMORY, allowed, unverified(reason, allowed=allowed))

    # ------------------------------------------------------------------ drain

    def drain(
        self,
        spec: NodeMaintenanceInput,
        progress: Progress,
        tasks: RunningTaskCounter | None = None,
    ) -> DrainOutcome:
        mark_phase, count_phase = DRAIN_PHASES
        files = self.config.agent_files
        progress(mark_phase, PhaseStatus.STARTED)
        try:
            already = self.is_draining()
            if not already:
                self._ensure_parents(files.state_dir, mode=0o700)
                self.root.write_atomic(
                    files.drain_marker, f"task {spec.task_id}\n{utc_now_iso()}\n", mode=0o600
                )
        except UnsafePath:
            raise HostError(HostErrorType.UNSAFE_PATH, "the agent state dir is a symlink") from None
        except OSError as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR, f"drain marker not written: {type(err).__name__}"
            ) from None
        progress(mark_phase, PhaseStatus.SUCCEEDED, "already draining" if already else "")
        progress(count_phase, PhaseStatus.STARTED)
        running = tasks.running() if tasks is not None else 0
        progress(count_phase, PhaseStatus.SUCCEEDED, f"{running} running")
        return DrainOutcome(draining=True, already_draining=already, running_tasks=running)

    def undrain(self, spec: NodeMaintenanceInput, progress: Progress) -> DrainOutcome:
        """Undo node.drain once a soft reset has proven the node clean: host activities take
        tenant work again. Idempotent (no marker: nothing to do)."""
        (phase,) = UNDRAIN_PHASES
        progress(phase, PhaseStatus.STARTED)
        was = self.is_draining()
        try:
            if was:
                self.root.remove_file(self.config.agent_files.drain_marker)
        except UnsafePath:
            raise HostError(HostErrorType.UNSAFE_PATH, "the agent state dir is a symlink") from None
        except OSError as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR, f"drain marker not removed: {type(err).__name__}"
            ) from None
        progress(phase, PhaseStatus.SUCCEEDED, "" if was else "was not draining")
        return DrainOutcome(draining=False, already_draining=was, running_tasks=0)

    def is_draining(self) -> bool:
        """Whether node.drain has run (the host activities may refuse new work on it)."""
        try:
            return self.root.read_text(self.config.agent_files.drain_marker) is not None
        except FileNotFoundError:
            return False

    def _ensure_parents(self, absolute: str, *, mode: int) -> None:
        parts = SystemRoot.parts(absolute)
        for depth in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:depth])
            host = self.root.host_path(path)
            if host.is_symlink() or (host.exists() and not host.is_dir()):
                # Never replaced: a symlinked /var (say) is the OS's business, not ours.
                raise UnsafePath(f"{path} is not a plain directory")
            if not host.exists():
                self.root.ensure_dir(path, mode=mode if depth == len(parts) else 0o755)

    # ------------------------------------------------------------------ uninstall

    def uninstall(self, spec: NodeMaintenanceInput, progress: Progress) -> UninstallOutcome:
        (phase,) = UNINSTALL_PHASES
        files = self.config.agent_files
        removed: list[str] = []
        absent: list[str] = []
        progress(phase, PhaseStatus.STARTED)
        try:
            for path in files.files:
                (removed if self.root.remove_file(path) else absent).append(path)
            # The state dir last: identity.json (listed above) and the drain marker lie in it.
            (removed if self.root.remove_tree(files.state_dir) else absent).append(files.state_dir)
        except UnsafePath:
            raise HostError(
                HostErrorType.UNSAFE_PATH, "an agent path lies under a symlink"
            ) from None
        except IsADirectoryError:
            raise HostError(
                HostErrorType.UNSAFE_PATH, "an agent file is a directory: refused"
            ) from None
        except OSError as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR, f"uninstall failed: {type(err).__name__}"
            ) from None
        progress(phase, PhaseStatus.SUCCEEDED, f"{len(removed)} removed, {len(absent)} absent")
        return UninstallOutcome(removed=removed, absent=absent)

    # ------------------------------------------------------------------ hw_sync_reseed

    def hw_sync_reseed(self, spec: HwSyncReseedInput, progress: Progress) -> HwSyncOutcome:
        low, high = _INTERVAL_RANGE
        if not low <= spec.interval_minutes <= high:
            raise HostError(
                HostErrorType.INVALID_SPEC, f"interval_minutes must be within {low}..{high}"
            )
        cfg = self.config.hw_sync
        creds_phase, write_phase, restart_phase = HW_SYNC_RESEED_PHASES
        progress(creds_phase, PhaseStatus.STARTED)
        try:
            present = self.root.host_path(cfg.credentials).is_file()
        except ValueError:
            present = False
        # Presence only: the credentials' content is never read here.
        progress(creds_phase, PhaseStatus.SUCCEEDED, "present" if present else "missing")

        progress(write_phase, PhaseStatus.STARTED)
        wanted = {
            cfg.service_unit: render_hw_sync_service(cfg),
            cfg.timer_unit: render_hw_sync_timer(cfg, spec.interval_minutes),
        }
        written: list[str] = []
        unchanged: list[str] = []
        try:
            for path, text in wanted.items():
                if self.root.read_text(path) == text:
                    unchanged.append(path)
                else:
                    self.root.write_atomic(path, text, mode=0o644, uid=0, gid=0)
                    written.append(path)
        except UnsafePath:
            raise HostError(HostErrorType.UNSAFE_PATH, "the unit directory is a symlink") from None
        except OSError as err:
            raise HostError(
                HostErrorType.MAINTENANCE_ERROR, f"unit files not written: {type(err).__name__}"
            ) from None
        progress(write_phase, PhaseStatus.SUCCEEDED, f"{len(written)} written")

        progress(restart_phase, PhaseStatus.STARTED)
        restarted = False
        if self._units is not None and present:
            try:
                self._units.reload_and_restart([PurePosixPath(cfg.timer_unit).name])
            except Exception as err:
                raise HostError(
                    HostErrorType.MAINTENANCE_ERROR, f"restart failed: {type(err).__name__}"
                ) from None
            restarted = True
        progress(
            restart_phase,
            PhaseStatus.SUCCEEDED,
            "restarted" if restarted else ("no unit manager" if present else "no credentials"),
        )
        return HwSyncOutcome(
            units_written=written,
            units_unchanged=unchanged,
            credentials_present=present,
            restarted=restarted,
        )


def _strictly_below(path: str, base: str) -> bool:
    p = PurePosixPath("/", path)
    b = PurePosixPath("/", base)
    return p != b and b in p.parents


def _unescape_mount(field_text: str) -> str:
    """/proc/self/mounts escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def _few(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMES])
    return shown + (f" and {len(items) - _MAX_NAMES} more" if len(items) > _MAX_NAMES else "")
