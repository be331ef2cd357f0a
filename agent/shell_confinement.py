"""Confinement of the simulated hosts' terminal shells (issue 36 §6).

A simulated machine (the demo fleet, `--hosts libvirt-test`, the terminal tests) is a directory on
the computer that runs the stack, and its agent runs as that computer's user: root in CI. A
tenant's shell started as-is would be that user, able to read the stack's state (the admin token
in .state/tokens.json, the database's files), every other simulated machine and the agent's own
process. So the shell runs confined instead:

- new mount, PID, IPC, UTS and network namespaces (util-linux `unshare`); as a normal user, a
  user namespace first, so the namespaces need no privilege;
- a minimal root: an empty tmpfs with read-only, nosuid binds of /usr, /bin, /sbin, /lib*, /etc
  (its account files replaced by the tenant's own), a private /tmp, /dev with only the harmless
  device nodes and a private devpts, a fresh /proc of the new PID namespace, and the tenant's
  home (its directory under the simulated machine's root) at /home/<user>, the only writable
  place that outlives the session. The computer's own root is detached: the repository, the
  stack's state directory and other machines' directories are not in the shell's world;
- the network namespace has only its loopback: the stack's services on this computer's
  loopback (Temporal, PostgreSQL, the MAAS and Vault simulators) are out of reach;
- an unprivileged user: as root, a dedicated uid per home (DEDICATED_UID_BASE and up, never a
  uid of this computer's accounts), then a user namespace where it reads as the account's uid;
  as a normal user, a nested user namespace where that user reads as the account's uid. Either
  way no capability survives the exec, no_new_privs is set (setuid binaries do not elevate), and
  the shell dies with the `unshare` the agent watches (PR_SET_PDEATHSIG).

`confined_launch` is what the launchers call; it probes once per process that the whole setup
works here (`unshare` present, namespaces allowed) and raises ConfinementUnavailable otherwise:
the open then fails with CONFINEMENT_UNAVAILABLE, never falls back to an unconfined shell.

Run as a script (`python -I -S shell_confinement.py SPEC`), this file is the setup that runs as
PID 1 of the new namespaces and execs the shell. It imports nothing but the standard library, and
everything before the pivot.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONFINEMENT_UNAVAILABLE = "shell_confinement_unavailable"
# Exit status of a setup that could not confine the shell (the shell never ran).
SETUP_FAILED_STATUS = 125
# As root, the shell's real uid: DEDICATED_UID_BASE + a hash of the home, far above any
# account of this computer (useradd stops at 60000; subordinate ids start at 100000).
DEDICATED_UID_BASE = 1_500_000_000
DEDICATED_UID_SPAN = 100_000_000
PROBE_TIMEOUT_SECONDS = 20.0
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Configuration of this computer's own gpucloud processes (an agent's or a stack's).
ALWAYS_HIDDEN = ("/etc/gpucloud",)
USERNAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
SHELL_PATH = "/usr/local/bin:/usr/bin:/bin"

# <linux/mount.h>, <linux/sched.h>, <linux/prctl.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
# pivot_root(2) has no libc wrapper: its syscall number per architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


class ConfinementUnavailable(Exception):
    """The shell cannot be confined on this computer; `code` is the open's failure type."""

    code = CONFINEMENT_UNAVAILABLE


@dataclass(frozen=True)
class ShellSpec:
    """One confined shell. `home`: the tenant's home on this computer (created if missing);
    `uid`/`gid`: what the tenant reads as inside; `env`: the shell's whole environment (HOME
    and PWD are set to the home inside)."""

    home: str
    username: str
    uid: int
    gid: int
    hostname: str
    executable: str
    argv0: str
    env: dict[str, str] = field(repr=False)
    hidden: tuple[str, ...] = ()
    probe: bool = False

    @property
    def home_inside(self) -> str:
        return f"/home/{self.username}"


@dataclass(frozen=True)
class Launch:
    """The program the agent starts on the PTY (`unshare`), with its own environment."""

    executable: str
    argv: tuple[str, ...]
    env: dict[str, str]


