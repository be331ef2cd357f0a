"""A slice VM on the libvirt backend gets its own bridge (pyroute2, in a test network namespace):
the domain's NIC is on it while the VM lives, and release removes it. The VM's tap is the agent's:
on the bridge, at the bridge's MTU (which the domain's `<mtu>` hands the guest), and without any
IPv6 address (IPv6 off on it, and on the bridge: the host is no IPv6 neighbour of a slice)."""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest
from pyroute2 import IPRoute

from agent.backends import FixedAddressProbe
from agent.backends.domain_xml import parse_domain
from agent.backends.libvirt_slice import LibvirtSliceBackend
from agent.network import Vxlan
from agent.network.allocation_network import (
    bridge_name,
    segment_bridge_name,
    segment_member_name,
    tap_names,
)
from agent.network.slice_networks import SliceNetworks
from tests.disk_images import write_base_image
from tests.slice_vlan_rig import in_netns
from tests.test_agent_libvirt import IMAGE, provision_spec, release_spec
from tests.test_agent_network import add_uplink, links_by_name, require_support

HOST_XML = Path(__file__).parent / "data" / "libvirt" / "host.xml"


class Silent:
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def cancelled(self) -> bool:
        return False

    def wait(self, seconds: float | None) -> None:
        pass

    def suspend_heartbeats(self) -> None:
        pass


@pytest.fixture
def backend(tmp_path: Path, ns: str) -> Iterator[tuple[LibvirtSliceBackend, Any]]:
    (tmp_path / "images").mkdir()
    content = write_base_image(tmp_path / "images" / IMAGE)
    conn = libvirt.open(f"test://{HOST_XML}")
    yield (
        LibvirtSliceBackend(
            f"test://{HOST_XML}",
            image_dir=tmp_path / "images",
            image_catalog={IMAGE: hashlib.sha256(content).hexdigest()},
            seed_dir=tmp_path / "seeds",
            state_dir=tmp_path / "state",
            readiness=FixedAddressProbe("10.20.0.5"),
            connection=conn,
            poll_interval_s=0.05,
            networks=SliceNetworks(netns=ns),
        ),
        conn,
    )
    conn.close()


def test_slice_vm_gets_its_own_bridge_and_release_removes_it(
    backend: tuple[LibvirtSliceBackend, Any], ns: str
) -> None:
    slices, conn = backend
    spec = provision_spec()
    bridge = bridge_name(spec.allocation_id)

    slices.provision_slice_vm(spec, Silent())  # type: ignore[arg-type]
    assert bridge in links_by_name(ns)
    xml = conn.lookupByName(f"gpc-{spec.allocation_id}").XMLDesc(0)
    assert "<interface type='bridge'>" in xml
    assert f"<source bridge='{bridge}'/>" in xml

    slices.release_slice_vm(release_spec(spec.allocation_id), Silent())  # type: ignore[arg-type]
    assert bridge not in links_by_name(ns)


def ipv6_addresses(ns: str, name: str) -> list[str]:
    """`ip -6 addr show dev <name>`, through pyroute2."""
    with IPRoute(netns=ns, flags=0) as ipr:
        index = ipr.link_lookup(ifname=name)[0]
        return [a.get("address") for a in ipr.get_addr(index=index, family=socket.AF_INET6)]


def ipv6_disabled(ns: str, name: str) -> bool:
    """`net.ipv6.conf.<name>.disable_ipv6`, read inside the namespace."""
    path = Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6")
    return in_netns(ns, lambda: path.read_text().strip()) == "1"


def interface_xml(conn: Any, allocation_id: str) -> ET.Element:
    root = ET.fromstring(conn.lookupByName(f"gpc-{allocation_id}").XMLDesc(0))  # noqa: S314
    (iface,) = root.findall("devices/interface")
    return iface


