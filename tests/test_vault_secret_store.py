"""core.secrets.VaultSecretStore over HTTP, against HashiCorp Vault itself and the Vault
simulator (the sealing, outage and data-file cases: the simulator only): reads see the latest
version at call time (rotation needs no restart), absence is None, and failures are typed errors
that name the path but never carry a secret value, in any text a log or a trace could show."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.config import Settings
from core.secrets import (
    SecretStoreError,
    SecretStoreForbidden,
    SecretStoreMisconfigured,
    SecretStoreUnavailable,
    VaultSecretStore,
)
from tests.vault_fixtures import VaultServer


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests touch no database: no PostgreSQL cluster for them (overrides conftest's)."""


def site_path(kind: str = "api-token") -> str:
    return f"kv/maas-sites/{uuid.uuid4()}/{kind}"


def secret_value() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


def assert_leaks_nothing(err: BaseException, secret: str, caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(err, SecretStoreError)
    assert caplog.records, "the log check reads what was logged"
    shown = [str(err), repr(err), "".join(traceback.format_exception(err)), caplog.text]
    for text in shown:
        assert secret not in text
    # Nothing chained: a reporter walking __cause__/__context__ finds no hvac/requests text.
    assert err.__cause__ is None
    assert err.__context__ is None


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) but never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(params=["hashicorp_vault_server", "vault_server"])
def kv_server(request: pytest.FixtureRequest) -> VaultServer:
    """The KV and token behaviour below, against HashiCorp Vault itself and the simulator."""
    server: VaultServer = request.getfixturevalue(request.param)
    return server


@pytest.fixture
def kv_store(kv_server: VaultServer) -> VaultSecretStore:
    return VaultSecretStore(kv_server.addr, token=kv_server.token, timeout=5.0)


# --- reads and writes --------------------------------------------------------------------------


async def test_write_then_read_and_rotation_is_seen_by_the_next_read(
    kv_store: VaultSecretStore,
) -> None:
    path = site_path()
    assert await kv_store.write(path, {"token": "ck:tk:ts-1"}) == 1
    assert await kv_store.read(path) == {"token": "ck:tk:ts-1"}
    assert await kv_store.write(path, {"token": "ck:tk:ts-2"}) == 2
    assert await kv_store.read(path) == {"token": "ck:tk:ts-2"}


async def test_writes_by_another_client_are_read_at_call_time(
    kv_store: VaultSecretStore, kv_server: VaultServer
) -> None:
    path = site_path("power/default")
    await kv_store.write(path, {"user": "root", "pass": "one"})
    kv_server.client().secrets.kv.v2.create_or_update_secret(
        path=path.removeprefix("kv/"), secret={"user": "root", "pass": "two"}, mount_point="kv"
    )
    assert await kv_store.read(path) == {"user": "root", "pass": "two"}


async def test_absent_and_soft_deleted_secrets_read_as_none(
    kv_store: VaultSecretStore, kv_server: VaultServer
) -> None:
    assert await kv_store.read(site_path()) is None
    path = site_path()
    await kv_store.write(path, {"token": "x"})
    kv_server.client().secrets.kv.v2.delete_latest_version_of_secret(
        path=path.removeprefix("kv/"), mount_point="kv"
    )
    assert await kv_store.read(path) is None


async def test_delete_removes_every_version_and_is_idempotent(
    kv_store: VaultSecretStore, kv_server: VaultServer
) -> None:
    path = site_path()
    await kv_store.write(path, {"token": "1"})
    await kv_store.write(path, {"token": "2"})
    await kv_store.delete(path)
    assert await kv_store.read(path) is None
    response = kv_server.client().adapter.get(
        f"/v1/kv/metadata/{path.removeprefix('kv/')}", raise_exception=False
    )
    assert response.status_code == 404  # metadata gone too, not only the data
    await kv_store.delete(path)  # nothing there: still fine
    assert await kv_store.write(path, {"token": "fresh"}) == 1


async def test_concurrent_calls(kv_store: VaultSecretStore) -> None:
    paths = [site_path() for _ in range(10)]
    await asyncio.gather(*(kv_store.write(p, {"token": p}) for p in paths))
    results = await asyncio.gather(*(kv_store.read(p) for p in paths))
    assert results == [{"token": p} for p in paths]


async def test_a_secret_that_is_not_a_map_of_strings_is_an_error(
    kv_store: VaultSecretStore, kv_server: VaultServer
) -> None:
    path = site_path()
    kv_server.client().secrets.kv.v2.create_or_update_secret(
        path=path.removeprefix("kv/"), secret={"port": 623}, mount_point="kv"
    )
    with pytest.raises(SecretStoreError, match="not a map of strings"):
        await kv_store.read(path)


# --- typed errors that leak nothing ------------------------------------------------------------


