"""The Vault simulator answers hvac (and raw HTTP) as HashiCorp Vault does: KV v2 paths, versions,
check-and-set, soft delete, undelete, destroy, metadata, listing, and Vault's 403/404 bodies.
Everything goes over HTTP to a real `python -m sim.vault` subprocess."""

from __future__ import annotations

import re
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import hvac
import hvac.exceptions
import pytest

from tests.vault_fixtures import VaultServer

RFC3339_NANO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z$")
CAS_MISMATCH = "check-and-set parameter did not match the current version"


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests touch no database: no PostgreSQL cluster for them (overrides conftest's)."""


def unique(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def kv(server: VaultServer) -> Any:
    return server.client().secrets.kv.v2


def raw(server: VaultServer, method: str, path: str, token: str | None = None,
        **kwargs: Any) -> httpx.Response:  # fmt: skip
    headers = {} if token == "" else {"X-Vault-Token": server.token if token is None else token}
    return httpx.request(method, f"{server.addr}/v1/{path}", headers=headers, timeout=5, **kwargs)


def read(server: VaultServer, path: str, version: int | None = None) -> dict[str, Any]:
    response: dict[str, Any] = kv(server).read_secret_version(
        path=path, version=version, mount_point="kv", raise_on_deleted_version=True
    )
    return response


# --- sys ---------------------------------------------------------------------------------------


def test_health_and_seal_status_answer_without_a_token(vault_server: VaultServer) -> None:
    anonymous = hvac.Client(url=vault_server.addr, token="", timeout=5)
    health = anonymous.sys.read_health_status(method="GET")
    assert health["initialized"] is True
    assert health["sealed"] is False
    assert health["standby"] is False
    assert anonymous.sys.is_initialized() is True
    assert anonymous.sys.is_sealed() is False
    head = httpx.head(f"{vault_server.addr}/v1/sys/health", timeout=5)
    assert head.status_code == 200
    assert head.content == b""


def test_token_lookup_self_tells_a_good_token_from_a_bad_one(vault_server: VaultServer) -> None:
    assert vault_server.client().is_authenticated() is True
    assert vault_server.client(token="hvs.not-the-root-token").is_authenticated() is False
    me = vault_server.client().lookup_token()
    assert me["data"]["policies"] == ["root"]


def test_mounts_lists_kv_as_version_2(vault_server: VaultServer) -> None:
    mounts = vault_server.client().sys.list_mounted_secrets_engines()
    assert mounts["data"]["kv/"]["type"] == "kv"
    assert mounts["data"]["kv/"]["options"] == {"version": "2"}


# --- auth failures and not found ---------------------------------------------------------------


@pytest.mark.parametrize("token", ["", "hvs.wrong"], ids=["missing", "wrong"])
def test_a_missing_or_wrong_token_gets_vaults_403_body(
    vault_server: VaultServer, token: str
) -> None:
    path = unique()
    kv(vault_server).create_or_update_secret(path=path, secret={"k": "v"}, mount_point="kv")
    for method, url, body in (
        ("GET", f"kv/data/{path}", None),
        ("POST", f"kv/data/{path}", {"data": {"k": "other"}}),
        ("LIST", "kv/metadata/", None),
        ("DELETE", f"kv/metadata/{path}", None),
    ):
        response = raw(vault_server, method, url, token=token, json=body)
        assert response.status_code == 403, (method, url)
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {"errors": ["permission denied"]}
    with pytest.raises(hvac.exceptions.Forbidden) as caught:
        vault_server.client(token=token).secrets.kv.v2.read_secret_version(
            path=path, mount_point="kv", raise_on_deleted_version=True
        )
    assert caught.value.errors == ["permission denied"]
    assert read(vault_server, path)["data"]["data"] == {"k": "v"}  # the refused write did nothing


def test_a_missing_secret_is_404_with_an_empty_error_list(vault_server: VaultServer) -> None:
    path = unique()
    response = raw(vault_server, "GET", f"kv/data/{path}")
    assert response.status_code == 404
    assert response.json() == {"errors": []}
    assert raw(vault_server, "GET", f"kv/metadata/{path}").json() == {"errors": []}
    with pytest.raises(hvac.exceptions.InvalidPath) as caught:
        read(vault_server, path)
    assert caught.value.errors == []


def test_an_unknown_mount_is_404_no_handler_for_route(vault_server: VaultServer) -> None:
    response = raw(vault_server, "GET", "nosuchmount/data/x")
    assert response.status_code == 404
    assert response.json() == {
        "errors": ['no handler for route "nosuchmount/data/x". route entry not found.']
    }


# --- writes, versions, check-and-set -----------------------------------------------------------


def test_writes_create_versions_and_reads_return_vaults_envelope(
    vault_server: VaultServer,
) -> None:
    path = unique("maas-sites") + "/api-token"
    first = kv(vault_server).create_or_update_secret(
        path=path, secret={"token": "a:b:c"}, mount_point="kv"
    )
    assert first["data"]["version"] == 1
    assert first["data"]["deletion_time"] == ""
    assert first["data"]["destroyed"] is False
    assert RFC3339_NANO.match(first["data"]["created_time"])
    second = kv(vault_server).create_or_update_secret(
        path=path, secret={"token": "d:e:f"}, mount_point="kv"
    )
    assert second["data"]["version"] == 2

    latest = read(vault_server, path)
    assert set(latest) >= {"request_id", "lease_id", "renewable", "lease_duration", "data",
                           "wrap_info", "warnings", "auth"}  # fmt: skip
    assert latest["lease_id"] == ""
    assert latest["renewable"] is False
    assert latest["lease_duration"] == 0
    assert latest["data"]["data"] == {"token": "d:e:f"}
    assert latest["data"]["metadata"] == {
        "version": 2,
        "created_time": second["data"]["created_time"],
        "deletion_time": "",
        "destroyed": False,
        "custom_metadata": None,
    }
    assert read(vault_server, path, version=1)["data"]["data"] == {"token": "a:b:c"}
    with pytest.raises(hvac.exceptions.InvalidPath):
        read(vault_server, path, version=3)


def test_check_and_set(vault_server: VaultServer) -> None:
    path = unique()
    store = kv(vault_server)
    assert store.create_or_update_secret(path=path, secret={"n": "1"}, cas=0,
                                         mount_point="kv")["data"]["version"] == 1  # fmt: skip
    with pytest.raises(hvac.exceptions.InvalidRequest) as caught:
        store.create_or_update_secret(path=path, secret={"n": "x"}, cas=0, mount_point="kv")
    assert caught.value.errors == [CAS_MISMATCH]
    response = raw(vault_server, "POST", f"kv/data/{path}",
                   json={"data": {"n": "x"}, "options": {"cas": 5}})  # fmt: skip
    assert response.status_code == 400
    assert response.json() == {"errors": [CAS_MISMATCH]}
    assert store.create_or_update_secret(path=path, secret={"n": "2"}, cas=1,
                                         mount_point="kv")["data"]["version"] == 2  # fmt: skip
    assert read(vault_server, path)["data"]["data"] == {"n": "2"}


def test_put_writes_like_post_and_bad_bodies_get_400(vault_server: VaultServer) -> None:
    path = unique()
    response = raw(vault_server, "PUT", f"kv/data/{path}", json={"data": {"k": "v"}})
    assert response.status_code == 200
    assert response.json()["data"]["version"] == 1
    no_data = raw(vault_server, "POST", f"kv/data/{path}", json={"options": {}})
    assert (no_data.status_code, no_data.json()) == (400, {"errors": ["no data provided"]})
    garbage = raw(vault_server, "POST", f"kv/data/{path}", content=b"{not json")
    assert (garbage.status_code, garbage.json()) == (400, {"errors": ["error parsing JSON"]})


# --- delete, undelete, destroy -----------------------------------------------------------------


def test_soft_delete_of_the_latest_version_and_undelete(vault_server: VaultServer) -> None:
    path = unique()
    store = kv(vault_server)
    store.create_or_update_secret(path=path, secret={"v": "1"}, mount_point="kv")
    store.create_or_update_secret(path=path, secret={"v": "2"}, mount_point="kv")
    response = store.delete_latest_version_of_secret(path=path, mount_point="kv")
    assert response.status_code == 204

    with pytest.raises(hvac.exceptions.InvalidPath):
        read(vault_server, path)
    # Vault answers 404 but still sends the envelope: data null, the version's metadata.
    deleted = raw(vault_server, "GET", f"kv/data/{path}")
    assert deleted.status_code == 404
    body = deleted.json()
    assert body["data"]["data"] is None
    assert body["data"]["metadata"]["version"] == 2
    assert RFC3339_NANO.match(body["data"]["metadata"]["deletion_time"])
    assert body["data"]["metadata"]["destroyed"] is False
    seen = store.read_secret_version(path=path, mount_point="kv", raise_on_deleted_version=False)
    assert seen["data"]["data"] is None
    assert read(vault_server, path, version=1)["data"]["data"] == {"v": "1"}

    store.undelete_secret_versions(path=path, versions=[2], mount_point="kv")
    assert read(vault_server, path)["data"]["data"] == {"v": "2"}
    assert read(vault_server, path)["data"]["metadata"]["deletion_time"] == ""


def test_delete_and_destroy_named_versions(vault_server: VaultServer) -> None:
    path = unique()
    store = kv(vault_server)
    for n in range(3):
        store.create_or_update_secret(path=path, secret={"v": str(n + 1)}, mount_point="kv")
    assert store.delete_secret_versions(path=path, versions=[1, 2], mount_point="kv"
                                        ).status_code == 204  # fmt: skip
    with pytest.raises(hvac.exceptions.InvalidPath):
        read(vault_server, path, version=1)
    assert read(vault_server, path)["data"]["data"] == {"v": "3"}

    store.destroy_secret_versions(path=path, versions=[2, 3], mount_point="kv")
    destroyed = raw(vault_server, "GET", f"kv/data/{path}", params={"version": 3})
    assert destroyed.status_code == 404
    assert destroyed.json()["data"]["metadata"]["destroyed"] is True
    assert destroyed.json()["data"]["data"] is None
    store.undelete_secret_versions(path=path, versions=[1, 2, 3], mount_point="kv")
    assert read(vault_server, path, version=1)["data"]["data"] == {"v": "1"}  # undeleted
    for version in (2, 3):  # destroyed versions stay gone
        with pytest.raises(hvac.exceptions.InvalidPath):
            read(vault_server, path, version=version)
    versions = store.read_secret_metadata(path=path, mount_point="kv")["data"]["versions"]
    assert [versions[n]["destroyed"] for n in ("1", "2", "3")] == [False, True, True]

    missing = raw(vault_server, "POST", f"kv/destroy/{path}", json={"versions": []})
    assert missing.json() == {"errors": ["no version number provided"]}
    missing = raw(vault_server, "POST", f"kv/delete/{path}", json={})
    assert missing.json() == {"errors": ["No version number provided"]}


# --- metadata and listing ----------------------------------------------------------------------


def test_metadata_read_and_delete_of_all_versions(vault_server: VaultServer) -> None:
    path = unique()
    store = kv(vault_server)
    store.create_or_update_secret(path=path, secret={"v": "1"}, mount_point="kv")
    store.create_or_update_secret(path=path, secret={"v": "2"}, mount_point="kv")
    metadata = store.read_secret_metadata(path=path, mount_point="kv")["data"]
    assert metadata["current_version"] == 2
    assert metadata["oldest_version"] == 0
    assert sorted(metadata["versions"]) == ["1", "2"]
    assert RFC3339_NANO.match(metadata["created_time"])
    assert metadata["updated_time"] == metadata["versions"]["2"]["created_time"]

    response = store.delete_metadata_and_all_versions(path=path, mount_point="kv")
    assert response.status_code == 204
    for url in (f"kv/data/{path}", f"kv/metadata/{path}"):
        gone = raw(vault_server, "GET", url)
        assert (gone.status_code, gone.json()) == (404, {"errors": []})
    # A new write starts again at version 1.
    again = store.create_or_update_secret(path=path, secret={"v": "new"}, mount_point="kv")
    assert again["data"]["version"] == 1


def test_listing_keys_with_list_and_get_list_true(vault_server: VaultServer) -> None:
    root = unique("list")
    store = kv(vault_server)
    for key in ("b", "c/d", "c/e/f", "a"):
        store.create_or_update_secret(path=f"{root}/{key}", secret={"k": "v"}, mount_point="kv")
    assert store.list_secrets(path=root, mount_point="kv")["data"]["keys"] == ["a", "b", "c/"]
    with_get = raw(vault_server, "GET", f"kv/metadata/{root}/c", params={"list": "true"})
    assert with_get.json()["data"]["keys"] == ["d", "e/"]
    with_list = raw(vault_server, "LIST", f"kv/metadata/{root}/c/")
    assert with_list.json()["data"]["keys"] == ["d", "e/"]
    assert f"{root}/" in store.list_secrets(path="", mount_point="kv")["data"]["keys"]

    store.delete_metadata_and_all_versions(path=f"{root}/a", mount_point="kv")
    assert store.list_secrets(path=root, mount_point="kv")["data"]["keys"] == ["b", "c/"]
    empty = raw(vault_server, "LIST", f"kv/metadata/{unique()}")
    assert (empty.status_code, empty.json()) == (404, {"errors": []})


# --- private servers: persistence, mounts, sealing, logs ----------------------------------------


def test_secrets_and_the_generated_root_token_survive_a_restart(
    start_vault: Callable[..., VaultServer], tmp_path: Path
) -> None:
    token_file = tmp_path / "state" / "vault-token"
    data_file = tmp_path / "state" / "vault-data.json"
    (tmp_path / "state").mkdir()
    first = start_vault(token_file=token_file, data_file=data_file)
    assert first.token.startswith("hvs.")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    store = kv(first)
    store.create_or_update_secret(path="site/api-token", secret={"token": "t1"}, mount_point="kv")
    store.create_or_update_secret(path="site/api-token", secret={"token": "t2"}, mount_point="kv")
    store.create_or_update_secret(path="site/gone", secret={"x": "y"}, mount_point="kv")
    store.delete_latest_version_of_secret(path="site/gone", mount_point="kv")
    assert stat.S_IMODE(data_file.stat().st_mode) == 0o600
    first.stop()

    second = start_vault(token_file=token_file, data_file=data_file)
    assert second.token == first.token
    assert read(second, "site/api-token")["data"]["data"] == {"token": "t2"}
    assert read(second, "site/api-token", version=1)["data"]["data"] == {"token": "t1"}
    with pytest.raises(hvac.exceptions.InvalidPath):
        read(second, "site/gone")
    written = kv(second).create_or_update_secret(path="site/api-token", secret={"token": "t3"},
                                                 mount_point="kv")  # fmt: skip
    assert written["data"]["version"] == 3
    assert kv(second).list_secrets(path="site", mount_point="kv")["data"]["keys"] == [
        "api-token",
        "gone",
    ]


def test_other_mounts_from_the_command_line(start_vault: Callable[..., VaultServer]) -> None:
    server = start_vault(mounts=("kv", "secret"))
    client = server.client()
    client.secrets.kv.v2.create_or_update_secret(path="a", secret={"k": "s"}, mount_point="secret")
    assert client.secrets.kv.v2.read_secret_version(
        path="a", mount_point="secret", raise_on_deleted_version=True
    )["data"]["data"] == {"k": "s"}
    with pytest.raises(hvac.exceptions.InvalidPath):
        read(server, "a")  # mounts are separate namespaces


def test_a_sealed_vault_answers_503_until_unsealed(
    start_vault: Callable[..., VaultServer],
) -> None:
    server = start_vault()
    client = server.client()
    client.secrets.kv.v2.create_or_update_secret(path="a", secret={"k": "v"}, mount_point="kv")
    client.sys.seal()
    with pytest.raises(hvac.exceptions.VaultDown):
        read(server, "a")
    sealed = raw(server, "GET", "kv/data/a")
    assert (sealed.status_code, sealed.json()) == (503, {"errors": ["Vault is sealed"]})
    assert httpx.get(f"{server.addr}/v1/sys/health", timeout=5).status_code == 503
    assert client.sys.is_sealed() is True
    client.sys.submit_unseal_key(key=server.token)
    assert read(server, "a")["data"]["data"] == {"k": "v"}


def test_the_server_log_has_paths_but_no_secret_values_or_tokens(
    start_vault: Callable[..., VaultServer],
) -> None:
    server = start_vault()
    secret_value = f"very-secret-{uuid.uuid4().hex}"
    kv(server).create_or_update_secret(path="logged/path", secret={"pass": secret_value},
                                       mount_point="kv")  # fmt: skip
    read(server, "logged/path")
    raw(server, "POST", "kv/data/logged/path", token="hvs.wrong", json={"data": {"p": "x"}})
    server.stop()
    log = server.log_text()
    assert "/v1/kv/data/logged/path" in log
    assert secret_value not in log
    assert server.token not in log
