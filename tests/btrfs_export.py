"""A storage export whose filesystem enforces namespace quotas, for the tests: a small btrfs
image, loop-mounted, with quotas enabled (activities/storage_quota.py), unmounted and removed
afterwards. Needs root (a loop mount) and btrfs-progs (mkfs.btrfs, btrfs) on the machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

IMAGE_BYTES = 256 << 20  # btrfs's smallest comfortable size with its default DUP metadata


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def btrfs_quota_export(workdir: Path) -> Iterator[Path]:
    """`workdir/storage-export`, a fresh btrfs with quotas enabled, mounted there. Skips (as a
    root skip: CI fails it under GPUCLOUD_REQUIRE_ROOT=1) when loop mounts are impossible."""
    if os.geteuid() != 0 or not Path("/dev/loop-control").exists():
        pytest.skip("loop mounts need root (CAP_SYS_ADMIN) and /dev/loop-control")
    missing = [tool for tool in ("mkfs.btrfs", "btrfs") if shutil.which(tool) is None]
    if missing:
        message = f"{', '.join(missing)} not installed (Debian package btrfs-progs)"
        if os.environ.get("GPUCLOUD_REQUIRE_ROOT") == "1":
            pytest.fail(message)
        pytest.skip(message)
    image = workdir / "storage-export.img"
    mount_point = workdir / "storage-export"
    mount_point.mkdir()
    with image.open("wb") as out:
        out.truncate(IMAGE_BYTES)  # sparse
    made = _run("mkfs.btrfs", "-q", "-f", str(image))
    assert made.returncode == 0, made.stderr
    mounted = _run("mount", "-o", "loop", str(image), str(mount_point))
    if mounted.returncode != 0:
        image.unlink()
        pytest.skip(f"loop mounts need root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        enabled = _run("btrfs", "quota", "enable", str(mount_point))
        assert enabled.returncode == 0, enabled.stderr
        yield mount_point
    finally:
        # The loop device goes with the last unmount (mount -o loop sets autoclear).
        unmounted = _run("umount", str(mount_point))
        if unmounted.returncode != 0:
            _run("umount", "-l", str(mount_point))
        image.unlink(missing_ok=True)
