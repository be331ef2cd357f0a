"""The JSON the region answers with: machines (DISPLAYED_MACHINE_FIELDS), interfaces, links,
block devices, partitions, subnets, VLANs, fabrics and events."""

from __future__ import annotations

from typing import Any

from sim.maas import hwsync, storage
from sim.maas.clock import format_datetime, format_event_time
from sim.maas.enums import NodeStatus
from sim.maas.model import (
    BlockDevice,
    Event,
    Fabric,
    Interface,
    Link,
    Machine,
    Partition,
    Subnet,
    Vlan,
)
from sim.maas.region import Region

API = "/MAAS/api/2.0"


def vlan(v: Vlan) -> dict[str, Any]:
    return {
        "id": v.id,
        "vid": v.vid,
        "name": v.name,
        "fabric": v.fabric.name,
        "fabric_id": v.fabric.id,
        "mtu": v.mtu,
        "dhcp_on": v.dhcp_on,
        "external_dhcp": None,
        "relay_vlan": None,
        "primary_rack": "rack01" if v.dhcp_on else None,
        "secondary_rack": None,
        "space": "undefined",
        "description": "",
        "resource_uri": f"{API}/vlans/{v.id}/",
    }


def fabric(region: Region, f: Fabric) -> dict[str, Any]:
    return {
        "id": f.id,
        "name": f.name,
        "class_type": None,
        "description": "",
        "vlans": [vlan(v) for v in region.vlans.values() if v.fabric is f],
        "resource_uri": f"{API}/fabrics/{f.id}/",
    }


def subnet(s: Subnet) -> dict[str, Any]:
    return {
        "id": s.id,
        "name": s.name,
        "description": s.description,
        "vlan": vlan(s.vlan),
        "cidr": s.cidr,
        "gateway_ip": s.gateway_ip,
        "dns_servers": list(s.dns_servers),
        "rdns_mode": 2,
        "allow_dns": True,
        "allow_proxy": True,
        "active_discovery": False,
        "managed": s.managed,
        "disabled_boot_architectures": [],
        "space": s.space or "undefined",
        "resource_uri": f"{API}/subnets/{s.id}/",
    }


def link(lk: Link) -> dict[str, Any]:
    # `subnet` and `ip_address` are absent, not null, when unset.
    data: dict[str, Any] = {"id": lk.id, "mode": lk.mode}
    if lk.subnet is not None:
        data["subnet"] = subnet(lk.subnet)
    if lk.ip_address:
        data["ip_address"] = lk.ip_address
    return data


def interface(machine: Machine, i: Interface) -> dict[str, Any]:
    return {
        "id": i.id,
        "name": i.name,
        "type": "physical",
        "mac_address": i.mac_address,
        "vlan": vlan(i.vlan) if i.vlan else None,
        "enabled": i.enabled,
        "links": [link(lk) for lk in i.links],
        "params": "",
        "discovered": [],
        "effective_mtu": i.vlan.mtu if i.vlan else 1500,
        "parents": [],
        "children": [],
        "tags": [],
        "vendor": i.vendor,
        "product": i.product,
        "firmware_version": "22.31.6",
        "link_connected": i.link_connected,
        "interface_speed": i.speed,
        "link_speed": i.speed if i.link_connected else 0,
        "numa_node": 0,
        "sriov_max_vf": 0,
        "system_id": machine.system_id,
        "resource_uri": f"{API}/nodes/{machine.system_id}/interfaces/{i.id}/",
    }


def partition(machine: Machine, device: BlockDevice, p: Partition) -> dict[str, Any]:
    return {
        "id": p.id,
        "uuid": p.uuid,
        "size": p.size,
        "bootable": p.bootable,
        "tags": [],
        "type": "partition",
        "path": f"/dev/disk/by-dname/{device.name}-part{p.index}",
        "filesystem": {
            "fstype": p.fstype,
            "label": p.label,
            "uuid": p.fs_uuid,
            "mount_point": p.mount_point,
            "mount_options": p.mount_options,
        },
        "used_for": storage.partition_used_for(p),
        "device_id": device.id,
        "system_id": machine.system_id,
        "resource_uri": (
            f"{API}/nodes/{machine.system_id}/blockdevices/{device.id}/partition/{p.id}"
        ),
    }


def block_device(machine: Machine, d: BlockDevice) -> dict[str, Any]:
    available = storage.available_size(d)
    return {
        "id": d.id,
        "name": d.name,
        "uuid": d.uuid,
        "type": "physical",
        "path": f"/dev/disk/by-dname/{d.name}",
        "model": d.model,
        "serial": d.serial,
        "id_path": d.id_path,
        "size": d.size,
        "block_size": d.block_size,
        "available_size": available,
        "used_size": d.size - available,
        "used_for": storage.used_for(d),
        "tags": list(d.tags),
        "filesystem": None,
        "partition_table_type": d.partition_table_type,
        "partitions": [partition(machine, d, p) for p in d.partitions],
        "firmware_version": d.firmware_version,
        "storage_pool": None,
        "numa_node": 0,
        "system_id": machine.system_id,
        "resource_uri": f"{API}/nodes/{machine.system_id}/blockdevices/{d.id}/",
    }


