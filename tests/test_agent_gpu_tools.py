"""The GPU vendor tools of node maintenance (agent/gpu_tools.py): the NVML memory probe against a
stand-in for pynvml that has only the read-only calls (and against the real binding where this
machine has or lacks an NVIDIA driver), the nvidia-smi scrubber against a stand-in nvidia-smi
executable that records how it was called, both cross-checked with a sysfs tree. Then both
plugged into FileMaintenanceBackend, as the production agent wires them."""

from __future__ import annotations

import ctypes
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.backend import PhaseStatus
from agent.backends.baremetal_users import UserAccountConfig
from agent.gpu_tools import (
    GpuMemoryUse,
    GpuQueryFailed,
    GpuToolUnavailable,
    NvidiaSmi,
    NvidiaSmiScrubber,
    NvmlGpuMemoryProbe,
    is_unverified,
    load_nvml,
    unverified,
)
from agent.inventory import normalize_pci_address
from agent.maintenance import (
    CHECK_GPU_MEMORY,
    FileMaintenanceBackend,
    MaintenanceConfig,
    ProcessInfo,
)
from contracts.host_tasks import GpuScrubOutcome, NodeMaintenanceInput
from tests.test_agent_gpu_health import FakeSysfs

GPU_A = "0000:18:00.0"
GPU_B = "0000:2a:00.0"
GPU_C = "0000:ba:00.0"
GIB = 1 << 30


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


# --------------------------------------------------------------------------- NVML


