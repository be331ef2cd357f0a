"""Terminal shells on a simulated node (`--backend simulated`, the demo fleet): the stand-in for
agent.terminal.BaremetalLoginShell. The tenant's user exists only in the SimulatedHost; its home
is a directory of the simulated machine (`home_root`/<user>). The same refusals apply (no such
user for this allocation). A slice's VM is simulated too: its "console" is the same kind of shell.

The agent is a process of the computer that runs the stack, so the shell is confined
(agent/shell_confinement.py): an unprivileged user in its own namespaces, seeing the system
directories read-only and its home at /home/<user>, nothing of the stack; refused
(shell_confinement_unavailable) where this computer cannot confine it."""

from __future__ import annotations

from pathlib import Path

from agent.backend import HostError
from agent.shell_confinement import ShellSpec
from agent.terminal import FALLBACK_SHELL, ShellCommand, confined_shell
from contracts.host_tasks import HostErrorType
from contracts.terminal_session import TerminalOpenInput
from sim.host import SimulatedHost

PROMPT = r"\u@\h:\w\$ "
# What the simulated account reads as inside its shell (the SimulatedHost keeps no uids).
TENANT_UID = 1000
TENANT_GID = 1000


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
        home_inside = f"/home/{username}"
        return confined_shell(
            ShellSpec(
                home=str(self.home_root / username),
                username=username,
                uid=TENANT_UID,
                gid=TENANT_GID,
                hostname=self.host.hostname or "sim",
                executable=FALLBACK_SHELL,
                argv0="-sh",
                env={
                    "HOME": home_inside,
                    "USER": username,
                    "LOGNAME": username,
                    "SHELL": FALLBACK_SHELL,
                    "TERM": "xterm-256color",
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "PS1": PROMPT,
                },
                # The simulated machine's whole directory (its disk, other homes).
                hidden=(str(self.home_root.resolve().parent),),
            )
        )
