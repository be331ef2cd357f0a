"""Vault fixtures: the Vault simulator (`python -m sim.vault`) as a real subprocess on a free port,
spoken to over HTTP by hvac and core.secrets, as production speaks to Vault.

    def test_x(vault_server):              # one server for the session: use unique paths
        vault_server.client().secrets.kv.v2.read_secret_version(...)
    async def test_y(secret_store):        # VaultSecretStore with the root token
        await secret_store.write("kv/some/path", {"k": "v"})
    def test_z(start_vault):               # a private server: data file, restarts, sealing
        server = start_vault(data_file=tmp_path / "vault.json")
        server.stop(); server = start_vault(data_file=..., token_file=server.token_file)

`start_hashicorp_vault` starts HashiCorp Vault itself (devstack/vault_release.py, built by
bin/bootstrap) in dev mode, with what the stack's Vault has: KV v2 at `kv/`, AppRole enabled,
and a file audit device, whose request entries `VaultServer.requests` counts as it counts the
simulator's access log.

Every server started here is stopped at its fixture's teardown.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hvac
import pytest

from core.secrets import VaultSecretStore
from devstack.processes import free_port
from devstack.vault_auth import enable_approle
from devstack.vault_release import vault_path

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 20.0


@dataclass
class VaultServer:
    addr: str
    token: str
    token_file: Path
    data_file: Path | None
    log_file: Path
    process: subprocess.Popen[bytes]
    audit_file: Path | None = None  # HashiCorp Vault's: its request log

    def client(self, token: str | None = None) -> hvac.Client:
        return hvac.Client(url=self.addr, token=self.token if token is None else token, timeout=5)

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace")

    def requests(self, route: str) -> int:
        """How many requests the server logged for `route` (e.g. "auth/approle/login"),
        answered or refused: the simulator's access log, or Vault's audit log."""
        if self.audit_file is None:
            return len(re.findall(rf'"[A-Z]+ /v1/{re.escape(route)} HTTP', self.log_text()))
        if not self.audit_file.exists():
            return 0
        count = 0
        for line in self.audit_file.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("type") == "request" and entry["request"].get("path") == route:
                count += 1
        return count

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait_healthy(server: VaultServer) -> bool:
    """True once /v1/sys/health answers; False if the process exited (e.g. the port was taken)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.addr}/v1/sys/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"the Vault server did not answer in {READY_TIMEOUT_S:.0f}s:\n"
                       f"{server.log_text()[-3000:]}")  # fmt: skip


def launch_vault(
    workdir: Path,
    *,
    token_file: Path | None = None,
    data_file: Path | None = None,
    mounts: tuple[str, ...] = (),
) -> VaultServer:
    """Start `python -m sim.vault` and wait until it answers. Without `token_file` a random root
    token is written to a new one; with an existing file the server keeps its token."""
    workdir.mkdir(parents=True, exist_ok=True)
    if token_file is None:
        token_file = workdir / f"root-token-{secrets.token_hex(4)}"
        token_file.write_text("hvs." + secrets.token_urlsafe(18) + "\n")
        token_file.chmod(0o600)
    for _ in range(3):  # a free port can be taken between the probe and the server's bind
        port = free_port()
        log_file = workdir / f"vault-{port}.log"
        argv = [sys.executable, "-m", "sim.vault", "--host", "127.0.0.1", "--port", str(port),
                "--root-token-file", str(token_file)]  # fmt: skip
        if data_file is not None:
            argv += ["--data-file", str(data_file)]
        for mount in mounts:
            argv += ["--mount", mount]
        with log_file.open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        server = VaultServer(
            addr=f"http://127.0.0.1:{port}",
            token="",
            token_file=token_file,
            data_file=data_file,
            log_file=log_file,
            process=process,
        )
        if _wait_healthy(server):
            # Read after start: the server generates the token when the file did not exist.
            server.token = token_file.read_text().strip()
            return server
    raise RuntimeError(f"the Vault simulator would not start:\n{server.log_text()[-3000:]}")


def launch_hashicorp_vault(workdir: Path) -> VaultServer:
    """`vault server -dev` on a free port, with a random root token, KV v2 at `kv/`, AppRole and
    a file audit device."""
    binary = vault_path(build=False)
    workdir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)  # a chosen id may not take Vault's own `hvs.` prefix
    token_file = workdir / f"root-token-{secrets.token_hex(4)}"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    for _ in range(3):  # a free port can be taken between the probe and the server's bind
        port = free_port()
        log_file = workdir / f"hashicorp-vault-{port}.log"
        argv = [str(binary), "server", "-dev", f"-dev-root-token-id={token}",
                f"-dev-listen-address=127.0.0.1:{port}", "-dev-no-store-token"]  # fmt: skip
        with log_file.open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        server = VaultServer(
            addr=f"http://127.0.0.1:{port}",
            token=token,
            token_file=token_file,
            data_file=None,
            log_file=log_file,
            process=process,
        )
        if _wait_healthy(server):
            root = server.client()
            root.sys.enable_secrets_engine("kv", path="kv", options={"version": "2"})
            enable_approle(root)
            audit = workdir / f"audit-{port}.log"
            root.sys.enable_audit_device("file", options={"file_path": str(audit)})
            server.audit_file = audit
            return server
    raise RuntimeError(f"Vault would not start:\n{server.log_text()[-3000:]}")


def _started(launch: Callable[..., VaultServer]) -> Iterator[Callable[..., VaultServer]]:
    """A factory for servers `launch` starts, each stopped at teardown."""
    started: list[VaultServer] = []

    def start(**kwargs: Any) -> VaultServer:
        server = launch(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def vault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    server = launch_vault(tmp_path_factory.mktemp("vault"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hashicorp_vault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    server = launch_hashicorp_vault(tmp_path_factory.mktemp("hashicorp-vault"))
    yield server
    server.stop()


@pytest.fixture
def secret_store(vault_server: VaultServer) -> VaultSecretStore:
    return VaultSecretStore(vault_server.addr, token=vault_server.token, timeout=5.0)


@pytest.fixture
def start_vault(tmp_path: Path) -> Iterator[Callable[..., VaultServer]]:
    """A factory for private simulator servers (same keywords as launch_vault)."""
    yield from _started(lambda **kwargs: launch_vault(tmp_path / "vault", **kwargs))


@pytest.fixture
def start_hashicorp_vault(tmp_path: Path) -> Iterator[Callable[..., VaultServer]]:
    """A factory for private HashiCorp Vault dev servers."""
    yield from _started(lambda: launch_hashicorp_vault(tmp_path / "hashicorp-vault"))
