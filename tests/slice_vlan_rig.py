"""A network rig for slice VLAN tests, in network namespaces on the real kernel (pyroute2):
nodes whose uplinks meet on a switch (a plain bridge in a namespace of its own, which carries
802.1Q-tagged frames as they are, like a trunk, and the nodes' VXLAN underlay: each uplink has
an address on one subnet, and the bridge carries their multicast and unicast UDP), and "VMs":
namespaces with one veth NIC whose other end is plugged into the bridge the agent answered, as
libvirt plugs a VM's tap, both ends with the bridge's MTU (libvirt gives a tap its bridge's; a
guest is told it, or configured with it).

Traffic is real: `reaches` is a UDP exchange both ways (the kernel resolves ARP first), and
`frames_from` lists every frame a VM's NIC received from a given MAC (an AF_PACKET capture
opened with the VM), so "never shares an L2 segment" is checked on the wire, ARP included.
`Rig.capture` opens such a capture on any link (a switch port), and `vxlan_frames` reads the
VXLAN packets among what it saw.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_ETH_P_ALL = 0x0003
UDP_PORT = 47000
SUBNET_PREFIX = 24
UNDERLAY_PREFIX = 24
_IP_UDP_HEADERS = 28  # what a datagram adds to its payload inside the MTU: IPv4 (20), UDP (8)


def in_netns(name: str, work: Callable[[], T]) -> T:
    """Run `work` on a thread that entered namespace `name` (setns is per thread); sockets it
    opens stay in that namespace whichever thread uses them afterwards."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
            result.append(work())
        except BaseException as exc:  # re-raised in the calling thread
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def index_of(ipr: Any, name: str) -> int:
    found = ipr.link_lookup(ifname=name)
    assert found, f"no link {name!r}"
    return int(found[0])


def links_of(ns: str) -> dict[str, Any]:
    with IPRoute(netns=ns, flags=0) as ipr:
        return {link.get("ifname"): link for link in ipr.get_links()}


def _link_supported(ns: str, **attrs: Any) -> bool:
    """Whether this kernel makes a link of `attrs` on top of a veth (deleted again at once)."""
    with IPRoute(netns=ns, flags=0) as ipr:
        ipr.link("add", ifname="vprobe0", kind="veth", peer="vprobe1")
        try:
            ipr.link("add", ifname="vprobe0.9", **attrs, link=index_of(ipr, "vprobe0"))
        except NetlinkError as exc:
            if exc.code == errno.EOPNOTSUPP:
                return False
            raise
        finally:
            ipr.link("del", index=index_of(ipr, "vprobe0"))
    return True


def vlan_supported(ns: str) -> bool:
    """Whether this kernel makes 802.1Q sub-interfaces (CONFIG_VLAN_8021Q)."""
    return _link_supported(ns, kind="vlan", vlan_id=9)


def vxlan_supported(ns: str) -> bool:
    """Whether this kernel makes VXLAN devices (CONFIG_VXLAN)."""
    return _link_supported(ns, kind="vxlan", vxlan_id=9, vxlan_port=4789)


def drain(capture: socket.socket) -> list[bytes]:
    """Every frame a non-blocking capture holds."""
    frames = []
    while True:
        try:
            frames.append(capture.recv(65535))
        except BlockingIOError:
            return frames


def vxlan_frames(frames: list[bytes], port: int = 4789) -> list[tuple[int, bytes]]:
    """(VNI, inner frame) of each IPv4 VXLAN packet to `port` among captured Ethernet frames."""
    found = []
    for frame in frames:
        if len(frame) < 50 or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_UDP:
            continue
        udp = 14 + (frame[14] & 0x0F) * 4
        if int.from_bytes(frame[udp + 2 : udp + 4], "big") != port:
            continue
        vxlan = frame[udp + 8 : udp + 16]
        if vxlan[0] & 0x08:  # the VNI-present flag
            found.append((int.from_bytes(vxlan[4:7], "big"), frame[udp + 16 :]))
    return found


