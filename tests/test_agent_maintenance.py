"""Node maintenance (agent/maintenance.py) against a temporary system root, plus activities run
through a real Temporal worker with a tiny test workflow (as tests/test_agent_host.py does)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from agent.backend import HostError, PhaseStatus
from agent.backends.baremetal_users import UserAccountConfig
from agent.backends.system_root import SystemRoot
from agent.gpu_tools import GpuQueryFailed, GpuToolUnavailable, unverified
from agent.maintenance import (
    CHECK_GPU_MEMORY,
    CHECK_TENANT_MOUNTS,
    CHECK_TENANT_PROCESSES,
    CHECK_TENANT_USERS,
    VALIDATE_CLEAN_PHASES,
    FileMaintenanceBackend,
    GpuMemoryUse,
    MaintenanceConfig,
    ProcessInfo,
    ProcProcessLister,
    WholeNodeScrubber,
    sanitise,
)
from agent.node_worker import NodeServices, build_node_worker
from contracts.host_tasks import (
    NODE_DRAIN,
    NODE_GPU_SCRUB,
    NODE_HW_SYNC_RESEED,
    NODE_STORAGE_CLEANUP,
    NODE_UNINSTALL,
    NODE_VALIDATE_CLEAN,
    NON_RETRYABLE_MAINTENANCE_ERRORS,
    TASK_SUMMARIES,
    GpuScrubOutcome,
    HostErrorType,
    HwSyncReseedInput,
    NodeMaintenanceInput,
    StorageCleanupInput,
    StorageCleanupResult,
    ValidateCleanResult,
)
from core.task_queues import node_task_queue

MY_UID = os.getuid()
PASSWD = "root:x:0:0:root:/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n"
MOUNTS = (
    "/dev/sda1 / ext4 rw 0 0\n"
    "/dev/nvme0n1 /scratch xfs rw 0 0\n"
    "proc /proc proc rw 0 0\n"
    "/dev/sdb1 /home ext4 rw 0 0\n"
)
SECRET = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeyMaterialAAAAAAAAAAAAAAAAAAAAAAAAAA me@x"


class RecordingProgress:
    def __init__(self) -> None:
        self.events: list[tuple[str, PhaseStatus, str]] = []

    def __call__(self, phase: str, status: PhaseStatus, message: str = "") -> None:
        self.events.append((phase, status, message))

    @property
    def cancelled(self) -> bool:
        return False

    def wait(self, seconds: float | None) -> None:
        raise AssertionError("maintenance never waits")

    def suspend_heartbeats(self) -> None:
        raise AssertionError("maintenance never suspends heartbeats")


@dataclass
class FakeScrubber:
    outcomes: list[GpuScrubOutcome] = field(
        default_factory=lambda: [GpuScrubOutcome("0", True), GpuScrubOutcome("1", True)]
    )
    calls: int = 0

    def scrub_each(self) -> list[GpuScrubOutcome]:
        self.calls += 1
        return self.outcomes


@dataclass
class FakeProcesses:
    procs: list[ProcessInfo] = field(default_factory=list)

    def processes(self) -> list[ProcessInfo]:
        return self.procs


@dataclass
class FakeProbe:
    use: list[GpuMemoryUse] = field(default_factory=lambda: [GpuMemoryUse("0", 1 << 20, 0)])

    def usage(self) -> list[GpuMemoryUse]:
        return self.use


@dataclass
class FakeUnits:
    restarted: list[list[str]] = field(default_factory=list)

    def reload_and_restart(self, units: list[str]) -> None:
        self.restarted.append(units)


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for d in ("etc", "proc/self", "home", "scratch", "tmp", "var/tmp", "var/lib"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text(PASSWD)
    (root / "proc/self/mounts").write_text(MOUNTS)
    return root


def backend(root: Path, *, tenant_uid: int | None = None, **kw: Any) -> FileMaintenanceBackend:
    """A backend whose tenant uid range holds `tenant_uid` (default: a range this process is not
    in, so its own files count as system-owned)."""
    uid = tenant_uid if tenant_uid is not None else (MY_UID + 50000)
    config = kw.pop("config", None) or MaintenanceConfig(
        users=UserAccountConfig(uid_min=uid, uid_max=uid)
    )
    kw.setdefault("scrubber", FakeScrubber())
    kw.setdefault("gpu_probe", FakeProbe())
    kw.setdefault("processes", FakeProcesses())
    return FileMaintenanceBackend(root, config=config, **kw)


def tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def spec(**kw: Any) -> NodeMaintenanceInput:
    return NodeMaintenanceInput(task_id=str(uuid.uuid4()), node_id=kw.pop("node_id", "n1"), **kw)


# --------------------------------------------------------------------------- contract


def test_every_maintenance_activity_has_a_summary() -> None:
    for name in (NODE_GPU_SCRUB, NODE_STORAGE_CLEANUP, NODE_VALIDATE_CLEAN, NODE_DRAIN,
                 NODE_UNINSTALL, NODE_HW_SYNC_RESEED):  # fmt: skip
        assert name.startswith("node.")
        assert TASK_SUMMARIES[name]
    assert HostErrorType.UNSUPPORTED in NON_RETRYABLE_MAINTENANCE_ERRORS
    assert HostErrorType.MAINTENANCE_ERROR not in NON_RETRYABLE_MAINTENANCE_ERRORS


def test_sanitise_redacts_secrets_root_and_truncates(tmp_path: Path) -> None:
    root = SystemRoot(make_root(tmp_path))
    text = (
        f"failed at {root.path}/scratch/x with {SECRET} password=hunter2 token abc\x07" + "y" * 500
    )
    clean = sanitise(text, root=root)
    assert str(root.path) not in clean
    assert "/scratch/x" in clean
    assert "KeyMaterial" not in clean
    assert "hunter2" not in clean
    assert "\x07" not in clean
    assert len(clean) <= 240


# --------------------------------------------------------------------------- gpu_scrub


def test_gpu_scrub_reports_each_gpu(tmp_path: Path) -> None:
    scrubber = FakeScrubber([GpuScrubOutcome("0", True), GpuScrubOutcome("1", False, SECRET)])
    progress = RecordingProgress()
    outcomes = backend(make_root(tmp_path), scrubber=scrubber).gpu_scrub(spec(), progress)
    assert [(o.gpu, o.scrubbed) for o in outcomes] == [("0", True), ("1", False)]
    assert "KeyMaterial" not in outcomes[1].message
    assert progress.events[-1][1] == PhaseStatus.FAILED


def test_whole_node_scrubber_adapts_the_baremetal_interface() -> None:
    class Ok:
        def scrub(self) -> str:
            return "reset 8 GPUs"

    class Broken:
        def scrub(self) -> str:
            raise RuntimeError("nvidia-smi exited 3")

    assert WholeNodeScrubber(Ok()).scrub_each() == [GpuScrubOutcome("all", True, "reset 8 GPUs")]
    [failed] = WholeNodeScrubber(Broken()).scrub_each()
    assert not failed.scrubbed
    assert failed.message == "RuntimeError"

    class NoTool:
        def scrub(self) -> str:
            raise GpuToolUnavailable("nvidia-smi is not installed")

    [unsure] = WholeNodeScrubber(NoTool()).scrub_each()
    assert (unsure.scrubbed, unsure.message) == (False, "unverified: nvidia-smi is not installed")


@dataclass
class RaisingScrubber:
    error: Exception

    def scrub_each(self) -> list[GpuScrubOutcome]:
        raise self.error


def test_gpu_scrub_that_cannot_verify_is_not_scrubbed_unless_policy_allows(
    tmp_path: Path,
) -> None:
    root = make_root(tmp_path)
    no_tool = RaisingScrubber(GpuToolUnavailable("nvidia-smi is not installed"))
    progress = RecordingProgress()
    [outcome] = backend(root, scrubber=no_tool).gpu_scrub(spec(), progress)
    assert (outcome.gpu, outcome.scrubbed) == ("all", False)
    assert outcome.message == "unverified: nvidia-smi is not installed"
    assert progress.events[-1][1] == PhaseStatus.FAILED
    assert "unverified: nvidia-smi is not installed" in progress.events[-1][2]

    progress = RecordingProgress()
    [outcome] = backend(root, scrubber=no_tool, allow_unverified_gpu=True).gpu_scrub(
        spec(), progress
    )
    assert outcome.scrubbed
    assert outcome.message == "unverified (allowed by node policy): nvidia-smi is not installed"
    assert progress.events[-1][1] == PhaseStatus.SUCCEEDED
    assert progress.events[-1][2].startswith("0 scrubbed, 1 unverified (allowed by node policy)")


def test_gpu_scrub_never_counts_an_unverified_gpu_as_scrubbed_by_default(tmp_path: Path) -> None:
    """A scrubber that says scrubbed=True about a GPU it could not verify is corrected."""
    claims = FakeScrubber(
        [GpuScrubOutcome("0", True), GpuScrubOutcome("1", True, unverified("on vfio-pci"))]
    )
    outcomes = backend(make_root(tmp_path), scrubber=claims).gpu_scrub(spec(), RecordingProgress())
    assert [(o.gpu, o.scrubbed) for o in outcomes] == [("0", True), ("1", False)]


def test_gpu_scrub_failure_of_the_tool_is_a_retryable_error(tmp_path: Path) -> None:
    failing = RaisingScrubber(GpuQueryFailed("a GPU has fallen off the bus (nvidia-smi exit 15)"))
    with pytest.raises(HostError) as err:
        backend(make_root(tmp_path), scrubber=failing, allow_unverified_gpu=True).gpu_scrub(
            spec(), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.MAINTENANCE_ERROR
    assert "fallen off the bus" in err.value.message
    assert HostErrorType.MAINTENANCE_ERROR not in NON_RETRYABLE_MAINTENANCE_ERRORS


# --------------------------------------------------------------------------- storage_cleanup


def test_storage_cleanup_empties_scratch_but_keeps_roots_and_foreign_tmp(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "scratch/job/deep").mkdir(parents=True)
    (root / "scratch/job/deep/data.bin").write_bytes(b"x" * 10)
    (root / "scratch/job/escape").symlink_to(outside)  # a symlink inside: unlinked, not followed
    (root / "scratch/link").symlink_to(outside / "precious")
    (root / "tmp/system.sock").write_text("")  # owned by this (non-tenant) uid: kept
    before_outside = tree(outside)

    out = backend(root).storage_cleanup(
        StorageCleanupInput(task_id="t", node_id="n1"), RecordingProgress()
    )
    assert tree(root / "scratch") == set()
    assert (root / "scratch").is_dir()
    assert tree(outside) == before_outside
    assert (outside / "precious").read_text() == "keep"
    assert tree(root / "tmp") == {"system.sock"}
    by_root = {r.root: r for r in out.roots}
    assert by_root["/scratch"].entries_removed == 2
    assert by_root["/tmp"].entries_kept == 1


def test_storage_cleanup_removes_tenant_owned_tmp_entries(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "tmp/tenant-cache").mkdir()
    (root / "var/tmp/tenant-file").write_text("x")
    tenant = MY_UID
    if MY_UID == 0:  # uid 0 is never a tenant: hand the files to one (root may chown)
        tenant = 20000
        for entry in ("tmp/tenant-cache", "var/tmp/tenant-file"):
            os.chown(root / entry, tenant, tenant)
    out = backend(root, tenant_uid=tenant).storage_cleanup(
        StorageCleanupInput(task_id="t", node_id="n1"), RecordingProgress()
    )
    assert tree(root / "tmp") == set()
    assert tree(root / "var/tmp") == set()
    assert sum(r.entries_removed for r in out.roots) == 2


def test_storage_cleanup_missing_root_is_reported_absent(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "scratch").rmdir()
    out = backend(root).storage_cleanup(
        StorageCleanupInput(task_id="t", node_id="n1", roots=["/scratch"]), RecordingProgress()
    )
    assert [(r.root, r.present) for r in out.roots] == [("/scratch", False)]


def test_storage_cleanup_refuses_a_symlinked_root(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "scratch").rmdir()
    (root / "scratch").symlink_to(outside)
    with pytest.raises(HostError) as err:
        backend(root).storage_cleanup(
            StorageCleanupInput(task_id="t", node_id="n1"), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.UNSAFE_PATH
    assert str(tmp_path) not in sanitise(err.value.message)
    assert (outside / "precious").read_text() == "keep"


def test_storage_cleanup_refuses_roots_that_are_not_configured(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "etc/keep").write_text("x")
    for bad in (["/etc"], ["/scratch/../etc"], ["/"]):
        with pytest.raises(HostError) as err:
            backend(root).storage_cleanup(
                StorageCleanupInput(task_id="t", node_id="n1", roots=bad), RecordingProgress()
            )
        assert err.value.error_type == HostErrorType.UNSAFE_PATH
    assert (root / "etc/keep").exists()


def test_storage_cleanup_refuses_a_mount_below_a_root(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "scratch/weka").mkdir()
    (root / "scratch/weka/tenant-data").write_text("x")
    with (root / "proc/self/mounts").open("a") as f:
        f.write("weka0 /scratch/weka wekafs rw 0 0\n")
    with pytest.raises(HostError) as err:
        backend(root).storage_cleanup(
            StorageCleanupInput(task_id="t", node_id="n1"), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.UNSAFE_PATH
    assert (root / "scratch/weka/tenant-data").exists()


def test_weka_cleanup_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(HostError) as err:
        backend(make_root(tmp_path)).storage_cleanup(
            StorageCleanupInput(task_id="t", node_id="n1", scope="weka"), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.UNSUPPORTED
    assert "Weka" in err.value.message
    assert "not supported" in err.value.message


# --------------------------------------------------------------------------- validate_clean


def checks(root: Path, **kw: Any) -> dict[str, tuple[bool, str]]:
    out = backend(root, **kw).validate_clean(spec(), RecordingProgress())
    return {c.name: (c.passed, c.reason) for c in out.checks}


def test_validate_clean_passes_on_a_clean_node(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    progress = RecordingProgress()
    out = backend(root).validate_clean(spec(), progress)
    assert out.clean, out.checks
    assert [c.name for c in out.checks] == [
        CHECK_TENANT_USERS, CHECK_TENANT_PROCESSES, CHECK_TENANT_MOUNTS, CHECK_GPU_MEMORY
    ]  # fmt: skip
    assert [e[0] for e in progress.events if e[1] == PhaseStatus.SUCCEEDED] == list(
        VALIDATE_CLEAN_PHASES
    )


def test_validate_clean_finds_tenant_users(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    with (root / "etc/passwd").open("a") as f:
        f.write("alice:x:20000:20000:gpucloud allocation a:/home/alice:/bin/bash\n")
    result = checks(root, tenant_uid=20000)
    assert result[CHECK_TENANT_USERS] == (False, "1 tenant account(s) remain: alice")
    assert result[CHECK_TENANT_PROCESSES][0]
    assert result[CHECK_GPU_MEMORY][0]


def test_validate_clean_finds_tenant_processes(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    procs = FakeProcesses([ProcessInfo(1, 0), ProcessInfo(4242, 20000), ProcessInfo(4243, 20000)])
    passed, reason = checks(root, tenant_uid=20000, processes=procs)[CHECK_TENANT_PROCESSES]
    assert not passed
    assert reason.startswith("2 tenant process(es)")


def test_validate_clean_reads_proc_under_the_root_by_default(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    for pid, uid in ((1, 0), (777, 20000)):
        (root / f"proc/{pid}").mkdir()
        (root / f"proc/{pid}/status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    b = FileMaintenanceBackend(
        root,
        scrubber=FakeScrubber(),
        gpu_probe=FakeProbe(),
        config=MaintenanceConfig(users=UserAccountConfig(uid_min=20000, uid_max=20000)),
    )
    out = b.validate_clean(spec(), RecordingProgress())
    assert {c.name: c.passed for c in out.checks}[CHECK_TENANT_PROCESSES] is False


def test_validate_clean_finds_tenant_mounts(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    with (root / "proc/self/mounts").open("a") as f:
        f.write("fuse /home/alice/my\\040data fuse rw 0 0\nweka0 /scratch/w wekafs rw 0 0\n")
    passed, reason = checks(root)[CHECK_TENANT_MOUNTS]
    assert not passed
    assert "/home/alice/my data" in reason
    assert "/scratch/w" in reason


def test_validate_clean_fails_without_a_mount_table(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "proc/self/mounts").unlink()
    assert checks(root)[CHECK_TENANT_MOUNTS][0] is False


@pytest.mark.parametrize(
    ("probe", "fragment"),
    [
        (FakeProbe([GpuMemoryUse("0", 0, 0), GpuMemoryUse("3", 40 << 30, 0)]), "GPU 3"),
        (FakeProbe([GpuMemoryUse("1", 0, 2)]), "GPU 1"),
        (None, "no GPU memory probe"),
    ],
)
def test_validate_clean_finds_gpu_memory_in_use(
    tmp_path: Path, probe: FakeProbe | None, fragment: str
) -> None:
    passed, reason = checks(make_root(tmp_path), gpu_probe=probe)[CHECK_GPU_MEMORY]
    assert not passed
    assert fragment in reason


@dataclass
class RaisingProbe:
    error: Exception

    def usage(self) -> list[GpuMemoryUse]:
        raise self.error


def test_validate_clean_gpu_state_this_host_cannot_verify(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    no_nvml = RaisingProbe(GpuToolUnavailable("the NVML library is not installed"))
    out = backend(root, gpu_probe=no_nvml).validate_clean(spec(), RecordingProgress())
    assert not out.clean
    gpu = {c.name: c for c in out.checks}[CHECK_GPU_MEMORY]
    assert (gpu.passed, gpu.reason) == (False, "unverified: the NVML library is not installed")

    progress = RecordingProgress()
    allowed = backend(root, gpu_probe=no_nvml, allow_unverified_gpu=True)
    out = allowed.validate_clean(spec(), progress)
    assert out.clean
    gpu = {c.name: c for c in out.checks}[CHECK_GPU_MEMORY]
    assert gpu.passed
    assert gpu.reason == "unverified (allowed by node policy): the NVML library is not installed"
    assert progress.events[-1] == (
        "gpu_memory_checked",
        PhaseStatus.SUCCEEDED,
        "passed, unverified (allowed by node policy): the NVML library is not installed",
    )

    # No probe at all is unverified too, and policy may accept it.
    assert checks(root, gpu_probe=None)[CHECK_GPU_MEMORY] == (
        False,
        "unverified: no GPU memory probe configured",
    )
    lenient = checks(root, gpu_probe=None, allow_unverified_gpu=True)[CHECK_GPU_MEMORY]
    assert lenient[0] is True


def test_validate_clean_unverified_gpus_beside_idle_ones(tmp_path: Path) -> None:
    probe = FakeProbe(
        [
            GpuMemoryUse("0000:18:00.0", 0, 0),
            GpuMemoryUse(
                "0000:2a:00.0", 0, 0, unverified="not visible to NVML (bound to vfio-pci)"
            ),
        ]
    )
    passed, reason = checks(make_root(tmp_path), gpu_probe=probe)[CHECK_GPU_MEMORY]
    assert not passed
    assert reason == (
        "unverified: GPU 0000:2a:00.0: not visible to NVML (bound to vfio-pci) "
        "(1 other GPU(s) idle)"
    )


def test_validate_clean_policy_never_excuses_gpus_in_use_or_a_failed_probe(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    busy = FakeProbe(
        [
            GpuMemoryUse("0000:18:00.0", 0, 1),
            GpuMemoryUse("0000:2a:00.0", 0, 0, unverified="not visible to NVML"),
        ]
    )
    passed, reason = checks(root, gpu_probe=busy, allow_unverified_gpu=True)[CHECK_GPU_MEMORY]
    assert not passed
    assert reason == "GPU memory in use on GPU 0000:18:00.0 (1 more unverified)"
    lost = RaisingProbe(GpuQueryFailed("NVML failed on GPU 0000:18:00.0: GPU is lost"))
    passed, reason = checks(root, gpu_probe=lost, allow_unverified_gpu=True)[CHECK_GPU_MEMORY]
    assert not passed
    assert reason == "GPU probe failed: NVML failed on GPU 0000:18:00.0: GPU is lost"


def test_validate_clean_finds_tenant_groups_and_sudoers_grants(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "etc/group").write_text("root:x:0:\nalice:x:20000:\nusers:x:100:alice\n")
    (root / "etc/sudoers.d").mkdir()
    (root / "etc/sudoers.d/gpucloud-alice").write_text("alice ALL=(ALL) NOPASSWD:ALL\n")
    (root / "etc/sudoers.d/README").write_text("")
    passed, reason = checks(root, tenant_uid=20000)[CHECK_TENANT_USERS]
    assert not passed
    assert reason == "1 tenant group(s) remain: alice; 1 sudoers grant(s) remain: gpucloud-alice"
    with (root / "etc/passwd").open("a") as f:
        f.write("alice:x:20000:20000::/home/alice:/bin/bash\n")
    (root / "etc/sudoers.d/gpucloud-alice").unlink()
    # The account's own group is part of the account finding.
    assert checks(root, tenant_uid=20000)[CHECK_TENANT_USERS] == (
        False,
        "1 tenant account(s) remain: alice",
    )


def test_validate_clean_counts_any_tenant_uid_of_a_process(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    # A root-started process running as the tenant (effective uid) and a setuid helper the
    # tenant started (real uid root, saved uid the tenant's).
    for pid, uids in ((1, "0\t0\t0\t0"), (50, "0\t20000\t20000\t20000"), (51, "0\t0\t20000\t0")):
        (root / f"proc/{pid}").mkdir()
        (root / f"proc/{pid}/status").write_text(f"Name:\tx\nUid:\t{uids}\nGid:\t0\t0\t0\t0\n")
    procs = ProcProcessLister(SystemRoot(root)).processes()
    assert sorted(procs, key=lambda p: p.pid) == [
        ProcessInfo(1, 0, (0, 0, 0)),
        ProcessInfo(50, 0, (20000, 20000, 20000)),
        ProcessInfo(51, 0, (0, 20000, 0)),
    ]
    passed, reason = checks(root, tenant_uid=20000, processes=ProcProcessLister(SystemRoot(root)))[
        CHECK_TENANT_PROCESSES
    ]
    assert not passed
    assert reason == "2 tenant process(es) running, uid(s) 20000"


def test_validate_clean_finds_tenant_runtime_dirs_and_fuse_mounts(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    with (root / "proc/self/mounts").open("a") as f:
        f.write("tmpfs /run/user/20000 tmpfs rw,nosuid,nodev,size=1G,uid=20000 0 0\n")
        f.write("tmpfs /run/user/1000 tmpfs rw,nosuid,nodev,uid=1000 0 0\n")
        f.write("sshfs /mnt/data fuse.sshfs rw,nosuid,user_id=20000,group_id=20000 0 0\n")
        f.write("gvfsd /run/x fuse.gvfsd rw,user_id=0,group_id=0 0 0\n")
    passed, reason = checks(root, tenant_uid=20000)[CHECK_TENANT_MOUNTS]
    assert not passed
    assert reason == "2 tenant mount(s): /run/user/20000, /mnt/data"


def test_validate_clean_reasons_are_sanitised(tmp_path: Path) -> None:
    root = make_root(tmp_path)

    class Broken:
        def processes(self) -> list[ProcessInfo]:
            raise PermissionError(SECRET)

    passed, reason = checks(root, processes=Broken())[CHECK_TENANT_PROCESSES]
    assert not passed
    assert "KeyMaterial" not in reason
    assert "PermissionError" in reason


# --------------------------------------------------------------------------- drain / uninstall


def test_drain_writes_a_marker_once_and_counts_tasks(tmp_path: Path) -> None:
    root = make_root(tmp_path)

    class Two:
        def running(self) -> int:
            return 2

    b = backend(root)
    assert not b.is_draining()
    first = b.drain(spec(), RecordingProgress(), Two())
    assert first.draining
    assert not first.already_draining
    assert first.running_tasks == 2
    assert (root / "var/lib/gpucloud-agent/draining").is_file()
    assert b.is_draining()
    again = b.drain(spec(), RecordingProgress())
    assert again.already_draining


def test_undrain_removes_the_marker_and_is_idempotent(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    b = backend(root)
    b.drain(spec(), RecordingProgress())
    assert b.is_draining()
    out = b.undrain(spec(), RecordingProgress())
    assert not out.draining
    assert out.already_draining  # it was draining before
    assert not (root / "var/lib/gpucloud-agent/draining").exists()
    assert not b.is_draining()
    again = b.undrain(spec(), RecordingProgress())
    assert not again.already_draining


def test_uninstall_removes_only_the_agents_own_files(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    state = root / "var/lib/gpucloud-agent"
    state.mkdir(parents=True)
    (state / "identity.json").write_text("{}")
    (state / "draining").write_text("")
    (root / "etc/gpucloud").mkdir()
    (root / "etc/gpucloud/agent.toml").write_text('enrollment_token = "x"')
    (root / "etc/gpucloud/other.toml").write_text("")
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/gpucloud-agent.service").write_text("")
    (root / "etc/systemd/system/sshd.service").write_text("")
    before = tree(root)

    out = backend(root).uninstall(spec(), RecordingProgress())
    gone = {
        "var/lib/gpucloud-agent",
        "var/lib/gpucloud-agent/identity.json",
        "var/lib/gpucloud-agent/draining",
        "etc/gpucloud/agent.toml",
        "etc/systemd/system/gpucloud-agent.service",
    }
    assert tree(root) == before - gone
    assert len(out.removed) == 4
    assert out.absent == []
    again = backend(root).uninstall(spec(), RecordingProgress())
    assert again.removed == []
    assert len(again.absent) == 4


def test_uninstall_never_follows_a_symlinked_state_dir(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "identity.json").write_text("not ours")
    (root / "var/lib/gpucloud-agent").symlink_to(outside)
    with pytest.raises(HostError) as err:
        backend(root).uninstall(spec(), RecordingProgress())
    assert err.value.error_type == HostErrorType.UNSAFE_PATH
    assert (outside / "identity.json").read_text() == "not ours"


# --------------------------------------------------------------------------- hw_sync_reseed


def test_hw_sync_reseed_writes_units_and_restarts(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/maas").mkdir()
    (root / "etc/maas/maas-machine-creds.yml").write_text("token: s3cret")
    units = FakeUnits()
    b = backend(root, units=units)
    out = b.hw_sync_reseed(HwSyncReseedInput("t", "n1", interval_minutes=30), RecordingProgress())
    assert out.credentials_present
    assert out.restarted
    assert len(out.units_written) == 2
    timer = (root / "etc/systemd/system/maas_hardware_sync.timer").read_text()
    assert "OnUnitActiveSec=30min" in timer
    assert "ExecStart=" in (root / "etc/systemd/system/maas_hardware_sync.service").read_text()
    again = b.hw_sync_reseed(HwSyncReseedInput("t", "n1", interval_minutes=30), RecordingProgress())
    assert again.units_written == []
    assert len(again.units_unchanged) == 2
    assert units.restarted == [["maas_hardware_sync.timer"]] * 2


def test_hw_sync_reseed_without_credentials_does_not_restart(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "etc/systemd/system").mkdir(parents=True)
    units = FakeUnits()
    out = backend(root, units=units).hw_sync_reseed(
        HwSyncReseedInput("t", "n1"), RecordingProgress()
    )
    assert not out.credentials_present
    assert not out.restarted
    assert units.restarted == []


def test_hw_sync_reseed_validates_the_interval(tmp_path: Path) -> None:
    with pytest.raises(HostError) as err:
        backend(make_root(tmp_path)).hw_sync_reseed(
            HwSyncReseedInput("t", "n1", interval_minutes=0), RecordingProgress()
        )
    assert err.value.error_type == HostErrorType.INVALID_SPEC


# --------------------------------------------------------------------------- through Temporal


@dataclass
class MaintenanceCall:
    activity: str
    node_id: str
    cleanup: StorageCleanupInput | None = None
    validate: NodeMaintenanceInput | None = None


@dataclass
class MaintenanceCallResult:
    cleanup: StorageCleanupResult | None = None
    validate: ValidateCleanResult | None = None


@workflow.defn(name="AgentTestMaintenanceCall")
class MaintenanceCallWorkflow:
    @workflow.run
    async def run(self, call: MaintenanceCall) -> MaintenanceCallResult:
        options: dict[str, Any] = {
            "task_queue": node_task_queue(call.node_id),
            "schedule_to_start_timeout": timedelta(seconds=10),
            "start_to_close_timeout": timedelta(seconds=30),
            "heartbeat_timeout": timedelta(seconds=5),
            "retry_policy": RetryPolicy(
                maximum_attempts=1,
                non_retryable_error_types=[e.value for e in NON_RETRYABLE_MAINTENANCE_ERRORS],
            ),
        }
        if call.cleanup is not None:
            cleaned = await workflow.execute_activity(
                call.activity, call.cleanup, result_type=StorageCleanupResult, **options
            )
            return MaintenanceCallResult(cleanup=cleaned)
        validated = await workflow.execute_activity(
            call.activity, call.validate, result_type=ValidateCleanResult, **options
        )
        return MaintenanceCallResult(validate=validated)


@pytest.fixture
async def maintenance_queue(temporal_client: Client) -> AsyncIterator[str]:
    task_queue = f"agent-test-{uuid.uuid4()}"
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[MaintenanceCallWorkflow],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        yield task_queue


async def test_maintenance_activities_through_a_real_worker(
    temporal_client: Client, maintenance_queue: str, tmp_path: Path
) -> None:
    from sim.config import SimHostConfig
    from sim.host import SimulatedHost

    root = make_root(tmp_path)
    (root / "scratch/job").mkdir()
    with (root / "etc/passwd").open("a") as f:
        f.write("alice:x:20000:20000::/home/alice:/bin/bash\n")
    node = str(uuid.uuid4())
    maint = backend(root, tenant_uid=20000)
    worker = build_node_worker(
        temporal_client, node, NodeServices(SimulatedHost(node, config=SimHostConfig()), maint)
    )

    async def call(c: MaintenanceCall) -> MaintenanceCallResult:
        return await temporal_client.execute_workflow(
            MaintenanceCallWorkflow.run, c, id=f"maint-{uuid.uuid4()}", task_queue=maintenance_queue
        )

    async with worker:
        cleaned = (
            await call(
                MaintenanceCall(
                    NODE_STORAGE_CLEANUP,
                    node,
                    cleanup=StorageCleanupInput("t1", node, roots=["/scratch"]),
                )
            )
        ).cleanup
        assert isinstance(cleaned, StorageCleanupResult)
        assert cleaned.roots[0].entries_removed == 1
        assert tree(root / "scratch") == set()
        assert [p.phase for p in cleaned.phases if p.status == "succeeded"] == [
            "mounts_checked",
            "scratch_cleaned",
        ]

        validated = (
            await call(
                MaintenanceCall(
                    NODE_VALIDATE_CLEAN, node, validate=NodeMaintenanceInput("t2", node)
                )
            )
        ).validate
        assert isinstance(validated, ValidateCleanResult)
        assert not validated.clean
        assert {c.name: c.passed for c in validated.checks}[CHECK_TENANT_USERS] is False

        with pytest.raises(WorkflowFailureError) as failed:
            await call(
                MaintenanceCall(
                    NODE_STORAGE_CLEANUP,
                    node,
                    cleanup=StorageCleanupInput("t3", node, scope="weka"),
                )
            )
        cause = failed.value.cause
        assert isinstance(cause, ActivityError)
        assert isinstance(cause.cause, ApplicationError)
        assert cause.cause.type == HostErrorType.UNSUPPORTED.value
        assert cause.cause.non_retryable

        with pytest.raises(WorkflowFailureError) as wrong_node:
            await call(
                MaintenanceCall(
                    NODE_VALIDATE_CLEAN, node, validate=NodeMaintenanceInput("t4", "other-node")
                )
            )
        assert isinstance(wrong_node.value.cause, ActivityError)
        assert isinstance(wrong_node.value.cause.cause, ApplicationError)
        assert wrong_node.value.cause.cause.type == HostErrorType.INVALID_SPEC.value


def test_drain_refuses_a_symlinked_state_dir(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "var/lib/gpucloud-agent").symlink_to(outside)
    with pytest.raises(HostError) as err:
        backend(root).drain(spec(), RecordingProgress())
    assert err.value.error_type == HostErrorType.UNSAFE_PATH
    assert tree(outside) == set()
    assert (root / "var/lib/gpucloud-agent").is_symlink()