class _NVMLError(Exception):
    """pynvml's NVMLError: carries the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {12: "NVML Shared Library Not Found", 15: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}"
        )


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None  # pynvml's field name


class FakeNvml:
    """Stands in for pynvml. Only NVML's read-only calls exist on it: a reset or a setter would
    be an AttributeError. `gpus`: bus id -> (used bytes, compute pids, graphics pids)."""

    NVMLError = _NVMLError

    def __init__(self, gpus: dict[str, tuple[int, list[int], list[int]]]) -> None:
        self.gpus = gpus
        self.calls: list[str] = []
        self.fail: dict[str, int] = {}  # call name -> NVML error code it raises

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise _NVMLError(self.fail[name])

    def _bus(self, handle: int) -> str:
        return list(self.gpus)[handle]

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._call("nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetPciInfo(self, handle: int) -> object:
        self._call("nvmlDeviceGetPciInfo")
        bus = "0000" + self._bus(handle).upper()  # NVML's 8-digit domain, upper case
        return type("Pci", (), {"busId": bus.encode() if handle == 0 else bus})()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        self._call("nvmlDeviceGetMemoryInfo")
        used = self.gpus[self._bus(handle)][0]
        return type("Memory", (), {"total": 80 * GIB, "used": used, "free": 80 * GIB - used})()

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[_Proc]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        return [_Proc(pid, GIB) for pid in self.gpus[self._bus(handle)][1]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[_Proc]:
        self._call("nvmlDeviceGetGraphicsRunningProcesses")
        return [_Proc(pid, None) for pid in self.gpus[self._bus(handle)][2]]


READ_ONLY_NVML = {
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
}


def test_nvml_probe_reports_memory_and_processes_per_gpu(sysfs: FakeSysfs) -> None:
    sysfs.add_gpu(GPU_A)
    sysfs.add_gpu(GPU_B)
    nvml = FakeNvml({GPU_A: (2 << 20, [], []), GPU_B: (40 * GIB, [4242], [4242, 77])})
    usage = NvmlGpuMemoryProbe(sysfs_root=sysfs.root, nvml=nvml).usage()
    assert usage == [
        GpuMemoryUse(GPU_A, 2 << 20, 0),
        GpuMemoryUse(GPU_B, 40 * GIB, 2),  # pid 4242 on both lists counts once
    ]
    assert nvml.calls[0] == "nvmlInit"
    assert nvml.calls[-1] == "nvmlShutdown"
    assert set(nvml.calls) <= READ_ONLY_NVML


def test_nvml_probe_reports_gpus_the_driver_cannot_see_as_unverified(sysfs: FakeSysfs) -> None:
    """A slice node: one GPU on the NVIDIA driver, two on vfio-pci or no driver (NVML lists only
    the first). They are unverified, not "idle"."""
    sysfs.add_gpu(GPU_A, driver="nvidia")
    sysfs.add_gpu(GPU_B, driver="vfio-pci")
    sysfs.add_gpu(GPU_C, driver=None)
    usage = NvmlGpuMemoryProbe(sysfs_root=sysfs.root, nvml=FakeNvml({GPU_A: (0, [], [])})).usage()
    assert usage == [
        GpuMemoryUse(GPU_A, 0, 0),
        GpuMemoryUse(GPU_B, 0, 0, unverified="not visible to NVML (bound to vfio-pci)"),
        GpuMemoryUse(GPU_C, 0, 0, unverified="not visible to NVML (bound to no driver)"),
    ]


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (12, "the NVML library is not installed"),
        (9, "the NVIDIA driver is not loaded"),
        (4, "no permission to query NVML"),
        (18, "NVML and the loaded driver differ in version"),
    ],
)
def test_nvml_that_cannot_start_here_is_unverified(code: int, reason: str) -> None:
    nvml = FakeNvml({})
    nvml.fail["nvmlInit"] = code
    with pytest.raises(GpuToolUnavailable) as err:
        NvmlGpuMemoryProbe(sysfs_root=None, nvml=nvml).usage()
    assert reason in str(err.value)


def test_nvml_failures_are_failures_not_unverified(sysfs: FakeSysfs) -> None:
    nvml = FakeNvml({GPU_A: (0, [], [])})
    nvml.fail["nvmlInit"] = 999
    with pytest.raises(GpuQueryFailed):
        NvmlGpuMemoryProbe(sysfs_root=None, nvml=nvml).usage()

    lost = FakeNvml({GPU_A: (0, [], []), GPU_B: (0, [], [])})
    lost.fail["nvmlDeviceGetMemoryInfo"] = 15
    with pytest.raises(GpuQueryFailed, match=f"GPU {GPU_A}: GPU is lost"):
        NvmlGpuMemoryProbe(sysfs_root=None, nvml=lost).usage()
    assert lost.calls[-1] == "nvmlShutdown"


def test_nvml_per_gpu_answers_it_cannot_give_are_unverified() -> None:
    nvml = FakeNvml({GPU_A: (0, [], [])})
    nvml.fail["nvmlDeviceGetComputeRunningProcesses"] = 3  # NOT_SUPPORTED
    [use] = NvmlGpuMemoryProbe(sysfs_root=None, nvml=nvml).usage()
    assert use.unverified == "not supported by this GPU or driver"
    # A GPU without a graphics engine answers NOT_SUPPORTED there: no graphics processes.
    graphics = FakeNvml({GPU_A: (0, [12], [])})
    graphics.fail["nvmlDeviceGetGraphicsRunningProcesses"] = 3
    assert NvmlGpuMemoryProbe(sysfs_root=None, nvml=graphics).usage() == [GpuMemoryUse(GPU_A, 0, 1)]


def test_no_nvml_binding_is_unverified(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(GpuToolUnavailable, match="nvidia-ml-py"):
        load_nvml()
    with pytest.raises(GpuToolUnavailable, match="nvidia-ml-py"):
        NvmlGpuMemoryProbe(sysfs_root=None).usage()


def _nvml_starts_here() -> bool:
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
    except Exception:
        return False
    nvml.nvmlShutdown()
    return True


PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
HELD_BYTES = GIB  # what the test holds on one GPU to see the probe count it


class CudaMemory:
    """Memory held on one GPU through the CUDA driver API (libcuda, which every NVIDIA driver
    installs): a context and one allocation of this process, as a tenant's job leaves them."""

    def __init__(self, cuda: ctypes.CDLL) -> None:
        self._cuda = cuda
        self._context = ctypes.c_void_p()
        self._pointer = ctypes.c_uint64()
        self.pci_address = ""

    def _call(self, name: str, *args: Any) -> None:
        code = getattr(self._cuda, name)(*args)
        assert code == 0, f"{name} returned CUresult {code}"

    def hold(self, size: int) -> None:
        device = ctypes.c_int()
        self._call("cuInit", 0)
        self._call("cuDeviceGet", ctypes.byref(device), 0)
        bus_id = ctypes.create_string_buffer(32)
        self._call("cuDeviceGetPCIBusId", bus_id, len(bus_id), device)
        self.pci_address = bus_id.value.decode()
        self._call("cuCtxCreate_v2", ctypes.byref(self._context), 0, device)
        self._call("cuMemAlloc_v2", ctypes.byref(self._pointer), ctypes.c_size_t(size))

    def release(self) -> None:
        if self._pointer.value:
            self._cuda.cuMemFree_v2(self._pointer)
        if self._context.value:
            self._cuda.cuCtxDestroy_v2(self._context)