@dataclass
class Vm:
    """A stand-in VM: its namespace, address, MAC, a UDP socket and a capture on its NIC."""

    name: str
    ns: str
    ip: str
    mac: str
    udp: socket.socket
    capture: socket.socket
    host_end: str  # the veth end on the node, plugged into the bridge
    mtu: int  # its NIC's (the bridge's)

    def close(self) -> None:
        self.udp.close()
        self.capture.close()

    def drain(self) -> list[bytes]:
        return drain(self.capture)

    def received(self, timeout: float) -> bytes | None:
        """The next datagram, or None after `timeout`."""
        self.udp.settimeout(timeout)
        try:
            data, _ = self.udp.recvfrom(65535)
        except TimeoutError:
            return None
        return data

    def datagrams_from(self, sender: Vm) -> list[bytes]:
        """The datagrams waiting on the socket that `sender` sent; the rest are dropped."""
        found = []
        self.udp.setblocking(False)
        try:
            while True:
                data, (source, _) = self.udp.recvfrom(65535)
                if source == sender.ip:
                    found.append(data)
        except BlockingIOError:
            return found


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(part, 16) for part in mac.split(":"))


def frames_from(receiver: Vm, sender: Vm) -> list[bytes]:
    """Frames `receiver`'s NIC got since the last drain whose source MAC is `sender`'s."""
    source = _mac_bytes(sender.mac)
    return [frame for frame in receiver.drain() if frame[6:12] == source]


def reaches(a: Vm, b: Vm, *, attempts: int = 20, full_size: bool = False) -> bool:
    """A UDP datagram from a to b and one back, each retried while ARP resolves; `full_size`:
    each fills the sender's MTU (an IP packet of exactly the MTU, never fragmented)."""

    def one_way(src: Vm, dst: Vm) -> bool:
        payload = f"{src.name}->{dst.name}:{uuid.uuid4().hex}".encode()
        if full_size:
            payload = payload.ljust(src.mtu - _IP_UDP_HEADERS, b".")
        for _ in range(attempts):
            src.udp.sendto(payload, (dst.ip, UDP_PORT))
            while (data := dst.received(0.1)) is not None:
                if data == payload:
                    return True
        return False

    return one_way(a, b) and one_way(b, a)


def isolated(a: Vm, b: Vm, *, settle: float = 0.5) -> bool:
    """Neither VM gets a single frame from the other: ARP for each other's address, unicast and
    broadcast UDP are all sent, then both captures are read."""
    for vm in (a, b):
        vm.drain()
        vm.datagrams_from(a)
        vm.datagrams_from(b)
    for src, dst in ((a, b), (b, a)):
        for _ in range(3):
            src.udp.sendto(b"hello?", (dst.ip, UDP_PORT))
            src.udp.sendto(b"anyone?", (_broadcast(dst.ip), UDP_PORT))
    time.sleep(settle)  # nothing must arrive: a bounded window, then the captures are read
    return not (
        frames_from(b, a) or frames_from(a, b) or b.datagrams_from(a) or a.datagrams_from(b)
    )


def _broadcast(ip: str) -> str:
    return ".".join([*ip.split(".")[:3], "255"])


