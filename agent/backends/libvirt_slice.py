"""`LibvirtSliceBackend`: GPU-slice VMs on a real libvirt (qemu:///system on a node;
`test:///abs/path/host.xml` in tests), behind the HostBackend seam.

Provision: verify (or reuse) the base image and give the allocation its own disk -> write the
cloud-init NoCloud seed -> define a domain named `gpc-<allocation id>` with one VFIO `<hostdev>`
per GPU, memory bound (`numatune strict`) to the GPUs' NUMA node(s) and vCPUs pinned to that
node's CPUs -> start it -> wait for the guest (readiness probe) -> wait for the GPU driver. A
re-run after a crash adopts the domain the earlier attempt defined.

Release: graceful shutdown within a timeout (or a hard stop) -> destroy -> undefine and remove
the allocation's disk and seed -> wipe the lease file the backend keeps for the allocation. What is
already gone counts as done.

Blocking: the agent runs these methods on a worker thread. One libvirt connection is opened lazily
and shared (libvirt connections are thread-safe); a `test:///file` connection keeps its state
only as long as it is open, so tests that simulate a crash pass the same connection to a fresh
backend.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import libvirt

from agent.backend import (
    HARD_STOP_PHASE,
    HostError,
    PhaseStatus,
    Progress,
    ProvisionOutcome,
    ReleaseOutcome,
    RevokeOutcome,
)
from agent.backends import cloud_init_seed, domain_xml
from agent.backends.images import ImageMismatch, ImageMissing, ImageStore, ImageUnreadable
from agent.backends.readiness import NotReady, ReadinessProbe
from agent.gpu_health import GpuHealthCheck
from agent.network.slice_networks import SliceNetworks
from contracts.host_tasks import HostErrorType, HostProvisionInput, HostReleaseInput, UnhealthyGpu

logger = logging.getLogger("agent.backends.libvirt_slice")

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_GPU_CLASS_PREFIX = "0x03"  # PCI base class 0x03: display controller
# What libvirt/QEMU say when starting a domain with a passthrough GPU fails because of the host's
# VFIO setup (no IOMMU, group not viable, /dev/vfio not openable, vfio-pci bind refused): an
# operator fixes the host, a retry would fail the same way.
_VFIO_FAILURE = re.compile(r"vfio|iommu", re.IGNORECASE)


def _quiet_libvirt(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; we raise and classify them instead."""


