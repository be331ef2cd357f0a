"""Discovery: MAAS never talks to a BMC it does not know. Someone power-cycles it out of band;
the machine PXE boots into enlistment and registers itself as New (or completes the New record
the product created with that power address)."""

from __future__ import annotations

from sim.maas import network
from sim.maas.enums import NodeStatus
from sim.maas.hardware import discover_hardware, ipmi_parameters, link_hardware, new_machine
from sim.maas.lifecycle import set_hardware_power
from sim.maas.model import Hardware, Machine
from sim.maas.region import Region

S = NodeStatus


def power_cycle_bmc(region: Region, hardware: Hardware) -> str:
    """Someone power-cycles the BMC out of band (ipmitool, the BMC UI). A machine MAAS does not
    know (or knows only as New) PXE boots into enlistment and shows up as New afterwards."""
    known = [m for m in region.machines.values() if m.hardware is hardware]
    set_hardware_power(region, hardware, True)
    if any(m.status != S.NEW for m in known):
        return "booted"
    hardware.cancel_steps()
    region.schedule(hardware, hardware.timings.enlistment, lambda: enlist(region, hardware))
    return "enlisting"


def enlist(region: Region, hardware: Hardware) -> Machine:
    """AnonMachinesHandler.create from the enlistment environment: an existing New machine with
    the power address BMC detection reports is completed, else a New machine with a petname is
    created; BMC detection leaves a `maas` IPMI user behind."""
    detected = hardware.spec.bmc.enlists_as
    existing = next(
        (m for m in region.machines_at_bmc(detected) if m.status in (S.NEW, S.COMMISSIONING)),
        None,
    )
    machine = existing or new_machine(region, region.petname(), S.NEW)
    if existing is None:
        machine.power_parameters = ipmi_parameters(detected, "maas", region.token_string(12))
    link_hardware(region, machine)
    discover_hardware(region, machine)
    for iface in machine.interfaces:
        network.ensure_link_up(region, iface)
    set_hardware_power(region, hardware, False)  # enlistment ends with a power off
    return machine
