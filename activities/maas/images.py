"""Image names at the MAAS boundary (docs/maas-sites.md#policy-knobs).

Profiles may name our uploaded host images without MAAS's namespace (`gpuaas-h100-2404`), but
MAAS's `distro_series` looks a bare name up as an Ubuntu series and rejects it, so deploy calls
must send the custom namespace form `custom/<name>`. Ubuntu series in any of the forms MAAS
accepts (`noble`, `ubuntu/noble`, `24.04`) and other `<os>/<series>` names pass through.
"""

from __future__ import annotations

CUSTOM_NAMESPACE = "custom/"
# Our uploaded images are named gpuaas-*; nothing else is moved into the custom namespace.
CUSTOM_IMAGE_PREFIX = "gpuaas-"


def normalise_distro_series(name: str) -> str:
    image = name.strip()
    if not image:
        raise ValueError("distro_series must not be empty")
    if image.lower().startswith(CUSTOM_NAMESPACE):
        if not image[len(CUSTOM_NAMESPACE) :]:
            raise ValueError("custom image name must not be empty")
        return image
    if image.lower().startswith(CUSTOM_IMAGE_PREFIX):
        return CUSTOM_NAMESPACE + image
    return image


def is_custom_image(name: str) -> bool:
    return normalise_distro_series(name).lower().startswith(CUSTOM_NAMESPACE)
