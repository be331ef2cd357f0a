"""A region built from a scenario: networks, physical machines, and the MAAS records of the
machines the scenario says are enlisted, in the status it gives them, with what MAAS would know
about them in that status (hardware, links, layout, owner, addresses, node key, sync fields)."""

from __future__ import annotations

from sim.maas import hardware, hwsync, lifecycle, network, storage
from sim.maas.enums import NodeStatus, PowerState, ScriptStatus
from sim.maas.faults import FaultSet
from sim.maas.model import Hardware, Subnet
from sim.maas.region import Region
from sim.maas.scenario import MachineSpec, Scenario, ScenarioError

S = NodeStatus
# Statuses a scenario machine may start in: resting ones (transitions start through the API).
_SEEDABLE = frozenset(
    {
        S.NEW, S.READY, S.ALLOCATED, S.DEPLOYED, S.BROKEN, S.FAILED_COMMISSIONING,
        S.FAILED_DEPLOYMENT, S.FAILED_DISK_ERASING, S.FAILED_TESTING, S.RESERVED, S.RETIRED,
        S.MISSING,
    }
)  # fmt: skip
_OWNED = frozenset({S.ALLOCATED, S.DEPLOYED, S.FAILED_DEPLOYMENT, S.RESERVED})


def build_region(scenario: Scenario, time_scale: float | None = None) -> Region:
    region = Region(scenario, time_scale)
    region.default_vlan()
    for net in scenario.subnets:
        vlan = region.vlan_on(region.fabric_named(net.fabric), net.vid)
        vlan.mtu, vlan.dhcp_on = net.mtu, net.dhcp_on
        region.add_subnet(
            Subnet(
                id=region.next_id("subnet"),
                name=net.name,
                cidr=net.cidr,
                vlan=vlan,
                gateway_ip=net.gateway_ip,
                dns_servers=net.dns_servers,
                dynamic_range=net.dynamic_range,
                managed=net.managed,
                space=net.space,
            )
        )
    used = network.used_addresses(region)  # kept up to date by each deployed machine seeded
    for spec in scenario.machines:
        if spec.enlisted and spec.status not in _SEEDABLE:
            raise ScenarioError(
                f"machine {spec.hostname}: cannot start in {spec.status.label}; start it "
                "Ready/Allocated/... and drive the transition through the API"
            )
        # A deployed machine runs its OS unless the scenario says otherwise.
        default_power = PowerState.ON if spec.status == S.DEPLOYED else PowerState.OFF
        power = spec.power or default_power
        physical = Hardware(
            spec=spec,
            faults=FaultSet.of(spec.faults),
            timings=scenario.timings_for(spec),
            power=power,
        )
        region.hardware[spec.bmc.address] = physical
        if spec.enlisted:
            _seed_machine(region, physical, used)
    return region


def _seed_machine(region: Region, physical: Hardware, used: set[str]) -> None:
    spec: MachineSpec = physical.spec
    machine = hardware.new_machine(region, spec.hostname, spec.status)
    if spec.system_id:
        region.machines.pop(machine.system_id)
        machine.system_id = spec.system_id
        region.machines[machine.system_id] = machine
    machine.description = spec.description
    machine.architecture = spec.architecture
    machine.power_parameters = hardware.ipmi_parameters(
        spec.bmc.address, spec.bmc.user, spec.bmc.password
    )
    hardware.link_hardware(region, machine)
    hardware.discover_hardware(region, machine)
    if spec.status == S.NEW:
        for iface in machine.interfaces:
            network.ensure_link_up(region, iface)
        return
    if spec.boot_disk is not None:
        chosen = next((d for d in machine.block_devices if d.name == spec.boot_disk), None)
        machine.boot_disk_id = chosen.id if chosen else None
    hardware.apply_commissioning_config(region, machine)
    machine.commissioning_status = ScriptStatus.PASSED
    machine.testing_status = ScriptStatus.PASSED
    if spec.status in _OWNED or (spec.status == S.BROKEN and spec.owner):
        machine.owner = spec.owner or region.site.admin_user
    if spec.status == S.DEPLOYED:
        _seed_deployed(region, machine.system_id, spec, used)
    if spec.status == S.BROKEN:
        machine.previous_status = S.READY


def _seed_deployed(region: Region, system_id: str, spec: MachineSpec, used: set[str]) -> None:
    machine = region.machines[system_id]
    machine.osystem = spec.osystem
    machine.distro_series = spec.distro_series or region.site.default_distro_series
    network.claim_auto_ips(region, machine, used)
    network.lease_dhcp_ips(region, machine)
    used.update(link.ip_address for i in machine.interfaces for link in i.links if link.ip_address)
    lifecycle.ensure_node_key(region, machine)
    if spec.enable_hw_sync:
        hwsync.set_enable_hw_sync(region, machine, True)
        machine.deployed_sync = region.wall_now()
    if not storage.has_root_filesystem(machine) and machine.block_devices:
        storage.apply_layout(region, machine, "flat")
