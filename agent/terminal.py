"""Terminal sessions on the node (docs/lifecycles/terminal-session.md): the `terminal.open` and
`terminal.close` host tasks.

`terminal.open` starts the allocation's shell on a PTY, dials the gateway with an OUTBOUND
WebSocket (the node opens no port), authenticates with the session's secret, tells the workflow
the stream is attached, then relays until the session ends, heartbeating all along so a dead agent
is noticed (the workflow then closes the session with `node_stream_dropped`). It returns how the
session ended. `terminal.close` asks the running session to end with a reason: the agent sends
that reason to the gateway (which tells the tenant), ends the shell and answers once it is gone,
which is the close's acknowledgement.

Frames (contracts/terminal_session.py): binary frames are terminal bytes; text frames are JSON
control messages (resize, close). Buffers are bounded: one PTY read of PTY_READ_BYTES is sent
before the next is taken (the shell blocks on a full PTY meanwhile), frames from the gateway are
at most MAX_FRAME_BYTES, and websockets' own queues are capped.

What the shell is comes from a `ShellLauncher`: on bare metal a login shell as the allocation's
user (`BaremetalLoginShell`, through the bare-metal user backend's account), on a slice the VM's
serial console through libvirt (`SliceSerialConsole`); on a simulated machine (the embedded
stack) a confined shell (`confined_shell`, agent/shell_confinement.py), refused with
`shell_confinement_unavailable` where it cannot be confined. The session's bytes are never
logged and never reach Temporal: only ids and close reasons do.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidHandshake

from agent.backend import HostError
from agent.backends.baremetal_users import FileBaremetalUserBackend
from agent.backends.domain_xml import domain_name
from agent.host_activities import heartbeat_interval_seconds
from agent.progress import utc_now_iso
from agent.shell_confinement import ConfinementUnavailable, ShellSpec, confined_launch
from contracts.host_tasks import SHAPE_BAREMETAL, SHAPE_GPU_SLICE, HostErrorType
from contracts.terminal_session import (
    AUTH_TIMEOUT_SECONDS,
    FRAME_ATTACHED,
    FRAME_AUTH,
    FRAME_CLOSE,
    FRAME_CLOSED,
    FRAME_RESIZE,
    MAX_FRAME_BYTES,
    STREAM_ATTACHED_SIGNAL,
    TERMINAL_CLOSE,
    TERMINAL_OPEN,
    CloseReason,
    TerminalCloseInput,
    TerminalCloseResult,
    TerminalOpenInput,
    TerminalOpenResult,
    close_reason_of,
    control_frame,
    parse_control,
    terminal_size,
)

logger = logging.getLogger("agent.terminal")

PTY_READ_BYTES = 16 * 1024
# websockets' bounds: frames queued from the gateway, and bytes buffered towards it.
INBOUND_QUEUE_FRAMES = 16
WRITE_LIMIT_BYTES = 256 * 1024
# WebSocket pings towards the gateway (a silent gateway ends the stream as dropped).
PING_INTERVAL_SECONDS = 20.0
# The shell gets SIGHUP, then this long before SIGKILL.
KILL_GRACE_SECONDS = 2.0
# A terminal.close waits at most this long for the session to end.
CLOSE_WAIT_SECONDS = 10.0
DEFAULT_SIZE = (80, 24)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FALLBACK_SHELL = "/bin/sh"
OPEN_FAILED = CloseReason.OPEN_FAILED.value


@dataclass(frozen=True)
class ShellCommand:
    """The program a session runs on its PTY. uid/gid None: the agent's own user."""

    executable: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    cwd: str
    uid: int | None = None
    gid: int | None = None


class ShellLauncher(Protocol):
    def shell_for(self, spec: TerminalOpenInput) -> ShellCommand:
        """The shell for this session; raises HostError when it cannot run here."""
        ...


def _login_env(username: str, home: str, shell: str) -> dict[str, str]:
    return {
        "HOME": home,
        "USER": username,
        "LOGNAME": username,
        "SHELL": shell,
        "TERM": "xterm-256color",
        "PATH": DEFAULT_PATH,
        "LANG": "C.UTF-8",
    }


