"""Real host backends for the node agent (the simulator lives in sim/host.py)."""

from agent.backends.readiness import (
    FixedAddressProbe,
    GuestAgentProbe,
    NotReady,
    ReadinessProbe,
    SshPortProbe,
)

__all__ = [
    "FixedAddressProbe",
    "GuestAgentProbe",
    "NotReady",
    "ReadinessProbe",
    "SshPortProbe",
]
