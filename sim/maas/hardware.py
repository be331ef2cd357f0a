"""The physical machine behind a MAAS record and what MAAS learns of it: a record with power
type ipmi is the machine whose BMC answers at its power address; commissioning (and enlistment)
report its CPUs, memory, NICs and disks; commissioning leaves links and a layout behind."""

from __future__ import annotations

from sim.maas import faults as F
from sim.maas import network, storage
from sim.maas.enums import NodeStatus
from sim.maas.model import Interface, Machine
from sim.maas.region import Region
from sim.maas.scenario import Timings


def timings(region: Region, machine: Machine) -> Timings:
    return machine.hardware.timings if machine.hardware else region.scenario.timings


def machine_faults(machine: Machine) -> F.FaultSet:
    return machine.hardware.faults if machine.hardware else F.FaultSet()


def link_hardware(region: Region, machine: Machine) -> None:
    """Machines with power_type ipmi are the physical machine whose BMC has that address."""
    address = machine.power_address
    machine.hardware = (
        region.hardware_at(address) if address and machine.power_type == "ipmi" else None
    )


def discover_hardware(
    region: Region, machine: Machine, networking: bool = True, disks: bool = True
) -> None:
    """What the commissioning scripts report: CPU, memory, NICs and disks (by MAC / serial, so
    ids survive a recommission); a BOSS disk is absent when that fault is armed."""
    hardware = machine.hardware
    if hardware is None:
        return
    spec = hardware.spec
    machine.architecture = machine.architecture or spec.architecture
    machine.cpu_count = spec.cpu_count
    machine.memory = spec.memory
    if networking:
        known = {i.mac_address: i for i in machine.interfaces}
        interfaces = []
        for ispec in spec.interfaces:
            cabled = region.subnet_by_ref(ispec.subnet) if ispec.subnet else None
            port_vlan = cabled.vlan if cabled else None
            if port_vlan is None and ispec.vid is not None:
                fabric = region.fabric_named(ispec.fabric or "fabric-0")
                port_vlan = region.vlan_on(fabric, ispec.vid)
            iface = known.get(ispec.mac) or Interface(
                id=region.next_id("interface"),
                name=ispec.name,
                mac_address=ispec.mac,
                vlan=port_vlan,
            )
            iface.name, iface.speed = ispec.name, ispec.speed
            iface.vendor, iface.product = ispec.vendor, ispec.product
            iface.cabled_subnet, iface.planned_ip = cabled, ispec.ip
            iface.link_connected = port_vlan is not None
            if port_vlan is not None and iface.vlan is None:
                iface.vlan = port_vlan
            interfaces.append(iface)
            if ispec.pxe:
                machine.boot_interface_id = iface.id
        machine.interfaces = interfaces
    if disks:
        boss_missing = hardware.faults.has(F.BOSS_DISK_MISSING)
        known_disks = {(d.name, d.serial): d for d in machine.block_devices}
        machine.block_devices = [
            known_disks.get((d.name, d.serial)) or storage.device_from_spec(region, d)
            for d in spec.block_devices
            if not (boss_missing and d.looks_like_boss)
        ]
        if machine.boot_disk_id is not None and machine.block_device(machine.boot_disk_id) is None:
            machine.boot_disk_id = None


def apply_commissioning_config(
    region: Region, machine: Machine, networking: bool = True, disks: bool = True
) -> None:
    """What commissioning leaves behind: the boot interface linked AUTO (unless the PXE link
    fault is armed) and the default flat layout on the boot disk."""
    if networking:
        pxe_linked = not machine_faults(machine).has(F.PXE_UNLINKED)
        network.reset_links_after_commissioning(region, machine, pxe_linked)
    if disks and machine.block_devices:
        storage.apply_layout(region, machine, "flat")


def new_machine(region: Region, hostname: str, status: NodeStatus) -> Machine:
    machine = Machine(system_id=region.new_system_id(), hostname=hostname, status=status)
    region.machines[machine.system_id] = machine
    return machine


def ipmi_parameters(address: str, user: str, password: str) -> dict[str, object]:
    return {
        "power_driver": "LAN_2_0",
        "power_boot_type": "auto",
        "power_address": address,
        "power_user": user,
        "power_pass": password,
        "k_g": "",
        "cipher_suite_id": "3",
        "privilege_level": "ADMIN",
        "workaround_flags": ["opensesspriv"],
        "mac_address": "",
        "power_off_mode": "hard",
    }