def _datetime(region: Region, wall: float | None) -> str | None:
    return None if wall is None else format_datetime(wall, region.site.aware_datetimes)


# The REST hardware-sync fields (exposed since 3.4); a build without them omits all four.
SYNC_FIELDS = ("enable_hw_sync", "last_sync", "sync_interval", "next_sync")


def machine(region: Region, m: Machine) -> dict[str, Any]:
    boot_disk = storage.boot_disk(m)
    boot_iface = m.boot_interface
    devices = [block_device(m, d) for d in m.block_devices]
    last_sync = hwsync.last_sync(region, m)
    next_sync = last_sync + m.sync_interval if last_sync is not None and m.sync_interval else None
    domain = region.site.domain
    rendered: dict[str, Any] = {
        "system_id": m.system_id,
        "hostname": m.hostname,
        "fqdn": f"{m.hostname}.{domain}",
        "domain": {
            "authoritative": True,
            "ttl": None,
            "resource_record_count": 0,
            "name": domain,
            "id": 0,
            "is_default": True,
            "resource_uri": f"{API}/domains/0/",
        },
        "description": m.description,
        "owner": m.owner,
        "owner_data": {},
        "locked": False,
        "architecture": m.architecture,
        "cpu_count": m.cpu_count,
        "cpu_speed": 2400 if m.cpu_count else 0,
        "memory": m.memory,
        "storage": sum(d.size for d in m.block_devices) / 1_000_000,
        "swap_size": m.swap_size,
        "status": int(m.status),
        "status_name": m.status.label,
        "status_action": "",
        "status_message": region.status_message(m),
        "error_description": m.error_description,
        "osystem": m.osystem,
        "distro_series": m.distro_series,
        "hwe_kernel": m.hwe_kernel,
        "min_hwe_kernel": "",
        "netboot": m.status != NodeStatus.DEPLOYED,
        "ephemeral_deploy": False,
        "power_type": m.power_type,
        "power_state": m.power_state,
        "ip_addresses": m.ip_addresses,
        "boot_interface": interface(m, boot_iface) if boot_iface else None,
        "interface_set": [interface(m, i) for i in m.interfaces],
        "boot_disk": block_device(m, boot_disk) if boot_disk else None,
        "blockdevice_set": devices,
        "physicalblockdevice_set": devices,
        "virtualblockdevice_set": [],
        "volume_groups": [],
        "raids": [],
        "cache_sets": [],
        "bcaches": [],
        "special_filesystems": [],
        "bios_boot_method": "uefi",
        "zone": {
            "name": m.zone,
            "description": "",
            "id": 1,
            "resource_uri": f"{API}/zones/{m.zone}/",
        },
        "pool": {
            "name": m.pool,
            "description": "Default pool",
            "id": 0,
            "resource_uri": f"{API}/resourcepool/0/",
        },
        "tag_names": [],
        "node_type": 0,
        "node_type_name": "Machine",
        "pod": None,
        "is_dpu": False,
        "agent_name": m.agent_name,
        "commissioning_status": int(m.commissioning_status),
        "commissioning_status_name": m.commissioning_status.label,
        "testing_status": int(m.testing_status),
        "testing_status_name": m.testing_status.label,
        "hardware_info": _hardware_info(m),
        "numanode_set": [{"index": 0, "memory": m.memory, "cores": list(range(m.cpu_count))}],
        "enable_hw_sync": m.enable_hw_sync,
        "last_sync": _datetime(region, last_sync),
        "sync_interval": m.sync_interval,
        "next_sync": _datetime(region, next_sync),
        "resource_uri": f"{API}/machines/{m.system_id}/",
    }
    if not region.site.hw_sync_fields:
        for key in SYNC_FIELDS:
            del rendered[key]
    return rendered


def _hardware_info(m: Machine) -> dict[str, str]:
    unknown = "Unknown"
    spec = m.hardware.spec if m.hardware and m.cpu_count else None
    return {
        "system_vendor": spec.system_vendor if spec else unknown,
        "system_product": spec.system_product if spec else unknown,
        "system_family": unknown,
        "system_version": unknown,
        "system_sku": unknown,
        "system_serial": (spec.system_serial or spec.hostname.upper()) if spec else unknown,
        "cpu_model": "AMD EPYC 9454 48-Core Processor" if spec else unknown,
        "mainboard_vendor": spec.system_vendor if spec else unknown,
        "mainboard_product": unknown,
        "mainboard_serial": unknown,
        "mainboard_version": unknown,
        "mainboard_firmware_vendor": spec.system_vendor if spec else unknown,
        "mainboard_firmware_date": unknown,
        "mainboard_firmware_version": unknown,
        "chassis_vendor": unknown,
        "chassis_type": unknown,
        "chassis_serial": unknown,
        "chassis_version": unknown,
    }


def event(region: Region, e: Event) -> dict[str, Any]:
    return {
        "username": e.username,
        "node": e.system_id,
        "hostname": e.hostname,
        "id": e.id,
        "level": region.level_name(e.type.level),
        "created": format_event_time(e.created),
        "type": e.type.description,
        "description": e.description,
    }
