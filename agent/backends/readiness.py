"""How the backend learns that a slice VM's guest is up: a small seam with real probes (the QEMU
guest agent, or an SSH port) and a fixed answer for libvirt's test driver, where no guest runs.

A probe blocks until ready or raises `NotReady` when `timeout` passes; it waits through
`progress.wait`, so a cancelled task stops waiting at once.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from typing import Any, Protocol

import libvirt

from agent.backend import Progress
from agent.backends.cloud_init_seed import READINESS_MARKER


class NotReady(Exception):
    """The guest did not become ready in time (message: what was last seen, no secrets)."""


class ReadinessProbe(Protocol):
    def wait_reachable(self, domain: Any, timeout: float, progress: Progress) -> str:
        """Wait until the guest answers and has written the readiness marker; return the
        address the tenant connects to."""
        ...

    def wait_driver_ready(
        self, domain: Any, gpu_count: int, timeout: float, progress: Progress
    ) -> str:
        """Wait until the guest's GPU driver sees `gpu_count` GPUs; return a short message."""
        ...


class FixedAddressProbe:
    """For libvirt's test driver (no guest exists): the guest counts as reachable at a fixed
    address. Not for production; the backend refuses it on a non-test URI only by convention."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.reachable_calls = 0

    def wait_reachable(self, domain: Any, timeout: float, progress: Progress) -> str:
        self.reachable_calls += 1
        return self.address

    def wait_driver_ready(
        self, domain: Any, gpu_count: int, timeout: float, progress: Progress
    ) -> str:
        return f"driver sees {gpu_count} GPU(s) (assumed: test driver)"


def _interface_address(domain: Any, source: int) -> str | None:
    try:
        interfaces = domain.interfaceAddresses(source)
    except Exception:
        return None
    for iface in (interfaces or {}).values():
        for addr in iface.get("addrs") or []:
            if addr.get("type") == 0 and not str(addr.get("addr", "")).startswith("127."):
                return str(addr["addr"])
    return None


class GuestAgentProbe:
    """Production probe over the QEMU guest agent channel the domain XML declares."""

    def __init__(self, poll_interval: float = 2.0) -> None:
        self.poll_interval = poll_interval

    def _agent(self, domain: Any, command: dict[str, Any], timeout: int = 5) -> Any:
        import libvirt_qemu

        return json.loads(libvirt_qemu.qemuAgentCommand(domain, json.dumps(command), timeout, 0))

    def _exec(self, domain: Any, path: str, args: list[str], timeout: float) -> tuple[int, str]:
        started = self._agent(
            domain,
            {
                "execute": "guest-exec",
                "arguments": {"path": path, "arg": args, "capture-output": True},
            },
        )
        pid = started["return"]["pid"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self._agent(
                domain, {"execute": "guest-exec-status", "arguments": {"pid": pid}}
            )
            result = status["return"]
            if result.get("exited"):
                out = base64.b64decode(result.get("out-data", "")).decode(errors="replace")
                return int(result.get("exitcode", 1)), out
            time.sleep(0.5)
        raise NotReady(f"{path} did not finish in the guest")

    def wait_reachable(self, domain: Any, timeout: float, progress: Progress) -> str:

        deadline = time.monotonic() + timeout
        last = "guest agent not answering"
        while time.monotonic() < deadline:
            try:
                code, _ = self._exec(domain, "/usr/bin/test", ["-f", READINESS_MARKER], 10)
                if code == 0:
                    address = _interface_address(
                        domain, libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT
                    )
                    if address:
                        return address
                    last = "guest has no IPv4 address yet"
                else:
                    last = "readiness marker not written yet"
            except (libvirt.libvirtError, KeyError, ValueError, NotReady):
                last = "guest agent not answering"
            progress.wait(self.poll_interval)
        raise NotReady(last)

    def wait_driver_ready(
        self, domain: Any, gpu_count: int, timeout: float, progress: Progress
    ) -> str:

        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            try:
                code, out = self._exec(domain, "/usr/bin/nvidia-smi", ["-L"], 30)
                seen = sum(1 for line in out.splitlines() if line.startswith("GPU "))
                if code == 0 and seen >= gpu_count:
                    return f"driver sees {seen} GPU(s)"
            except (libvirt.libvirtError, KeyError, ValueError, NotReady):
                pass
            progress.wait(self.poll_interval)
        raise NotReady(f"driver sees {seen} of {gpu_count} GPU(s)")


class SshPortProbe:
    """Production probe without a guest agent: the address from libvirt's DHCP lease, then a TCP
    connect to the SSH port. It cannot look inside the guest, so driver readiness is reported as
    unverified."""

    def __init__(self, port: int = 22, poll_interval: float = 2.0) -> None:
        self.port = port
        self.poll_interval = poll_interval

    def wait_reachable(self, domain: Any, timeout: float, progress: Progress) -> str:

        deadline = time.monotonic() + timeout
        last = "no DHCP lease yet"
        while time.monotonic() < deadline:
            address = _interface_address(domain, libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE)
            if address:
                try:
                    with socket.create_connection((address, self.port), timeout=3):
                        return address
                except OSError:
                    last = f"ssh port {self.port} not open yet"
            progress.wait(self.poll_interval)
        raise NotReady(last)

    def wait_driver_ready(
        self, domain: Any, gpu_count: int, timeout: float, progress: Progress
    ) -> str:
        return f"{gpu_count} GPU(s) passed through (driver not verified by the ssh probe)"
