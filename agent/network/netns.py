"""pyroute2 plumbing shared by the network operations: namespace selection, taps, state dumps.

Every operation takes `netns`: None means the host's own namespace, a name means the named
namespace under /var/run/netns (as `ip netns` manages them). A missing namespace is an error,
never silently created (pyroute2's default `flags=O_CREAT` would create it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from agent.network.errors import InvalidNetworkSpec, NamespaceNotFound, NetworkOperationFailed

NETNS_RUN_DIR = "/var/run/netns"
_IPV6_CONF = "/proc/sys/net/ipv6/conf"
T = TypeVar("T")
IFNAMSIZ = 15  # usable characters; the kernel's IFNAMSIZ (16) includes the NUL
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_TUNSETPERSIST = 0x400454CB
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000


def validate_ifname(name: str, what: str = "interface name") -> str:
    if not name or len(name) > IFNAMSIZ:
        raise InvalidNetworkSpec(
            f"{what} {name!r} must be 1..{IFNAMSIZ} characters (IFNAMSIZ), got {len(name)}"
        )
    if not _IFNAME_RE.match(name) or name in (".", ".."):
        raise InvalidNetworkSpec(f"{what} {name!r} has characters an interface name cannot use")
    return name


def _check_netns(netns: str | None) -> None:
    if netns is None:
        return
    if not netns or "/" in netns or netns in (".", ".."):
        raise InvalidNetworkSpec(f"network namespace name {netns!r} is not valid")
    if not os.path.exists(os.path.join(NETNS_RUN_DIR, netns)):
        raise NamespaceNotFound(netns)


@contextmanager
def rtnl(netns: str | None = None) -> Iterator[Any]:
    """An IPRoute bound to `netns` (None: the host's namespace), closed on exit."""
    _check_netns(netns)
    ipr = IPRoute(netns=netns, flags=0) if netns is not None else IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def link_index(ipr: Any, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


def get_link(ipr: Any, ifname: str) -> Any | None:
    index = link_index(ipr, ifname)
    if index is None:
        return None
    try:
        return ipr.get_links(index)[0]
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return None
        raise


def link_kind(link: Any) -> str | None:
    kind = link.get(("linkinfo", "kind"))
    return str(kind) if kind is not None else None


def vlan_id_of(link: Any) -> int | None:
    vid = link.get(("linkinfo", "data", "vlan_id"))
    return int(vid) if vid is not None else None


def in_netns(netns: str | None, work: Callable[[], T], what: str) -> T:
    """Run `work` on a short-lived thread that has entered `netns` (None: the caller's own),
    and answer its result; the calling thread never changes namespace (setns is per-thread).

    For what netlink cannot do from outside: tun/tap creation (an ioctl on /dev/net/tun, which
    acts in the calling thread's namespace; pyroute2's `kind="tuntap"` does it in the caller's
    even when the IPRoute is bound elsewhere) and /proc/sys/net, which shows the namespace of
    the thread that opens it. A failure is raised here as NetworkOperationFailed(`what`)."""
    _check_netns(netns)
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if netns is not None:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                nsfd = os.open(os.path.join(NETNS_RUN_DIR, netns), os.O_RDONLY)
                try:
                    if libc.setns(nsfd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns({netns}): {os.strerror(err)}")
                finally:
                    os.close(nsfd)
            result.append(work())
        except BaseException as exc:  # re-raised in the calling thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"in-netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        exc = failure[0]
        raise NetworkOperationFailed(f"{what}: {exc}") from exc
    return result[0]


def create_tap(ifname: str, netns: str | None = None) -> None:
    """Create a persistent tap (IFF_TAP | IFF_NO_PI | IFF_VNET_HDR) inside `netns`, down, owned
    by no user: libvirtd (root) opens it for a domain's `<interface type='ethernet'>` with
    `<target dev=… managed='no'/>` and hands QEMU the descriptor; the flags are the opener's."""
    validate_ifname(ifname, "tap name")

    def make() -> None:
        tun = os.open("/dev/net/tun", os.O_RDWR)
        try:
            ifr = struct.pack("16sH", ifname.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
            fcntl.ioctl(tun, _TUNSETIFF, ifr)
            fcntl.ioctl(tun, _TUNSETPERSIST, 1)
        finally:
            os.close(tun)

    in_netns(netns, make, f"could not create tap {ifname!r}")


def disable_ipv6(ifname: str, netns: str | None = None) -> bool:
    """Turn IPv6 off on the link (`net.ipv6.conf.<ifname>.disable_ipv6 = 1` in `netns`): the
    kernel drops its IPv6 addresses, gives it none (no link-local, no SLAAC address from a
    router advertisement a tenant sends) and takes in no IPv6 on it. Answers whether it
    changed; a kernel without IPv6 (no /proc/sys/net/ipv6) has nothing to turn off."""
    validate_ifname(ifname)
    if ifname in (".", "..", "all", "default"):
        raise InvalidNetworkSpec(f"{ifname!r} is not a link of its own")

    def write() -> bool:
        path = os.path.join(_IPV6_CONF, ifname, "disable_ipv6")
        try:
            with open(path) as handle:
                if handle.read().strip() == "1":
                    return False
            with open(path, "w") as handle:
                handle.write("1")
        except FileNotFoundError:
            if os.path.isdir(_IPV6_CONF):
                raise  # IPv6 is there but the link is not (gone meanwhile)
            return False
        return True

    return in_netns(netns, write, f"could not turn IPv6 off on {ifname!r}")


def dump_state(netns: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """A comparable picture of links, addresses, rules and routes (both families) in `netns`.

    Volatile fields (counters, carrier timing) are left out so that two dumps of an unchanged
    namespace are equal.
    """
    with rtnl(netns) as ipr:
        names = {int(link["index"]): link.get("ifname") for link in ipr.get_links()}
        links = list(
            (
                link.get("ifname"),
                link_kind(link),
                link.get("ifalias"),
                names.get(link.get("master") or 0),
                names.get(link.get("link") or 0),
                vlan_id_of(link),
                link["flags"] & 0x1,  # IFF_UP
                link.get("address"),
                link.get("mtu"),
            )
            for link in ipr.get_links()
        )
        addrs = list(
            (names.get(a["index"]), a["family"], a.get("address"), a["prefixlen"], a["scope"])
            for a in ipr.get_addr()
        )
        rules = list(
            (
                r["family"],
                r.get("priority") or 0,
                r.get("table"),
                r.get("src"),
                r["src_len"],
                r.get("dst"),
                r["dst_len"],
                r.get("protocol"),
            )
            for family in (2, 10)
            for r in ipr.get_rules(family=family)
        )
        routes = list(
            (
                r["family"],
                r.get("table"),
                r.get("dst"),
                r["dst_len"],
                r.get("gateway"),
                names.get(r.get("oif") or 0),
                r.get("prefsrc"),
                r["proto"],
                r["scope"],
                r["type"],
                r.get("priority"),
            )
            for family in (2, 10)
            for r in ipr.get_routes(family=family, table=0)
        )
    key = repr
    return {
        "links": sorted(links, key=key),
        "addrs": sorted(addrs, key=key),
        "rules": sorted(rules, key=key),
        "routes": sorted(routes, key=key),
    }
