"""The node's GPU vendor tools for node maintenance (node.gpu_scrub, node.validate_clean), strictly
read-only: nothing here resets a GPU, changes a setting or kills a process.

- `NvmlGpuMemoryProbe` (agent.maintenance's `GpuMemoryProbe`): NVML through the official binding
  (`nvidia-ml-py`, imported lazily as `pynvml`), calling only nvmlInit, nvmlDeviceGetCount,
  nvmlDeviceGetHandleByIndex, nvmlDeviceGetPciInfo, nvmlDeviceGetMemoryInfo,
  nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetGraphicsRunningProcesses and nvmlShutdown.
- `NvidiaSmiScrubber` (agent.maintenance's `NodeGpuScrubber`, and the bare-metal `GpuScrubber`):
  the production scrub. It runs `nvidia-smi --query-gpu=...` and `--query-compute-apps=...`
  (fixed arguments, no shell) and verifies that no compute process holds memory on any GPU; it
  never resets one. A GPU with a process on it is not scrubbed.

Three kinds of answer, never confused:

- verified: the tool inspected the GPU (idle or not);
- unverified: this host cannot answer (no binding, no NVML library, no driver loaded, no
  nvidia-smi, no permission, a GPU the driver cannot see because it is bound to vfio-pci). The
  tools say so, with the reason: `GpuToolUnavailable` for the whole node, `GpuMemoryUse.unverified`
  or an outcome message starting with `UNVERIFIED_PREFIX` for one GPU. Unverified is never clean;
  only node policy (FileMaintenanceBackend(allow_unverified_gpu=True)) may accept it.
- failed: the tool is there and answered with an error (a GPU fell off the bus, the tool timed
  out): `GpuQueryFailed`. Node policy never excuses it.

Both tools compare what they saw with the NVIDIA GPUs in the kernel's PCI tree
(agent.inventory.probe_sysfs): a GPU the driver does not see is reported as unverified, so a slice
node whose GPUs sit on vfio-pci cannot pass as "0 GPUs, all idle".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.gpu_health import bound_driver
from agent.inventory import (
    DEFAULT_SYSFS_ROOT,
    InventoryUnavailable,
    normalize_pci_address,
    probe_sysfs,
)
from contracts.host_tasks import GpuScrubOutcome

UNVERIFIED_PREFIX = "unverified: "
ALLOWED_UNVERIFIED_PREFIX = "unverified (allowed by node policy): "
NVIDIA_SMI = "/usr/bin/nvidia-smi"
NVIDIA_SMI_TIMEOUT_S = 60.0
_KILL_GRACE_S = 5.0
_MAX_PIDS = 5


def unverified(reason: str, *, allowed: bool = False) -> str:
    """The message of a check or outcome that could not be verified; `allowed`: node policy
    accepts it (the note comes first, so truncating a long reason never drops it)."""
    if is_unverified(reason):
        reason = reason.split(": ", 1)[1]
    return (ALLOWED_UNVERIFIED_PREFIX if allowed else UNVERIFIED_PREFIX) + reason


def is_unverified(message: str) -> bool:
    return message.startswith((UNVERIFIED_PREFIX, ALLOWED_UNVERIFIED_PREFIX))


class GpuToolUnavailable(RuntimeError):
    """This host cannot answer for its GPUs: no vendor tool, library, driver or permission.
    Means "unverified", never "clean". The message is the reason (short, no secrets)."""


class GpuQueryFailed(RuntimeError):
    """The vendor tool is present and failed (a GPU fell off the bus, the tool crashed or timed
    out). A failure, not "unverified": node policy never excuses it."""


@dataclass(frozen=True)
class GpuMemoryUse:
    gpu: str  # the PCI address ("0000:18:00.0") for the tools here
    used_bytes: int
    processes: int  # compute/graphics processes holding memory on it
    unverified: str = ""  # why this GPU could not be inspected; "" when it was


# --------------------------------------------------------------------------- sysfs cross-check


def gpus_hidden_from(
    seen: Iterable[str], tool: str, sysfs_root: Path | str | None
) -> list[tuple[str, str]]:
    """(PCI address, reason) of each NVIDIA GPU in the kernel's PCI tree that `tool` did not
    report (bound to vfio-pci, to no driver, ...). [] without a sysfs root or tree."""
    if sysfs_root is None:
        return []
    try:
        present = probe_sysfs(sysfs_root)
    except InventoryUnavailable:
        return []
    known = {normalize_pci_address(a) for a in seen}
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    hidden = []
    for record in present:
        if record.pci_address in known:
            continue
        driver = bound_driver(devices / record.pci_address)
        hidden.append(
            (record.pci_address, f"not visible to {tool} (bound to {driver or 'no driver'})")
        )
    return hidden


# --------------------------------------------------------------------------- NVML

# NVML return codes (nvml.h) that mean "this host cannot tell", not "something is wrong".
_NVML_UNVERIFIABLE = {
    3: "not supported by this GPU or driver",  # NVML_ERROR_NOT_SUPPORTED
    4: "no permission to query NVML",  # NVML_ERROR_NO_PERMISSION
    9: "the NVIDIA driver is not loaded",  # NVML_ERROR_DRIVER_NOT_LOADED
    12: "the NVML library is not installed",  # NVML_ERROR_LIBRARY_NOT_FOUND
    13: "NVML lacks a needed function (driver too old)",  # NVML_ERROR_FUNCTION_NOT_FOUND
    18: "NVML and the loaded driver differ in version (reboot after the driver update)",
}
_NVML_NOT_SUPPORTED = (3, 13)


def load_nvml() -> Any:
    """The `pynvml` module of nvidia-ml-py; GpuToolUnavailable where it is not installed."""
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        raise GpuToolUnavailable("the NVML binding (nvidia-ml-py) is not installed") from None
    return pynvml


def _nvml_code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _nvml_error_text(err: BaseException) -> str:
    try:
        text = str(err)
    except Exception:  # pynvml's __str__ may itself call into the library
        text = ""
    return text or type(err).__name__


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpuMemoryProbe:
    """`GpuMemoryProbe` through NVML: per GPU, the memory in use and the processes holding it
    (read-only calls only, listed in the module doc). Raises GpuToolUnavailable where NVML cannot
    run here, GpuQueryFailed where it fails; a GPU NVML does not see (sysfs cross-check) or
    cannot answer for comes back with `unverified` set.

    nvml: the pynvml module (default: imported on each call); sysfs_root: the PCI tree to
    cross-check against (None: no cross-check)."""

    def __init__(
        self, *, sysfs_root: Path | str | None = DEFAULT_SYSFS_ROOT, nvml: Any | None = None
    ) -> None:
        self._sysfs_root = sysfs_root
        self._nvml = nvml

    def usage(self) -> list[GpuMemoryUse]:
        nvml = self._nvml if self._nvml is not None else load_nvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            reason = _NVML_UNVERIFIABLE.get(_nvml_code(err) or 0)
            if reason is not None:
                raise GpuToolUnavailable(f"NVML did not initialise: {reason}") from None
            raise GpuQueryFailed(f"NVML did not initialise: {_nvml_error_text(err)}") from None
        try:
            result = [self._one(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as err:
            raise GpuQueryFailed(f"NVML query failed: {_nvml_error_text(err)}") from None
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
        hidden = gpus_hidden_from([u.gpu for u in result], "NVML", self._sysfs_root)
        return result + [GpuMemoryUse(a, 0, 0, unverified=why) for a, why in hidden]

    def _one(self, nvml: Any, index: int) -> GpuMemoryUse:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        address = normalize_pci_address(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            pids = {int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            try:
                pids |= {int(p.pid) for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)}
            except nvml.NVMLError as err:
                if _nvml_code(err) not in _NVML_NOT_SUPPORTED:  # no graphics engine: none
                    raise
        except nvml.NVMLError as err:
            reason = _NVML_UNVERIFIABLE.get(_nvml_code(err) or 0)
            if reason is None:
                raise GpuQueryFailed(
                    f"NVML failed on GPU {address}: {_nvml_error_text(err)}"
                ) from None
            return GpuMemoryUse(address, 0, 0, unverified=reason)
        return GpuMemoryUse(address, int(memory.used), len(pids))


# --------------------------------------------------------------------------- nvidia-smi

# nvidia-smi exit codes (its man page) that mean "this host cannot tell".
_SMI_UNVERIFIABLE = {
    3: "the query is not supported on this GPU",
    4: "no permission to run the query",
    9: "the NVIDIA driver is not loaded",
    12: "the NVML library is not installed",
    13: "the local NVML lacks a needed function (driver too old)",
}
_SMI_FAILED = {
    14: "a GPU's infoROM is corrupted",
    15: "a GPU has fallen off the bus",
}
_SMI_NO_DEVICES = "No devices were found"


@dataclass(frozen=True)
class SmiGpu:
    pci_address: str
    used_mib: int | None


@dataclass(frozen=True)
class SmiProcess:
    pci_address: str
    pid: int
    used_mib: int | None


def _number(text: str) -> int | None:
    """nvidia-smi's numbers; "[N/A]", "[Not Supported]" and the like are None."""
    try:
        return int(float(text))
    except ValueError:
        return None


