"""A tenant's terminal on a simulated host is confined (issue 36 §6): the node's real
`gpucloud-agent` process (the production `host` backend on a simulated machine's disk, as
`--hosts libvirt-test` runs it, and the demo fleet's `simulated` plugin) opens the session
through the tenant API and the WebSocket, and the shell it starts runs on the computer that
runs the stack. There it must be an unprivileged user that sees its own home and nothing of the
stack: not the admin token file, not the stack's state or repository, not another simulated
machine, not the agent's process, not the stack's loopback services. Where this computer
cannot confine a shell, the open fails with a machine-readable code instead of a root shell.

These tests run as whatever user runs the suite (root in CI): the agent confines as root with a
dedicated uid, and as a normal user through a user namespace."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.shell_confinement import CONFINEMENT_UNAVAILABLE
from sim.machine_image import build_machine
from tests.terminal_fixtures import TerminalRig

Rig = Callable[..., Awaitable[TerminalRig]]
REPOSITORY = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")


def _stack_state(tmp_path: Path, admin_token: str) -> Path:
    """A stack's state directory beside the machines, as `bin/stack` keeps it: its tokens file
    (mode 0600, the admin token in it)."""
    state = tmp_path / "state"
    state.mkdir()
    tokens = state / "tokens.json"
    tokens.write_text(json.dumps({"admin_token": admin_token}))
    tokens.chmod(0o600)
    return tokens


@pytest.mark.parametrize("backend", ["host", "simulated"])
async def test_the_shell_is_unprivileged_and_sees_only_its_home(
    terminal_rig: Rig, make_token: Any, tmp_path: Path, backend: str
) -> None:
    admin_token = await make_token("admin")
    tokens = _stack_state(tmp_path, admin_token)
    other = build_machine(tmp_path / "machine-other", address="127.0.0.2", machine_key="other")
    other_secret = other.root / "etc/gpucloud/agent.d/50-machine.toml"
    assert other_secret.is_file()
    rig = await terminal_rig(backend=backend)
    agent_pid = rig.agent.process.pid
    gateway_port = int(rig.gateway.url.rsplit(":", 1)[1])
    username = f"gpu-{rig.allocation_id.replace('-', '')[:12]}"
    created = await rig.open_session()
    async with rig.terminal(created) as term:
        await rig.wait_session(created["session_id"], "active")
        # Each probe prints name=0 when the shell could do it (a failure for the tenant is any
        # other status); the arithmetic keeps the echoed command line from matching.
        checks = {
            "token": f"cat {tokens}",
            "state": f"ls {tokens.parent}",
            "repo": f"ls {REPOSITORY}",
            "machine": f"ls {rig.agent.root}/etc",
            "other": f"cat {other_secret}",
            "agentproc": f"cat /proc/{agent_pid}/environ",
            "kill": f"kill -9 {agent_pid}",
            "usr": "touch /usr/confined-probe",
            "root": "touch /confined-probe",
        }
        for number, (name, command) in enumerate(checks.items(), start=100):
            output = await term.run(
                f"{command} >/dev/null 2>&1; echo {name}=$? end-$((7*{number}))",
                f"end-{7 * number}".encode(),
            )
            tail = output.rsplit(f"{name}=".encode(), 1)[1]
            assert not tail.startswith(b"0 "), f"the shell could: {command}"
        output = await term.run('echo "uid=$(id -u) home=$HOME up=$((5*5))"', b"up=25")
        uid = int(output.rsplit(b"uid=", 1)[1].split()[0])
        assert uid != 0
        assert f"home=/home/{username}".encode() in output
        # Its home is writable, and is the account's home on the machine's disk.
        await term.run("echo written-by-tenant > ~/note.txt; echo wrote-$((8*8))", b"wrote-64")
        # The stack's loopback services (here: the gateway) are not reachable.
        if shutil.which("python3", path="/usr/bin:/bin"):
            probe = (
                'python3 -c \'import socket; socket.create_connection(("127.0.0.1", '
                f"{gateway_port}), 2)' >/dev/null 2>&1; echo net=$? net-$((9*9))"
            )
            output = await term.run(probe, b"net-81")
            assert not output.rsplit(b"net=", 1)[1].startswith(b"0 ")
    note = rig.agent.root / "home" / username / "note.txt"  # the account's home on the disk
    assert note.read_text() == "written-by-tenant\n"
    # Owned by the shell's real user: never root's file, as root a dedicated uid.
    if os.geteuid() == 0:
        assert note.stat().st_uid != 0
    # Nothing it tried touched the stack: the agent lives, the token file is intact.
    assert rig.agent.process.poll() is None
    assert admin_token in tokens.read_text()
    with socket.create_connection(("127.0.0.1", gateway_port), 2):
        pass  # the gateway itself was up all along


async def test_no_confinement_refuses_the_open(terminal_rig: Rig, tmp_path: Path) -> None:
    """A computer that cannot make the namespaces (here: an `unshare` that is refused, as in a
    container without CAP_SYS_ADMIN or with user namespaces off) gets no shell at all: the open
    fails with shell_confinement_unavailable and the session ends in error."""
    bin_dir = tmp_path / "no-namespaces"
    bin_dir.mkdir()
    refused = bin_dir / "unshare"
    refused.write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    refused.chmod(0o755)
    rig = await terminal_rig(
        backend="simulated", agent_env={"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    )
    created = await rig.open_session()
    term = await rig.connect(created)
    error = await term.control("error", timeout=90)
    assert error["code"] == "open_failed"
    failed = await rig.wait_session(created["session_id"], "error")
    assert failed["close_reason"] == "open_failed"
    timeline = (await rig.tenant.get(f"/api/v1/allocations/{rig.allocation_id}/timeline")).json()
    (task,) = [i for i in timeline["items"] if i.get("name") == "terminal.open"]
    assert task["status"] == "failed"
    assert task["error_type"] == CONFINEMENT_UNAVAILABLE
    assert bytes(term.output) == b""  # not a byte of any shell reached the tenant
