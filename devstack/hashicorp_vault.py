"""HashiCorp Vault as a production deployment runs it, for `bin/stack --vault hashicorp`: a
server with file storage under the stack's state folder, initialised once (one unseal key
share, the root token), unsealed on every start, with what the stack's secrets need mounted (KV
v2 at `kv/`, AppRole). The binary is the one bin/bootstrap builds (devstack/vault_release.py).

The unseal key and the root token are written 0600 into the state folder at initialisation: a
development convenience (a production Vault keeps them with its operators or auto-unseals). The
worker and the gateway never get either: they log in by AppRole (devstack/vault_auth.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hvac

from devstack.private_files import write_private
from devstack.vault_auth import enable_approle
from devstack.vault_release import vault_path

KV_MOUNT = "kv"


@dataclass(frozen=True)
class VaultServerFiles:
    """One Vault server's files under `folder`."""

    folder: Path
    port: int

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.folder / "vault.hcl"

    @property
    def data_dir(self) -> Path:
        return self.folder / "data"

    @property
    def unseal_key_file(self) -> Path:
        return self.folder / "unseal-key"

    @property
    def root_token_file(self) -> Path:
        return self.folder / "root-token"


def server_argv(files: VaultServerFiles) -> list[str]:
    """`vault server` with its configuration written (file storage, one local listener)."""
    files.folder.mkdir(parents=True, exist_ok=True)
    files.folder.chmod(0o700)
    files.config_file.write_text(
        f'storage "file" {{\n  path = "{files.data_dir}"\n}}\n'
        f'listener "tcp" {{\n  address = "127.0.0.1:{files.port}"\n  tls_disable = true\n}}\n'
        f'api_addr = "{files.addr}"\n'
        # mlock needs CAP_IPC_LOCK and a memlock limit a development machine rarely grants.
        "disable_mlock = true\n"
    )
    return [str(vault_path(build=False)), "server", f"-config={files.config_file}"]


def initialize_and_unseal(files: VaultServerFiles) -> str:
    """Initialise the server the first time (its unseal key and root token into the folder),
    unseal it, and mount what the stack uses; what it says it did."""
    client = hvac.Client(url=files.addr, timeout=10)
    done = []
    if not client.sys.is_initialized():
        result = client.sys.initialize(secret_shares=1, secret_threshold=1)
        write_private(files.unseal_key_file, result["keys_base64"][0] + "\n")
        write_private(files.root_token_file, result["root_token"] + "\n")
        done.append("initialised")
    if client.sys.is_sealed():
        client.sys.submit_unseal_key(key=files.unseal_key_file.read_text().strip())
        done.append("unsealed")
    root = hvac.Client(url=files.addr, token=files.root_token_file.read_text().strip(), timeout=10)
    if f"{KV_MOUNT}/" not in root.sys.list_mounted_secrets_engines()["data"]:
        root.sys.enable_secrets_engine("kv", path=KV_MOUNT, options={"version": "2"})
        done.append("KV v2 mounted at kv/")
    enable_approle(root)
    return ", ".join(done) or "already unsealed"