def _nvml_totals() -> dict[str, int]:
    """Each GPU's memory size as NVML reports it, read here beside the probe."""
    nvml = load_nvml()
    nvml.nvmlInit()
    try:
        totals = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
            address = normalize_pci_address(bus_id if isinstance(bus_id, str) else bus_id.decode())
            totals[address] = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        return totals
    finally:
        nvml.nvmlShutdown()


def test_the_real_nvml_binding_answers_or_says_why_not() -> None:
    """On this machine, through the real pynvml: a GPU machine lists every GPU NVML sees, each
    with a believable amount in use, and counts memory a process holds on one (a GiB held here
    through the CUDA driver shows up on that GPU); any other machine says why it cannot
    tell (no library, no driver), and never reports clean."""
    if not _nvml_starts_here():
        with pytest.raises(GpuToolUnavailable):
            NvmlGpuMemoryProbe().usage()
        return
    totals = _nvml_totals()
    before = {u.gpu: u for u in NvmlGpuMemoryProbe().usage() if not u.unverified}
    assert before, "NVML started but the probe lists no GPU"
    assert set(before) == set(totals)
    for use in before.values():
        assert PCI_ADDRESS.fullmatch(use.gpu), use.gpu
        assert 0 <= use.used_bytes <= totals[use.gpu]

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("NVML answered (checked above) but libcuda is missing: nothing to hold")
    held = CudaMemory(cuda)
    try:
        held.hold(HELD_BYTES)
        gpu = normalize_pci_address(held.pci_address)
        during = {u.gpu: u for u in NvmlGpuMemoryProbe().usage()}
    finally:
        held.release()
    # At least the GiB held (plus the context's own); its process is not asserted: inside a
    # container NVML may not list processes of another PID namespace.
    assert during[gpu].used_bytes - before[gpu].used_bytes >= HELD_BYTES, (before[gpu], during)


# --------------------------------------------------------------------------- nvidia-smi


