"""`bin/stack --vault hashicorp`'s Vault (devstack/hashicorp_vault.py): HashiCorp Vault itself on
file storage, initialised once and unsealed on every start, keeps the stack's secrets across a
restart, and the worker's AppRole login (devstack/vault_auth.py) works on it before and after."""

from __future__ import annotations

import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core.config import Settings
from core.secrets import VaultSecretStore
from core.vault_policies import WORKER
from devstack.hashicorp_vault import VaultServerFiles, initialize_and_unseal, server_argv
from devstack.processes import free_port
from devstack.vault_auth import provision


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """No database here (overrides conftest's)."""


class Server:
    def __init__(self, files: VaultServerFiles) -> None:
        self.files = files
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.files.folder.parent / "vault.log").open("ab")
        self.process = subprocess.Popen(server_argv(self.files), stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "vault server exited"
            try:
                if httpx.get(f"{self.files.addr}/v1/sys/seal-status", timeout=1).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("vault server did not answer")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(VaultServerFiles(tmp_path / "hashicorp-vault", free_port()))
    yield running
    running.stop()


def health_status(files: VaultServerFiles) -> int:
    return httpx.get(f"{files.addr}/v1/sys/health", timeout=5).status_code


def worker_store(files: VaultServerFiles, env: dict[str, str]) -> VaultSecretStore:
    return VaultSecretStore.from_settings(
        Settings.from_env({"GPUCLOUD_VAULT_ADDR": files.addr, **env})
    )


async def test_initialised_once_unsealed_on_each_start_and_secrets_survive_a_restart(
    server: Server, tmp_path: Path
) -> None:
    files = server.files
    server.start()
    assert initialize_and_unseal(files) == "initialised, unsealed, KV v2 mounted at kv/"
    for private in (files.unseal_key_file, files.root_token_file):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.folder.stat().st_mode) == 0o700
    env = provision(files.addr, files.root_token_file, tmp_path / "approle")[WORKER.role]
    path = f"kv/maas-sites/{uuid.uuid4()}/api-token"
    assert await worker_store(files, env).write(path, {"token": "a:b:c"}) == 1

    server.stop()
    server.start()
    assert health_status(files) == 503  # sealed until the stack unseals it
    assert initialize_and_unseal(files) == "unsealed"
    assert health_status(files) == 200
    # The stack provisions again on each start (a fresh secret id); the data is still there.
    env = provision(files.addr, files.root_token_file, tmp_path / "approle")[WORKER.role]
    assert await worker_store(files, env).read(path) == {"token": "a:b:c"}
    assert initialize_and_unseal(files) == "already unsealed"
