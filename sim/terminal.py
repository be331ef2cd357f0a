"""Terminal shells on a simulated node (`--backend simulated`, the demo fleet): the root-less
stand-in for agent.terminal.BaremetalLoginShell. The tenant's user exists only in the
SimulatedHost, so the shell runs as the agent's own user, in a home directory of that user under
the simulated machine's directory; the same refusals apply (no such user for this allocation).
A slice's VM is simulated too: its "console" is the same kind of shell."""

from __future__ import annotations

from pathlib import Path

from agent.backend import HostError
from agent.terminal import FALLBACK_SHELL, ShellCommand
from contracts.host_tasks import HostErrorType
from contracts.terminal_session import TerminalOpenInput
from sim.host import SimulatedHost

PROMPT = r"\u@sim:\w\$ "


class SimulatedShell:
    def __init__(self, host: SimulatedHost, home_root: Path) -> None:
        self.host = host
        self.home_root = home_root

    def shell_for(self, spec: TerminalOpenInput) -> ShellCommand:
        user = self.host.user(spec.allocation_id)
        domain = self.host.domain(spec.allocation_id)
        if user is None and (domain is None or domain.state != "running"):
            raise HostError(
                HostErrorType.INVALID_SPEC, "the allocation has nothing to log in to on this node"
            )
        username = user.username if user is not None else spec.username
        home = self.home_root / username
        home.mkdir(parents=True, exist_ok=True)
        return ShellCommand(
            executable=FALLBACK_SHELL,
            argv=("-sh",),
            env={
                "HOME": str(home),
                "USER": username,
                "LOGNAME": username,
                "SHELL": FALLBACK_SHELL,
                "TERM": "xterm-256color",
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "PS1": PROMPT,
            },
            cwd=str(home),
        )
