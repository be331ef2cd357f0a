"""BMC power credentials for a machine, resolved in docs/maas-sites.md#power-credential-overrides's
order: an active override matching one of its PXE MACs, then its IPMI address, then its hostname,
else the site default. Read from Vault at call time, so a rotated secret is used by the next
activity without restart."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from core.secrets import SecretStore
from schema.models import MaasPowerCredentialOverride, MaasSite

SELECTOR_ORDER = ("pxe_mac", "ipmi_ip", "hostname")


class PowerCredentialsMissing(LookupError):
    """No secret where the site says one is: the site lacks a capability an operator must add."""


# The start of a source naming a per-node override ("override:<selector type>").
OVERRIDE_SOURCE_PREFIX = "override:"


@dataclass(frozen=True)
class PowerCredentials:
    user: str
    password: str = field(repr=False)
    # "override:pxe_mac" | "override:ipmi_ip" | "override:hostname" | "site_default"
    source: str = "site_default"
    vault_path: str = ""


async def resolve_power_credentials(
    session: AsyncSession,
    secrets: SecretStore,
    site_id: uuid.UUID,
    *,
    pxe_macs: Sequence[str] = (),
    ipmi_ip: str | None = None,
    hostname: str | None = None,
) -> PowerCredentials:
    wanted = {
        "pxe_mac": {m.strip().lower().replace("-", ":") for m in pxe_macs if m},
        "ipmi_ip": {ipmi_ip.strip()} if ipmi_ip else set(),
        "hostname": {hostname.strip().lower()} if hostname else set(),
    }
    conditions = [
        (MaasPowerCredentialOverride.selector_type == kind)
        & MaasPowerCredentialOverride.selector_value.in_(values)
        for kind, values in wanted.items()
        if values
    ]
    overrides: list[MaasPowerCredentialOverride] = []
    if conditions:
        overrides = list(
            await session.scalars(
                select(MaasPowerCredentialOverride).where(
                    MaasPowerCredentialOverride.site_id == site_id,
                    MaasPowerCredentialOverride.status == "active",
                    or_(*conditions),
                )
            )
        )
    for kind in SELECTOR_ORDER:
        match = next((o for o in overrides if o.selector_type == kind), None)
        if match is not None:
            return await _read(secrets, match.vault_path, f"{OVERRIDE_SOURCE_PREFIX}{kind}")
    default_path = await session.scalar(
        select(MaasSite.default_power_creds_vault_path).where(MaasSite.id == site_id)
    )
    if default_path is None:
        raise PowerCredentialsMissing(f"MAAS site {site_id} does not exist")
    return await _read(secrets, default_path, "site_default")


async def _read(secrets: SecretStore, path: str, source: str) -> PowerCredentials:
    value = await secrets.read(path)
    if not value or not value.get("user") or not value.get("pass"):
        raise PowerCredentialsMissing(f"no power credentials at {path}")
    return PowerCredentials(
        user=value["user"], password=value["pass"], source=source, vault_path=path
    )
