"""Cloud-init NoCloud seeds for slice VMs: `meta-data` and `user-data` (a #cloud-config that
creates the tenant user with its SSH keys and writes a readiness marker), owner-only files.

The seed directory is always written; when an ISO tool is on PATH (cloud-localds, genisoimage,
mkisofs or xorriso) it is also packed as `seed.iso` with the volume label `cidata`, which is what
the guest's NoCloud datasource looks for. The files hold tenant public keys: they are created 0600,
and nothing here logs their content.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Written by the guest's last boot step; the readiness probes look for it.
READINESS_MARKER = "/var/lib/gpucloud/ready"
SEED_LABEL = "cidata"


@dataclass(frozen=True)
class Seed:
    directory: Path
    iso: Path | None  # None when no ISO tool is installed


def user_data(username: str, ssh_public_keys: list[str], allocation_id: str) -> str:
    """#cloud-config as JSON (JSON is YAML), so no key or name can break out of its string."""
    config = {
        "users": [
            {
                "name": username,
                "shell": "/bin/bash",
                "lock_passwd": True,
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "ssh_authorized_keys": [key.strip() for key in ssh_public_keys],
            }
        ],
        "ssh_pwauth": False,
        "disable_root": True,
        "runcmd": [
            ["mkdir", "-p", os.path.dirname(READINESS_MARKER)],
            ["sh", "-c", f"echo {allocation_id} > {READINESS_MARKER}"],
        ],
    }
    return "#cloud-config\n" + json.dumps(config, indent=2) + "\n"


def meta_data(allocation_id: str, hostname: str) -> str:
    return json.dumps({"instance-id": allocation_id, "local-hostname": hostname}, indent=2) + "\n"


def _write_private(path: Path, content: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.chmod(path, 0o600)  # an earlier file may have had looser bits


def _iso_command(directory: Path, iso: Path) -> list[str] | None:
    user, meta = str(directory / "user-data"), str(directory / "meta-data")
    if tool := shutil.which("cloud-localds"):
        return [tool, str(iso), user, meta]
    for name in ("genisoimage", "mkisofs"):
        if tool := shutil.which(name):
            return [tool, "-quiet", "-output", str(iso), "-volid", SEED_LABEL, "-joliet",
                    "-rock", user, meta]  # fmt: skip
    if tool := shutil.which("xorriso"):
        return [tool, "-as", "mkisofs", "-quiet", "-output", str(iso), "-volid", SEED_LABEL,
                "-joliet", "-rock", user, meta]  # fmt: skip
    return None


def write_seed(
    seed_root: Path, allocation_id: str, username: str, ssh_public_keys: list[str]
) -> Seed:
    directory = seed_root / allocation_id
    # 0711: QEMU runs as its own user (libvirt-qemu), which libvirt lets open seed.iso but which
    # must traverse this directory to reach it; nobody but root lists it or reads the 0600 files.
    directory.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(directory, 0o711)  # noqa: S103 - traverse only; the files are 0600
    _write_private(directory / "user-data", user_data(username, ssh_public_keys, allocation_id))
    _write_private(directory / "meta-data", meta_data(allocation_id, f"gpc-{allocation_id}"))
    iso = directory / "seed.iso"
    command = _iso_command(directory, iso)
    if command is None:
        return Seed(directory, None)
    # Output is not captured into logs: a tool's error could echo file content.
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    os.chmod(iso, 0o600)
    return Seed(directory, iso)


def remove_seed(seed_root: Path, allocation_id: str) -> bool:
    """Remove an allocation's seed; answers whether there was one."""
    directory = seed_root / allocation_id
    if not directory.exists():
        return False
    shutil.rmtree(directory)
    return True
