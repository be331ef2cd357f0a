"""Base images for slice VMs: verify the cached file against the catalog's sha256 ("prepared or
reused"), and give each allocation its own writable disk on top of it.

With `qemu-img` on PATH the per-allocation disk is a qcow2 overlay backed by the base image
(instant, copy-on-write), and every image's format is what `qemu-img info` reads, never assumed:
a file that only starts like a qcow2 image is refused before an overlay is built on it. Without
qemu-img (a host with libvirt's test driver only) the disk is a copy of the base file and the
format is sniffed from its first bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 4 * 1024 * 1024


class ImageMismatch(Exception):
    """The cached image is not the catalog's image (sha256 differs)."""


class ImageMissing(Exception):
    """No such image in the catalog, or not prepared on this host."""


@dataclass(frozen=True)
class PreparedImage:
    path: Path
    sha256: str
    reused: bool  # verified earlier by this process and unchanged since


@dataclass(frozen=True)
class AllocationDisk:
    path: Path
    format: str  # "qcow2" (overlay) | "raw"/"qcow2" (copy of the base)
    created: bool


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ImageUnreadable(Exception):
    """qemu-img cannot read the file as a disk image (corrupt, truncated, not an image)."""


def image_format(path: Path) -> str:
    """The disk format QEMU will open `path` with ("qcow2", "raw", ...)."""
    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        with path.open("rb") as handle:
            return "qcow2" if handle.read(4) == b"QFI\xfb" else "raw"
    # -U: read the header even while a running guest holds the image's write lock.
    probe = subprocess.run(
        [qemu_img, "info", "-U", "--output=json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        reason = probe.stderr.strip().splitlines()[-1:] or [f"exit {probe.returncode}"]
        raise ImageUnreadable(f"{path.name}: qemu-img cannot read it: {reason[0]}")
    return str(json.loads(probe.stdout)["format"])


class ImageStore:
    def __init__(self, image_dir: Path, catalog: Mapping[str, str], disk_dir: Path) -> None:
        self.image_dir = image_dir
        self.catalog = {name: sha.lower() for name, sha in catalog.items()}
        self.disk_dir = disk_dir
        self._lock = threading.Lock()
        # path -> (size, mtime_ns, sha256) of files hashed already: a reuse skips re-hashing.
        self._verified: dict[Path, tuple[int, int, str]] = {}

    def prepare(self, name: str, expected_sha256: str = "") -> PreparedImage:
        catalog_sha = self.catalog.get(name)
        if catalog_sha is None:
            raise ImageMissing(f"image {name!r} is not in this node's image catalog")
        if expected_sha256 and expected_sha256.lower() != catalog_sha:
            raise ImageMismatch(f"image {name!r}: the requested sha256 is not the catalog's")
        path = self.image_dir / name
        if not path.is_file():
            raise ImageMissing(f"image {name!r} is not prepared on this node")
        stat = path.stat()
        with self._lock:
            known = self._verified.get(path)
        if known is not None and known[:2] == (stat.st_size, stat.st_mtime_ns):
            actual, reused = known[2], True
        else:
            actual, reused = sha256_of(path), False
            with self._lock:
                self._verified[path] = (stat.st_size, stat.st_mtime_ns, actual)
        if actual != catalog_sha:
            raise ImageMismatch(f"image {name!r}: sha256 of the cached file does not match")
        return PreparedImage(path, actual, reused)

    def disk_path(self, allocation_id: str) -> Path:
        return self.disk_dir / f"gpc-{allocation_id}.qcow2"

    def allocation_disk(self, allocation_id: str, base: PreparedImage) -> AllocationDisk:
        target = self.disk_path(allocation_id)
        if target.exists():
            return AllocationDisk(target, image_format(target), created=False)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        qemu_img = shutil.which("qemu-img")
        if qemu_img:
            subprocess.run(
                [
                    qemu_img,
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    image_format(base.path),
                    "-b",
                    str(base.path),
                    str(partial),
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
        else:
            shutil.copyfile(base.path, partial)
        os.chmod(partial, 0o600)
        os.replace(partial, target)  # a crash mid-copy never leaves a half disk under the name
        return AllocationDisk(target, image_format(target), created=True)

    def remove_allocation_disk(self, allocation_id: str) -> bool:
        removed = False
        for path in (
            self.disk_path(allocation_id),
            self.disk_path(allocation_id).with_suffix(".partial"),
        ):
            try:
                path.unlink()
                removed = True
            except FileNotFoundError:
                pass
        return removed
