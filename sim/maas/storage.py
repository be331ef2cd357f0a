"""Block devices and storage layouts. A layout goes on the node's boot disk, which is the one
chosen with op=set_boot_disk, else the lowest-id physical disk of at least the minimum size
(models/node.py get_boot_disk). Only `flat` and `blank` are modelled: flat is a GPT table with an
EFI system partition at /boot/efi, an optional /boot, and / on the rest (or on root_device)."""

from __future__ import annotations

from sim.maas.errors import ApiError, field_errors
from sim.maas.model import BlockDevice, Machine, Partition
from sim.maas.region import Region
from sim.maas.scenario import BlockDeviceSpec

MIB = 1024**2
MIN_BOOT_DISK_SIZE = 4 * 1024**3
EFI_PARTITION_SIZE = 512 * MIB
# GPT headers and alignment that no partition can use (PARTITION_TABLE_EXTRA_SPACE).
PARTITION_TABLE_EXTRA_SPACE = 7 * MIB
PARTITION_ALIGNMENT = 4 * MIB
LAYOUTS = ("flat", "lvm", "bcache", "vmfs6", "vmfs7", "custom", "blank")
MODELLED_LAYOUTS = ("flat", "blank")


def device_from_spec(region: Region, spec: BlockDeviceSpec) -> BlockDevice:
    return BlockDevice(
        id=region.next_id("blockdevice"),
        name=spec.name,
        uuid=region.uuid(),
        model=spec.model,
        serial=spec.serial,
        id_path=spec.id_path,
        size=spec.size,
        block_size=spec.block_size,
        firmware_version=spec.firmware_version,
        tags=spec.tags,
    )


def default_boot_disk(machine: Machine) -> BlockDevice | None:
    candidates = [d for d in machine.block_devices if d.size >= MIN_BOOT_DISK_SIZE]
    return min(candidates, key=lambda d: d.id, default=None)


def boot_disk(machine: Machine) -> BlockDevice | None:
    if machine.boot_disk_id is not None:
        chosen = machine.block_device(machine.boot_disk_id)
        if chosen is not None:
            return chosen
    return default_boot_disk(machine)


def clear_layout(machine: Machine) -> None:
    for device in machine.block_devices:
        device.partitions = []


def has_root_filesystem(machine: Machine) -> bool:
    return any(p.mount_point == "/" for d in machine.block_devices for p in d.partitions)


def _align_down(size: int) -> int:
    return size - size % PARTITION_ALIGNMENT


def _usable(device: BlockDevice) -> int:
    return _align_down(device.size - PARTITION_TABLE_EXTRA_SPACE)


def available_size(device: BlockDevice) -> int:
    if not device.partitions:
        return device.size
    return max(0, _usable(device) - sum(p.size for p in device.partitions))


def _add_partition(
    region: Region,
    device: BlockDevice,
    size: int,
    fstype: str,
    mount_point: str,
    bootable: bool = False,
) -> None:
    device.partitions.append(
        Partition(
            id=region.next_id("partition"),
            uuid=region.uuid(),
            size=size,
            index=len(device.partitions) + 1,
            bootable=bootable,
            fstype=fstype,
            mount_point=mount_point,
            fs_uuid=region.uuid(),
            mount_options="umask=0077" if fstype == "fat32" else None,
            label="efi" if fstype == "fat32" else "",
        )
    )


def apply_layout(
    region: Region,
    machine: Machine,
    layout: str,
    root_device: BlockDevice | None = None,
    root_size: int | None = None,
    boot_size: int | None = None,
) -> None:
    """op=set_storage_layout (also run at the end of commissioning with `flat`)."""
    if layout not in LAYOUTS:
        message = f"Select a valid choice. {layout} is not one of the available choices."
        raise field_errors({"storage_layout": message})
    if layout not in MODELLED_LAYOUTS:
        # Not a MAAS answer: the simulator says plainly what it does not model.
        raise ApiError(400, {"storage_layout": [f"The simulator does not model '{layout}'."]})
    disk = boot_disk(machine)
    if disk is None:
        raise field_errors({"__all__": "Node doesn't have any storage devices to configure."})
    clear_layout(machine)
    if layout == "blank":
        return
    _add_partition(region, disk, EFI_PARTITION_SIZE, "fat32", "/boot/efi", bootable=True)
    if boot_size:
        _add_partition(region, disk, _align_down(boot_size), "ext4", "/boot")
    root = root_device or disk
    room = available_size(root) if root.partitions else _usable(root)
    size = min(_align_down(root_size), room) if root_size else room
    if size < PARTITION_ALIGNMENT:
        clear_layout(machine)
        raise field_errors({"root_size": "Size is too large to fit on the root device."})
    _add_partition(region, root, size, "ext4", "/")


def used_for(device: BlockDevice) -> str:
    count = len(device.partitions)
    if count == 0:
        return "Unused"
    return f"GPT partitioned with {count} partition{'s' if count > 1 else ''}"


def partition_used_for(partition: Partition) -> str:
    return f"{partition.fstype} formatted filesystem mounted at {partition.mount_point}"
