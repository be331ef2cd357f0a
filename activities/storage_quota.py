"""A namespace's quota enforced by the export's filesystem, and its usage read from that
filesystem's own accounting (issue 37 item 3): btrfs quota groups.

Each namespace is a btrfs subvolume; btrfs keeps a quota group (qgroup 0/<subvolume id>) per
subvolume whose `referenced` bytes it updates at every transaction commit, and refuses a write
that would take them past the group's `max_referenced` with EDQUOT, for every writer (root and
NFS clients of an exported btrfs alike). Usage is then one read of
/sys/fs/btrfs/<fsid>/qgroups/0_<id>/referenced: no tree walk, whatever the namespace holds.

Why btrfs and not ext4/XFS project quotas: the kernel the control plane and CI run on is built
without CONFIG_QFMT_V2 (ext4 refuses to mount a filesystem with the quota feature) and without
CONFIG_XFS_QUOTA, so project quotas cannot be enforced, or tested, there; btrfs qgroups can.
The qgroup id is the subvolume's, which btrfs picks: the namespace's gid stays its number for
access, the qgroup its number for space.

Everything goes through ioctls and sysfs (no btrfs-progs on the worker). Setting up the export
needs btrfs-progs once: `mkfs.btrfs`, then `btrfs quota enable <mount point>`.
Accounting lags writes by up to one commit interval (30 s by default, mount option `commit=`);
enforcement does not.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

SYSFS_BTRFS = Path("/sys/fs/btrfs")
# Every subvolume's root directory has this inode number (BTRFS_FIRST_FREE_OBJECTID).
SUBVOLUME_ROOT_INODE = 256

_IOC_WRITE, _IOC_READ = 1, 2
_BTRFS_IOCTL_MAGIC = 0x94


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_BTRFS_IOCTL_MAGIC << 8) | number


# <linux/btrfs.h>
_VOL_ARGS_SIZE = 4096  # struct btrfs_ioctl_vol_args: __s64 fd; char name[4088]
_INO_LOOKUP_SIZE = 4096  # struct btrfs_ioctl_ino_lookup_args: __u64 treeid, objectid; name[4080]
_FS_INFO_SIZE = 1024  # struct btrfs_ioctl_fs_info_args: fsid at offset 16
_QGROUP_LIMIT_SIZE = 48  # struct btrfs_ioctl_qgroup_limit_args: qgroupid, then btrfs_qgroup_limit
BTRFS_IOC_SUBVOL_CREATE = _ioc(_IOC_WRITE, 14, _VOL_ARGS_SIZE)
BTRFS_IOC_INO_LOOKUP = _ioc(_IOC_READ | _IOC_WRITE, 18, _INO_LOOKUP_SIZE)
BTRFS_IOC_FS_INFO = _ioc(_IOC_READ, 31, _FS_INFO_SIZE)
BTRFS_IOC_QGROUP_LIMIT = _ioc(_IOC_READ, 43, _QGROUP_LIMIT_SIZE)
BTRFS_QGROUP_LIMIT_MAX_RFER = 1 << 0


@dataclass(frozen=True)
class QuotaGroup:
    """A namespace's quota group: where its accounting lives in sysfs."""

    fsid: str
    subvolume_id: int

    @property
    def sysfs(self) -> Path:
        return SYSFS_BTRFS / self.fsid / "qgroups" / f"0_{self.subvolume_id}"

    def referenced_bytes(self) -> int:
        """The bytes the subvolume references, as of the last commit."""
        return int((self.sysfs / "referenced").read_text())

    def limit_bytes(self) -> int | None:
        """Its max_referenced (None: no limit)."""
        text = (self.sysfs / "max_referenced").read_text().strip()
        value = int(text)
        return None if value in (0, 2**64 - 1) else value


def _ioctl(path: Path, request: int, buffer: bytearray) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, request, buffer)
    finally:
        os.close(fd)


def btrfs_fsid(path: Path) -> str | None:
    """The btrfs filesystem `path` is on (its sysfs name), or None if it is not btrfs."""
    buffer = bytearray(_FS_INFO_SIZE)
    try:
        _ioctl(path, BTRFS_IOC_FS_INFO, buffer)
    except OSError as err:
        if err.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    return str(uuid.UUID(bytes=bytes(buffer[16:32])))


def quota_unavailable_reason(root: Path) -> str | None:
    """Why the export at `root` cannot enforce namespace quotas (None: it can): not btrfs, or
    btrfs with quotas not enabled, or its accounting inconsistent (a rescan is running or
    needed; its figures are not to be trusted until it is done)."""
    fsid = btrfs_fsid(root)
    if fsid is None:
        return "the export is not a btrfs filesystem (no filesystem quota)"
    qgroups = SYSFS_BTRFS / fsid / "qgroups"
    if not qgroups.is_dir():
        return f"btrfs quotas are not enabled on the export (btrfs quota enable {root})"
    inconsistent = qgroups / "inconsistent"
    if inconsistent.exists() and inconsistent.read_text().strip() == "1":
        return "the export's btrfs quota accounting is inconsistent (btrfs quota rescan)"
    return None


def is_subvolume(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and path.stat().st_ino == SUBVOLUME_ROOT_INODE


def create_subvolume(parent: Path, name: str) -> None:
    """`parent/name` as a new subvolume; one already there (any directory) raises
    FileExistsError, as mkdir does."""
    encoded = name.encode()
    if len(encoded) >= _VOL_ARGS_SIZE - 8 or "/" in name:
        raise ValueError(f"not a subvolume name: {name!r}")
    buffer = bytearray(_VOL_ARGS_SIZE)
    buffer[8 : 8 + len(encoded)] = encoded
    _ioctl(parent, BTRFS_IOC_SUBVOL_CREATE, buffer)


def quota_group(path: Path) -> QuotaGroup:
    """The quota group of the subvolume whose root is `path`."""
    fsid = btrfs_fsid(path)
    if fsid is None:
        raise OSError(errno.ENOTSUP, f"{path} is not on btrfs")
    buffer = bytearray(_INO_LOOKUP_SIZE)
    struct.pack_into("<QQ", buffer, 0, 0, SUBVOLUME_ROOT_INODE)
    _ioctl(path, BTRFS_IOC_INO_LOOKUP, buffer)
    (tree_id,) = struct.unpack_from("<Q", buffer, 0)
    return QuotaGroup(fsid, tree_id)


def set_limit(path: Path, limit_bytes: int) -> None:
    """The subvolume at `path` may reference at most `limit_bytes` (data and its metadata)."""
    buffer = bytearray(_QGROUP_LIMIT_SIZE)
    # qgroupid 0: the subvolume of the descriptor; then flags, max_rfer, max_excl, rsv_*.
    struct.pack_into("<QQQQQQ", buffer, 0, 0, BTRFS_QGROUP_LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)
    _ioctl(path, BTRFS_IOC_QGROUP_LIMIT, buffer)