class LibvirtSliceBackend:
    def __init__(
        self,
        uri: str,
        *,
        image_dir: Path | str,
        image_catalog: Mapping[str, str],
        seed_dir: Path | str,
        state_dir: Path | str,
        readiness: ReadinessProbe,
        disk_dir: Path | str | None = None,
        default_image: str = "",
        default_vcpus: int = 4,
        default_memory_mb: int = 16384,
        network: str = "default",
        shutdown_timeout_s: float = 60.0,
        readiness_timeout_s: float = 600.0,
        driver_timeout_s: float = 300.0,
        poll_interval_s: float = 1.0,
        connection: Any | None = None,
        gpu_health: GpuHealthCheck | None = None,
        networks: SliceNetworks | None = None,
        domain_type: str = domain_xml.DEFAULT_DOMAIN_TYPE,
        device_removal_timeout_s: float = 60.0,
    ) -> None:
        """
        uri: libvirt URI ("qemu:///system"; "test:///abs/path/host.xml" in tests).
        image_dir / image_catalog: base images by name, each with its expected sha256.
        seed_dir: where NoCloud seeds are written (one 0700 directory per allocation).
        state_dir: the backend's own per-allocation state (GPU lease files).
        disk_dir: per-allocation disks (overlays); defaults to `state_dir/disks`.
        connection: an open libvirt connection to use instead of opening `uri`.
        networks: per-allocation bridges (agent/network); None keeps the libvirt `network`.
        gpu_health: checks each released GPU (agent.gpu_health.SysfsGpuHealthCheck on a real
            host); None skips the check (the test driver's GPUs have no sysfs).
        domain_type: "kvm" (production) or "qemu" (TCG, where KVM is unusable); libvirt's test
            driver always gets "test".
        device_removal_timeout_s: how long a live detach waits for the guest to let the device
            go before the task fails (and is retried).
        """
        if domain_type not in domain_xml.DOMAIN_TYPES:
            raise ValueError(f"domain_type must be one of {', '.join(domain_xml.DOMAIN_TYPES)}")
        self.domain_type = domain_type
        self.uri = uri
        self.images = ImageStore(
            Path(image_dir),
            image_catalog,
            Path(disk_dir) if disk_dir is not None else Path(state_dir) / "disks",
        )
        self.seed_dir = Path(seed_dir)
        self.lease_dir = Path(state_dir) / "leases"
        self.readiness = readiness
        self.gpu_health = gpu_health
        self.networks = networks
        self.default_image = default_image
        self.default_vcpus = default_vcpus
        self.default_memory_mb = default_memory_mb
        self.network = network
        self.shutdown_timeout_s = shutdown_timeout_s
        self.readiness_timeout_s = readiness_timeout_s
        self.driver_timeout_s = driver_timeout_s
        self.poll_interval_s = poll_interval_s
        self.device_removal_timeout_s = device_removal_timeout_s
        self._conn = connection
        self._lock = threading.Lock()
        # Serialises define and lease bookkeeping: two allocations must not claim one GPU.
        self._define_lock = threading.Lock()

    # ------------------------------------------------------------------ connection

    @property
    def conn(self) -> Any:
        with self._lock:
            if self._conn is None:
                libvirt.registerErrorHandler(_quiet_libvirt, None)
                self._conn = libvirt.open(self.uri)
            return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @property
    def is_test_driver(self) -> bool:
        return str(self.conn.getType()).lower() == "test"

    def numa_topology(self) -> dict[int, tuple[int, ...]]:
        """NUMA cell -> host CPUs, as the hypervisor reports them."""
        cells = domain_xml.parse_numa_topology(self.conn.getCapabilities())
        if not cells and self.is_test_driver:
            cells = self._test_host_topology()
        return cells

    def _test_host_topology(self) -> dict[int, tuple[int, ...]]:
        """libvirt's test driver builds no NUMA cells from a custom host file
        (`test:///abs/path/host.xml`): the file's own `<topology><cells>` block stands for them
        (sim/libvirt_hosts.host_xml writes one). A real hypervisor reports its cells itself."""
        path = urlsplit(self.uri).path
        if not path or path == "/default":
            return {}
        try:
            return domain_xml.parse_numa_topology(Path(path).read_text())
        except (OSError, SyntaxError):  # unreadable, or not XML (ET.ParseError)
            return {}

    def lookup_domain(self, allocation_id: str) -> Any | None:
        try:
            return self.conn.lookupByName(domain_xml.domain_name(allocation_id))
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise

    def lease_path(self, allocation_id: str) -> Path:
        return self.lease_dir / f"{allocation_id}.json"

    # ------------------------------------------------------------------ HostBackend: slices

    def provision_slice_vm(self, spec: HostProvisionInput, progress: Progress) -> ProvisionOutcome:
        _check_ids(spec.allocation_id, spec.username)
        gpus = [domain_xml.PciAddress.parse(g.pci_address) for g in spec.gpus]
        adopted = False
        state: dict[str, Any] = {}

        def prepare_image() -> str:
            name = spec.image or self.default_image
            try:
                image = self.images.prepare(name, spec.image_sha256)
                disk = self.images.allocation_disk(spec.allocation_id, image)
            except (ImageMismatch, ImageMissing, ImageUnreadable) as err:
                raise HostError(HostErrorType.IMAGE_ERROR, str(err)) from None
            state["disk"] = disk
            verb = "reused" if image.reused else "verified"
            return (
                f"image {name} {verb} (sha256 ok), disk {'created' if disk.created else 'reused'}"
            )

        def write_seed() -> str:
            seed = cloud_init_seed.write_seed(
                self.seed_dir, spec.allocation_id, spec.username, spec.ssh_public_keys
            )
            if seed.iso is None and not self.is_test_driver:
                raise HostError(
                    HostErrorType.IMAGE_ERROR,
                    "no ISO tool (cloud-localds, genisoimage, xorriso) to pack the cloud-init seed",
                )
            state["seed"] = seed
            kind = "iso" if seed.iso is not None else "directory"
            return f"NoCloud seed ({kind}) with {len(spec.ssh_public_keys)} authorized key(s)"

        def define() -> str:
            nonlocal adopted
            with self._define_lock:
                existing = self.lookup_domain(spec.allocation_id)
                if existing is not None:
                    facts = domain_xml.parse_domain(existing.XMLDesc(0))
                    if facts.allocation_id not in (None, spec.allocation_id):
                        raise HostError(
                            HostErrorType.LEASE_CONFLICT,
                            "a domain of that name belongs to another allocation",
                        )
                    adopted = True
                    self._write_lease(spec.allocation_id, facts.hostdevs)
                    return "adopted the domain an earlier attempt defined"
                plan = self._plan(spec, gpus, state)
                self._check_gpus_free(spec.allocation_id, gpus)
                self.conn.defineXML(domain_xml.render_domain(plan))
                self._write_lease(spec.allocation_id, tuple(gpus))
            nodes = ",".join(str(n) for n in plan.numa_nodes)
            return f"domain {plan.name} defined with {len(gpus)} GPU(s) on NUMA node {nodes}"

        def start() -> str:
            domain = self._require_domain(spec.allocation_id)
            if domain.isActive():
                return "already running"
            try:
                domain.create()
            except libvirt.libvirtError as err:
                raise _start_failure(err) from None
            return "started"

        def reach_guest() -> str:
            domain = self._require_domain(spec.allocation_id)
            try:
                state["address"] = self.readiness.wait_reachable(
                    domain, self.readiness_timeout_s, progress
                )
            except NotReady as err:
                raise HostError(
                    HostErrorType.READINESS_TIMEOUT, f"guest not ready: {err}"
                ) from None
            return f"guest reachable at {state['address']}"

        def driver_ready() -> str:
            domain = self._require_domain(spec.allocation_id)
            try:
                return self.readiness.wait_driver_ready(
                    domain, len(gpus), self.driver_timeout_s, progress
                )
            except NotReady as err:
                raise HostError(
                    HostErrorType.READINESS_TIMEOUT, f"GPU driver not ready: {err}"
                ) from None

        _phase(progress, "image_prepared", prepare_image)
        _phase(progress, "cloud_init_seed_generated", write_seed)
        _phase(progress, "domain_defined", define)
        _phase(progress, "vm_started", start)
        _phase(progress, "guest_reachable", reach_guest)
        _phase(progress, "driver_ready", driver_ready)
        logger.info(
            "allocation %s: slice VM ready at %s with %d GPU(s) (adopted=%s)",
            spec.allocation_id,
            state["address"],
            len(gpus),
            adopted,
        )
        return ProvisionOutcome(connect_host=state["address"], adopted_existing=adopted)

    def release_slice_vm(self, spec: HostReleaseInput, progress: Progress) -> ReleaseOutcome:
        _check_ids(spec.allocation_id, None)
        hard_stopped = False

        def hard_stop() -> str:
            nonlocal hard_stopped
            domain = self.lookup_domain(spec.allocation_id)
            if domain is None:
                return "no domain (already released)"
            if not domain.isActive():
                return "already stopped"
            hard_stopped = True
            domain.destroy()
            return "powered off"

        released_gpus = self._domain_gpus(spec.allocation_id)  # read before it is undefined
        unhealthy: list[UnhealthyGpu] = []

        def check_gpus() -> str:
            if self.gpu_health is None:
                return f"{len(released_gpus)} GPU(s) not checked (no health check on this host)"
            for address in released_gpus:
                reason = self.gpu_health.check(address)
                if reason is not None:
                    unhealthy.append(UnhealthyGpu(address, reason))
            return f"{len(released_gpus) - len(unhealthy)} healthy, {len(unhealthy)} quarantined"

        try:
            if spec.force or not _phase(
                progress, "graceful_shutdown", lambda: self._graceful(spec, progress)
            ):
                _phase(progress, HARD_STOP_PHASE, hard_stop)
            _phase(progress, "domain_destroyed", lambda: self._destroy(spec.allocation_id))
            _phase(progress, "domain_undefined", lambda: self._undefine(spec.allocation_id))
            _phase(progress, "leases_wiped", lambda: self._wipe_leases(spec.allocation_id))
        except libvirt.libvirtError as err:
            raise HostError(
                HostErrorType.RELEASE_ERROR, f"libvirt: {err.get_error_message()}"
            ) from None
        _phase(progress, "gpus_health_checked", check_gpus)
        for gpu in unhealthy:
            logger.warning(
                "allocation %s: GPU %s quarantined: %s",
                spec.allocation_id,
                gpu.pci_address,
                gpu.reason,
            )
        logger.info(
            "allocation %s: slice VM released (hard_stopped=%s, %d GPU(s))",
            spec.allocation_id,
            hard_stopped,
            len(released_gpus),
        )
        return ReleaseOutcome(
            released=True,
            hard_stopped=hard_stopped,
            wiped=True,
            leases_released=True,
            unhealthy_gpus=tuple(unhealthy),
        )

    def _domain_gpus(self, allocation_id: str) -> list[str]:
        domain = self.lookup_domain(allocation_id)
        if domain is None:
            return []
        return [str(address) for address in domain_xml.parse_domain(domain.XMLDesc(0)).hostdevs]

    # ------------------------------------------------------------------ bare metal: not here

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome:
        raise HostError(
            HostErrorType.INVALID_SPEC, "bare-metal access is not served by this backend"
        )

    def deprovision_baremetal_user(
        self, spec: HostReleaseInput, progress: Progress
    ) -> ReleaseOutcome:
        raise HostError(
            HostErrorType.INVALID_SPEC, "bare-metal access is not served by this backend"
        )

    def revoke_baremetal_user(self, spec: HostReleaseInput, progress: Progress) -> RevokeOutcome:
        raise HostError(
            HostErrorType.INVALID_SPEC, "bare-metal access is not served by this backend"
        )

    # ------------------------------------------------------------------ guest filesystems

    def attach_filesystem(
        self, allocation_id: str, source_dir: Path, tag: str, *, read_only: bool
    ) -> str:
        """Give the allocation's VM the host directory as virtiofs filesystem `tag`: hot-plugged
        into the running guest (libvirt starts a virtiofsd for it) and kept in the domain's
        definition, so a restarted VM has it again. Where it is already (live, defined) counts
        as done. `read_only`: the directory must be a read-only mount already, the one guard a
        virtiofs device has here (domain_xml.render_filesystem)."""
        _check_ids(allocation_id, None)
        domain = self.lookup_domain(allocation_id)
        if domain is None:
            raise HostError(
                HostErrorType.INVALID_SPEC, f"allocation {allocation_id} has no VM on this node"
            )
        if read_only and not _read_only_mount(source_dir):
            raise HostError(
                HostErrorType.STORAGE_ERROR,
                f"virtiofs {tag} not attached: the host directory of a read-only attachment "
                "is not a read-only mount",
            )
        with self._define_lock:
            found = self._filesystem_devices(domain, tag)
            config = found.defined is None
            live = found.hot_pluggable and found.live is None
            if not (config or live):
                return f"virtiofs {tag} already attached"
            device = domain_xml.render_filesystem(str(source_dir), tag)
            return self._change_device(domain, tag, device, attach=True, config=config, live=live)

    def detach_filesystem(self, allocation_id: str, tag: str) -> str:
        """Take filesystem `tag` out of the VM (live and its definition); what is not there (or a
        VM already gone) counts as done. The live unplug is done when libvirt has removed the
        device (the guest let go of it, virtiofsd stopped): until then the host directory is
        still the guest's, and the task fails after `device_removal_timeout_s` (a retry waits
        again). A guest with the filesystem mounted does not refuse: its mount loses the device
        (ENOTCONN)."""
        _check_ids(allocation_id, None)
        domain = self.lookup_domain(allocation_id)
        if domain is None:
            return "no VM: nothing attached"
        with self._define_lock:
            found = self._filesystem_devices(domain, tag)
            live = found.hot_pluggable and found.live is not None
            # The defined element where there is one: libvirt matches a device by target tag and,
            # when the XML names one, by alias, which the definition has not and the live has.
            device = found.defined or (found.live if live else None)
            if device is None:
                return f"virtiofs {tag} was not attached"
            config = found.defined is not None
            message = self._change_device(
                domain, tag, device, attach=False, config=config, live=live
            )
            if live:
                self._wait_device_removed(domain, tag)
            return message

    def _filesystem_devices(self, domain: Any, tag: str) -> _FilesystemDevices:
        defined = domain_xml.filesystem_element(
            domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE), tag
        )
        # libvirt's test driver changes no running domain's devices (it has no hot-plug).
        if self.is_test_driver or not domain.isActive():
            return _FilesystemDevices(defined, None, hot_pluggable=False)
        live = domain_xml.filesystem_element(domain.XMLDesc(0), tag)
        return _FilesystemDevices(defined, live, hot_pluggable=True)

    def _change_device(
        self, domain: Any, tag: str, device: str, *, attach: bool, config: bool, live: bool
    ) -> str:
        flags = (libvirt.VIR_DOMAIN_AFFECT_CONFIG if config else 0) | (
            libvirt.VIR_DOMAIN_AFFECT_LIVE if live else 0
        )
        verb = "attached" if attach else "detached"
        try:
            (domain.attachDeviceFlags if attach else domain.detachDeviceFlags)(device, flags)
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_SUPPORT:
                # libvirt or QEMU said no (no virtiofsd for the device, no free PCI slot, an
                # unplug still pending): retried, then the attachment's failure.
                raise HostError(
                    HostErrorType.STORAGE_ERROR, f"virtiofs {tag} not {verb}: {err}"
                ) from None
            # The driver has no device hot-plug at all (libvirt's test driver): the persistent
            # definition carries the change, and the guest sees it from its next boot.
            persistent = domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
            self.conn.defineXML(
                domain_xml.with_filesystem(persistent, tag, device if attach else None)
            )
            return f"virtiofs {tag} {verb} in the definition (this driver has no hot-plug)"
        return f"virtiofs {tag} {verb}{' live' if live else ''}"

    def _wait_device_removed(self, domain: Any, tag: str) -> None:
        """libvirt answers a live detach after waiting a few seconds for the guest; a slow guest
        (TCG under load) lets the device go later, and only then is virtiofsd stopped."""
        deadline = time.monotonic() + self.device_removal_timeout_s
        while domain.isActive() and domain_xml.filesystem_element(domain.XMLDesc(0), tag):
            if time.monotonic() >= deadline:
                raise HostError(
                    HostErrorType.STORAGE_ERROR,
                    f"virtiofs {tag}: the guest has not released the device within "
                    f"{self.device_removal_timeout_s:g}s (the unplug stays requested)",
                )
            time.sleep(self.poll_interval_s)

    # ------------------------------------------------------------------ helpers

    def _require_domain(self, allocation_id: str) -> Any:
        domain = self.lookup_domain(allocation_id)
        if domain is None:
            # Someone undefined it between phases: a retry defines it again.
            raise RuntimeError(f"domain {domain_xml.domain_name(allocation_id)} vanished")
        return domain

    def _plan(
        self,
        spec: HostProvisionInput,
        gpus: Sequence[domain_xml.PciAddress],
        state: Mapping[str, Any],
    ) -> domain_xml.SliceDomain:
        nodes: set[int] = set()
        for gpu, assignment in zip(gpus, spec.gpus, strict=True):
            device = self._pci_device(gpu)
            if not device.device_class.startswith(_GPU_CLASS_PREFIX):
                raise HostError(HostErrorType.VFIO_ERROR, f"PCI device {gpu} is not a GPU")
            node = (
                device.numa_node
                if device.numa_node is not None and device.numa_node >= 0
                else assignment.numa_node
            )
            nodes.add(node)
        topology = self.numa_topology()
        if not gpus:
            # A slice without GPUs (a CPU-only VM; the real-hypervisor tests' guests) has no
            # device to place it by: it may use every NUMA node of the host.
            nodes = set(topology)
        cpus = domain_xml.cpus_of_nodes(topology, nodes)
        if not cpus:
            raise HostError(
                HostErrorType.VFIO_ERROR,
                f"the host reports no CPUs for NUMA node(s) {sorted(nodes)}",
            )
        disk = state["disk"]
        seed = state["seed"]
        nic = (
            self.networks.prepare_nic(spec.allocation_id, spec.vlan_id)
            if self.networks is not None
            else None
        )
        return domain_xml.SliceDomain(
            allocation_id=spec.allocation_id,
            domain_type="test" if self.is_test_driver else self.domain_type,
            vcpus=spec.vcpus or self.default_vcpus,
            memory_mib=spec.memory_mb or self.default_memory_mb,
            numa_nodes=tuple(sorted(nodes)),
            cpuset=cpus,
            gpus=tuple(gpus),
            disk_path=str(disk.path),
            disk_format=disk.format,
            seed_path=str(seed.iso if seed.iso is not None else seed.directory),
            seed_is_iso=seed.iso is not None,
            network=self.network,
            bridge=nic.bridge if nic is not None else None,
            # A real hypervisor opens the agent's tap (no IPv6 on it, the bridge's MTU). The
            # test driver opens no tap at all: its domain names the bridge the tap is on.
            tap=nic.tap if nic is not None and not self.is_test_driver else None,
            mtu=nic.mtu if nic is not None else None,
        )

    def _pci_device(self, address: domain_xml.PciAddress) -> domain_xml.PciDevice:
        try:
            device = self.conn.nodeDeviceLookupByName(address.nodedev_name)
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_NODE_DEVICE:
                raise HostError(
                    HostErrorType.VFIO_ERROR, f"GPU {address} is not a PCI device on this host"
                ) from None
            raise
        return domain_xml.parse_pci_nodedev(device.XMLDesc(0))

    def _check_gpus_free(self, allocation_id: str, gpus: Sequence[domain_xml.PciAddress]) -> None:
        wanted = set(gpus)
        for domain in self.conn.listAllDomains(0):
            if domain.name() == domain_xml.domain_name(allocation_id):
                continue
            facts = domain_xml.parse_domain(domain.XMLDesc(0))
            if wanted & set(facts.hostdevs):
                raise HostError(
                    HostErrorType.LEASE_CONFLICT,
                    "a requested GPU is passed through to another domain",
                )

    def _write_lease(self, allocation_id: str, gpus: Sequence[domain_xml.PciAddress]) -> None:
        self.lease_dir.mkdir(parents=True, exist_ok=True)
        path = self.lease_path(allocation_id)
        partial = path.with_suffix(".partial")
        partial.write_text(
            json.dumps({"allocation_id": allocation_id, "gpus": [str(g) for g in gpus]})
        )
        os.replace(partial, path)

    def _graceful(self, spec: HostReleaseInput, progress: Progress) -> str:
        domain = self.lookup_domain(spec.allocation_id)
        if domain is None:
            return "no domain (already released)"
        if not domain.isActive():
            return "already stopped"
        domain.shutdown()
        deadline = time.monotonic() + self.shutdown_timeout_s
        while domain.isActive():
            if time.monotonic() >= deadline:
                raise _ShutdownTimedOut(f"guest still running after {self.shutdown_timeout_s:g}s")
            progress.wait(self.poll_interval_s)
        return "guest shut down"

    def _destroy(self, allocation_id: str) -> str:
        domain = self.lookup_domain(allocation_id)
        if domain is None:
            return "no domain (already released)"
        if not domain.isActive():
            return "not running"
        try:
            domain.destroy()
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_OPERATION_INVALID:  # stopped meanwhile
                raise
        return "domain destroyed"

    def _undefine(self, allocation_id: str) -> str:
        domain = self.lookup_domain(allocation_id)
        message = "already undefined"
        if domain is not None:
            flags = (
                libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
            )
            try:
                domain.undefineFlags(flags)
            except libvirt.libvirtError as err:
                if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    pass
                elif err.get_error_code() in (
                    libvirt.VIR_ERR_NO_SUPPORT,
                    libvirt.VIR_ERR_INVALID_ARG,
                ):
                    domain.undefine()
                else:
                    raise
            message = "domain undefined"
        # Storage is ours by construction (named after the allocation), never read from the XML.
        disk = self.images.remove_allocation_disk(allocation_id)
        seed = cloud_init_seed.remove_seed(self.seed_dir, allocation_id)
        removed = [what for what, gone in (("disk", disk), ("seed", seed)) if gone]
        return f"{message}; removed {', '.join(removed) or 'no storage (already removed)'}"

    def _wipe_leases(self, allocation_id: str) -> str:
        links = ""
        if self.networks is not None:
            links = f", {self.networks.remove(allocation_id)} network link(s) removed"
        path = self.lease_path(allocation_id)
        try:
            held = json.loads(path.read_text()).get("gpus", [])
        except FileNotFoundError:
            return f"no leases (already wiped){links}"
        except ValueError:
            held = []
        path.unlink(missing_ok=True)
        return f"{len(held)} GPU lease(s) released{links}"


