"""The production host backend, built from the agent config file's `[libvirt]` table:

    [libvirt]
    uri = "qemu:///system"
    image_dir = "/var/lib/gpucloud/images"
    seed_dir = "/var/lib/gpucloud/seeds"
    state_dir = "/var/lib/gpucloud/vms"
    readiness = "guest-agent"            # or "ssh"
    check_gpu_health = true              # sysfs check of every released GPU
    bridge_per_allocation = true         # an isolated bridge per slice (agent/network)
    uplink = "bond0"                     # tenant VLANs hang off it (optional)

    [libvirt.images]                     # name → expected sha256
    "ubuntu-22.04-cuda-12.4" = "9f86d0…"

GPU slices run on libvirt. Bare-metal access is not served by this backend yet: the file-based
user backend is for system roots the agent owns (tests, libvirt-test hosts); a node's real
accounts need the useradd-based variant and real session and GPU-scrub implementations."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from agent.backends.composite import NodeHostBackend
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.backends.readiness import GuestAgentProbe, ReadinessProbe, SshPortProbe
from agent.gpu_health import SysfsGpuHealthCheck
from agent.network.slice_networks import SliceNetworks

READINESS = {"guest-agent": GuestAgentProbe, "ssh": SshPortProbe}


class BackendConfigError(ValueError):
    pass


def host_backend_from_config(path: Path) -> NodeHostBackend:
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise BackendConfigError(f"cannot read {path}: {err}") from None
    section = data.get("libvirt")
    if not isinstance(section, dict):
        raise BackendConfigError(f"{path}: a [libvirt] table is needed for the host backend")
    images = section.get("images", {})
    if not isinstance(images, dict) or not all(isinstance(v, str) for v in images.values()):
        raise BackendConfigError(f"{path}: [libvirt.images] maps image names to sha256 strings")
    probe_kind = section.get("readiness", "guest-agent")
    if probe_kind not in READINESS:
        raise BackendConfigError(f"{path}: readiness must be one of {', '.join(READINESS)}")
    readiness: ReadinessProbe = READINESS[probe_kind]()
    try:
        slices = LibvirtSliceBackend(
            str(section.get("uri", "qemu:///system")),
            image_dir=Path(section["image_dir"]),
            image_catalog={str(k): v.lower() for k, v in images.items()},
            seed_dir=Path(section["seed_dir"]),
            state_dir=Path(section["state_dir"]),
            readiness=readiness,
            gpu_health=SysfsGpuHealthCheck() if section.get("check_gpu_health", True) else None,
            networks=(
                SliceNetworks(uplink=section.get("uplink"))
                if section.get("bridge_per_allocation", True)
                else None
            ),
        )
    except KeyError as err:
        raise BackendConfigError(f"{path}: [libvirt] needs {err.args[0]}") from None
    return NodeHostBackend(slice=slices, baremetal=None)