class FakeSmi:
    """A stand-in `nvidia-smi` executable: prints canned CSV for each query, exits with a chosen
    status, and records each argument list it was called with."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "nvidia-smi"
        self.calls_file = directory / "calls"
        self.gpus = ""
        self.apps = ""
        self.exit = 0
        self.stall_s = 0.0

    def write(self) -> Path:
        (self.path.parent / "gpus.csv").write_text(self.gpus)
        (self.path.parent / "apps.csv").write_text(self.apps)
        d = self.path.parent
        self.path.write_text(
            "#!/bin/sh\n"
            f'echo "$@" >> "{self.calls_file}"\n'
            + (f"exec sleep {self.stall_s}\n" if self.stall_s else "")
            + 'case "$1" in\n'
            f'  --query-gpu=*) cat "{d}/gpus.csv" ;;\n'
            f'  --query-compute-apps=*) cat "{d}/apps.csv" ;;\n'
            "esac\n"
            f"exit {self.exit}\n"
        )
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)
        return self.path

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path / "bin")


def scrubber(smi: FakeSmi, sysfs: FakeSysfs | None = None, **kw: Any) -> NvidiaSmiScrubber:
    return NvidiaSmiScrubber(
        NvidiaSmi(smi.write(), timeout_s=kw.pop("timeout_s", 10)),
        sysfs_root=sysfs.root if sysfs is not None else None,
        **kw,
    )


def test_scrub_verifies_no_compute_process_holds_gpu_memory(smi: FakeSmi, sysfs: FakeSysfs) -> None:
    sysfs.add_gpu(GPU_A)
    sysfs.add_gpu(GPU_B)
    smi.gpus = "00000000:18:00.0, 1\n00000000:2A:00.0, 40960\n"
    smi.apps = "00000000:2A:00.0, 4242, 40000\n00000000:2A:00.0, 4243, [N/A]\n"
    outcomes = scrubber(smi, sysfs).scrub_each()
    assert [(o.gpu, o.scrubbed) for o in outcomes] == [(GPU_A, True), (GPU_B, False)]
    assert outcomes[0].message == (
        "no compute process holds memory (1 MiB in use; verified, not reset)"
    )
    assert outcomes[1].message == (
        "2 compute process(es) hold memory (pid 4242, 4243; 40960 MiB in use)"
    )
    # Queries only: never --gpu-reset, -r, -pm, -c or any other setter.
    assert smi.calls() == [
        "--query-gpu=pci.bus_id,memory.used --format=csv,noheader,nounits",
        "--query-compute-apps=gpu_bus_id,pid,used_memory --format=csv,noheader,nounits",
    ]


def test_scrub_without_nvidia_smi_is_unverified(tmp_path: Path) -> None:
    outcomes = NvidiaSmiScrubber(NvidiaSmi(tmp_path / "missing" / "nvidia-smi")).scrub_each()
    assert len(outcomes) == 1
    assert outcomes[0].gpu == "all"
    assert not outcomes[0].scrubbed
    assert outcomes[0].message.startswith("unverified: nvidia-smi is not installed")


@pytest.mark.parametrize(
    ("status", "reason"),
    [(9, "the NVIDIA driver is not loaded"), (12, "the NVML library is not installed")],
)
def test_scrub_where_nvidia_smi_cannot_answer_is_unverified(
    smi: FakeSmi, status: int, reason: str
) -> None:
    smi.exit = status
    [outcome] = scrubber(smi).scrub_each()
    assert (outcome.gpu, outcome.scrubbed) == ("all", False)
    assert outcome.message == unverified(f"{reason} (nvidia-smi exit {status})")


def test_scrub_of_gpus_the_driver_cannot_see_is_unverified(smi: FakeSmi, sysfs: FakeSysfs) -> None:
    """The NVIDIA driver is loaded but every GPU sits on vfio-pci: nvidia-smi finds none."""
    sysfs.add_gpu(GPU_A, driver="vfio-pci")
    sysfs.add_gpu(GPU_B, driver="vfio-pci")
    smi.gpus = smi.apps = "No devices were found\n"
    smi.exit = 6
    outcomes = scrubber(smi, sysfs).scrub_each()
    assert [(o.gpu, o.scrubbed, o.message) for o in outcomes] == [
        (GPU_A, False, "unverified: not visible to nvidia-smi (bound to vfio-pci)"),
        (GPU_B, False, "unverified: not visible to nvidia-smi (bound to vfio-pci)"),
    ]


def test_scrub_fails_when_nvidia_smi_fails(smi: FakeSmi) -> None:
    smi.exit = 15
    with pytest.raises(GpuQueryFailed, match="fallen off the bus"):
        scrubber(smi).scrub_each()
    smi.exit = 0
    smi.gpus = "something, else, entirely\n"
    with pytest.raises(GpuQueryFailed, match="unexpected nvidia-smi output"):
        scrubber(smi).scrub_each()


def test_scrub_fails_when_nvidia_smi_hangs(smi: FakeSmi) -> None:
    smi.stall_s = 5
    with pytest.raises(GpuQueryFailed, match="did not answer"):
        scrubber(smi, timeout_s=0.3).scrub_each()


def test_bare_metal_scrub_raises_unless_every_gpu_is_verified(
    smi: FakeSmi, sysfs: FakeSysfs
) -> None:
    sysfs.add_gpu(GPU_A)
    smi.gpus = "00000000:18:00.0, 0\n"
    assert scrubber(smi, sysfs).scrub() == "1 GPU(s) verified free of compute processes"
    smi.apps = "00000000:18:00.0, 999, 100\n"
    with pytest.raises(RuntimeError, match="pid 999"):
        scrubber(smi, sysfs).scrub()
    smi.apps = ""
    sysfs.add_gpu(GPU_B, driver="vfio-pci")
    with pytest.raises(RuntimeError, match="unverified"):
        scrubber(smi, sysfs).scrub()
    assert scrubber(smi, sysfs, allow_unverified=True).scrub() == (
        "1 GPU(s) verified free of compute processes, 1 unverified (allowed by node policy)"
    )


def test_unverified_messages() -> None:
    assert unverified("no driver") == "unverified: no driver"
    assert unverified("no driver", allowed=True) == (
        "unverified (allowed by node policy): no driver"
    )
    again = unverified(unverified("no driver"), allowed=True)
    assert again == unverified("no driver", allowed=True)
    assert is_unverified(unverified("x"))
    assert is_unverified(unverified("x", allowed=True))
    assert not is_unverified("no compute process holds memory")


# --------------------------------------------------------------------------- in the backend


class _Progress:
    def __init__(self) -> None:
        self.events: list[tuple[str, PhaseStatus, str]] = []

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        self.events.append((phase, status, message))

    cancelled = False

    def wait(self, seconds: float | None) -> None:
        raise AssertionError("never waits")

    def suspend_heartbeats(self) -> None:
        raise AssertionError("never suspends heartbeats")


def node_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for d in ("etc", "proc/self"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "proc/self/mounts").write_text("/dev/sda1 / ext4 rw 0 0\n")
    return root


class NoProcesses:
    def processes(self) -> list[ProcessInfo]:
        return []


def production_backend(
    tmp_path: Path,
    smi: FakeSmi,
    nvml: FakeNvml | Callable[[], Any],
    sysfs: FakeSysfs,
    **kw: Any,
) -> FileMaintenanceBackend:
    return FileMaintenanceBackend(
        node_root(tmp_path),
        scrubber=NvidiaSmiScrubber(NvidiaSmi(smi.write()), sysfs_root=sysfs.root),
        gpu_probe=NvmlGpuMemoryProbe(sysfs_root=sysfs.root, nvml=nvml),
        processes=NoProcesses(),
        config=MaintenanceConfig(users=UserAccountConfig(uid_min=20000, uid_max=29999)),
        **kw,
    )


def spec() -> NodeMaintenanceInput:
    return NodeMaintenanceInput(task_id="t1", node_id="n1")


def test_an_nvidia_node_scrubs_and_validates_clean(
    tmp_path: Path, smi: FakeSmi, sysfs: FakeSysfs
) -> None:
    sysfs.add_gpu(GPU_A)
    sysfs.add_gpu(GPU_B)
    smi.gpus = "00000000:18:00.0, 0\n00000000:2A:00.0, 0\n"
    nvml = FakeNvml({GPU_A: (1 << 20, [], []), GPU_B: (1 << 20, [], [])})
    backend = production_backend(tmp_path, smi, nvml, sysfs)
    progress = _Progress()
    outcomes = backend.gpu_scrub(spec(), progress)
    assert [(o.gpu, o.scrubbed) for o in outcomes] == [(GPU_A, True), (GPU_B, True)]
    assert progress.events[-1] == ("gpus_scrubbed", PhaseStatus.SUCCEEDED, "2 scrubbed")
    out = backend.validate_clean(spec(), _Progress())
    assert out.clean, out.checks
    assert {c.name: c.reason for c in out.checks}[CHECK_GPU_MEMORY] == "2 GPU(s) idle"


def test_a_node_without_nvidia_tools_is_not_clean_unless_policy_allows_it(
    tmp_path: Path, smi: FakeSmi, sysfs: FakeSysfs
) -> None:
    """GPUs in sysfs, no driver loaded: neither tool can answer. Unverified, never clean."""
    sysfs.add_gpu(GPU_A, driver="vfio-pci")
    smi.exit = 9
    nvml = FakeNvml({})
    nvml.fail["nvmlInit"] = 9

    strict = production_backend(tmp_path / "a", smi, nvml, sysfs)
    progress = _Progress()
    [outcome] = strict.gpu_scrub(spec(), progress)
    assert not outcome.scrubbed
    assert outcome.message.startswith("unverified: the NVIDIA driver is not loaded")
    assert progress.events[-1][1] == PhaseStatus.FAILED
    out = strict.validate_clean(spec(), _Progress())
    assert not out.clean
    gpu = next(c for c in out.checks if c.name == CHECK_GPU_MEMORY)
    assert not gpu.passed
    assert gpu.reason == "unverified: NVML did not initialise: the NVIDIA driver is not loaded"

    lenient = production_backend(tmp_path / "b", smi, nvml, sysfs, allow_unverified_gpu=True)
    progress = _Progress()
    [outcome] = lenient.gpu_scrub(spec(), progress)
    assert outcome.scrubbed
    assert outcome.message.startswith("unverified (allowed by node policy): the NVIDIA driver")
    assert progress.events[-1][1] == PhaseStatus.SUCCEEDED
    progress = _Progress()
    out = lenient.validate_clean(spec(), progress)
    assert out.clean
    gpu = next(c for c in out.checks if c.name == CHECK_GPU_MEMORY)
    assert gpu.reason.startswith("unverified (allowed by node policy): NVML did not initialise")
    assert progress.events[-1][2].startswith("passed, unverified (allowed by node policy)")


def test_policy_never_excuses_a_gpu_in_use(tmp_path: Path, smi: FakeSmi, sysfs: FakeSysfs) -> None:
    sysfs.add_gpu(GPU_A)
    sysfs.add_gpu(GPU_B, driver="vfio-pci")
    smi.gpus = "00000000:18:00.0, 30000\n"
    smi.apps = "00000000:18:00.0, 4242, 30000\n"
    nvml = FakeNvml({GPU_A: (30000 << 20, [4242], [])})
    backend = production_backend(tmp_path, smi, nvml, sysfs, allow_unverified_gpu=True)
    outcomes = backend.gpu_scrub(spec(), _Progress())
    assert [(o.gpu, o.scrubbed) for o in outcomes] == [(GPU_A, False), (GPU_B, True)]
    gpu = next(
        c for c in backend.validate_clean(spec(), _Progress()).checks if c.name == CHECK_GPU_MEMORY
    )
    assert not gpu.passed
    assert gpu.reason == f"GPU memory in use on GPU {GPU_A} (1 more unverified)"


def test_outcomes_leave_no_tool_output_unsanitised(tmp_path: Path) -> None:
    """A scrubber's own message goes through sanitise like every other string."""

    class Leaky:
        def scrub_each(self) -> list[GpuScrubOutcome]:
            return [GpuScrubOutcome("all", False, unverified("token=abc123secret in output"))]

    backend = FileMaintenanceBackend(node_root(tmp_path), scrubber=Leaky())
    [outcome] = backend.gpu_scrub(spec(), _Progress())
    assert "abc123secret" not in outcome.message
    assert is_unverified(outcome.message)
    assert not os.path.exists(tmp_path / "root" / "var")  # nothing written on the node