def real_root() -> bool:
    """Root of the computer itself (not root of a user namespace, as in a rootless container)."""
    if os.geteuid() != 0:
        return False
    try:
        mapping = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return False
    return mapping == ["0", "0", "4294967295"]


def dedicated_uid(home: str) -> int:
    """The real uid a root agent gives the shell of `home`: stable per home, so the files a
    tenant leaves there are its own at the next session."""
    return DEDICATED_UID_BASE + zlib.crc32(home.encode()) % DEDICATED_UID_SPAN


def _default_hidden() -> tuple[str, ...]:
    """This code's own checkout, the agent's working directory and its Python environment: not
    in the shell's world anyway, unless they lie under a system directory the shell sees."""
    own = [Path(__file__).parents[1], Path.cwd(), Path(sys.prefix)]
    return tuple(dict.fromkeys([*(str(p.resolve()) for p in own), *ALWAYS_HIDDEN]))


def _launch(spec: ShellSpec, unshare: str) -> Launch:
    namespaces = ["--mount", "--pid", "--ipc", "--uts", "--net", "--fork", "--kill-child"]
    if not real_root():
        namespaces = ["--user", "--map-root-user", *namespaces]
    payload = json.dumps(asdict(spec))
    return Launch(
        executable=unshare,
        argv=(unshare, *namespaces, "--", sys.executable, "-I", "-S", __file__, payload),
        env={"PATH": SHELL_PATH, "LANG": "C.UTF-8"},
    )


_probed: dict[tuple[int, str], str | None] = {}


def _probe(unshare: str) -> str | None:
    """Run the whole setup once with `exit 0` for a shell; None when it works, else why not."""
    key = (os.geteuid(), unshare)
    if key in _probed:
        return _probed[key]
    home = tempfile.mkdtemp(prefix="gpucloud-shell-probe-")
    try:
        spec = ShellSpec(
            hidden=_default_hidden(),
            home=home,
            username="probe",
            uid=1000,
            gid=1000,
            hostname="probe",
            executable="/bin/sh",
            argv0="sh",
            env={"PATH": SHELL_PATH},
            probe=True,
        )
        launch = _launch(spec, unshare)
        result = subprocess.run(
            launch.argv,
            executable=launch.executable,
            env=launch.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_SECONDS,
            check=False,
        )
        problem = None
        if result.returncode != 0:
            said = (result.stderr or result.stdout).decode(errors="replace").strip()
            problem = f"{said[-300:] or 'the setup failed'} (status {result.returncode})"
    except (OSError, subprocess.TimeoutExpired) as err:
        problem = f"the setup did not run: {err}"
    finally:
        shutil.rmtree(home, ignore_errors=True)
    _probed[key] = problem
    return problem


def confined_launch(spec: ShellSpec) -> Launch:
    """How to start `spec`'s shell confined; raises ConfinementUnavailable when this computer
    cannot (no `unshare`, namespaces refused: e.g. a container without CAP_SYS_ADMIN, or
    unprivileged user namespaces turned off)."""
    if not USERNAME.fullmatch(spec.username):
        raise ConfinementUnavailable(f"not a username for a confined home: {spec.username!r}")
    if spec.uid <= 0 or spec.gid <= 0:
        raise ConfinementUnavailable("a confined shell never runs as uid or gid 0")
    unshare = shutil.which("unshare", path=os.environ.get("PATH") or SHELL_PATH)
    if unshare is None:
        raise ConfinementUnavailable("util-linux `unshare` is not installed")
    problem = _probe(unshare)
    if problem is not None:
        raise ConfinementUnavailable(f"namespaces are not available here: {problem}")
    home = Path(spec.home)
    home.mkdir(parents=True, exist_ok=True)
    hidden = tuple(dict.fromkeys([*_default_hidden(), *spec.hidden]))
    return _launch(_replace_hidden(spec, hidden), unshare)


def _replace_hidden(spec: ShellSpec, hidden: tuple[str, ...]) -> ShellSpec:
    values = asdict(spec)
    values["hidden"] = hidden
    return ShellSpec(**values)


