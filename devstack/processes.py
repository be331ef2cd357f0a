"""Child processes of the embedded stack: started with their output in a log file, in a session of
their own (Ctrl-C reaches only the supervisor, which stops them in order), and tied to the
supervisor's life (PR_SET_PDEATHSIG), so that a killed `gpucloud-stack` leaves no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the child: between fork and exec the child only makes the one call.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def python_entry(module: str, func: str = "main") -> list[str]:
    """`python -c 'from module import func; func()'`: works whether or not the module has a
    `__main__` guard; arguments appended to the list reach it as sys.argv[1:]."""
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code]


def open_log(path: Path) -> IO[bytes]:
    """A fresh log per run; the previous run's is kept as `<name>.1`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        path.replace(path.with_name(path.name + ".1"))
    log = path.open("ab", buffering=0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    log.write(f"=== {stamp} started by gpucloud-stack\n".encode())
    return log


def tail(path: Path, lines: int = 25) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


async def http_ok(url: str) -> bool:
    """Whether `url` answers 200 now (a readiness probe; never raises for a network error)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a private server to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str]
    cwd: Path
    proc: asyncio.subprocess.Process | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        self._log = open_log(self.log_path)
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(self.env),
            cwd=str(self.cwd),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s` seconds."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                self.kill()
                await self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
