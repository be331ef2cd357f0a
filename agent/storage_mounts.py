"""Storage attachment host tasks (docs/lifecycles/storage-attachment.md): storage.mount and
storage.unmount on the node's queue, run by the node's agent for StorageAttachmentWorkflow.

The provider these mount is the shared directory provider (activities/storage_provider.py): a
directory tree on a filesystem the control plane's storage activities and every node see, at
`[storage] export_root` on the node (a cluster filesystem or an NFS export mounted there; the
same directory on one machine in the embedded stack and the tests). In it, each namespace is
`namespaces/<namespace key>/` and each access the control plane granted is
`grants/<namespace key>/<attachment id>.json` naming the node and the write mode.

Rules:

- Nothing to act on comes from the control plane as a path
(docs/lifecycles/node.md#what-the-control-plane-asks-of-a-node): the namespace key and
  the attachment id must be UUIDs; the source is resolved under the agent's own export root and
  the mount point is `<mount_base>/<attachment id>` under the agent's system root.
- A mount needs the grant for this attachment and this node; the grant's mode wins (a read_only
  grant is mounted read-only whatever the task says). A source or grant that is a symlink is
  refused (`unsafe_path`).
- The mount is a bind mount (mount(8) --bind, then remount,bind,nosuid,nodev, plus ro for
  read_only), seen in the kernel's mount table; an existing mount at the point is adopted, so a
  retried task is a no-op. nosuid: a tenant may not leave a setgid program in the namespace for
  whoever mounts it next to run with the namespace's group.
- Tenant access on a bare-metal node (issue 36 item 4): the namespace directory belongs to a gid
  of its own (activities/storage_provider.py); after the mount, the allocation's tenant account
  is made a member of that group (`tenant_access_granted`, through the bare-metal user backend),
  so the non-root tenant reads and writes its mount (the mount's mode decides which) and nothing
  else of the export. An unmount takes the membership away first (`tenant_access_removed`)
  unless another mount on this node still shows the same namespace. A process the tenant
  started before the attach keeps the groups it had: the next login (or `sg gpucloud-ns<gid>`)
  has the new one.
- An unmount removes the mount and then the empty mount point, never anything in it: a mount
  point that still holds files after the unmount is left alone and reported, so a failed unmount
  can never delete namespace data. Unmounting what is not mounted succeeds.
- A gpu_slice allocation's tenant works inside its VM, not on the host: after the host mount, the
  VM gets it as a virtiofs filesystem (`guest_attached`, tagged `virtiofs_tag(attachment id)`,
  through the node's slice backend: hot-plugged and kept in the domain's definition), and the
  tenant mounts the tag inside the guest. An unmount takes it out of the VM first
  (`guest_detached`; a guest that has not let the device go in time fails it, and the host mount
  stays; one that has it mounted loses it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError

from agent.backend import HostError, PhaseStatus, Progress
from agent.backends.system_root import SystemRoot
from agent.host_activities import HostActivities
from agent.maintenance import _unescape_mount
from agent.progress import utc_now_iso
from contracts.host_tasks import STORAGE_MOUNT, STORAGE_UNMOUNT, HostErrorType
from contracts.states import SkuShape
from contracts.storage import (
    NAMESPACE_GID_MAX,
    NAMESPACE_GID_MIN,
    PROVIDER_SHARED_DIRECTORY,
    StorageMountInput,
    StorageMountResult,
    StorageUnmountInput,
    StorageUnmountResult,
    WriteMode,
    virtiofs_tag,
)

logger = logging.getLogger("agent.storage")

MOUNT_PHASES = ("grant_checked", "mount_point_prepared", "mounted")
UNMOUNT_PHASES = ("unmounted", "mount_point_removed")
GUEST_ATTACH_PHASE = "guest_attached"  # after MOUNT_PHASES, for a slice VM
GUEST_DETACH_PHASE = "guest_detached"  # before UNMOUNT_PHASES, for a slice VM
TENANT_GRANT_PHASE = "tenant_access_granted"  # after MOUNT_PHASES, for a host tenant
TENANT_REVOKE_PHASE = "tenant_access_removed"  # before UNMOUNT_PHASES, for a host tenant
DEFAULT_MOUNT_BASE = "/mnt/gpucloud/storage"
MOUNT_COMMAND_TIMEOUT_S = 60
MOUNT_TABLE = Path("/proc/self/mountinfo")

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class StorageMountConfig:
    """`[storage]` of the agent config. `export_root`: where the shared directory provider's tree
    is on this machine (a host path, not under the system root: the filesystem is mounted there
    by the node's image or site hook); None: this node mounts no storage. `mount_base`: where
    attachments are mounted, a path under the system root."""

    export_root: Path | None = None
    mount_base: str = DEFAULT_MOUNT_BASE

    @classmethod
    def from_table(cls, section: dict[str, Any]) -> StorageMountConfig:
        export = section.get("export_root")
        return cls(
            export_root=Path(str(export)) if export else None,
            mount_base=str(section.get("mount_base") or DEFAULT_MOUNT_BASE),
        )


class Mounter(Protocol):
    """The kernel side of a mount; blocking."""

    def bind(self, source: Path, target: Path, *, read_only: bool) -> None: ...

    def unmount(self, target: Path) -> None: ...

    def is_mounted(self, target: Path) -> bool: ...


class GuestFilesystems(Protocol):
    """The node's slice VMs, as far as storage needs them (agent.backends.libvirt_slice);
    blocking. Each answers a phase message."""

    def attach_filesystem(
        self, allocation_id: str, source_dir: Path, tag: str, *, read_only: bool
    ) -> str: ...

    def detach_filesystem(self, allocation_id: str, tag: str) -> str: ...


class TenantAccounts(Protocol):
    """The node's bare-metal tenant accounts, as far as storage needs them
    (agent.backends.baremetal_users); blocking."""

    def join_storage_group(self, allocation_id: str, gid: int) -> str | None: ...

    def leave_storage_group(self, allocation_id: str, gid: int) -> bool: ...


class MountFailed(Exception):
    """mount(8) or umount(8) said no; the message is the tool's, without paths."""


class KernelBindMounter:
    """Bind mounts through util-linux mount(8)/umount(8) with fixed arguments; the kernel's own
    mount table (/proc/self/mountinfo) says what is mounted (a bind mount on the same filesystem
    keeps the device, so os.path.ismount cannot see it)."""

    def bind(self, source: Path, target: Path, *, read_only: bool) -> None:
        self._run("mount", "--bind", str(source), str(target))
        # A bind mount takes its flags only from a remount.
        flags = "remount,bind,nosuid,nodev" + (",ro" if read_only else "")
        try:
            self._run("mount", "-o", flags, str(target))
        except MountFailed:
            self._run("umount", str(target))
            raise

    def unmount(self, target: Path) -> None:
        self._run("umount", str(target))

    def is_mounted(self, target: Path) -> bool:
        wanted = str(target)
        for line in MOUNT_TABLE.read_text().splitlines():
            fields = line.split()
            if len(fields) > 4 and _unescape_mount(fields[4]) == wanted:
                return True
        return False

    @staticmethod
    def _run(*argv: str) -> None:
        tool = shutil.which(argv[0])
        if tool is None:
            raise MountFailed(f"{argv[0]} is not installed")
        done = subprocess.run(
            [tool, *argv[1:]],
            check=False,
            capture_output=True,
            text=True,
            timeout=MOUNT_COMMAND_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise MountFailed(f"{argv[0]} exited {done.returncode}")


@dataclass(frozen=True)
class MountOutcome:
    mount_path: str
    read_only: bool
    adopted_existing: bool
    guest_mount_tag: str | None = None


@dataclass(frozen=True)
class UnmountOutcome:
    was_mounted: bool


class StorageMountBackend:
    """Mounts and unmounts attachments under a `SystemRoot` ("/" on a node, a simulated
    machine's disk in the stack and the tests)."""

    def __init__(
        self,
        root: SystemRoot,
        config: StorageMountConfig,
        mounter: Mounter | None = None,
        *,
        guests: GuestFilesystems | None = None,
        tenants: TenantAccounts | None = None,
    ) -> None:
        """`guests`: the node's slice VMs (None: the node runs none). `tenants`: its bare-metal
        tenant accounts (None: it has none; only root on the node reaches a mount)."""
        self.root = root
        self.config = config
        self._mounter = mounter or KernelBindMounter()
        self.guests = guests
        self.tenants = tenants

    def mount_point(self, attachment_id: str) -> str:
        """The mount point as seen on the node."""
        return str(PurePosixPath(self.config.mount_base) / attachment_id)

    def mount(self, spec: StorageMountInput, progress: Progress) -> MountOutcome:
        guests = self._guests_for(spec)
        grant_phase, point_phase, mount_phase = MOUNT_PHASES
        progress(grant_phase, PhaseStatus.STARTED)
        source, read_only = self._granted_source(spec)
        progress(grant_phase, PhaseStatus.SUCCEEDED)

        progress(point_phase, PhaseStatus.STARTED)
        point = self.mount_point(spec.attachment_id)
        self._ensure_mount_point(point)
        target = self.root.host_path(point)
        progress(point_phase, PhaseStatus.SUCCEEDED)

        progress(mount_phase, PhaseStatus.STARTED)
        adopted = self._mounter.is_mounted(target)
        if adopted:
            progress(mount_phase, PhaseStatus.SUCCEEDED, "already mounted")
        else:
            try:
                self._mounter.bind(source, target, read_only=read_only)
            except (MountFailed, OSError, subprocess.TimeoutExpired) as err:
                raise HostError(
                    HostErrorType.STORAGE_ERROR, f"mount failed: {_describe(err)}"
                ) from None
            progress(mount_phase, PhaseStatus.SUCCEEDED, "read-only" if read_only else "read-write")
        if guests is None:
            if self.tenants is not None:
                progress(TENANT_GRANT_PHASE, PhaseStatus.STARTED)
                message = self._grant_tenant(spec, target)
                progress(TENANT_GRANT_PHASE, PhaseStatus.SUCCEEDED, message)
            return MountOutcome(point, read_only, adopted_existing=adopted)
        tag = virtiofs_tag(spec.attachment_id)
        progress(GUEST_ATTACH_PHASE, PhaseStatus.STARTED)
        message = guests.attach_filesystem(spec.allocation_id, target, tag, read_only=read_only)
        progress(GUEST_ATTACH_PHASE, PhaseStatus.SUCCEEDED, message)
        return MountOutcome(point, read_only, adopted_existing=adopted, guest_mount_tag=tag)

    def unmount(self, spec: StorageUnmountInput, progress: Progress) -> UnmountOutcome:
        unmount_phase, remove_phase = UNMOUNT_PHASES
        point = self.mount_point(spec.attachment_id)
        target = self.root.host_path(point)
        if spec.allocation_shape == SkuShape.GPU_SLICE and self.guests is not None:
            # Out of the VM first: the host mount is what the guest's filesystem reads.
            progress(GUEST_DETACH_PHASE, PhaseStatus.STARTED)
            message = self.guests.detach_filesystem(
                spec.allocation_id, virtiofs_tag(spec.attachment_id)
            )
            progress(GUEST_DETACH_PHASE, PhaseStatus.SUCCEEDED, message)
        elif self.tenants is not None:
            # Before the unmount: a busy mount stays, but the tenant's access to it is gone.
            progress(TENANT_REVOKE_PHASE, PhaseStatus.STARTED)
            message = self._revoke_tenant(spec, target)
            progress(TENANT_REVOKE_PHASE, PhaseStatus.SUCCEEDED, message)
        progress(unmount_phase, PhaseStatus.STARTED)
        was_mounted = self._mounter.is_mounted(target)
        if was_mounted:
            try:
                self._mounter.unmount(target)
            except (MountFailed, OSError, subprocess.TimeoutExpired) as err:
                raise HostError(
                    HostErrorType.STORAGE_ERROR, f"unmount failed: {_describe(err)}"
                ) from None
        progress(unmount_phase, PhaseStatus.SUCCEEDED, "" if was_mounted else "was not mounted")

        progress(remove_phase, PhaseStatus.STARTED)
        self._remove_mount_point(point)
        progress(remove_phase, PhaseStatus.SUCCEEDED)
        return UnmountOutcome(was_mounted=was_mounted)

    # ------------------------------------------------------------------ tenant access

    def _grant_tenant(self, spec: StorageMountInput, target: Path) -> str:
        assert self.tenants is not None
        gid = self._namespace_gid(target)
        if gid is None:
            # A provider that could not give the namespace its group (not root on the export).
            return "the namespace has no group of its own: only root reaches it"
        try:
            username = self.tenants.join_storage_group(spec.allocation_id, gid)
        except OSError as err:
            raise HostError(
                HostErrorType.STORAGE_ERROR, f"tenant access not granted: {_describe(err)}"
            ) from None
        if username is None:
            if spec.allocation_shape == SkuShape.BAREMETAL:
                # Provisioned before it is active: retried, then the attachment fails.
                raise HostError(
                    HostErrorType.STORAGE_ERROR, "no tenant account for the allocation here"
                )
            return "no tenant account for the allocation on this node"
        return f"{username} is in the namespace's group (gid {gid})"

    def _revoke_tenant(self, spec: StorageUnmountInput, target: Path) -> str:
        assert self.tenants is not None
        if not self._mounter.is_mounted(target):
            return "not mounted"
        gid = self._namespace_gid(target)
        if gid is None:
            return "the namespace has no group of its own"
        if self._still_mounted_elsewhere(target):
            return "the namespace is still mounted here for another attachment"
        try:
            was_member = self.tenants.leave_storage_group(spec.allocation_id, gid)
        except OSError as err:
            raise HostError(
                HostErrorType.STORAGE_ERROR, f"tenant access not removed: {_describe(err)}"
            ) from None
        return f"left the namespace's group (gid {gid})" if was_member else "was not a member"

    @staticmethod
    def _namespace_gid(target: Path) -> int | None:
        """The gid of the mounted namespace directory, if it is a namespace's own."""
        gid = target.stat().st_gid
        return gid if NAMESPACE_GID_MIN <= gid <= NAMESPACE_GID_MAX else None

    def _still_mounted_elsewhere(self, target: Path) -> bool:
        """Whether another mount under the mount base shows the same directory as `target`."""
        own = target.stat()
        base = target.parent
        for other in base.iterdir():
            if other == target or not self._mounter.is_mounted(other):
                continue
            st = other.stat()
            if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                return True
        return False

    # ------------------------------------------------------------------ helpers

    def _guests_for(self, spec: StorageMountInput) -> GuestFilesystems | None:
        """The VMs to give the mount to: a slice allocation's, which this node must run. (A task
        from an older workflow names no shape and mounts on the host only, as it did then.)"""
        if spec.allocation_shape != SkuShape.GPU_SLICE:
            return None
        if self.guests is None:
            raise HostError(
                HostErrorType.UNSUPPORTED, "this node runs no slice VMs to give the storage to"
            )
        return self.guests

    def _granted_source(self, spec: StorageMountInput) -> tuple[Path, bool]:
        """The namespace directory and whether to mount it read-only, from the provider's grant
        for this attachment and node."""
        export = self.config.export_root
        if export is None:
            raise HostError(HostErrorType.UNSUPPORTED, "this node has no storage export configured")
        if spec.provider != PROVIDER_SHARED_DIRECTORY:
            raise HostError(HostErrorType.UNSUPPORTED, f"storage provider {spec.provider!r}")
        source = export / "namespaces" / spec.namespace_key
        grant_file = export / "grants" / spec.namespace_key / f"{spec.attachment_id}.json"
        for path in (source, grant_file):
            try:
                st = path.lstat()
            except FileNotFoundError:
                # The export may not be mounted yet, or the grant not visible yet: retried.
                raise HostError(
                    HostErrorType.STORAGE_ERROR, f"{path.relative_to(export)} is not in the export"
                ) from None
            if stat.S_ISLNK(st.st_mode):
                raise HostError(
                    HostErrorType.UNSAFE_PATH, f"{path.relative_to(export)} is a symlink"
                )
        if not source.is_dir():
            raise HostError(HostErrorType.INVALID_SPEC, "the namespace is not a directory")
        try:
            grant = json.loads(grant_file.read_text())
        except (OSError, ValueError):
            raise HostError(HostErrorType.STORAGE_ERROR, "the grant cannot be read") from None
        if grant.get("node_id") != spec.node_id:
            raise HostError(HostErrorType.INVALID_SPEC, "the grant is for another node")
        granted_mode = grant.get("mode")
        read_only = WriteMode.READ_ONLY in (granted_mode, spec.mode)
        return source, read_only

    def _ensure_mount_point(self, point: str) -> None:
        """Make the missing directories down to the mount point. An existing one is left as it
        is: the point may be a live mount, whose mode is the namespace's."""
        path = ""
        try:
            for part in PurePosixPath(point).parts[1:]:
                path = f"{path}/{part}"
                if not self.root.host_path(path).is_dir():
                    # Opened without following symlinks below the root: a planted link fails.
                    self.root.ensure_dir(path, mode=0o755, uid=0, gid=0)
        except OSError as err:
            raise HostError(
                HostErrorType.UNSAFE_PATH, f"mount point cannot be made: {_describe(err)}"
            ) from None

    def _remove_mount_point(self, point: str) -> None:
        parent, name = str(PurePosixPath(point).parent), PurePosixPath(point).name
        try:
            with self.root.open_dir(parent) as dir_fd:
                os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as err:
            # Not empty means the unmount did not take: nothing in it is ever deleted.
            raise HostError(
                HostErrorType.STORAGE_ERROR, f"mount point not removed: {_describe(err)}"
            ) from None


def _describe(err: BaseException) -> str:
    if isinstance(err, MountFailed):
        return str(err)
    if isinstance(err, OSError):
        return f"{type(err).__name__} (errno {err.errno})"
    return type(err).__name__


def _check_spec(node_id: str, agent_node_id: str | None, **ids: str) -> None:
    """Ids must be UUIDs (they become path names) and the task must be for this node."""
    problems = [name for name, value in ids.items() if not _UUID.match(value)]
    if agent_node_id is not None and node_id != agent_node_id:
        problems.append("node_id")
    if problems:
        raise ApplicationError(
            f"invalid storage task ({', '.join(problems)})",
            type=HostErrorType.INVALID_SPEC.value,
            non_retryable=True,
        )


class StorageMountActivities:
    """storage.mount and storage.unmount, run through the node's HostActivities (progress
    reports, heartbeats, running count, drain refusal), bound to a backend; without one (a node
    with no `[storage]` config) both answer `unsupported`."""

    def __init__(
        self, backend: StorageMountBackend | None, *, node_id: str | None, tasks: HostActivities
    ) -> None:
        self._backend = backend
        self._node_id = node_id
        self._tasks = tasks

    def activities(self) -> list[Callable[..., Any]]:
        return [self.mount, self.unmount]

    def _require_backend(self) -> StorageMountBackend:
        if self._backend is None:
            raise ApplicationError(
                "this node mounts no storage ([storage] export_root is not configured)",
                type=HostErrorType.UNSUPPORTED.value,
                non_retryable=True,
            )
        return self._backend

    @activity.defn(name=STORAGE_MOUNT)
    async def mount(self, spec: StorageMountInput) -> StorageMountResult:
        _check_spec(
            spec.node_id,
            self._node_id,
            attachment_id=spec.attachment_id,
            namespace_key=spec.namespace_key,
        )
        backend = self._require_backend()
        started_at = utc_now_iso()
        outcome, progress = await self._tasks.run_tenant_task(
            STORAGE_MOUNT,
            spec.task_id,
            spec.allocation_id,
            lambda p: backend.mount(spec, p),
            unexpected_error_type=HostErrorType.STORAGE_ERROR.value,
            new_work=True,
        )
        return StorageMountResult(
            task_id=spec.task_id,
            started_at=started_at,
            finished_at=utc_now_iso(),
            phases=progress.snapshot(),
            mount_path=outcome.mount_path,
            read_only=outcome.read_only,
            adopted_existing=outcome.adopted_existing,
            guest_mount_tag=outcome.guest_mount_tag,
        )

    @activity.defn(name=STORAGE_UNMOUNT)
    async def unmount(self, spec: StorageUnmountInput) -> StorageUnmountResult:
        _check_spec(spec.node_id, self._node_id, attachment_id=spec.attachment_id)
        backend = self._require_backend()
        started_at = utc_now_iso()
        outcome, progress = await self._tasks.run_tenant_task(
            STORAGE_UNMOUNT,
            spec.task_id,
            spec.allocation_id,
            lambda p: backend.unmount(spec, p),
            unexpected_error_type=HostErrorType.STORAGE_ERROR.value,
            new_work=False,
        )
        return StorageUnmountResult(
            task_id=spec.task_id,
            started_at=started_at,
            finished_at=utc_now_iso(),
            phases=progress.snapshot(),
            was_mounted=outcome.was_mounted,
        )
