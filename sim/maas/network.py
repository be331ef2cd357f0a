"""Interface links and addresses, as models/interface.py keeps them: AUTO links get an address
when deployment starts and lose it on release, an enabled interface left without links gets a
`link_up` one, and commissioning links the boot interface AUTO to the subnet it booted from."""

from __future__ import annotations

import ipaddress

from sim.maas.model import AUTO, DHCP, LINK_UP, STATIC, Interface, Link, Machine, Subnet
from sim.maas.region import Region

# Addresses MAAS hands out start here, clear of the routers and services at the bottom.
_FIRST_HOST_OFFSET = 10


def used_addresses(region: Region) -> set[str]:
    used = {
        link.ip_address
        for machine in region.machines.values()
        for iface in machine.interfaces
        for link in iface.links
        if link.ip_address
    }
    used.update(s.gateway_ip for s in region.subnets.values() if s.gateway_ip)
    return used


def allocate_ip(
    region: Region,
    subnet: Subnet,
    preferred: str | None = None,
    dynamic: bool = False,
    used: set[str] | None = None,
) -> str | None:
    """The preferred address if free and in the subnet, else the lowest free one (outside the
    dynamic range for AUTO/STATIC, inside it for a DHCP lease). `used`: the region's used
    addresses when the caller keeps them (seeding tens of thousands of machines would
    otherwise gather them again for each one)."""
    if used is None:
        used = used_addresses(region)
    network = subnet.network
    if preferred and preferred not in used and ipaddress.ip_address(preferred) in network:
        return preferred
    for index, host in enumerate(network.hosts()):
        address = str(host)
        if network.prefixlen < 30 and index < _FIRST_HOST_OFFSET - 1 and not dynamic:
            continue
        if address in used or subnet.in_dynamic_range(address) != dynamic:
            continue
        return address
    return None


def add_link(
    region: Region, iface: Interface, mode: str, subnet: Subnet | None, ip: str | None = None
) -> Link:
    # A real link replaces the placeholder link_up one.
    if mode != LINK_UP:
        iface.links = [link for link in iface.links if link.mode != LINK_UP]
    if subnet is not None and iface.vlan is None:
        iface.vlan = subnet.vlan
    link = Link(region.next_id("link"), mode, subnet, ip)
    iface.links.append(link)
    return link


def ensure_link_up(region: Region, iface: Interface) -> None:
    if iface.enabled and not iface.links:
        iface.links.append(Link(region.next_id("link"), LINK_UP))


def unlink(region: Region, iface: Interface, link_id: int) -> None:
    iface.links = [link for link in iface.links if link.id != link_id]
    ensure_link_up(region, iface)


def reset_links_after_commissioning(region: Region, machine: Machine, pxe_linked: bool) -> None:
    """The boot interface AUTO on the subnet it booted from; the others link_up."""
    boot = machine.boot_interface
    for iface in machine.interfaces:
        iface.links = []
        if iface is boot and pxe_linked and iface.cabled_subnet is not None:
            add_link(region, iface, AUTO, iface.cabled_subnet)
        ensure_link_up(region, iface)


def has_deployable_network(machine: Machine) -> bool:
    """Node._start_deployment: some link other than link_up must carry a subnet."""
    return any(
        link.mode != LINK_UP and link.subnet is not None
        for iface in machine.interfaces
        for link in iface.links
    )


def claim_auto_ips(region: Region, machine: Machine, used: set[str] | None = None) -> None:
    """`used`, when given, is the region's used addresses, kept up to date here."""
    for iface in machine.interfaces:
        for link in iface.links:
            if link.mode == AUTO and link.subnet is not None and not link.ip_address:
                link.ip_address = allocate_ip(region, link.subnet, iface.planned_ip, used=used)
                if used is not None and link.ip_address:
                    used.add(link.ip_address)


def lease_dhcp_ips(region: Region, machine: Machine) -> None:
    """A deployed OS that asked for DHCP shows its lease as the link's address."""
    for iface in machine.interfaces:
        for link in iface.links:
            if link.mode == DHCP and link.subnet is not None and not link.ip_address:
                link.ip_address = allocate_ip(region, link.subnet, dynamic=True)


def release_ips(machine: Machine) -> None:
    """Release gives back AUTO addresses and DHCP leases; STATIC ones stay with the machine."""
    for iface in machine.interfaces:
        for link in iface.links:
            if link.mode in (AUTO, DHCP):
                link.ip_address = None


def primary_link(machine: Machine) -> Link | None:
    """The link whose address the product treats as the machine's address: the boot
    interface's first addressed link, else any addressed link."""
    boot = machine.boot_interface
    candidates = list(boot.links) if boot else []
    candidates += [link for iface in machine.interfaces for link in iface.links]
    return next((link for link in candidates if link.ip_address and link.mode != STATIC), None) or (
        next((link for link in candidates if link.ip_address), None)
    )
