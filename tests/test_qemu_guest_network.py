"""A real guest's NIC through the agent (libvirt's QEMU driver, TCG; see tests/test_qemu_guest.py
for the kernel-boot seam this reuses): the VM's tap is the agent's own, opened by libvirt
unmanaged, on the allocation's segment, with no IPv6 address on it or on the segment's bridge, and
the guest's virtio NIC gets the segment's MTU from the domain's `<mtu>`.

The segment crosses a stand-in uplink (a veth end with a TEST-NET address, made here in the
host's namespace, where libvirtd runs, and removed at the end) over VXLAN, so its MTU is
1500 - 50 = 1450 and not the kernel's default. The guest's init loads virtio-net from the host's
own kernel modules and writes its NIC's MTU to the console with the marker line.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from agent.backends.domain_xml import parse_domain
from agent.network import Vxlan
from agent.network.allocation_network import segment_bridge_name, segment_member_name
from agent.network.slice_networks import SliceNetworks
from tests.test_agent_libvirt import RecordingProgress
from tests.test_qemu_guest import (
    MARKER,
    build_initramfs,
    guest_kernel,
    real_guest,
    workdir,  # noqa: F401 - the fixture
)

# virtio-net and what it needs, in load order (Debian builds them as modules).
MODULES = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko",
    "drivers/virtio/virtio_pci.ko",
    "net/core/failover.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko",
)
VLAN_ID = 3901
UPLINK_ADDRESS = "198.51.100.77"  # TEST-NET-2, on a veth of this test's own

INIT = f"""#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
for module in /lib/gpucloud/*.ko; do /bin/busybox insmod "$module"; done
for word in $(/bin/busybox cat /proc/cmdline); do
    case "$word" in gpucloud.alloc=*) alloc="${{word#gpucloud.alloc=}}" ;; esac
done
nic=none; mtu=none
for i in $(/bin/busybox seq 1 100); do
    for path in /sys/class/net/*; do
        [ "${{path##*/}}" = lo ] && continue
        nic="${{path##*/}}"; mtu="$(/bin/busybox cat "$path/mtu")"
    done
    [ "$nic" != none ] && break
    /bin/busybox sleep 0.1
done
echo "{MARKER} $alloc $(/bin/busybox uname -r) nic=$nic mtu=$mtu"
exec /bin/busybox sleep 100000
"""


@pytest.fixture
def uplink() -> Iterator[str]:
    """A stand-in for the node's uplink (one end of a veth pair), in the host's namespace, with
    an address for the VXLAN to send from; removed (both ends) at the end."""
    name = f"gcqu{os.getpid() % 100000}"
    with IPRoute() as ipr:
        try:
            ipr.link("add", ifname=name, kind="veth", peer=f"{name}p")
        except NetlinkError as exc:  # no veth in this kernel: nothing to stand in
            pytest.skip(f"cannot make a stand-in uplink here: {exc}")
        for end in (f"{name}p", name):
            index = ipr.link_lookup(ifname=end)[0]
            ipr.link("set", index=index, mtu=1500, state="up")
        ipr.addr("add", index=index, address=UPLINK_ADDRESS, prefixlen=32)
    try:
        yield name
    finally:
        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=name):
                ipr.link("del", index=index)


def ipv6_addresses(name: str) -> list[str]:
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=name)[0]
        return [a.get("address") for a in ipr.get_addr(index=index, family=socket.AF_INET6)]


def test_a_real_guests_tap_has_no_ipv6_and_the_guest_gets_the_segment_mtu(
    qemu_connection: Any,
    workdir: Path,  # noqa: F811 - the fixture imported above
    uplink: str,
) -> None:
    kernel = guest_kernel()
    assert kernel is not None, "no /boot/vmlinuz-* (bin/bootstrap installs linux-image-amd64)"
    release_name = kernel.name.removeprefix("vmlinuz-")
    initrd = workdir / "initramfs.cpio.gz"
    build_initramfs(initrd, INIT, kernel_release=release_name, modules=MODULES)
    allocation = f"qnet{os.getpid()}"
    probe, backend, spec, release = real_guest(
        qemu_connection,
        workdir,
        kernel,
        initrd,
        allocation,
        SliceNetworks(uplink=uplink, encapsulation=Vxlan()),
        vlan_id=VLAN_ID,
    )
    tap, bridge = segment_member_name(allocation), segment_bridge_name(VLAN_ID)
    started = time.monotonic()
    try:
        backend.provision_slice_vm(spec, RecordingProgress())
        booted_s = time.monotonic() - started
        # The guest's virtio NIC took the segment's MTU (VXLAN leaves 1450 of the uplink's 1500).
        assert probe.seen.startswith(f"{MARKER} {allocation} {release_name} "), probe.seen
        assert probe.seen.endswith(" mtu=1450"), probe.seen
        live = qemu_connection.lookupByName(f"gpc-{allocation}").XMLDesc(0)
        assert parse_domain(live).interfaces == ((tap, 1450),)
        assert "type='ethernet'" in live
        with IPRoute() as ipr:
            (link,) = ipr.get_links(ipr.link_lookup(ifname=tap)[0])
            (bridge_link,) = ipr.get_links(ipr.link_lookup(ifname=bridge)[0])
        assert link.get("master") == bridge_link["index"]
        assert link.get("mtu") == bridge_link.get("mtu") == 1450
        assert link.get("operstate") == "UP"  # QEMU holds the tap: carrier on
        # Up, with carrier, and still no IPv6 address: none on the tap, none on the bridge.
        for name in (tap, bridge):
            assert ipv6_addresses(name) == [], name
            assert Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6").read_text().strip() == "1"
        print(f"guest up in {booted_s:.1f}s: {probe.seen}")
    finally:
        released = backend.release_slice_vm(release, RecordingProgress())
    assert released.released
    assert not Path(f"/sys/class/net/{tap}").exists()
    assert not Path(f"/sys/class/net/{bridge}").exists()
