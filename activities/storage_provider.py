"""Storage providers (docs/lifecycles/storage-attachment.md): where a namespace's data lives and how
a node is granted access to it. The control plane's storage activities (activities/storage.py) call
a provider; the node's agent mounts what it was granted (agent/storage_mounts.py).

`SharedDirectoryProvider` is the one provider: a directory per namespace on a filesystem that
the control-plane worker and every node see at the same place (a cluster filesystem or an NFS
export mounted on each; in the embedded stack and the tests, a directory on the one machine).
Its tree under the root:

    namespaces/                                0o700: no one but the provider and the nodes'
                                               agents (root) lists or enters it
    namespaces/<namespace id>/                 the namespace's data: owner root, group the
                                               namespace's own gid, 0o2770 (no world access;
                                               setgid, so everything made in it keeps that
                                               group) and a default ACL giving the group rwx
                                               on everything made in it, whatever the
                                               writer's umask
    grants/                                    0o700, likewise
    grants/<namespace id>/<attachment id>.json {"node_id", "mode"}: what the node's agent checks
                                               before it mounts (and the mode it mounts with)
    gids/                                      0o700, likewise
    gids/<gid>                                 the namespace id that holds the gid (claimed
                                               with O_EXCL, so two namespaces never share one)

Isolation (issue 36 item 4): a tenant on a node reaches a namespace only through the bind mount
its agent made for an attachment (agent/storage_mounts.py), never by walking the export: a
non-root user cannot list `namespaces/` or `grants/`, nor enter another project's namespace even
knowing its id. Each namespace has a gid of its own, from NAMESPACE_GID_MIN..MAX (fleet-wide:
it lives on the shared filesystem, so every node reads the same one); while an attachment is
mounted on a bare-metal node, the agent makes the allocation's tenant account a member of that
gid's group (agent/backends/baremetal_users.py), and takes it out at the unmount. Files keep the
writer's node-local uid; access goes by the group, so another allocation of the same project,
on another node and with another uid, reads and writes them too. Single-writer against
multi-writer is not the group's business: the control plane lets one attachment write and the
agent mounts the others read-only. Not done yet: mounting only the attached namespaces on a
node instead of the whole export (a root tenant, e.g. with `grant_sudo`, still reaches the
export root on its node; see docs/storage.md).

A provider that may not chown (not root on the export) keeps the directories' group as it is
and says so in the log: the namespaces work, but only root on a node writes them.

Quota (activities/storage_quota.py): on an export that is btrfs with quotas enabled, each
namespace is a subvolume whose quota group's limit is its quota_bytes, so the filesystem refuses
(EDQUOT) any write past it, whoever writes, mounted or not; its usage is the group's accounting,
read in O(1), never a tree walk. Anywhere else (another filesystem, quotas not enabled, a
namespace made as a plain directory by an older build) the provider says so in its log and keeps
the accounting it had: bytes allocated under the namespace (st_blocks, hard links once, a tree
walk) compared with quota_bytes at the attach precheck, which lets a namespace at or over quota
take read_only attachments only but does not stop a writer already mounted.
`capabilities.hard_quota` tells which.
Capabilities: multi_writer (a shared filesystem takes concurrent writers; coordinating them is
the workload's business), so the namespace's policy decides.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from activities.storage_quota import (
    QuotaGroup,
    create_subvolume,
    is_subvolume,
    quota_group,
    quota_unavailable_reason,
    set_limit,
)
from contracts.storage import NAMESPACE_GID_MAX, NAMESPACE_GID_MIN, PROVIDER_SHARED_DIRECTORY

logger = logging.getLogger("activities.storage_provider")

STORAGE_ROOT_ENV = "GPUCLOUD_STORAGE_ROOT"
# A delete removes this many entries (files, directories) per chunk; the caller heartbeats
# between chunks.
DELETE_CHUNK_ENTRIES = 1000
DEFAULT_STORAGE_ROOT = "/srv/gpucloud-storage"

# A POSIX default ACL as the kernel takes it (the system.posix_acl_default xattr): version 2,
# then (tag, permissions, id) entries in tag order. Owner and group rwx, others nothing: new files
# get the group's access from the mode they are made with, not from the writer's umask.
_ACL_XATTR = "system.posix_acl_default"
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_ACL_USER_OBJ, _ACL_GROUP_OBJ, _ACL_OTHER = 0x01, 0x04, 0x20
_NAMESPACE_DEFAULT_ACL = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perms, _ACL_UNDEFINED_ID)
    for tag, perms in ((_ACL_USER_OBJ, 0o7), (_ACL_GROUP_OBJ, 0o7), (_ACL_OTHER, 0))
)


@dataclass(frozen=True)
class ProviderCapabilities:
    multi_writer: bool
    # Whether writes beyond the quota are stopped by the storage itself (False: accounting only).
    hard_quota: bool


class StorageProvider(Protocol):
    """Blocking calls; each is idempotent. `key` is the namespace id."""

    kind: str

    @property
    def capabilities(self) -> ProviderCapabilities: ...

    def create(self, key: str, quota_bytes: int | None = None) -> None:
        """Make the namespace (idempotent); with `quota_bytes`, its limit where the storage
        enforces one."""
        ...

    def delete(self, key: str) -> None:
        """Delete the namespace's data: only ever for a namespace deleted by its owner."""
        ...

    def delete_chunk(self, key: str, max_entries: int) -> tuple[int, bool]:
        """Remove at most `max_entries` entries of the namespace's data; answers how many it
        removed and whether the namespace is gone (data, grants and all). Bounded, so a caller
        heartbeats between chunks and a cancelled caller leaves at most one chunk running."""
        ...

    def usage_bytes(self, key: str) -> int: ...

    def grant(self, key: str, attachment_id: str, node_id: str, mode: str) -> None: ...

    def revoke(self, key: str, attachment_id: str) -> None: ...