class BaremetalLoginShell:
    """A login shell as the allocation's tenant user, found through the bare-metal user backend
    (so only an account this agent manages, belonging to this allocation and not revoked).

    On the node's real root the shell runs as that user (its uid and gid, no supplementary
    groups), in its home. On a simulated machine's root (tests, `--hosts libvirt-test`), where
    the account exists only in that root's files and the agent is a process of the computer
    that runs the stack, the shell is confined (agent/shell_confinement.py): unprivileged, in
    its own namespaces, seeing the system directories read-only and the account's home under
    that root at its home's path, nothing else of this computer."""

    def __init__(self, users: FileBaremetalUserBackend) -> None:
        self.users = users

    def shell_for(self, spec: TerminalOpenInput) -> ShellCommand:
        account = self.users.account(spec.username)
        if account is None or account.allocation_id != spec.allocation_id:
            raise HostError(
                HostErrorType.INVALID_SPEC, "the allocation's user does not exist on this node"
            )
        shell = account.shell
        if not shell or shell == self.users.config.nologin_shell or shell.endswith("/nologin"):
            raise HostError(HostErrorType.INVALID_SPEC, "login is disabled for this user")
        login_name = "-" + os.path.basename(shell)  # argv[0] "-bash": a login shell
        root = self.users.root
        if root.is_real_root:
            return ShellCommand(
                executable=shell,
                argv=(login_name,),
                env=_login_env(account.username, account.home, shell),
                cwd=account.home,
                uid=account.uid,
                gid=account.gid,
            )
        executable = shell if Path(shell).exists() else FALLBACK_SHELL
        return confined_shell(
            ShellSpec(
                home=str(root.host_path(account.home)),
                username=account.username,
                uid=account.uid,
                gid=account.gid,
                hostname=_machine_hostname(root.host_path("/etc/hostname")),
                executable=executable,
                argv0="-" + os.path.basename(executable),
                env=_login_env(account.username, f"/home/{account.username}", executable),
                hidden=(str(root.host_path("/")),),
            )
        )


def _machine_hostname(path: Path) -> str:
    with contextlib.suppress(OSError):
        if name := path.read_text().strip():
            return name
    return "node"


def confined_shell(spec: ShellSpec) -> ShellCommand:
    """A simulated machine's shell, confined (agent/shell_confinement.py); raises
    ConfinementUnavailable when this computer cannot confine it: never an unconfined shell."""
    launch = confined_launch(spec)
    return ShellCommand(executable=launch.executable, argv=launch.argv, env=launch.env, cwd="/")


