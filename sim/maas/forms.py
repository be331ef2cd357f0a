"""Validation shared by the machine handlers: power parameters, MAC addresses, architectures,
distro series, sizes; errors worded as the region's forms word them."""

from __future__ import annotations

import json
import re

from sim.maas.errors import field_errors
from sim.maas.http import Params
from sim.maas.region import Region

IPMI_PARAMETERS = frozenset(
    {
        "power_driver",
        "power_boot_type",
        "power_address",
        "power_user",
        "power_pass",
        "k_g",
        "cipher_suite_id",
        "privilege_level",
        "workaround_flags",
        "mac_address",
        "power_off_mode",
    }
)
POWER_TYPES = ("ipmi", "manual")
ARCHITECTURES = ("amd64/generic", "amd64/hwe-22.04", "amd64/ga-24.04", "arm64/generic")
UBUNTU_VERSIONS = {
    "bionic": "18.04",
    "focal": "20.04",
    "jammy": "22.04",
    "noble": "24.04",
    "oracular": "24.10",
    "plucky": "25.04",
}
_MAC = re.compile(r"^([0-9a-fA-F]{2}[:-]){5}[0-9a-fA-F]{2}$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)B?$", re.IGNORECASE)


def normalise_mac(value: str, field: str) -> str:
    if not _MAC.match(value.strip()):
        raise field_errors({field: f"'{value}' is not a valid MAC address."})
    return value.strip().lower().replace("-", ":")


def power_parameters(params: Params) -> dict[str, object] | None:
    """`power_parameters_<name>` fields or a JSON `power_parameters`; None when none are given."""
    given: dict[str, object] = {}
    if "power_parameters" in params:
        try:
            loaded = json.loads(params.get("power_parameters") or "{}")
        except ValueError:
            raise field_errors({"power_parameters": "Enter valid JSON."}) from None
        if not isinstance(loaded, dict):
            raise field_errors({"power_parameters": "Enter valid JSON."})
        given.update(loaded)
    for key in params:
        if key.startswith("power_parameters_") and key != "power_parameters_skip_check":
            name = key[len("power_parameters_") :]
            values = params.getlist(key)
            given[name] = values if name == "workaround_flags" else values[-1]
    if not given:
        return None
    unknown = sorted(set(given) - IPMI_PARAMETERS)
    if unknown:
        raise field_errors({"power_parameters": f"Unknown parameter(s): {', '.join(unknown)}."})
    return given


def power_type(params: Params, default: str | None) -> str | None:
    value = params.get("power_type", default)
    if value is not None and value not in POWER_TYPES:
        raise field_errors(
            {"power_type": f"Select a valid choice. {value} is not one of the available choices."}
        )
    return value


def architecture(value: str) -> str:
    arch = value if "/" in value else f"{value}/generic"
    if arch not in ARCHITECTURES:
        choices = ", ".join(f"'{a}'" for a in ARCHITECTURES)
        message = f"'{value}' is not a valid architecture.  It should be one of: {choices}."
        raise field_errors({"architecture": message})
    return arch


def distro_series(region: Region, value: str | None, osystem: str | None) -> tuple[str, str]:
    """(osystem, series) for op=deploy: `jammy`, `ubuntu/jammy`, `22.04`, `custom/<image>`."""
    site = region.site
    if not value:
        return (osystem or "ubuntu", site.default_distro_series)
    os_name, _, series = value.rpartition("/")
    os_name = os_name or osystem or "ubuntu"
    by_version = {v: k for k, v in UBUNTU_VERSIONS.items()}
    series = by_version.get(series, series)
    if os_name == "ubuntu" and series in site.distro_series:
        return ("ubuntu", series)
    if os_name == "custom" and series in site.custom_images:
        return ("custom", series)
    choices = ["''"] + [f"'ubuntu/{s}'" for s in site.distro_series]
    choices += [f"'custom/{c}'" for c in site.custom_images]
    raise field_errors(
        {
            "distro_series": f"'{value}' is not a valid distro_series.  It should be one of: "
            f"{', '.join(choices)}."
        }
    )


def size(params: Params, key: str) -> int | None:
    """A size in bytes, or with a K/M/G/T/P suffix (powers of 1000, as MAAS reads them)."""
    value = params.get(key)
    if not value:
        return None
    match = _SIZE.match(value.strip())
    if match is None:
        raise field_errors({key: f"Size is not valid: {value}"})
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1000 ** " KMGTP".index(unit or " "))
