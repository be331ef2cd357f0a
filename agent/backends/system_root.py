"""`SystemRoot`: a directory that stands for "/" while the agent edits account files.

In production the root is "/" itself; in tests it is a temporary tree, so no test ever touches
the CI machine's own users. Everything that writes here:

- resolves paths strictly below the root (an absolute path is re-rooted, ".." is refused);
- opens each directory with O_NOFOLLOW relative to its parent's descriptor, so a symlink planted
  by a tenant in its home (say `.ssh -> /etc`) is never followed by this root-privileged code;
- writes files atomically: a temporary file in the same directory, fchmod/fchown, fsync, then
  rename over the target, so a crash leaves the old or the new file, never half of one.

The account databases (etc/passwd, etc/group, etc/shadow, etc/gshadow) are edited under the same
lock shadow-utils takes (a POSIX lock on `etc/.pwd.lock`, like lckpwdf), plus a process-wide
lock (POSIX locks do not exclude threads of one process).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# One lock per process, whatever the root: the agent runs host tasks on a thread pool.
_PROCESS_LOCK = threading.RLock()


class UnsafePath(OSError):
    """A path component below the root is a symlink or not a directory where one is needed."""


class SystemRoot:
    """A directory standing for "/". `apply_ownership`: chown what is written (default: when
    running as root; a non-root test run still gets every mode right)."""

    def __init__(self, path: Path | str, *, apply_ownership: bool | None = None) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise FileNotFoundError(f"system root {self.path} is not a directory")
        self.apply_ownership = os.geteuid() == 0 if apply_ownership is None else apply_ownership

    def __repr__(self) -> str:
        return f"SystemRoot({str(self.path)!r})"

    @property
    def is_real_root(self) -> bool:
        """This machine's own "/": the only root where processes, services and the GPU driver
        the agent reaches (signals, systemctl, NVML) belong to the host it serves."""
        return self.path == Path("/")

    # ------------------------------------------------------------------ paths

    @staticmethod
    def parts(absolute: str) -> tuple[str, ...]:
        """ "/home/alice/.ssh" -> ("home", "alice", ".ssh"); refuses "..", "." and empty parts."""
        parts = PurePosixPath("/", absolute).parts[1:]
        for part in parts:
            if part in ("..", ".", ""):
                raise ValueError(f"path {absolute!r} leaves or re-enters the system root")
        return tuple(parts)

    def host_path(self, absolute: str) -> Path:
        """Where "/etc/passwd" lies on this machine (for reading and for tests)."""
        return self.path.joinpath(*self.parts(absolute))

    @contextlib.contextmanager
    def open_dir(self, absolute: str) -> Iterator[int]:
        """A descriptor for a directory below the root, no component followed if a symlink."""
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            for part in self.parts(absolute):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as err:
                    if err.errno in (20, 40):  # ENOTDIR, ELOOP: not a real directory
                        raise UnsafePath(f"{absolute}: {part} is not a directory") from None
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def account_lock(self) -> Iterator[None]:
        """Exclusive access to the account databases (passwd, group, shadow, gshadow)."""
        with _PROCESS_LOCK, self.open_dir("/etc") as etc:
            fd = os.open(".pwd.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=etc)
            try:
                # A POSIX record lock, as lckpwdf(3) takes, so useradd & co. and we serialise.
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock

    # ------------------------------------------------------------------ files

    def read_text(self, absolute: str) -> str | None:
        """A file's text, or None when it does not exist."""
        parent, name = self._split(absolute)
        with self.open_dir(parent) as dir_fd:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                return None
            with os.fdopen(fd, encoding="utf-8") as f:
                return f.read()

    def write_atomic(
        self,
        absolute: str,
        data: str,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        """Replace a file atomically. `mode`/`uid`/`gid` of None keep the existing file's (or
        0644 root:root for a new one)."""
        parent, name = self._split(absolute)
        with self.open_dir(parent) as dir_fd:
            try:
                current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                current = None
            if current is not None and not stat.S_ISREG(current.st_mode):
                # A symlink or anything else in its place: replaced, never written through.
                current = None
            final_mode = (
                mode
                if mode is not None
                else (stat.S_IMODE(current.st_mode) if current is not None else 0o644)
            )
            final_uid = uid if uid is not None else (current.st_uid if current else 0)
            final_gid = gid if gid is not None else (current.st_gid if current else 0)
            tmp = f".{name}.gpucloud-{os.getpid()}-{threading.get_ident()}.tmp"
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                try:
                    os.write(fd, data.encode("utf-8"))
                    if self.apply_ownership:
                        os.fchown(fd, final_uid, final_gid)
                    os.fchmod(fd, final_mode)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.fsync(dir_fd)

    def remove_file(self, absolute: str) -> bool:
        """Unlink a file (or a symlink: never its target); False when it was not there."""
        parent, name = self._split(absolute)
        try:
            with self.open_dir(parent) as dir_fd:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True

    def ensure_dir(
        self, absolute: str, *, mode: int, uid: int | None = None, gid: int | None = None
    ) -> None:
        """Make a directory (parents must exist) with this mode and owner; a symlink or a file in
        its place is removed first. An existing directory gets its mode and owner corrected."""
        parent, name = self._split(absolute)
        with self.open_dir(parent) as dir_fd:
            try:
                current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                current = None
            if current is not None and not stat.S_ISDIR(current.st_mode):
                os.unlink(name, dir_fd=dir_fd)
                current = None
            if current is None:
                os.mkdir(name, 0o700, dir_fd=dir_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                if self.apply_ownership and uid is not None and gid is not None:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def remove_tree(self, absolute: str) -> bool:
        """Remove a directory tree (a symlink in its place is unlinked, its target untouched);
        False when nothing was there. Uses the fd-based rmtree, which never follows symlinks."""
        parent, name = self._split(absolute)
        try:
            with self.open_dir(parent) as dir_fd:
                current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISDIR(current.st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                    return True
        except FileNotFoundError:
            return False
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux always has it
            raise UnsafePath("this platform's rmtree can follow symlinks")
        shutil.rmtree(self.host_path(absolute))
        return True

    def _split(self, absolute: str) -> tuple[str, str]:
        parts = self.parts(absolute)
        if not parts:
            raise ValueError("the system root itself is not a file")
        return "/" + "/".join(parts[:-1]), parts[-1]
