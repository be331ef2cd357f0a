"""Typed failures of the network operations.

They are `HostError`s, so a host activity that calls these operations turns them into classified
`ApplicationError`s without translating: bad input is `invalid_spec` (non-retryable), a name that
belongs to something else is `lease_conflict`.
"""

from __future__ import annotations

from agent.backend import HostError
from contracts.host_tasks import HostErrorType


class NetworkError(HostError):
    """Base of every failure raised by agent.network."""


class InvalidNetworkSpec(NetworkError):
    """The request itself is wrong: a bad CIDR, a VLAN id out of range, a name too long."""

    def __init__(self, message: str) -> None:
        super().__init__(HostErrorType.INVALID_SPEC, message)


class MissingInterface(NetworkError):
    """An interface the request names (uplink, RoCE NIC) does not exist in the namespace."""

    def __init__(self, ifname: str, netns: str | None) -> None:
        where = f"network namespace {netns!r}" if netns else "the host network namespace"
        super().__init__(HostErrorType.INVALID_SPEC, f"interface {ifname!r} not found in {where}")
        self.ifname = ifname
        self.netns = netns


class NamespaceNotFound(NetworkError):
    """The `netns` parameter names a namespace that does not exist (it is never created here)."""

    def __init__(self, netns: str) -> None:
        super().__init__(HostErrorType.INVALID_SPEC, f"network namespace {netns!r} does not exist")
        self.netns = netns


class NetworkConflict(NetworkError):
    """A name, address or rule we need is held by something we did not create (or differs)."""

    def __init__(self, message: str) -> None:
        super().__init__(HostErrorType.LEASE_CONFLICT, message)


class NetworkOperationFailed(NetworkError):
    """The kernel refused a change (netlink or ioctl error) that validation did not foresee.

    The contract has no network-specific error type yet; `lease_conflict` is used because its
    handling (retried, then failed) is right for a refusal that may be transient.
    """

    def __init__(
        self, message: str, error_type: HostErrorType = HostErrorType.LEASE_CONFLICT
    ) -> None:
        super().__init__(error_type, message)
