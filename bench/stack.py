"""What every benchmark that runs the embedded stack needs: a private state folder, free
ports, the stack's options with no simulated delays, per-process CPU accounting and a gauge of
the machine's speed."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from devstack.postgres import PostgresCluster, throwaway_cluster
from devstack.processes import free_port
from devstack.up import StackOptions


def machine_speed_seconds() -> float:
    """Seconds a fixed pure-Python loop takes here and now. The CI machine kind is a shared VM
    whose speed drifts by half within minutes; printed beside the figures, it tells a slow
    phase of the machine from a slower control plane."""
    started = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - started


_PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def percentile(values: list[float], q: float) -> float:
    """The `q`th percentile (0-100) of `values`, the nearest of them."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def p50_p99(values: list[float], width: int = 8, digits: int = 2) -> str:
    """The median and 99th percentile of `values` in milliseconds, as every bench prints them."""
    return (
        f"p50 {statistics.median(values):{width}.{digits}f} ms"
        f"  p99 {percentile(values, 99):{width}.{digits}f} ms"
    )


def machine_cpu_ticks() -> dict[str, int]:
    """The whole machine's CPU time so far, all cores together, by kind (/proc/stat)."""
    first_line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return dict(zip(_PROC_STAT_FIELDS, map(int, first_line[1:9]), strict=True))


def machine_cpu_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """How the machine's CPU time between two readings was spent: busy, idle, and stolen by the
    hypervisor. Steal is what the slow phases of the shared CI VM are made of (20 to 33 % in
    some minutes): the figures of a run with much steal measure the neighbours too."""
    spent = {kind: after[kind] - before[kind] for kind in _PROC_STAT_FIELDS}
    total = sum(spent.values()) or 1
    busy = sum(spent[k] for k in ("user", "nice", "system", "irq", "softirq"))
    return {
        "busy": busy / total,
        "idle": (spent["idle"] + spent["iowait"]) / total,
        "steal": spent["steal"] / total,
    }


def cpu_seconds(pids: dict[str, int], postgres_datadir: Path | None = None) -> dict[str, float]:
    """CPU time (user + system) used so far by each named process, and by PostgreSQL: with
    `postgres_datadir`, that cluster alone (its postmaster, its live processes and those that
    exited: on a machine shared with other clusters, whose processes come and go, only this
    reads steadily); without, every process of the `postgres` user."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: int) -> list[str]:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return []

    def of(pid: int, *, reaped_children: bool = False) -> float:
        fields = stat(pid)
        if not fields:
            return 0.0
        own = int(fields[11]) + int(fields[12])
        # cutime + cstime: children that exited and were waited for (PostgreSQL's backends,
        # reaped by the postmaster), whose CPU the live processes no longer show.
        return (own + (int(fields[13]) + int(fields[14]) if reaped_children else 0)) / tick

    used = {name: of(pid) for name, pid in pids.items()}
    used["bench-client"] = of(os.getpid())
    if postgres_datadir is not None:
        postmaster = int((postgres_datadir / "postmaster.pid").read_text().split()[0])
        children = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and stat(int(p.name))[1:2] == [str(postmaster)]
        ]
        used["postgres"] = of(postmaster, reaped_children=True) + sum(map(of, children))
        return used
    postgres_uid = None
    with contextlib.suppress(KeyError):
        postgres_uid = pwd.getpwnam("postgres").pw_uid
    used["postgres"] = sum(
        of(int(p.name))
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and postgres_uid is not None and _owner(p) == postgres_uid
    )
    return used


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None


def private_state_dir() -> Path:
    # World-traversable: the bench's PostgreSQL runs as the `postgres` user.
    state = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    state.chmod(0o755)
    return state


@contextlib.contextmanager
def private_postgres() -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL cluster on a free port, for benchmarks that need only the
    database; stopped and deleted on exit. The caller creates and migrates its databases."""
    state = private_state_dir()
    try:
        with throwaway_cluster(state / "pg", free_port()) as cluster:
            yield cluster
    finally:
        shutil.rmtree(state, ignore_errors=True)


def bench_stack_options(state: Path) -> StackOptions:
    """The whole embedded stack on free ports in `state`, with no agent fleet and no delays."""
    return StackOptions(
        state_dir=state,
        pg_port=free_port(),
        temporal_port=free_port(),
        ui_port=free_port(),
        gateway_host="127.0.0.1",
        gateway_port=free_port(),
        vault_port=free_port(),
        maas_port=free_port(),
        stripe_port=free_port(),
        worker_metrics_port=free_port(),
        phase_delay=0.0,
        jitter=0.0,
        agents=False,
        check=False,
        reset=False,
    )