class NvidiaSmi:
    """Read-only queries through nvidia-smi: fixed arguments, no shell, a minimal environment and
    a timeout. `binary`: the tool's path (default: `nvidia-smi` on PATH, else NVIDIA_SMI)."""

    def __init__(
        self, binary: Path | str | None = None, *, timeout_s: float = NVIDIA_SMI_TIMEOUT_S
    ) -> None:
        self.binary = Path(binary) if binary is not None else self.default_binary()
        self.timeout_s = timeout_s

    @staticmethod
    def default_binary() -> Path:
        found = shutil.which("nvidia-smi")
        return Path(found) if found else Path(NVIDIA_SMI)

    def gpus(self) -> list[SmiGpu]:
        rows = self._query("--query-gpu=pci.bus_id,memory.used", columns=2)
        return [SmiGpu(normalize_pci_address(bus), _number(used)) for bus, used in rows]

    def compute_apps(self) -> list[SmiProcess]:
        rows = self._query("--query-compute-apps=gpu_bus_id,pid,used_memory", columns=3)
        apps = []
        for bus, pid, used in rows:
            number = _number(pid)
            if number is None:
                raise GpuQueryFailed("nvidia-smi listed a compute process without a pid")
            apps.append(SmiProcess(normalize_pci_address(bus), number, _number(used)))
        return apps

    def gpus_and_compute_apps(self) -> tuple[list[SmiGpu], list[SmiProcess]]:
        """Both queries, the second only when there is a GPU to hold memory on."""
        gpus = self.gpus()
        return gpus, self.compute_apps() if gpus else []

    def _query(self, query: str, *, columns: int) -> list[list[str]]:
        name = self.binary.name
        if not self.binary.is_file():
            raise GpuToolUnavailable(f"{name} is not installed ({self.binary})")
        try:
            proc = subprocess.Popen(
                [str(self.binary), query, "--format=csv,noheader,nounits"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={"PATH": os.defpath, "LC_ALL": "C"},
            )
        except PermissionError:
            raise GpuToolUnavailable(f"{name} is not executable by the agent") from None
        except OSError as err:
            raise GpuQueryFailed(f"{name} did not run ({type(err).__name__})") from None
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            # A wedged GPU can leave nvidia-smi in uninterruptible sleep: kill it, give it a
            # moment, and never wait on it longer than that.
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=_KILL_GRACE_S)
            raise GpuQueryFailed(f"{name} did not answer within {self.timeout_s:g} s") from None
        if _SMI_NO_DEVICES in f"{stdout}\n{stderr}":
            return []  # the driver is loaded and sees no GPU (the cross-check names any)
        if proc.returncode in _SMI_UNVERIFIABLE:
            reason = _SMI_UNVERIFIABLE[proc.returncode]
            raise GpuToolUnavailable(f"{reason} ({name} exit {proc.returncode})")
        if proc.returncode != 0:
            reason = _SMI_FAILED.get(proc.returncode, "query failed")
            raise GpuQueryFailed(f"{reason} ({name} exit {proc.returncode})")
        rows = []
        for line in stdout.splitlines():
            if not line.strip() or line.strip().startswith("No running"):
                continue
            row = [cell.strip() for cell in line.split(",")]
            if len(row) != columns:
                raise GpuQueryFailed(f"unexpected {name} output for {query.split('=')[0]}")
            rows.append(row)
        return rows


