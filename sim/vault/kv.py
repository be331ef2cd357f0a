"""The KV version 2 engine of the Vault simulator: versioned secrets per mount, with the semantics
of HashiCorp's vault-plugin-secrets-kv (check-and-set, soft delete, undelete, destroy, metadata).

Pure state, no HTTP: `sim.vault.app` maps requests onto these methods and shapes the answers.
Not modelled: max_versions trimming, delete_version_after, cas_required, custom_metadata writes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DATA_FILE_FORMAT = 1


def vault_timestamp(ns: int | None = None) -> str:
    """Go's time.RFC3339Nano in UTC, as Vault writes created_time/deletion_time: nanoseconds with
    trailing zeros trimmed, e.g. 2018-03-22T02:24:06.945319214Z."""
    ns = time.time_ns() if ns is None else ns
    seconds, nanos = divmod(ns, 1_000_000_000)
    text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        text += "." + f"{nanos:09d}".rstrip("0")
    return text + "Z"


class CheckAndSetError(ValueError):
    """The write's `cas` option does not match the current version (Vault answers 400)."""


@dataclass
class Version:
    created_time: str
    data: dict[str, Any] | None  # None once destroyed
    deletion_time: str = ""
    destroyed: bool = False

    @property
    def readable(self) -> bool:
        return not self.deletion_time and not self.destroyed

    def metadata(self) -> dict[str, Any]:
        return {
            "created_time": self.created_time,
            "deletion_time": self.deletion_time,
            "destroyed": self.destroyed,
        }


@dataclass
class Secret:
    """KeyMetadata in Vault's terms: every version of one path."""

    created_time: str
    updated_time: str
    current_version: int = 0
    oldest_version: int = 0
    versions: dict[int, Version] = field(default_factory=dict)

    def metadata(self) -> dict[str, Any]:
        return {
            "versions": {str(n): v.metadata() for n, v in sorted(self.versions.items())},
            "current_version": self.current_version,
            "oldest_version": self.oldest_version,
            "created_time": self.created_time,
            "updated_time": self.updated_time,
            "max_versions": 0,
            "cas_required": False,
            "delete_version_after": "0s",
            "custom_metadata": None,
        }