class SharedDirectoryProvider:
    kind = PROVIDER_SHARED_DIRECTORY

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SharedDirectoryProvider:
        source = os.environ if env is None else env
        return cls(source.get(STORAGE_ROOT_ENV) or DEFAULT_STORAGE_ROOT)

    @property
    def capabilities(self) -> ProviderCapabilities:
        return ProviderCapabilities(
            multi_writer=True, hard_quota=self.quota_unavailable_reason() is None
        )

    def quota_unavailable_reason(self) -> str | None:
        """Why this export's filesystem does not enforce namespace quotas (None: it does).
        Asked each time: the export may be mounted, or its quotas enabled, after start."""
        self.root.mkdir(parents=True, exist_ok=True)
        return quota_unavailable_reason(self.root)

    def namespace_dir(self, key: str) -> Path:
        return self.root / "namespaces" / key

    def _grants_dir(self, key: str) -> Path:
        return self.root / "grants" / key

    def _private_dir(self, name: str) -> None:
        """`namespaces/` or `grants/` with no access for anyone but its owner (the provider) and
        root (the nodes' agents): made so, or made so again (an older build left 0o755)."""
        directory = self.root / name
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    def _gid_claim(self, gid: int) -> Path:
        return self.root / "gids" / str(gid)

    def create(self, key: str, quota_bytes: int | None = None) -> None:
        """The namespace's directory with its own group; on a quota-enforcing export a
        subvolume limited to `quota_bytes` (set again on every call: idempotent)."""
        self._private_dir("namespaces")
        path = self.namespace_dir(key)
        unenforced = self.quota_unavailable_reason()
        if unenforced is None:
            with contextlib.suppress(FileExistsError):
                create_subvolume(path.parent, key)
        else:
            path.mkdir(mode=0o700, exist_ok=True)
        self._own_group(key)
        if quota_bytes is None:
            return
        if unenforced is None and is_subvolume(path):
            set_limit(path, quota_bytes)
            return
        logger.warning(
            "namespace %s: quota of %d bytes not enforced by the filesystem (%s); checked "
            "against the provider's accounting at attach only",
            key,
            quota_bytes,
            unenforced or "made as a plain directory by an older build, not a subvolume",
        )

    def quota_group(self, key: str) -> QuotaGroup | None:
        """The namespace's quota group, where the filesystem enforces its quota (else None)."""
        path = self.namespace_dir(key)
        if not is_subvolume(path) or self.quota_unavailable_reason() is not None:
            return None
        return quota_group(path)

    def delete(self, key: str) -> None:
        while not self.delete_chunk(key, DELETE_CHUNK_ENTRIES)[1]:
            pass

    def delete_chunk(self, key: str, max_entries: int) -> tuple[int, bool]:
        """The data first, bottom-up, `max_entries` unlinks or rmdirs at a time; once its
        directory is gone, the grants and then the gid (a retried delete finds the claim by
        probing, see _claimed_gid). Safe beside another call on the same key (an earlier attempt
        still finishing its chunk): what the other removed is skipped. Raises what the
        filesystem refuses (an immutable file, a mount inside the namespace): the namespace is
        then not gone, and the caller tries again later."""
        top = self.namespace_dir(key)
        removed = 0
        if top.is_symlink():
            top.unlink(missing_ok=True)
            removed += 1
        elif top.exists():
            removed += _remove_bottom_up(top, max_entries)
        if os.path.lexists(top):
            return removed, False
        grants = self._grants_dir(key)
        if os.path.lexists(grants):
            if grants.is_symlink():
                grants.unlink(missing_ok=True)
            else:
                with contextlib.suppress(FileNotFoundError):  # removed beside us
                    shutil.rmtree(grants)
            if os.path.lexists(grants):
                return removed, False
        gid = self._claimed_gid(key)
        if gid is not None:
            self._gid_claim(gid).unlink(missing_ok=True)
        return removed, True

    # ------------------------------------------------------------------ the namespace's group

    def namespace_gid(self, key: str) -> int | None:
        """The namespace's own gid, if it has one (None: the provider could not set it)."""
        gid = self.namespace_dir(key).stat().st_gid
        return gid if self._claim_holder(gid) == key else None

    def _own_group(self, key: str) -> None:
        """Make the namespace directory root:<its gid> 0o2770 with the group's default ACL, or
        make it so again (idempotent; a namespace of an older build gets its gid here, at its
        next create or grant). Only what differs is written: a namespace at its filesystem
        quota refuses even an xattr write (EDQUOT), and its grants (read_only ones included)
        must still go through."""
        path = self.namespace_dir(key)
        gid = self.namespace_gid(key) or self._claim_gid(key)
        if path.stat().st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except PermissionError:
                logger.warning(
                    "namespace %s: the provider may not chown in the export; only root on a "
                    "node can write it",
                    key,
                )
        # After the chown (which may clear set-id bits): no world access, setgid.
        if path.stat().st_mode & 0o7777 != 0o2770:
            os.chmod(path, 0o2770)  # noqa: S103
        try:
            if _current_acl(path) != _NAMESPACE_DEFAULT_ACL:
                os.setxattr(path, _ACL_XATTR, _NAMESPACE_DEFAULT_ACL)
        except OSError as err:
            if err.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            logger.warning(
                "namespace %s: the export takes no POSIX ACLs; files follow the writer's umask",
                key,
            )

    def _claim_holder(self, gid: int) -> str | None:
        if not NAMESPACE_GID_MIN <= gid <= NAMESPACE_GID_MAX:
            return None
        try:
            return self._gid_claim(gid).read_text().strip()
        except FileNotFoundError:
            return None

    @staticmethod
    def _probe(key: str) -> Iterator[int]:
        """The gids to try for `key`, in order: from a start its id picks, round the range."""
        span = NAMESPACE_GID_MAX - NAMESPACE_GID_MIN + 1
        start = uuid.UUID(key).int % span if _is_uuid(key) else 0
        return (NAMESPACE_GID_MIN + (start + step) % span for step in range(span))

    def _claim_gid(self, key: str) -> int:
        """A gid no other namespace holds: the first free one along the key's probe (or one an
        interrupted earlier call claimed for it), claimed by creating its file exclusively, which
        a shared filesystem (NFS included) does atomically."""
        self._private_dir("gids")
        for gid in self._probe(key):
            claim = self._gid_claim(gid)
            try:
                fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if self._claim_holder(gid) == key:
                    return gid
                continue
            with os.fdopen(fd, "w") as out:
                out.write(key)
            return gid
        raise OSError(errno.ENOSPC, "no namespace gid left in the storage export")

    def _claimed_gid(self, key: str) -> int | None:
        """The gid `key` holds: its directory's, or (the directory gone: a retried delete) the
        one along its probe."""
        if self.namespace_dir(key).is_dir():
            return self.namespace_gid(key)
        for gid in self._probe(key):
            holder = self._claim_holder(gid)
            if holder == key:
                return gid
            if holder is None:
                return None
        return None

    def usage_bytes(self, key: str) -> int:
        """The namespace's bytes: its quota group's (data and metadata, as of the filesystem's
        last commit; O(1)) where the filesystem enforces its quota, else allocated under its
        directory, walked. A directory that is not there (the export not mounted on this worker,
        or removed under us) raises: a walk alone would answer 0, and the precheck would take an
        unmeasured namespace for an empty one."""
        top = self.namespace_dir(key)
        if not top.is_dir():
            raise FileNotFoundError(f"namespace {key} is not a directory in the storage export")
        group = self.quota_group(key)
        if group is not None:
            return group.referenced_bytes()
        return walked_usage_bytes(top)

    def grant(self, key: str, attachment_id: str, node_id: str, mode: str) -> None:
        if self.namespace_dir(key).is_dir():
            # Its group made so again (a namespace of an older build gets one here); one that is
            # missing is the node's mount to refuse, as before.
            self._own_group(key)
        self._private_dir("grants")
        directory = self._grants_dir(key)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{attachment_id}.json"
        temporary = directory / f".{attachment_id}.json.tmp"
        temporary.write_text(json.dumps({"node_id": node_id, "mode": mode}))
        os.replace(temporary, target)

    def revoke(self, key: str, attachment_id: str) -> None:
        (self._grants_dir(key) / f"{attachment_id}.json").unlink(missing_ok=True)