class SliceSerialConsole:
    """The slice VM's serial console through libvirt (`virsh console`): the guest's own login
    prompt, whatever network the VM has."""

    def __init__(self, uri: str, *, virsh: str = "virsh") -> None:
        self.uri = uri
        self.virsh = virsh

    def shell_for(self, spec: TerminalOpenInput) -> ShellCommand:
        return ShellCommand(
            executable=self.virsh,
            argv=(
                self.virsh,
                "-c",
                self.uri,
                "console",
                domain_name(spec.allocation_id),
                "--force",
            ),
            env={"TERM": "xterm-256color", "PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
            cwd="/",
        )


class NodeShells:
    """A node's launchers by allocation shape (a node may serve only one)."""

    def __init__(
        self, *, baremetal: ShellLauncher | None = None, slice: ShellLauncher | None = None
    ) -> None:
        self._by_shape = {SHAPE_BAREMETAL: baremetal, SHAPE_GPU_SLICE: slice}

    def shell_for(self, spec: TerminalOpenInput) -> ShellCommand:
        launcher = self._by_shape.get(spec.shape)
        if launcher is None:
            raise HostError(
                HostErrorType.UNSUPPORTED, f"terminal sessions for {spec.shape} are not served here"
            )
        return launcher.shell_for(spec)


# ---------------------------------------------------------------------------------------- PTY


def _take_controlling_terminal() -> None:
    """In the child, after setsid(): its stdin (the PTY's other end) becomes its terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyProcess:
    """A program on a fresh PTY; the agent holds the master end (non-blocking)."""

    def __init__(self, command: ShellCommand) -> None:
        master, child_end = os.openpty()
        try:
            _set_size(master, *DEFAULT_SIZE)
            self.process = subprocess.Popen(
                list(command.argv),
                executable=command.executable,
                stdin=child_end,
                stdout=child_end,
                stderr=child_end,
                cwd=command.cwd,
                env=command.env,
                start_new_session=True,
                user=command.uid,
                group=command.gid,
                extra_groups=[] if command.uid is not None else None,
                # One ioctl between fork and exec (setsid has run): no locks, no allocation.
                preexec_fn=_take_controlling_terminal,
                close_fds=True,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(child_end)
        os.set_blocking(master, False)
        self.master = master

    def resize(self, cols: int, rows: int) -> None:
        _set_size(self.master, cols, rows)

    async def read(self) -> bytes:
        """The next chunk of output; b"" once the program's side is closed."""
        while True:
            try:
                return os.read(self.master, PTY_READ_BYTES)
            except BlockingIOError:
                await _fd_ready(self.master, writable=False)
            except OSError:  # EIO: every process on the terminal has gone
                return b""

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.master, view)
            except BlockingIOError:
                await _fd_ready(self.master, writable=True)
                continue
            view = view[written:]

    async def terminate(self) -> None:
        """SIGHUP to the program's process group, SIGKILL after a grace; the PTY closed."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGHUP)
        try:
            await asyncio.to_thread(self.process.wait, KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await asyncio.to_thread(self.process.wait)
        with contextlib.suppress(OSError):
            os.close(self.master)


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


async def _fd_ready(fd: int, *, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


# ------------------------------------------------------------------------------------ session


class _Session:
    """One running session; `terminal.close` ends it through `request_close`."""

    def __init__(self, spec: TerminalOpenInput) -> None:
        self.spec = spec
        self.close_reason: str | None = None
        self.close_requested = asyncio.Event()
        self.finished = asyncio.Event()

    def request_close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        self.close_requested.set()

    async def relay(self, pty: PtyProcess, ws: ClientConnection) -> str:
        """Bytes both ways until the shell exits, the gateway ends the stream or a close is
        requested; returns the CloseReason value the session ended with."""
        output = asyncio.create_task(self._pty_to_gateway(pty, ws))
        inbound = asyncio.create_task(self._gateway_to_pty(pty, ws))
        closing = asyncio.create_task(self.close_requested.wait())
        tasks = {output, inbound, closing}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if closing in done:
            return self.close_reason or CloseReason.CLIENT_CLOSED.value
        finished = inbound if inbound in done else output
        error = finished.exception()
        if isinstance(error, ConnectionClosed):
            if isinstance(error, ConnectionClosedOK):
                return CloseReason.CLIENT_CLOSED.value
            return CloseReason.NODE_STREAM_DROPPED.value
        if error is not None:
            raise error
        reason: str = finished.result()
        return reason

    async def _pty_to_gateway(self, pty: PtyProcess, ws: ClientConnection) -> str:
        while True:
            data = await pty.read()
            if not data:
                return CloseReason.SHELL_EXITED.value
            # Awaited before the next read: at most one chunk is in flight per session.
            await ws.send(data)

    async def _gateway_to_pty(self, pty: PtyProcess, ws: ClientConnection) -> str:
        async for message in ws:
            if isinstance(message, bytes):
                await pty.write(message)
                continue
            control = parse_control(message)
            kind = control.get("type")
            if kind == FRAME_RESIZE and (size := terminal_size(control)) is not None:
                pty.resize(*size)
            elif kind == FRAME_CLOSE:
                return close_reason_of(control)
        return CloseReason.CLIENT_CLOSED.value


class TerminalActivities:
    """The terminal host tasks of one node (registered by agent.node_worker.node_activities)."""

    def __init__(
        self,
        shells: ShellLauncher | None,
        *,
        node_id: str | None = None,
        ws_connect: Callable[..., Any] = connect,
    ) -> None:
        self._shells = shells
        self._node_id = node_id
        self._connect = ws_connect
        self._sessions: dict[str, _Session] = {}

    def activities(self) -> list[Callable[..., Any]]:
        return [self.open_terminal, self.close_terminal]

    @activity.defn(name=TERMINAL_OPEN)
    async def open_terminal(self, spec: TerminalOpenInput) -> TerminalOpenResult:
        started_at = utc_now_iso()
        self._check(spec)
        assert self._shells is not None
        try:
            # In a thread: a launcher reads account files, a confined one probes once.
            command = await asyncio.to_thread(self._shells.shell_for, spec)
            pty = await asyncio.to_thread(PtyProcess, command)
        except HostError as err:
            logger.warning("terminal %s: cannot start: %s", spec.session_id, err.error_type.value)
            raise ApplicationError(
                err.message, type=err.error_type.value, non_retryable=True
            ) from None
        except ConfinementUnavailable as err:
            # Refused, never an unconfined shell in its place.
            logger.warning("terminal %s: cannot confine the shell: %s", spec.session_id, err)
            raise ApplicationError(str(err), type=err.code, non_retryable=True) from None
        except OSError as err:
            logger.warning("terminal %s: shell did not start (%s)", spec.session_id, err.errno)
            raise ApplicationError(
                "the shell did not start", type=OPEN_FAILED, non_retryable=True
            ) from None
        session = _Session(spec)
        self._sessions[spec.session_id] = session
        heartbeats = asyncio.create_task(_heartbeat_loop())
        try:
            ended_by = await self._run(session, pty)
        finally:
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)
            await pty.terminate()
            self._sessions.pop(spec.session_id, None)
            session.finished.set()
        logger.info("terminal %s: ended (%s)", spec.session_id, ended_by)
        return TerminalOpenResult(
            task_id=spec.task_id,
            session_id=spec.session_id,
            ended_by=ended_by,
            started_at=started_at,
            finished_at=utc_now_iso(),
        )

    @activity.defn(name=TERMINAL_CLOSE)
    async def close_terminal(self, spec: TerminalCloseInput) -> TerminalCloseResult:
        session = self._sessions.get(spec.session_id)
        if session is None:
            return TerminalCloseResult(spec.session_id, was_running=False)
        session.request_close(spec.reason)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                await session.finished.wait()
        return TerminalCloseResult(spec.session_id, was_running=True)

    def _check(self, spec: TerminalOpenInput) -> None:
        problem = None
        if self._shells is None:
            problem = (HostErrorType.UNSUPPORTED, "terminal sessions are not served on this node")
        elif self._node_id is not None and spec.node_id != self._node_id:
            problem = (HostErrorType.INVALID_SPEC, "task is for another node")
        elif not spec.stream_url.startswith(("ws://", "wss://")):
            problem = (HostErrorType.INVALID_SPEC, "stream_url must be a ws:// or wss:// URL")
        if problem is not None:
            raise ApplicationError(problem[1], type=problem[0].value, non_retryable=True)

    async def _run(self, session: _Session, pty: PtyProcess) -> str:
        spec = session.spec
        try:
            ws = await self._connect(
                spec.stream_url,
                max_size=MAX_FRAME_BYTES,
                max_queue=INBOUND_QUEUE_FRAMES,
                write_limit=WRITE_LIMIT_BYTES,
                ping_interval=PING_INTERVAL_SECONDS,
                ping_timeout=PING_INTERVAL_SECONDS,
                open_timeout=AUTH_TIMEOUT_SECONDS,
            )
        except (OSError, InvalidHandshake, TimeoutError) as err:
            logger.warning("terminal %s: gateway not reached (%s)", spec.session_id, type(err))
            raise ApplicationError(
                "the gateway's stream endpoint was not reached",
                type=OPEN_FAILED,
                non_retryable=True,
            ) from None
        try:
            await self._authenticate(ws, spec)
            await _report_attached()
            ended_by = await session.relay(pty, ws)
            if ended_by != CloseReason.NODE_STREAM_DROPPED:
                # The gateway tells the tenant why; a dropped stream has nobody to tell.
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(control_frame(FRAME_CLOSED, reason=ended_by))
            return ended_by
        finally:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _authenticate(self, ws: ClientConnection, spec: TerminalOpenInput) -> None:
        try:
            await ws.send(control_frame(FRAME_AUTH, secret=spec.agent_secret))
            async with asyncio.timeout(AUTH_TIMEOUT_SECONDS):
                control = parse_control(await ws.recv())
        except (ConnectionClosed, TimeoutError):
            control = {}
        if control.get("type") != FRAME_ATTACHED:
            raise ApplicationError(
                "the gateway did not attach the stream", type=OPEN_FAILED, non_retryable=True
            )


async def _heartbeat_loop() -> None:
    interval = heartbeat_interval_seconds()
    while True:
        activity.heartbeat()
        await asyncio.sleep(interval)


async def _report_attached() -> None:
    """Tell the session's workflow its stream is attached (it then counts as active). Best
    effort: a workflow that never hears it closes the session after its attach timeout."""
    info = activity.info()
    if info.workflow_id is None:
        return
    handle = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
    try:
        await handle.signal(STREAM_ATTACHED_SIGNAL)
    except RPCError as err:
        logger.warning("terminal: attach not reported to %s: %s", info.workflow_id, err.status)
