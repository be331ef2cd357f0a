"""libvirt's QEMU driver for the tests that boot real guests (tests/test_qemu_guest.py).

`qemu_connection` (session scope) yields a `qemu:///system` connection. A libvirtd that already
answers there (the system's own, or one another test session started) is used as it is;
otherwise the fixture prepares what Debian's `libvirt-daemon-system` would (the `libvirt-qemu`
user and `kvm` group QEMU runs as, libvirt's log/state directories), starts `virtlogd -d` and
`libvirtd -d` itself, and stops them at the end of the last session using them. Several sessions
on one machine (CI beside developers) share the daemons: each registers its pid under
RUN_DIR/sessions while it runs, and only the last one out stops the daemons a test session
started, by their pids; a system daemon is never stopped.

Skips only where the hypervisor is not installed (bin/bootstrap installs it) or the session is
not root (libvirtd's system instance needs root; under GPUCLOUD_REQUIRE_ROOT=1 that skip fails).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

QEMU_URI = "qemu:///system"
RUN_DIR = Path("/run/gpucloud-test-libvirt")
_SESSIONS = RUN_DIR / "sessions"
_STARTED = RUN_DIR / "started"  # "<name> <pid>" per daemon a test session started
_DAEMON_START_S = 30.0
_BINARIES = ("qemu-system-x86_64", "libvirtd", "virtlogd")
# What Debian's libvirt-daemon-system creates and libvirtd's QEMU driver needs.
_DIRECTORIES = (
    "/var/log/libvirt/qemu",
    "/var/lib/libvirt/qemu",
    "/var/cache/libvirt/qemu",
    "/run/libvirt",
)


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt prints every failed call to stderr; the probes below fail on purpose."""


def qemu_unavailable() -> str | None:
    """Why real guests cannot run on this machine (None: they can)."""
    missing = [name for name in _BINARIES if shutil.which(name) is None]
    if missing:
        return f"QEMU/libvirt not installed ({', '.join(missing)} missing; bin/bootstrap installs)"
    if os.geteuid() != 0:
        return "libvirtd's qemu:///system instance needs root"
    return None


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with (RUN_DIR / "lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaps, as in a container whose pid 1 does not, is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _live_sessions() -> list[int]:
    live = []
    for entry in _SESSIONS.glob("*") if _SESSIONS.is_dir() else ():
        pid = int(entry.name) if entry.name.isdigit() else 0
        if pid and _alive(pid):
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)  # a session that died without its teardown
    return live


def _try_open() -> Any | None:
    libvirt.registerErrorHandler(_quiet, None)
    try:
        return libvirt.open(QEMU_URI)
    except libvirt.libvirtError:
        return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=60)


def _prepare_host() -> None:
    """The user, group and directories libvirt-daemon-system would have made."""
    # Debian's libvirtd runs QEMU as libvirt-qemu:libvirt-qemu unless qemu.conf (which comes
    # with libvirt-daemon-system) says otherwise; kvm owns /dev/kvm.
    for group in ("kvm", "libvirt-qemu"):
        if subprocess.run(["getent", "group", group], capture_output=True).returncode != 0:
            _run("groupadd", "--system", group)
    if subprocess.run(["id", "libvirt-qemu"], capture_output=True).returncode != 0:
        _run(
            "useradd", "--system", "--gid", "kvm", "--groups", "libvirt-qemu", "--no-create-home",
            "--home-dir", "/var/lib/libvirt", "--shell", "/usr/sbin/nologin", "libvirt-qemu",
        )  # fmt: skip
    for directory in _DIRECTORIES:
        Path(directory).mkdir(parents=True, exist_ok=True)


def _daemon_pid(pidfile: Path, name: str) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return pid if comm == name else None


def _start_daemons() -> list[tuple[str, int]]:
    """Start virtlogd (unless running) and libvirtd; answer what was started."""
    started = []
    for name, pidfile in (("virtlogd", "/run/virtlogd.pid"), ("libvirtd", "/run/libvirtd.pid")):
        if _daemon_pid(Path(pidfile), name) is not None:
            continue
        # -d: a daemon of its own (not a child of this session), with its default pid file.
        _run(name, "-d")
        deadline = time.monotonic() + _DAEMON_START_S
        while (pid := _daemon_pid(Path(pidfile), name)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} -d wrote no pid file within {_DAEMON_START_S:g}s")
            time.sleep(0.1)
        started.append((name, pid))
    return started


def _stop(name: str, pid: int) -> None:
    if _daemon_pid(Path(f"/run/{name}.pid"), name) != pid:
        return  # gone already, or the pid is someone else's now
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _ensure_daemons() -> None:
    if (conn := _try_open()) is not None:
        conn.close()
        return
    _prepare_host()
    started = _start_daemons()
    if started:
        with _STARTED.open("a") as handle:
            handle.writelines(f"{name} {pid}\n" for name, pid in started)


@pytest.fixture(scope="session")
def qemu_connection() -> Iterator[Any]:
    """An open `qemu:///system` connection (libvirt's QEMU driver)."""
    reason = qemu_unavailable()
    if reason is not None:
        pytest.skip(reason)
    me = _SESSIONS / str(os.getpid())
    with _machine_lock():
        _SESSIONS.mkdir(parents=True, exist_ok=True)
        me.touch()
        _ensure_daemons()
    deadline = time.monotonic() + _DAEMON_START_S
    while (conn := _try_open()) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"libvirtd did not answer on {QEMU_URI}")
        time.sleep(0.2)
    try:
        yield conn
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()
        with _machine_lock():
            me.unlink(missing_ok=True)
            if not _live_sessions() and _STARTED.exists():
                # libvirtd first: it holds virtlogd's connection for its guests' logs.
                lines = _STARTED.read_text().split("\n")
                daemons = [line.split() for line in lines if line.strip()]
                for name, pid in sorted(daemons, key=lambda d: d[0] != "libvirtd"):
                    _stop(name, int(pid))
                _STARTED.unlink()
