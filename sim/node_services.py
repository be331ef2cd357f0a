"""Node services for simulated machines: the agent's backends when there is no hardware.

- `machine_services(machine)`: the production services (agent/backends/from_config.py) on a
  simulated machine's disk (sim/machine_image.py): libvirt's test driver, the account files,
  the stand-in sysfs and nvidia-smi. This is what `--hosts libvirt-test` runs.
- `simulated_services(...)`: a `SimulatedHost` (phase delays, faults: sim/host.py) for the
  allocation tasks, and the production maintenance backend on a machine's disk for the node
  tasks. This is the plugin `gpucloud-agent --backend simulated` loads through the entry point
  `gpucloud.agent.backends` (pyproject.toml), and the fleet's default.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from activities.storage_provider import STORAGE_ROOT_ENV
from agent.backends.from_config import node_services_from_config
from agent.backends.system_root import SystemRoot
from agent.config_file import read_agent_config
from agent.main import BackendContext
from agent.maintenance import MaintenanceBackend
from agent.node_worker import NodeServices
from agent.storage_mounts import GuestFilesystems, StorageMountBackend, StorageMountConfig
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from sim.machine_image import Machine, build_machine
from sim.terminal import SimulatedShell


def machine_services(machine: Machine, *, hostname: str | None = None) -> NodeServices:
    """The production node services on `machine`'s disk, configured by its image's drop-in."""
    config = read_agent_config(machine.root / "etc/gpucloud/agent.d/50-machine.toml")
    return node_services_from_config(config, SystemRoot(machine.root), hostname=hostname)


def machine_maintenance(directory: Path, *, key: str | None = None) -> MaintenanceBackend:
    """The production maintenance backend on a fresh simulated machine at `directory`."""
    machine = build_machine(directory, address="127.0.0.1", machine_key=key or directory.name)
    return machine_services(machine).maintenance


def simulated_storage(
    root: SystemRoot, guests: GuestFilesystems | None = None
) -> StorageMountBackend | None:
    """Storage mounts on a simulated machine's disk. The simulated machines run on the worker's
    computer, so they see the shared directory provider's tree where the worker keeps it
    (GPUCLOUD_STORAGE_ROOT, activities/storage_provider.py); unset: no storage on the node.
    `guests`: the node's slice VMs (a libvirt-test host's slice backend)."""
    export = os.environ.get(STORAGE_ROOT_ENV)
    if not export:
        return None
    return StorageMountBackend(root, StorageMountConfig(export_root=Path(export)), guests=guests)


def simulated_services(
    node_id: str, machine: Machine, *, hostname: str | None, config: SimHostConfig
) -> tuple[SimulatedHost, NodeServices]:
    host = SimulatedHost(node_id, hostname=hostname, config=config)
    return host, NodeServices(
        host=host,
        maintenance=machine_services(machine).maintenance,
        terminal=SimulatedShell(host, machine.directory / "terminal-homes"),
        storage=simulated_storage(SystemRoot(machine.root), guests=host),
    )


def simulated_node_services(context: BackendContext) -> NodeServices:
    """Entry point `simulated`: allocation tasks on a SimulatedHost, maintenance by the
    production backend on the agent's host root (GPUCLOUD_AGENT_ROOT: a simulated machine's
    disk). On the real root a throwaway machine is made instead, so no maintenance task ever
    touches this computer's own files."""
    if context.root.is_real_root:
        directory = Path(tempfile.mkdtemp(prefix=f"gpucloud-sim-{context.node_id[:8]}-"))
        machine = build_machine(directory, address=context.hostname, machine_key=context.node_id)
        maintenance = machine_services(machine).maintenance
        homes = directory / "terminal-homes"
        storage = simulated_storage(SystemRoot(machine.root))
    else:
        configured = node_services_from_config(
            context.config, context.root, hostname=context.hostname
        )
        maintenance = configured.maintenance
        homes = context.root.host_path("/home")
        # The config's [storage] (what cloud-init writes), else the provider's root from the env.
        storage = configured.storage or simulated_storage(context.root)
    host = SimulatedHost(
        context.node_id, hostname=context.hostname, config=SimHostConfig.from_env(context.node_id)
    )
    if storage is not None:
        storage.guests = host  # the slice VMs are the simulated host's, not the config's libvirt
    return NodeServices(
        host=host,
        maintenance=maintenance,
        terminal=SimulatedShell(host, homes),
        storage=storage,
    )