class KVStore:
    """Secrets of every mount; thread-safe; optionally saved to a JSON file after each change."""

    def __init__(self, mounts: list[str], data_file: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._mounts: dict[str, dict[str, Secret]] = {m: {} for m in mounts}
        self._data_file = data_file
        if data_file is not None and data_file.exists():
            self._load(data_file)

    @property
    def mounts(self) -> list[str]:
        return list(self._mounts)

    @property
    def data_file(self) -> Path | None:
        return self._data_file

    def mount_for(self, path: str) -> str | None:
        """The mount a request path (no /v1/ prefix) falls under: the longest matching prefix."""
        matches = [m for m in self._mounts if path == m or path.startswith(m + "/")]
        return max(matches, key=len) if matches else None

    # --- data/ ---------------------------------------------------------------------------------

    def write(self, mount: str, key: str, data: dict[str, Any], cas: int | None) -> dict[str, Any]:
        with self._lock:
            secrets = self._mounts[mount]
            secret = secrets.get(key)
            current = secret.current_version if secret else 0
            if cas is not None and cas != current:
                raise CheckAndSetError("check-and-set parameter did not match the current version")
            now = vault_timestamp()
            if secret is None:
                secret = secrets[key] = Secret(created_time=now, updated_time=now)
            secret.current_version += 1
            version = Version(created_time=now, data=data)
            secret.versions[secret.current_version] = version
            secret.updated_time = now
            self._save()
            return {"version": secret.current_version, **version.metadata(),
                    "custom_metadata": None}  # fmt: skip

    def read(self, mount: str, key: str, version: int) -> tuple[dict[str, Any], bool] | None:
        """(the data/ response body, readable) for `version` (0: the latest); None when the path or
        version does not exist. A deleted or destroyed version gives its metadata, data null."""
        with self._lock:
            secret = self._mounts[mount].get(key)
            if secret is None:
                return None
            number = version if version > 0 else secret.current_version
            found = secret.versions.get(number)
            if found is None:
                return None
            metadata = {"version": number, **found.metadata(), "custom_metadata": None}
            data = dict(found.data) if found.readable and found.data is not None else None
            return {"data": data, "metadata": metadata}, data is not None

    def delete_latest(self, mount: str, key: str) -> None:
        with self._lock:
            secret = self._mounts[mount].get(key)
            if secret is not None:
                self._soft_delete(secret, [secret.current_version])

    # --- delete/, undelete/, destroy/ ----------------------------------------------------------

    def delete_versions(self, mount: str, key: str, versions: list[int]) -> None:
        with self._lock:
            secret = self._mounts[mount].get(key)
            if secret is not None:
                self._soft_delete(secret, versions)

    def undelete_versions(self, mount: str, key: str, versions: list[int]) -> None:
        with self._lock:
            secret = self._mounts[mount].get(key)
            if secret is None:
                return
            for number in versions:
                found = secret.versions.get(number)
                if found is not None and not found.destroyed:
                    found.deletion_time = ""
            self._save()

    def destroy_versions(self, mount: str, key: str, versions: list[int]) -> None:
        with self._lock:
            secret = self._mounts[mount].get(key)
            if secret is None:
                return
            for number in versions:
                found = secret.versions.get(number)
                if found is not None:
                    found.destroyed = True
                    found.data = None
            self._save()

    def _soft_delete(self, secret: Secret, versions: list[int]) -> None:
        now = vault_timestamp()
        for number in versions:
            found = secret.versions.get(number)
            if found is not None and found.readable:
                found.deletion_time = now
        self._save()

    # --- metadata/ -----------------------------------------------------------------------------

    def metadata(self, mount: str, key: str) -> dict[str, Any] | None:
        with self._lock:
            secret = self._mounts[mount].get(key)
            return None if secret is None else secret.metadata()

    def delete_metadata(self, mount: str, key: str) -> None:
        with self._lock:
            if self._mounts[mount].pop(key, None) is not None:
                self._save()

    def list_keys(self, mount: str, prefix: str) -> list[str]:
        """Immediate children of `prefix` (which ends in "/" or is empty), folders ending in "/",
        sorted, as Vault's storage lists them."""
        children: set[str] = set()
        with self._lock:
            for key in self._mounts[mount]:
                if key.startswith(prefix):
                    head, slash, _ = key[len(prefix) :].partition("/")
                    children.add(head + slash)
        return sorted(children)

    # --- persistence ---------------------------------------------------------------------------

    def _save(self) -> None:
        """Write the whole state atomically (temp file, fsync, rename), readable by us only."""
        if self._data_file is None:
            return
        document = {
            "format": DATA_FILE_FORMAT,
            "mounts": {
                mount: {
                    key: {
                        "created_time": s.created_time,
                        "updated_time": s.updated_time,
                        "current_version": s.current_version,
                        "oldest_version": s.oldest_version,
                        "versions": {
                            str(n): {**v.metadata(), "data": v.data} for n, v in s.versions.items()
                        },
                    }
                    for key, s in secrets.items()
                }
                for mount, secrets in self._mounts.items()
            },
        }
        path = self._data_file
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(document, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _load(self, path: Path) -> None:
        document = json.loads(path.read_text())
        if document.get("format") != DATA_FILE_FORMAT:
            raise ValueError(f"{path}: unknown data file format {document.get('format')!r}")
        for mount, secrets in document["mounts"].items():
            target = self._mounts.setdefault(mount, {})
            for key, s in secrets.items():
                target[key] = Secret(
                    created_time=s["created_time"],
                    updated_time=s["updated_time"],
                    current_version=s["current_version"],
                    oldest_version=s["oldest_version"],
                    versions={
                        int(n): Version(
                            created_time=v["created_time"],
                            data=v["data"],
                            deletion_time=v["deletion_time"],
                            destroyed=v["destroyed"],
                        )
                        for n, v in s["versions"].items()
                    },
                )
