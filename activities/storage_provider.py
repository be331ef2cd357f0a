"""Storage providers (seed 001 §7): where a namespace's data lives and how a node is granted
access to it. The control plane's storage activities (activities/storage.py) call a provider;
the node's agent mounts what it was granted (agent/storage_mounts.py).

`SharedDirectoryProvider` is the one provider: a directory per namespace on a filesystem that
the control-plane worker and every node see at the same place (a cluster filesystem or an NFS
export mounted on each; in the embedded stack and the tests, a directory on the one machine).
Its tree under the root:

    namespaces/                                0o700: no one but the provider and the nodes'
                                               agents (root) lists or enters it
    namespaces/<namespace id>/                 the namespace's data (created empty, 0o2770: no
                                               world access)
    grants/                                    0o700, likewise
    grants/<namespace id>/<attachment id>.json {"node_id", "mode"}: what the node's agent checks
                                               before it mounts (and the mode it mounts with)

Isolation (issue 36 item 4, the part done): a tenant on a node reaches a namespace only through
the bind mount its agent made for an attachment (agent/storage_mounts.py), never by walking the
export: a non-root user cannot list `namespaces/` or `grants/`, nor enter another project's
namespace even knowing its id. Not done yet: mapping the tenant's uid/gid onto its own namespace
(so a non-root tenant reads and writes its own mount: today only root on the node can) and
mounting only the attached namespaces on a node instead of the whole export (a root tenant, e.g.
with `grant_sudo`, still reaches the export root on its node).

Quota is enforced by the provider's accounting, not by the kernel: the bytes allocated under a
namespace (st_blocks, hard links once) are compared with its quota_bytes when an attachment is
prechecked, and a namespace at or over quota takes read_only attachments only. A writer that is
already mounted is not stopped mid-write (no loop-mounted image or project quota here).
Capabilities: multi_writer (a shared filesystem takes concurrent writers; coordinating them is
the workload's business), so the namespace's policy decides.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contracts.storage import PROVIDER_SHARED_DIRECTORY

STORAGE_ROOT_ENV = "GPUCLOUD_STORAGE_ROOT"
DEFAULT_STORAGE_ROOT = "/srv/gpucloud-storage"


@dataclass(frozen=True)
class ProviderCapabilities:
    multi_writer: bool
    # Whether writes beyond the quota are stopped by the storage itself (False: accounting only).
    hard_quota: bool


class StorageProvider(Protocol):
    """Blocking calls; each is idempotent. `key` is the namespace id."""

    kind: str
    capabilities: ProviderCapabilities

    def create(self, key: str) -> None: ...

    def delete(self, key: str) -> None:
        """Delete the namespace's data: only ever for a namespace deleted by its owner."""
        ...

    def usage_bytes(self, key: str) -> int: ...

    def grant(self, key: str, attachment_id: str, node_id: str, mode: str) -> None: ...

    def revoke(self, key: str, attachment_id: str) -> None: ...


class SharedDirectoryProvider:
    kind = PROVIDER_SHARED_DIRECTORY
    capabilities = ProviderCapabilities(multi_writer=True, hard_quota=False)

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SharedDirectoryProvider:
        source = os.environ if env is None else env
        return cls(source.get(STORAGE_ROOT_ENV) or DEFAULT_STORAGE_ROOT)

    def namespace_dir(self, key: str) -> Path:
        return self.root / "namespaces" / key

    def _grants_dir(self, key: str) -> Path:
        return self.root / "grants" / key

    def _private_dir(self, name: str) -> None:
        """`namespaces/` or `grants/` with no access for anyone but its owner (the provider) and
        root (the nodes' agents): made so, or made so again (an older build left 0o755)."""
        directory = self.root / name
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    def create(self, key: str) -> None:
        self._private_dir("namespaces")
        path = self.namespace_dir(key)
        path.mkdir(mode=0o700, exist_ok=True)
        # No world access; group-writable with setgid for the project's group once tenants'
        # ids are mapped onto it (see the module text).
        os.chmod(path, 0o2770)  # noqa: S103

    def delete(self, key: str) -> None:
        for path in (self._grants_dir(key), self.namespace_dir(key)):
            if path.is_symlink():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)

    def usage_bytes(self, key: str) -> int:
        """Bytes allocated under the namespace's directory. A directory that is not there (the
        export not mounted on this worker, or removed under us) raises: os.walk alone would
        answer 0, and the precheck would take an unmeasured namespace for an empty one."""
        top = self.namespace_dir(key)
        if not top.is_dir():
            raise FileNotFoundError(f"namespace {key} is not a directory in the storage export")
        seen: set[tuple[int, int]] = set()
        total = 0

        def unreadable(err: OSError) -> None:
            raise err

        for directory, dirs, files in os.walk(top, onerror=unreadable):
            for name in (*dirs, *files):
                st = os.lstat(os.path.join(directory, name))
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
        return total

    def grant(self, key: str, attachment_id: str, node_id: str, mode: str) -> None:
        self._private_dir("grants")
        directory = self._grants_dir(key)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{attachment_id}.json"
        temporary = directory / f".{attachment_id}.json.tmp"
        temporary.write_text(json.dumps({"node_id": node_id, "mode": mode}))
        os.replace(temporary, target)

    def revoke(self, key: str, attachment_id: str) -> None:
        (self._grants_dir(key) / f"{attachment_id}.json").unlink(missing_ok=True)
