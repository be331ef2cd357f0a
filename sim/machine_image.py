"""A simulated machine: the host a real `gpucloud-agent` runs on when there is no hardware.

`build_machine(directory, ...)` lays out, under `directory`:

  root/       what the deployed OS has at "/" (the agent runs with GPUCLOUD_AGENT_ROOT pointing
              here): account databases, home/, scratch/, tmp/, proc/ (pid 1 as root, mounts),
              sys/bus/pci/devices/<addr> per GPU (vendor 0x10de, a 3D-controller class, its NUMA
              node, a readable config space, bound to the host driver), usr/bin/nvidia-smi (a
              stand-in answering the read-only queries the agent makes: every GPU idle), and the
              image's agent drop-in etc/gpucloud/agent.d/50-machine.toml naming this machine's
              hypervisor (libvirt's test driver on host.xml), its guests' fixed address and the
              tenant-facing address; var/lib/gpucloud/images holds base images whose sha256 are
              the demo catalog's stand-in digests
  host.xml    the libvirt test-driver host with the machine's CPUs, NUMA cells and GPUs (each
              GPU's NUMA node the one its sysfs entry names; the test driver builds no NUMA
              cells from a custom file, so the slice backend reads the file's <topology> block)

Nothing here is agent code: it is the machine the agent finds. The agent itself is the
production one (agent/backends/from_config.py) reading this root.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.libvirt_hosts import (
    DEFAULT_IMAGES,
    GPU_CLASS,
    GPU_PRODUCT,
    NVIDIA_VENDOR,
    GpuPlacement,
    guest_address,
    host_xml,
    numa_cells,
    prepare_system_root,
    write_images,
)

HOST_GPU_DRIVER = "nvidia"
DROP_IN = "etc/gpucloud/agent.d/50-machine.toml"
DEFAULT_GPU_COUNT = 8


def default_gpus(count: int = DEFAULT_GPU_COUNT) -> tuple[GpuPlacement, ...]:
    """An 8-GPU HGX layout: half the GPUs on each of two NUMA nodes."""
    buses = (0x1B, 0x29, 0x3A, 0x4C, 0x9C, 0xAB, 0xBA, 0xCB)
    return tuple(
        GpuPlacement(f"0000:{buses[i % len(buses)]:02x}:00.0", 0 if i < count // 2 else 1)
        for i in range(count)
    )


_NVIDIA_SMI = '''#!{python}
"""nvidia-smi stand-in of a simulated machine: the read-only CSV queries the agent makes."""
import json, sys
gpus = json.loads({gpus!r})
args = sys.argv[1:]
if any(a.startswith("--query-gpu=") for a in args):
    for bus in gpus:
        print(f"0000{{bus.upper()}}, 0")  # nvidia-smi's bus ids: 8-digit domain
elif any(a.startswith("--query-compute-apps=") for a in args):
    pass
else:
    sys.exit(2)
'''


def _toml_str(value: str) -> str:
    return json.dumps(value)


@dataclass(frozen=True)
class Machine:
    directory: Path
    root: Path
    host_xml: Path
    address: str
    gpus: tuple[GpuPlacement, ...]

    @property
    def libvirt_uri(self) -> str:
        return f"test://{self.host_xml}"


def _write_sysfs(root: Path, gpus: Sequence[GpuPlacement]) -> None:
    drivers = root / "sys/bus/pci/drivers" / HOST_GPU_DRIVER
    drivers.mkdir(parents=True, exist_ok=True)
    devices = root / "sys/bus/pci/devices"
    devices.mkdir(parents=True, exist_ok=True)
    vendor, device = int(NVIDIA_VENDOR, 16), int(GPU_PRODUCT[0], 16)
    for gpu in gpus:
        path = devices / gpu.pci_address
        path.mkdir(exist_ok=True)
        (path / "vendor").write_text(f"{NVIDIA_VENDOR}\n")
        (path / "device").write_text(f"{GPU_PRODUCT[0]}\n")
        # 24 bits, as the kernel writes it: class, subclass, programming interface.
        (path / "class").write_text(f"{GPU_CLASS}\n")
        (path / "numa_node").write_text(f"{gpu.numa_node}\n")
        header = vendor.to_bytes(2, "little") + device.to_bytes(2, "little")
        (path / "config").write_bytes(header + bytes(252))
        link = path / "driver"
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(drivers, path))


def build_machine(
    directory: Path,
    *,
    address: str,
    gpus: Sequence[GpuPlacement] = (),
    images: Iterable[str] = (),
    machine_key: str | None = None,
) -> Machine:
    """Lay out (or refresh) the machine under `directory`; existing accounts and data stay."""
    directory = directory.resolve()
    gpus = tuple(gpus) or default_gpus()
    root = directory / "root"
    prepare_system_root(root)
    for sub in ("scratch", "tmp", "var/tmp", "var/lib", "proc/1", "proc/self", "usr/bin"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "proc/1/status").write_text("Name:\tinit\nUid:\t0\t0\t0\t0\n")
    (root / "proc/self/mounts").write_text("/dev/sda2 / ext4 rw 0 0\nproc /proc proc rw 0 0\n")
    _write_sysfs(root, gpus)
    smi = root / "usr/bin/nvidia-smi"
    smi.write_text(
        _NVIDIA_SMI.format(python=sys.executable, gpus=json.dumps([g.pci_address for g in gpus]))
    )
    smi.chmod(0o755)
    xml = directory / "host.xml"
    xml.write_text(host_xml(numa_cells((), gpus), gpus))
    catalog = write_images(root / "var/lib/gpucloud/images", [*DEFAULT_IMAGES, *images])
    machine = Machine(directory, root, xml, address, gpus)
    drop_in = root / DROP_IN
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    images_table = "\n".join(f"{_toml_str(k)} = {_toml_str(v)}" for k, v in catalog.items())
    drop_in.write_text(
        "# The simulated machine's own facts (sim/machine_image.py), as an OS image would ship\n"
        "# them beside the agent.toml that cloud-init writes.\n"
        "[host]\n"
        f"connect_host = {_toml_str(address)}\n\n"
        "[libvirt]\n"
        f"uri = {_toml_str(machine.libvirt_uri)}\n"
        'readiness = "fixed"\n'
        f"fixed_address = {_toml_str(guest_address(machine_key or address))}\n"
        "bridge_per_allocation = false\n"
        # The test driver's hostdevs do not go through a host driver: the check would read the
        # stand-in sysfs, which is fine, so it stays on.
        "check_gpu_health = true\n"
        f"image_dir = {_toml_str('/var/lib/gpucloud/images')}\n\n"
        "[libvirt.images]\n"
        f"{images_table}\n"
    )
    return machine