# ------------------------------------------------------------------- the setup (namespaces' PID 1)


class SetupError(Exception):
    pass


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _kept_flags(path: str) -> int:
    """A bind's remount keeps the source's flags that a user namespace may not drop."""
    mask = os.statvfs(path).f_flag
    kept = 0
    for st, ms in (
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if mask & st:
            kept |= ms
    if not mask & (os.ST_NOATIME | os.ST_RELATIME):
        kept |= MS_STRICTATIME
    return kept


def _bind(source: str, target: str, *, writable: bool) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | _kept_flags(target)
    _mount(None, target, None, flags | (0 if writable else MS_RDONLY))


def _tmpfs(target: str, options: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    _mount("tmpfs", target, "tmpfs", flags, options)


def _remount_readonly(target: str, flags: int) -> None:
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)


def _write(path: str, text: str) -> None:
    with open(path, "w") as out:
        out.write(text)


def _account_files(spec: ShellSpec, new_root: str) -> list[tuple[str, str]]:
    """passwd and group naming only the tenant (the computer's accounts stay unseen)."""
    passwd = (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"{spec.username}:x:{spec.uid}:{spec.gid}::{spec.home_inside}:{spec.executable}\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    group = f"root:x:0:\n{spec.username}:x:{spec.gid}:\nnogroup:x:65534:\n"
    files = []
    for name, text in (("passwd", passwd), ("group", group), ("hostname", spec.hostname + "\n")):
        staged = f"{new_root}/.{name}"
        _write(staged, text)
        files.append((staged, f"{new_root}/etc/{name}"))
    return files


def _build_root(spec: ShellSpec, home_fd: int, new_root: str) -> list[str]:
    """The shell's world under `new_root` (still seen from this computer's root); returns the
    staged files to remove once pivoted."""
    _tmpfs(new_root, "mode=0755,size=4m")
    for name in SYSTEM_DIRS:
        host = f"/{name}"
        target = f"{new_root}/{name}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), target)
        elif os.path.isdir(host):
            os.mkdir(target)
            _bind(host, target, writable=False)
    staged = []
    if os.path.isdir(f"{new_root}/etc"):
        for source, target in _account_files(spec, new_root):
            if os.path.isfile(target):
                _mount(source, target, None, MS_BIND)
            staged.append(source.removeprefix(new_root))
    home = f"{new_root}{spec.home_inside}"
    os.makedirs(home, mode=0o755)
    _bind(f"/proc/self/fd/{home_fd}", home, writable=True)
    # The shell's own /tmp (a fresh tmpfs), not this computer's.
    private_tmp = os.path.join(new_root, "tmp")
    os.mkdir(private_tmp, 0o1777)
    _tmpfs(private_tmp, "mode=1777,size=256m")
    os.makedirs(f"{new_root}/var")
    os.symlink("../tmp", os.path.join(new_root, "var", "tmp"))
    _build_dev(f"{new_root}/dev")
    os.mkdir(f"{new_root}/proc")
    # Before the old root goes: a user namespace may mount proc only where one is fully seen.
    _mount("proc", f"{new_root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return staged


def _build_dev(dev: str) -> None:
    os.mkdir(dev)
    _tmpfs(dev, "mode=0755,size=64k", MS_NOSUID | MS_NOEXEC)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _write(f"{dev}/{name}", "")
            _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    os.mkdir(f"{dev}/pts")
    # A private devpts: the computer's other terminals (other tenants' sessions) are not here.
    with contextlib.suppress(SetupError):
        _mount(
            "devpts",
            f"{dev}/pts",
            "devpts",
            MS_NOSUID | MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=0620",
        )
        os.symlink("pts/ptmx", f"{dev}/ptmx")
    os.mkdir(f"{dev}/shm", 0o1777)
    _tmpfs(f"{dev}/shm", "mode=1777,size=64m")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    _remount_readonly(dev, MS_NOSUID | MS_NOEXEC)


def _pivot(new_root: str) -> None:
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: unknown architecture {platform.machine()}")
    os.chdir(new_root)
    os.mkdir(".oldroot")
    _check(_libc.syscall(number, b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.oldroot", MNT_DETACH), "umount the old root")
    os.rmdir("/.oldroot")


def _hide(paths: tuple[str, ...]) -> None:
    """Whatever of `paths` the system directories still show (below them: a system directory
    itself, /usr as a virtualenv's prefix, stays): an empty directory or file."""
    for path in paths:
        inside = any(path.startswith(f"/{name}/") for name in SYSTEM_DIRS)
        if not inside or not os.path.lexists(path) or os.path.islink(path):
            continue
        if os.path.isdir(path):
            _tmpfs(path, "mode=0000,size=4k", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _remount_readonly(path, MS_NOSUID | MS_NODEV | MS_NOEXEC)
        else:
            _mount("/dev/null", path, None, MS_BIND)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _drop_privileges(spec: ShellSpec, as_real_root: bool) -> None:
    """Become the unprivileged user; the tenant's uid inside a user namespace of our own."""
    if as_real_root:
        dedicated = dedicated_uid(spec.home)
        os.setgroups([])
        os.setresgid(dedicated, dedicated, dedicated)
        os.setresuid(dedicated, dedicated, dedicated)
        # A uid change leaves the process undumpable, its /proc/self files root's: the id maps
        # below are written by the process itself.
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
    outer_uid, outer_gid = os.geteuid(), os.getegid()
    if _libc.unshare(CLONE_NEWUSER) == 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{spec.uid} {outer_uid} 1\n")
        _write("/proc/self/gid_map", f"{spec.gid} {outer_gid} 1\n")
    elif not as_real_root:
        # Root of our first user namespace is the computer's user with every capability there:
        # the shell never gets that.
        raise SetupError(f"nested user namespace: {os.strerror(ctypes.get_errno())}")
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SetupError("still uid 0 after dropping privileges")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # Credential changes clear the parent-death signal `unshare --kill-child` set: set it again.
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")


def setup(spec: ShellSpec) -> None:
    """Build the namespaces' world, become unprivileged and exec the shell (never returns)."""
    as_real_root = real_root()
    home = spec.home
    if os.path.islink(home) or not os.path.isdir(home):
        raise SetupError("the home is not a directory")
    if as_real_root:
        dedicated = dedicated_uid(home)
        os.chown(home, dedicated, dedicated, follow_symlinks=False)
        os.chmod(home, 0o700)
    home_fd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    # Nothing of ours propagates back to the computer's mounts.
    _mount(None, "/", None, MS_REC | (1 << 18))  # MS_PRIVATE
    # Any existing directory will do (the home is bound from its descriptor, the rest from /).
    mountpoints = ("/tmp", "/mnt", "/run", "/srv")  # noqa: S108 - only a place to mount on
    new_root = next(d for d in mountpoints if os.path.isdir(d))
    staged = _build_root(spec, home_fd, new_root)
    os.close(home_fd)
    _pivot(new_root)
    for path in staged:
        os.unlink(path)
    _hide(tuple(spec.hidden))
    _remount_readonly("/", MS_NOSUID | MS_NODEV)
    with contextlib.suppress(OSError):
        socket.sethostname(spec.hostname)
    with contextlib.suppress(OSError):
        _loopback_up()
    _drop_privileges(spec, as_real_root)
    os.chdir(spec.home_inside)
    env = {**spec.env, "HOME": spec.home_inside, "PWD": spec.home_inside}
    argv = [spec.argv0, "-c", "exit 0"] if spec.probe else [spec.argv0]
    os.execve(spec.executable, argv, env)  # noqa: S606 - the tenant's shell, confined


def main(argv: list[str]) -> int:
    try:
        values = json.loads(argv[1])
        values["hidden"] = tuple(values.get("hidden", ()))
        setup(ShellSpec(**values))
    except (SetupError, OSError, ValueError, TypeError, IndexError) as err:
        print(f"gpucloud: the shell could not be confined: {err}", file=sys.stderr)
    return SETUP_FAILED_STATUS


if __name__ == "__main__":
    sys.exit(main(sys.argv))