class NvidiaSmiMemoryProbe:
    """`GpuMemoryProbe` through nvidia-smi, where NVML cannot be loaded by the agent (a host root
    other than "/": NVML would read the driver of the machine the process runs on). Read-only;
    unverifiable as NvmlGpuMemoryProbe is."""

    def __init__(self, tool: NvidiaSmi, *, sysfs_root: Path | str | None = DEFAULT_SYSFS_ROOT):
        self.tool = tool
        self._sysfs_root = sysfs_root

    def usage(self) -> list[GpuMemoryUse]:
        try:
            gpus, apps = self.tool.gpus_and_compute_apps()
        except GpuToolUnavailable as err:
            return [GpuMemoryUse("all", 0, 0, unverified=str(err))]
        result = [
            GpuMemoryUse(
                g.pci_address,
                (g.used_mib or 0) * 1024 * 1024,
                sum(1 for a in apps if a.pci_address == g.pci_address),
            )
            for g in gpus
        ]
        hidden = gpus_hidden_from([g.pci_address for g in gpus], "nvidia-smi", self._sysfs_root)
        return result + [GpuMemoryUse(a, 0, 0, unverified=why) for a, why in hidden]


class NvidiaSmiScrubber:
    """The production GPU scrub on NVIDIA nodes: verifies, per GPU, that no compute process holds
    memory on it (nvidia-smi, read-only; no reset). One outcome per GPU, by PCI address:

    - scrubbed: no compute process on it (the message gives the memory in use);
    - not scrubbed: processes hold memory on it (pids named);
    - unverified (not scrubbed, message `unverified: ...`): nvidia-smi cannot run here (one
      outcome "all") or the GPU is not visible to the driver (sysfs cross-check).

    Raises GpuQueryFailed when nvidia-smi is there and fails (retry, or the node needs an
    operator). `scrub()` serves the bare-metal `GpuScrubber` (run on each deprovision): it raises
    unless every GPU is scrubbed, or is unverified and `allow_unverified` says the node's policy
    accepts that."""

    def __init__(
        self,
        tool: NvidiaSmi | None = None,
        *,
        sysfs_root: Path | str | None = DEFAULT_SYSFS_ROOT,
        allow_unverified: bool = False,
    ) -> None:
        self.tool = tool or NvidiaSmi()
        self._sysfs_root = sysfs_root
        self.allow_unverified = allow_unverified

    def scrub_each(self) -> list[GpuScrubOutcome]:
        try:
            gpus, apps = self.tool.gpus_and_compute_apps()
        except GpuToolUnavailable as err:
            return [GpuScrubOutcome(gpu="all", scrubbed=False, message=unverified(str(err)))]
        outcomes = []
        for gpu in gpus:
            held = [a for a in apps if a.pci_address == gpu.pci_address]
            used = "unknown" if gpu.used_mib is None else f"{gpu.used_mib} MiB"
            if not held:
                outcomes.append(
                    GpuScrubOutcome(
                        gpu.pci_address,
                        True,
                        f"no compute process holds memory ({used} in use; verified, not reset)",
                    )
                )
                continue
            pids = ", ".join(str(a.pid) for a in held[:_MAX_PIDS])
            more = f" and {len(held) - _MAX_PIDS} more" if len(held) > _MAX_PIDS else ""
            outcomes.append(
                GpuScrubOutcome(
                    gpu.pci_address,
                    False,
                    f"{len(held)} compute process(es) hold memory "
                    f"(pid {pids}{more}; {used} in use)",
                )
            )
        hidden = gpus_hidden_from([g.pci_address for g in gpus], "nvidia-smi", self._sysfs_root)
        outcomes += [GpuScrubOutcome(a, False, unverified(why)) for a, why in hidden]
        return outcomes

    def scrub(self) -> str:
        outcomes = self.scrub_each()
        if not outcomes:
            raise RuntimeError("no GPU found to verify")
        unsure = [o for o in outcomes if not o.scrubbed and is_unverified(o.message)]
        failed = [o for o in outcomes if not o.scrubbed and not is_unverified(o.message)]
        if failed or (unsure and not self.allow_unverified):
            raise RuntimeError("; ".join(f"GPU {o.gpu}: {o.message}" for o in failed + unsure))
        verified = len(outcomes) - len(unsure)
        note = f", {len(unsure)} unverified (allowed by node policy)" if unsure else ""
        return f"{verified} GPU(s) verified free of compute processes{note}"