def _current_acl(path: Path) -> bytes | None:
    try:
        return os.getxattr(path, _ACL_XATTR)
    except OSError as err:
        if err.errno == errno.ENODATA:
            return None
        raise


def walked_usage_bytes(top: Path) -> int:
    """Bytes allocated under `top` (st_blocks, hard links once): a walk of the whole tree, for
    an export whose filesystem keeps no account per namespace."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def unreadable(err: OSError) -> None:
        raise err

    for directory, dirs, files in os.walk(top, onerror=unreadable):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(directory, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _remove_bottom_up(top: Path, budget: int) -> int:
    """Unlink files and remove emptied directories under `top` (and `top` itself last), at most
    `budget` of them: depth first, never following a symlink, reading each directory lazily (a
    directory of millions of entries is not listed whole). Answers how many it removed. An
    entry the filesystem refuses is stepped over, so everything else still goes; once nothing
    else is left, the first refusal is raised (the caller tries again later)."""
    removed = 0
    refused: dict[str, OSError] = {}
    stack = [os.fspath(top)]
    while stack and removed < budget:
        directory = stack[-1]
        descended = False
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.path in refused:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                        descended = True
                        break
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    except OSError as err:
                        refused[entry.path] = err
                        continue
                    removed += 1
                    if removed >= budget:
                        return removed
        except FileNotFoundError:
            stack.pop()
            continue
        except OSError as err:  # not listable
            refused[directory] = err
            stack.pop()
            continue
        if descended:
            continue
        try:
            os.rmdir(directory)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as err:  # not empty: something in it was refused
            refused.setdefault(directory, err)
        stack.pop()
    if refused and not stack:
        path, first = next(iter(refused.items()))
        raise OSError(
            first.errno,
            f"{len(refused)} entries of the namespace could not be removed; first {path}: "
            f"{first.strerror}",
        )
    return removed


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