async def test_a_wrong_token_is_forbidden_and_leaks_no_value(
    kv_server: VaultServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = VaultSecretStore(kv_server.addr, token="hvs.not-the-root-token", timeout=5)
    path, secret = site_path("power/default"), secret_value()
    with pytest.raises(SecretStoreForbidden) as caught:
        await store.write(path, {"user": "root", "pass": secret})
    assert path in str(caught.value)
    assert caught.value.path == path
    assert_leaks_nothing(caught.value, secret, caplog)
    assert "hvs.not-the-root-token" not in str(caught.value) + repr(store)
    with pytest.raises(SecretStoreForbidden):
        await store.read(path)
    with pytest.raises(SecretStoreForbidden):
        await store.delete(path)


async def test_connection_refused_is_unavailable_and_leaks_no_value(
    closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = VaultSecretStore(f"http://127.0.0.1:{closed_port}", token="hvs.x", timeout=2)
    path, secret = site_path(), secret_value()
    with pytest.raises(SecretStoreUnavailable) as caught:
        await store.write(path, {"token": secret})
    assert path in str(caught.value)
    assert_leaks_nothing(caught.value, secret, caplog)
    with pytest.raises(SecretStoreUnavailable):
        await store.read(path)


async def test_a_silent_server_times_out_as_unavailable(
    silent_listener: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = VaultSecretStore(silent_listener, token="hvs.x", timeout=0.5)
    path, secret = site_path(), secret_value()
    started = time.monotonic()
    with pytest.raises(SecretStoreUnavailable, match="timed out") as caught:
        await store.write(path, {"token": secret})
    assert time.monotonic() - started < 5
    assert_leaks_nothing(caught.value, secret, caplog)


async def test_a_sealed_vault_is_unavailable(
    start_vault: Callable[..., VaultServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # hvac, requests and urllib3, at their chattiest
    server = start_vault()
    store = VaultSecretStore(server.addr, token=server.token, timeout=5)
    path, secret = site_path(), secret_value()
    await store.write(path, {"token": "before"})
    server.client().sys.seal()
    with pytest.raises(SecretStoreUnavailable, match="503") as caught:
        await store.write(path, {"token": secret})
    assert_leaks_nothing(caught.value, secret, caplog)
    with pytest.raises(SecretStoreUnavailable):
        await store.read(path)
    server.client().sys.submit_unseal_key(key=server.token)
    assert await store.read(path) == {"token": "before"}


async def test_an_unknown_mount_is_misconfigured_not_absent(
    secret_store: VaultSecretStore,
) -> None:
    with pytest.raises(SecretStoreMisconfigured, match="no such KV v2 mount"):
        await secret_store.read("nosuchmount/maas-sites/x/api-token")
    with pytest.raises(SecretStoreMisconfigured):
        await secret_store.write("nosuchmount/x", {"k": "v"})


@pytest.mark.parametrize("path", ["kv", "kv/", "/kv/x", "kv/x/", "kv//x"])
async def test_malformed_paths_are_refused(secret_store: VaultSecretStore, path: str) -> None:
    with pytest.raises(SecretStoreMisconfigured):
        await secret_store.read(path)


# --- tokens ------------------------------------------------------------------------------------


async def test_the_token_file_is_reread_on_every_call(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    token_file = tmp_path / "vault-token"
    store = VaultSecretStore(vault_server.addr, token_file=token_file, timeout=5)
    path = site_path()

    with pytest.raises(SecretStoreMisconfigured, match="token file"):
        await store.read(path)  # no file yet
    token_file.write_text("")
    with pytest.raises(SecretStoreMisconfigured, match="empty"):
        await store.read(path)
    token_file.write_text("hvs.revoked-token\n")
    with pytest.raises(SecretStoreForbidden):
        await store.write(path, {"token": "x"})
    token_file.write_text(vault_server.token + "\n")  # rotated: the same store now gets in
    assert await store.write(path, {"token": "x"}) == 1
    assert await store.read(path) == {"token": "x"}


async def test_from_settings(vault_server: VaultServer, tmp_path: Path) -> None:
    token_file = tmp_path / "vault-token"
    token_file.write_text(vault_server.token)
    settings = Settings.from_env(
        {"GPUCLOUD_VAULT_ADDR": vault_server.addr, "GPUCLOUD_VAULT_TOKEN_FILE": str(token_file)}
    )
    path = site_path()
    store = VaultSecretStore.from_settings(settings)
    assert await store.write(path, {"token": "via-file"}) == 1

    settings = Settings.from_env(
        {"GPUCLOUD_VAULT_ADDR": vault_server.addr, "GPUCLOUD_VAULT_TOKEN": vault_server.token}
    )
    assert vault_server.token not in repr(settings)
    store = VaultSecretStore.from_settings(settings)
    assert vault_server.token not in repr(store)
    assert await store.read(path) == {"token": "via-file"}

    unconfigured = VaultSecretStore.from_settings(Settings.from_env({}))
    with pytest.raises(SecretStoreMisconfigured, match="no Vault token"):
        await unconfigured.read(path)


def test_a_token_and_a_token_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        VaultSecretStore("http://127.0.0.1:8200", token="t", token_file=tmp_path / "f")
