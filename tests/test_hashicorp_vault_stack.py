"""`bin/stack --vault hashicorp`'s Vault (devstack/hashicorp_vault.py): HashiCorp Vault itself on
file storage, started as the stack starts it, initialised once and unsealed on every start,
keeps the stack's secrets across a restart, and the worker's AppRole login (devstack/vault_auth.py)
works on it before and after."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from pathlib import Path

import httpx
import pytest

from core.config import Settings
from core.secrets import VaultSecretStore
from core.vault_policies import WORKER
from devstack.hashicorp_vault import VaultServerFiles, initialize_and_unseal, server_argv
from devstack.processes import Child, free_port, http_ok
from devstack.vault_auth import provision
from tests.lifecycle_support import eventually


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """No database here (overrides conftest's)."""


async def start_server(files: VaultServerFiles) -> Child:
    """The server as the stack runs it, once it answers (sealed or not)."""
    vault = Child("vault", server_argv(files), files.folder.parent / "vault.log",
                  dict(os.environ), files.folder.parent)  # fmt: skip
    await vault.start()
    await eventually(lambda: http_ok(f"{files.addr}/v1/sys/seal-status"), timeout=20)
    return vault


async def health_status(files: VaultServerFiles) -> int:
    async with httpx.AsyncClient(timeout=5) as http:
        return (await http.get(f"{files.addr}/v1/sys/health")).status_code


def worker_store(files: VaultServerFiles, env: dict[str, str]) -> VaultSecretStore:
    return VaultSecretStore.from_settings(
        Settings.from_env({"GPUCLOUD_VAULT_ADDR": files.addr, **env})
    )


async def test_initialised_once_unsealed_on_each_start_and_secrets_survive_a_restart(
    tmp_path: Path,
) -> None:
    files = VaultServerFiles(tmp_path / "hashicorp-vault", free_port())
    vault = await start_server(files)
    try:
        did = await asyncio.to_thread(initialize_and_unseal, files)
        assert did == "initialised, unsealed, KV v2 mounted at kv/"
        for private in (files.unseal_key_file, files.root_token_file):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600
        assert stat.S_IMODE(files.folder.stat().st_mode) == 0o700
        approle = tmp_path / "approle"
        env = (await asyncio.to_thread(provision, files.addr, files.root_token_file, approle))[
            WORKER.role
        ]
        path = f"kv/maas-sites/{uuid.uuid4()}/api-token"
        assert await worker_store(files, env).write(path, {"token": "a:b:c"}) == 1

        await vault.stop()
        vault = await start_server(files)
        assert await health_status(files) == 503  # sealed until the stack unseals it
        assert await asyncio.to_thread(initialize_and_unseal, files) == "unsealed"
        assert await health_status(files) == 200
        # The stack provisions again on each start (a fresh secret id); the data is still there.
        env = (await asyncio.to_thread(provision, files.addr, files.root_token_file, approle))[
            WORKER.role
        ]
        assert await worker_store(files, env).read(path) == {"token": "a:b:c"}
        assert await asyncio.to_thread(initialize_and_unseal, files) == "already unsealed"
    finally:
        await vault.stop()
