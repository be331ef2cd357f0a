"""Vault auth for the stack's processes, provisioned with the root token (its only use besides
seeding): each component's ACL policy and AppRole role (core.vault_policies), its role id, and a
fresh secret id on every start, written to 0600 files the component's process reads at each login.
The previous secret id is destroyed (by accessor), so a start also rotates them; the running
processes pick the new one up at their next login, without a restart.

    env = provision(addr, root_token_file, state_dir / "vault-approle")
    worker_env = {**base_env, **env["gpucloud-worker"]}
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import hvac
import hvac.exceptions

from core.vault_policies import COMPONENTS, TOKEN_MAX_TTL_S, TOKEN_TTL_S, Component
from devstack.private_files import write_private

APPROLE_MOUNT = "approle"


def enable_approle(client: hvac.Client) -> None:
    if f"{APPROLE_MOUNT}/" not in client.sys.list_auth_methods()["data"]:
        client.sys.enable_auth_method("approle", path=APPROLE_MOUNT)


def provision_component(client: hvac.Client, component: Component, folder: Path) -> dict[str, str]:
    """The component's policy, role, role id and a new secret id (the previous one destroyed);
    the environment that makes its process log in with them."""
    client.sys.create_or_update_acl_policy(component.policy, component.rules)
    approle = client.auth.approle
    approle.create_or_update_approle(
        component.role,
        token_policies=[component.policy],
        token_ttl=TOKEN_TTL_S,
        token_max_ttl=TOKEN_MAX_TTL_S,
        mount_point=APPROLE_MOUNT,
    )
    role_id = approle.read_role_id(component.role, mount_point=APPROLE_MOUNT)["data"]["role_id"]
    issued = approle.generate_secret_id(component.role, mount_point=APPROLE_MOUNT)["data"]
    accessor_file = folder / "secret-id-accessor"
    if accessor_file.exists():
        # Already gone when the Vault's auth state did not survive its restart.
        with contextlib.suppress(hvac.exceptions.InvalidPath, hvac.exceptions.InvalidRequest):
            approle.destroy_secret_id_accessor(
                component.role, accessor_file.read_text().strip(), mount_point=APPROLE_MOUNT
            )
    role_id_file, secret_id_file = folder / "role-id", folder / "secret-id"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(role_id_file, role_id + "\n")
    write_private(secret_id_file, issued["secret_id"] + "\n")
    write_private(accessor_file, issued["secret_id_accessor"] + "\n")
    return {
        "GPUCLOUD_VAULT_ROLE_ID_FILE": str(role_id_file),
        "GPUCLOUD_VAULT_SECRET_ID_FILE": str(secret_id_file),
    }


def provision(addr: str, root_token_file: Path, folder: Path) -> dict[str, dict[str, str]]:
    """Every component's policy and role; {role name: its process environment}."""
    client = hvac.Client(url=addr, token=root_token_file.read_text().strip(), timeout=10)
    try:
        enable_approle(client)
        return {c.role: provision_component(client, c, folder / c.role) for c in COMPONENTS}
    finally:
        client.adapter.close()