@dataclass
class Rig:
    """Namespaces made for one test, all removed at its end (VM sockets closed first)."""

    prefix: str = field(default_factory=lambda: f"gcv{uuid.uuid4().hex[:6]}")
    created: list[str] = field(default_factory=list)
    vms: list[Vm] = field(default_factory=list)
    captures: list[socket.socket] = field(default_factory=list)
    _next: int = 0

    def namespace(self, role: str) -> str:
        name = f"{self.prefix}-{role}"
        try:
            netns.create(name)
        except OSError as exc:
            pytest.skip(f"this environment forbids creating network namespaces: {exc}")
        self.created.append(name)
        with IPRoute(netns=name, flags=0) as ipr:
            ipr.link("set", index=index_of(ipr, "lo"), state="up")
        return name

    def _serial(self) -> int:
        self._next += 1
        return self._next

    def switch(self) -> str:
        ns = self.namespace("sw")
        with IPRoute(netns=ns, flags=0) as ipr:
            ipr.link("add", ifname="sw0", kind="bridge")
            ipr.link("set", index=index_of(ipr, "sw0"), state="up")
        return ns

    def uplink(
        self, node: str, switch: str, name: str = "uplink0", *, address: str | None = None
    ) -> str:
        """Give `node` a NIC `name` cabled to a port of the switch (with `address`/24 on the
        underlay when given, as a VXLAN node's uplink has); answer the switch port."""
        port = f"swp{self._serial()}"
        with IPRoute(netns=node, flags=0) as ipr:
            ipr.link("add", ifname=name, kind="veth", peer=port)
            ipr.link("set", index=index_of(ipr, port), net_ns_fd=switch)
            index = index_of(ipr, name)
            ipr.link("set", index=index, state="up")
            if address is not None:
                ipr.addr("add", index=index, address=address, prefixlen=UNDERLAY_PREFIX)
        with IPRoute(netns=switch, flags=0) as ipr:
            index = index_of(ipr, port)
            ipr.link("set", index=index, master=index_of(ipr, "sw0"))
            ipr.link("set", index=index, state="up")
        return port

    def capture(self, ns: str, ifname: str) -> socket.socket:
        """A non-blocking capture of every frame link `ifname` of `ns` sends or receives."""

        def open_capture() -> socket.socket:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
            sock.bind((ifname, 0))
            sock.setblocking(False)
            return sock

        sock = in_netns(ns, open_capture)
        self.captures.append(sock)
        return sock

    def vm(self, node: str, bridge: str, ip: str) -> Vm:
        """A VM on `node` whose NIC is plugged into `bridge` there, with address `ip`/24 and the
        bridge's MTU."""
        serial = self._serial()
        vm_ns = self.namespace(f"vm{serial}")
        host_end, vm_end = f"vmh{serial}", f"vmg{serial}"
        with IPRoute(netns=node, flags=0) as ipr:
            bridge_index = index_of(ipr, bridge)
            mtu = int(ipr.get_links(bridge_index)[0].get("mtu"))
            ipr.link("add", ifname=host_end, kind="veth", peer=vm_end)
            ipr.link("set", index=index_of(ipr, vm_end), net_ns_fd=vm_ns)
            index = index_of(ipr, host_end)
            ipr.link("set", index=index, mtu=mtu)
            ipr.link("set", index=index, master=bridge_index)
            ipr.link("set", index=index, state="up")
        with IPRoute(netns=vm_ns, flags=0) as ipr:
            index = index_of(ipr, vm_end)
            ipr.link("set", index=index, ifname="eth0")
            ipr.link("set", index=index, mtu=mtu)
            ipr.link("set", index=index, state="up")
            ipr.addr("add", index=index, address=ip, prefixlen=SUBNET_PREFIX)
            mac = str(ipr.get_links(index)[0].get("address"))

        def sockets() -> tuple[socket.socket, socket.socket]:
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            udp.bind(("0.0.0.0", UDP_PORT))  # noqa: S104 - inside the VM's own namespace
            capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
            capture.bind(("eth0", 0))
            capture.setblocking(False)
            return udp, capture

        udp, capture = in_netns(vm_ns, sockets)
        vm = Vm(f"vm{serial}", vm_ns, ip, mac, udp, capture, host_end, mtu)
        self.vms.append(vm)
        return vm

    def unplug(self, vm: Vm, node: str) -> None:
        """The VM is gone (as when libvirt destroys the domain): its NIC leaves the bridge."""
        vm.close()
        self.vms.remove(vm)
        with IPRoute(netns=node, flags=0) as ipr, contextlib.suppress(AssertionError):
            ipr.link("del", index=index_of(ipr, vm.host_end))

    def close(self) -> None:
        for vm in self.vms:
            vm.close()
        for sock in self.captures:
            sock.close()
        for name in reversed(self.created):
            with contextlib.suppress(OSError):
                netns.remove(name)
        assert not set(self.created) & set(netns.listnetns())