def test_the_vms_tap_is_the_agents_with_the_bridges_mtu_and_no_ipv6(
    backend: tuple[LibvirtSliceBackend, Any], ns: str
) -> None:
    slices, conn = backend
    spec = provision_spec()
    bridge, (tap,) = bridge_name(spec.allocation_id), tap_names(spec.allocation_id, 1)

    nic = slices.networks.prepare_nic(spec.allocation_id, None)  # type: ignore[union-attr]
    assert (nic.bridge, nic.tap, nic.mtu) == (bridge, tap, 1500)
    slices.provision_slice_vm(spec, Silent())  # type: ignore[arg-type]
    links = links_by_name(ns)
    assert links[tap].get(("linkinfo", "kind")) == "tun"
    assert links[tap].get("master") == links[bridge]["index"]
    assert links[tap].get("ifalias") == f"gpucloud:alloc:{spec.allocation_id}"
    assert links[tap].get("mtu") == links[bridge].get("mtu") == 1500
    for name in (tap, bridge):  # the host is no IPv6 neighbour of the slice on either
        assert links[name]["flags"] & 0x1  # up (a link-local would have come with that)
        assert ipv6_addresses(ns, name) == [], name
        assert ipv6_disabled(ns, name), name
    # The guest learns the bridge's MTU from the domain.
    assert interface_xml(conn, spec.allocation_id).find("mtu").get("size") == "1500"  # type: ignore[union-attr]
    facts = parse_domain(conn.lookupByName(f"gpc-{spec.allocation_id}").XMLDesc(0))
    assert [mtu for _, mtu in facts.interfaces] == [1500]

    slices.release_slice_vm(release_spec(spec.allocation_id), Silent())  # type: ignore[arg-type]
    assert tap not in links_by_name(ns)


def test_a_vxlan_segments_vm_gets_the_mtu_the_encapsulation_leaves(tmp_path: Path, ns: str) -> None:
    require_support(ns, Vxlan())
    add_uplink(ns)  # 1500, with an address for the VXLAN to send from
    (tmp_path / "images").mkdir()
    content = write_base_image(tmp_path / "images" / IMAGE)
    conn = libvirt.open(f"test://{HOST_XML}")
    slices = LibvirtSliceBackend(
        f"test://{HOST_XML}",
        image_dir=tmp_path / "images",
        image_catalog={IMAGE: hashlib.sha256(content).hexdigest()},
        seed_dir=tmp_path / "seeds",
        state_dir=tmp_path / "state",
        readiness=FixedAddressProbe("10.20.0.5"),
        connection=conn,
        poll_interval_s=0.05,
        networks=SliceNetworks(uplink="uplink0", netns=ns, encapsulation=Vxlan()),
    )
    spec = dataclasses.replace(provision_spec(), vlan_id=100)
    bridge, member = segment_bridge_name(100), segment_member_name(spec.allocation_id)
    try:
        slices.provision_slice_vm(spec, Silent())  # type: ignore[arg-type]
        links = links_by_name(ns)
        # The allocation's member link is the VM's NIC: on the segment, at its MTU, no IPv6.
        assert links[member].get("master") == links[bridge]["index"]
        assert links[member].get("mtu") == links[bridge].get("mtu") == 1500 - 50
        for name in (member, bridge):
            assert ipv6_addresses(ns, name) == [], name
            assert ipv6_disabled(ns, name), name
        iface = interface_xml(conn, spec.allocation_id)
        assert iface.find("mtu").get("size") == "1450"  # type: ignore[union-attr]
        assert iface.find("source").get("bridge") == bridge  # type: ignore[union-attr]
        slices.release_slice_vm(release_spec(spec.allocation_id), Silent())  # type: ignore[arg-type]
        assert not {member, bridge} & set(links_by_name(ns))
    finally:
        conn.close()


def test_an_existing_taps_link_local_address_goes_when_the_network_is_applied(ns: str) -> None:
    """A tap an older agent left with a link-local address (IPv6 on): the next prepare takes
    the address away and turns IPv6 off."""
    nets = SliceNetworks(netns=ns)
    nic = nets.prepare_nic("old-1", None)
    with IPRoute(netns=ns, flags=0) as ipr:
        index = ipr.link_lookup(ifname=nic.tap)[0]
        in_netns(
            ns, lambda: Path(f"/proc/sys/net/ipv6/conf/{nic.tap}/disable_ipv6").write_text("0")
        )
        ipr.addr("add", index=index, address="fe80::1", prefixlen=64)
    assert ipv6_addresses(ns, nic.tap) == ["fe80::1"]
    assert nets.prepare_nic("old-1", None) == nic
    assert ipv6_addresses(ns, nic.tap) == []
    assert ipv6_disabled(ns, nic.tap)
    nets.remove("old-1")
