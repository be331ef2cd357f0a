"""How onboarding reaches a machine outside MAAS's API: its BMC (to PXE-cycle it for discovery)
and, once deployed, its OS over SSH (the one explicit seed step before the node agent runs,
docs/lifecycles/onboarding.md#stages EnsureHardwareSyncConfigured). Real implementations:
`IpmitoolBmc` (activities/onboarding/ipmi.py) and `SshHostSeeder`
(activities/onboarding/ssh_seeder.py); the embedded default and the tests use sim/first_boot.py,
which answers the same calls.

Errors are `core.failures.ClassifiedError`s: bmc_power_failure for the BMC,
post_deploy_connectivity_failure for SSH. Their messages never carry a password, key or token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class BmcLogin:
    address: str
    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class SshLogin:
    """The site's deploy user (docs/maas-sites.md#policy-knobs deploy_user, password from Vault)."""

    address: str
    user: str
    password: str = field(repr=False)
    port: int = 22


@runtime_checkable
class BmcPowerControl(Protocol):
    async def power_status(self, login: BmcLogin) -> str:
        """The chassis power the BMC reports: "on", "off" or "unknown". Asked before any power
        action (issue 35): the answer is part of the evidence discovery records."""
        ...

    async def power_cycle(self, login: BmcLogin) -> None:
        """Power-cycle the machine so it PXE-boots (and enlists in MAAS if unknown)."""
        ...


@runtime_checkable
class HostSeeder(Protocol):
    async def seed_hardware_sync(
        self, login: SshLogin, *, creds_yaml: str, interval_minutes: int
    ) -> None:
        """Write /etc/maas/maas-machine-creds.yml (0600), (re)install the hardware-sync
        service and timer with this interval, and restart them
        (docs/lifecycles/onboarding.md#hardware-sync steps 4-5)."""
        ...

    async def push_agent_config(self, login: SshLogin, *, agent_toml: str) -> None:
        """Rewrite /etc/gpucloud/agent.toml (0600, a fresh enrollment token) and restart the
        node agent, so it enrolls with the new token."""
        ...


@dataclass(frozen=True)
class HostAccess:
    bmc: BmcPowerControl
    seeder: HostSeeder
