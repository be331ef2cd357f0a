"""`gpucloud-terminal ALLOCATION_ID`: a shell into an allocation from the command line
(docs/lifecycles/terminal-session.md). It opens a terminal session over the API (POST
.../terminal-sessions), connects to the session's WebSocket, sends the single-use open token as the
first frame and then relays this terminal: keys go to the node, output comes back; window size
changes are sent as resize frames, and a keep-alive ping goes every PING_INTERVAL_SECONDS.

The API comes from --api or GPUCLOUD_API, the tenant token from GPUCLOUD_TOKEN or TENANT_TOKEN
(what `source .state/stack.env` exports): never from an argument, where `ps` would show it.
With stdin not a terminal (a pipe), its lines are typed into the shell and the session ends when
the shell exits. Exit status: 0 when the session closed normally, 1 on an error or a dropped
stream (reopen to retry), 2 on a usage or API error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contracts.terminal_session import (
    FRAME_AUTH,
    FRAME_CLOSED,
    FRAME_ERROR,
    FRAME_PING,
    FRAME_READY,
    FRAME_RESIZE,
    MAX_FRAME_BYTES,
    RETRYABLE_CLOSE_REASONS,
    CloseReason,
    control_frame,
    parse_control,
)

PING_INTERVAL_SECONDS = 20.0
READ_BYTES = 4096
EXIT_OK, EXIT_SESSION_ERROR, EXIT_USAGE = 0, 1, 2
TOKEN_VARIABLES = ("GPUCLOUD_TOKEN", "TENANT_TOKEN")
# Reasons that end a session as asked (exit 0); anything else is reported as an error.
NORMAL_ENDS = frozenset(
    {CloseReason.CLIENT_CLOSED, CloseReason.SHELL_EXITED, CloseReason.SESSION_TTL_EXPIRED}
)


class CliError(Exception):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpucloud-terminal", description="Open a shell into an allocation."
    )
    parser.add_argument("allocation_id", help="the allocation's id")
    parser.add_argument(
        "--api",
        default=os.environ.get("GPUCLOUD_API", "http://127.0.0.1:8000"),
        help="the gateway's URL (default: GPUCLOUD_API or %(default)s)",
    )
    return parser.parse_args(argv)


def _token() -> str:
    for name in TOKEN_VARIABLES:
        if os.environ.get(name):
            return os.environ[name]
    raise CliError(f"set {' or '.join(TOKEN_VARIABLES)} to a tenant API token")


async def open_session(api: str, allocation_id: str, token: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        response = await http.post(
            f"/api/v1/allocations/{allocation_id}/terminal-sessions",
            headers={"Authorization": f"Bearer {token}"},
        )
    if response.status_code != 201:
        try:
            error = response.json()["error"]
            detail = f"{error['code']}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            detail = f"HTTP {response.status_code}"
        raise CliError(f"cannot open a terminal session ({detail})")
    body: dict[str, Any] = response.json()
    return body


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """Keys go to the remote shell as typed (Ctrl-C included) while the session runs."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _resize_frame() -> str | None:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        return None
    return control_frame(FRAME_RESIZE, cols=size.columns, rows=size.lines)


async def _keys_to_node(ws: ClientConnection) -> None:
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    ready = asyncio.Event()
    loop.add_reader(fd, ready.set)
    try:
        while True:
            await ready.wait()
            ready.clear()
            data = os.read(fd, READ_BYTES)
            if not data:  # end of a piped stdin: the shell ends the session when it exits
                return
            await ws.send(data[:MAX_FRAME_BYTES])
    finally:
        loop.remove_reader(fd)


async def _keep_alive(ws: ClientConnection) -> None:
    while True:
        await asyncio.sleep(PING_INTERVAL_SECONDS)
        await ws.send(control_frame(FRAME_PING))


async def _output(ws: ClientConnection) -> str:
    """Relay output until the session's closed (or error) frame; returns its reason."""
    out = sys.stdout.buffer
    async for message in ws:
        if isinstance(message, bytes):
            out.write(message)
            out.flush()
            continue
        control = parse_control(message)
        if control.get("type") == FRAME_CLOSED:
            return str(control.get("reason"))
        if control.get("type") == FRAME_ERROR:
            raise CliError(f"{control.get('code')}: {control.get('message')}")
    return CloseReason.NODE_STREAM_DROPPED.value


async def run(args: argparse.Namespace) -> int:
    created = await open_session(args.api.rstrip("/"), args.allocation_id, _token())
    async with connect(created["stream_url"], max_size=MAX_FRAME_BYTES) as ws:
        await ws.send(control_frame(FRAME_AUTH, token=created["open_token"]))
        first = parse_control(await ws.recv())
        if first.get("type") != FRAME_READY:
            raise CliError(f"{first.get('code')}: {first.get('message')}")
        print(f"[terminal session {created['session_id']}]", file=sys.stderr)
        loop = asyncio.get_running_loop()
        if (resize := _resize_frame()) is not None:
            await ws.send(resize)

        sends: set[asyncio.Task[None]] = set()  # held until done (the loop keeps weak refs)

        def on_resize() -> None:
            frame = _resize_frame()
            if frame is not None:
                send = loop.create_task(ws.send(frame))
                sends.add(send)
                send.add_done_callback(sends.discard)

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGWINCH, on_resize)
        helpers = [asyncio.create_task(_keys_to_node(ws)), asyncio.create_task(_keep_alive(ws))]
        try:
            with raw_terminal(sys.stdin.fileno()):
                reason = await _output(ws)
        except ConnectionClosed:
            reason = CloseReason.NODE_STREAM_DROPPED.value
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
    retry = " (reopen to retry)" if reason in RETRYABLE_CLOSE_REASONS else ""
    print(f"\r\n[terminal session closed: {reason}{retry}]", file=sys.stderr)
    return EXIT_OK if reason in NORMAL_ENDS else EXIT_SESSION_ERROR


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        status = asyncio.run(run(args))
    except CliError as err:
        print(f"gpucloud-terminal: {err}", file=sys.stderr)
        status = EXIT_USAGE
    except (OSError, httpx.HTTPError) as err:
        print(f"gpucloud-terminal: cannot reach {args.api}: {type(err).__name__}", file=sys.stderr)
        status = EXIT_USAGE
    sys.exit(status)


if __name__ == "__main__":
    main()
