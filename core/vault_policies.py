"""The Vault ACL policy and AppRole role of each component: what an operator applies to a
production Vault, and what `bin/stack` provisions in its own (devstack/vault_auth.py). Each
component reads only the paths it needs; the root token is for bootstrap alone.

Paths are KV v2 API paths: a secret `kv/<key>` is read and written at `kv/data/<key>`, and its
versions are deleted at `kv/metadata/<key>` (core.secrets uses both).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.payment_settings import STRIPE_API_KEY_PATH, STRIPE_WEBHOOK_SECRET_PATH
from core.secret_paths import KV_MOUNT

# Token lifetimes of the roles: renewed by the process (core.secrets) while it runs, re-issued by
# a fresh login after the max TTL.
TOKEN_TTL_S = 3600
TOKEN_MAX_TTL_S = 24 * 3600


def _data_path(secret_path: str) -> str:
    mount, _, key = secret_path.partition("/")
    return f"{mount}/data/{key}"


def _rule(path: str, *capabilities: str) -> str:
    listed = ", ".join(f'"{c}"' for c in capabilities)
    return f'path "{path}" {{\n  capabilities = [{listed}]\n}}\n'


def _owned_tree(prefix: str) -> str:
    """Full control of the secrets under kv/<prefix>/: written, read, deleted (every version)."""
    return _rule(f"{KV_MOUNT}/data/{prefix}/*", "create", "read", "update", "delete") + _rule(
        f"{KV_MOUNT}/metadata/{prefix}/*", "read", "delete", "list"
    )


@dataclass(frozen=True)
class Component:
    role: str  # the AppRole role name
    policy: str  # the ACL policy name
    rules: str  # the policy, in Vault's HCL


# The worker: MAAS site credentials and power overrides, node secrets, project notification
# webhook secrets (all written by its activities), and the Stripe API key.
WORKER = Component(
    role="gpucloud-worker",
    policy="gpucloud-worker",
    rules="".join(
        [
            _owned_tree("maas-sites"),
            _owned_tree("nodes"),
            _owned_tree("projects"),
            _rule(_data_path(STRIPE_API_KEY_PATH), "read"),
        ]
    ),
)
# The gateway writes no secret (its writes are the worker's admin operations): it reads the
# Stripe webhook signing secret to verify webhooks.
GATEWAY = Component(
    role="gpucloud-gateway",
    policy="gpucloud-gateway",
    rules=_rule(_data_path(STRIPE_WEBHOOK_SECRET_PATH), "read"),
)
COMPONENTS = (WORKER, GATEWAY)