@dataclass(frozen=True)
class _FilesystemDevices:
    """A virtiofs filesystem's device XML in a domain's definition and in its running guest
    (None: not there); `hot_pluggable`: a running guest whose devices can change."""

    defined: str | None
    live: str | None
    hot_pluggable: bool


class _ShutdownTimedOut(Exception):
    """The guest did not power off in time: the release continues with a hard stop."""


def _phase(progress: Progress, name: str, work: Callable[[], str]) -> bool:
    """Run one phase; False when a graceful shutdown timed out (the caller hard-stops). A
    HostError propagates: the activity marks the open phase failed."""
    progress(name, PhaseStatus.STARTED)
    try:
        message = work()
    except _ShutdownTimedOut as err:
        progress(name, PhaseStatus.FAILED, str(err))
        return False
    progress(name, PhaseStatus.SUCCEEDED, message)
    return True


def _start_failure(err: Exception) -> Exception:
    """A domain that libvirt refused to start: vfio_error when the host's VFIO setup is why
    (non-retryable), else the libvirt error itself (retried, then provisioning_error)."""
    message = str(err)
    if _VFIO_FAILURE.search(message):
        return HostError(HostErrorType.VFIO_ERROR, f"the host refused the GPU: {message[:300]}")
    return err


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_ids(allocation_id: str, username: str | None) -> None:
    # Both end up in names and paths (domain name, seed directory, cloud-config).
    if not _SAFE_ID.match(allocation_id):
        raise HostError(HostErrorType.INVALID_SPEC, "allocation_id has characters not allowed here")
    if username is not None and not _USERNAME.match(username):
        raise HostError(HostErrorType.INVALID_SPEC, "username is not a valid POSIX user name")
