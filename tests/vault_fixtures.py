"""Vault fixtures: the Vault simulator (`python -m sim.vault`) as a real subprocess on a free port,
spoken to over HTTP by hvac and core.secrets, as production speaks to Vault.

    def test_x(vault_server):              # one server for the session: use unique paths
        vault_server.client().secrets.kv.v2.read_secret_version(...)
    async def test_y(secret_store):        # VaultSecretStore with the root token
        await secret_store.write("kv/some/path", {"k": "v"})
    def test_z(start_vault):               # a private server: data file, restarts, sealing
        server = start_vault(data_file=tmp_path / "vault.json")
        server.stop(); server = start_vault(data_file=..., token_file=server.token_file)

Every server started here is stopped at its fixture's teardown.
"""

from __future__ import annotations

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

    def client(self, token: str | None = None) -> hvac.Client:
        return hvac.Client(url=self.addr, token=self.token if token is None else token, timeout=5)

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace")

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
    raise RuntimeError(f"the Vault simulator did not answer in {READY_TIMEOUT_S:.0f}s:\n"
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


@pytest.fixture(scope="session")
def vault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    server = launch_vault(tmp_path_factory.mktemp("vault"))
    yield server
    server.stop()


@pytest.fixture
def secret_store(vault_server: VaultServer) -> VaultSecretStore:
    return VaultSecretStore(vault_server.addr, token=vault_server.token, timeout=5.0)


@pytest.fixture
def start_vault(tmp_path: Path) -> Iterator[Callable[..., VaultServer]]:
    """A factory for private servers (same keywords as launch_vault), stopped at teardown."""
    started: list[VaultServer] = []

    def start(**kwargs: Any) -> VaultServer:
        server = launch_vault(tmp_path / "vault", **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
