"""Where each secret lives in Vault KV v2 (docs/maas-sites.md#secrets-in-vault). The database stores
these paths, never the values; the first segment is the KV mount."""

from __future__ import annotations

import uuid

KV_MOUNT = "kv"


def site_api_token_path(site_id: uuid.UUID) -> str:
    """→ {"token": "<consumer_key>:<token_key>:<token_secret>"}"""
    return f"{KV_MOUNT}/maas-sites/{site_id}/api-token"


def site_default_power_path(site_id: uuid.UUID) -> str:
    """→ {"user": ..., "pass": ...}"""
    return f"{KV_MOUNT}/maas-sites/{site_id}/power/default"


def site_deploy_password_path(site_id: uuid.UUID) -> str:
    """→ {"password": ...}"""
    return f"{KV_MOUNT}/maas-sites/{site_id}/deploy-password"


def power_override_path(site_id: uuid.UUID, override_id: uuid.UUID) -> str:
    """→ {"user": ..., "pass": ...}"""
    return f"{KV_MOUNT}/maas-sites/{site_id}/power/overrides/{override_id}"


def node_secret_root(node_id: uuid.UUID) -> str:
    """Node-scoped secrets (none are required today; operators and future agent features keep
    per-node material here), deleted by a full decommission's CleanupSecrets
    (docs/lifecycles/decommission.md#full-decommission)."""
    return f"{KV_MOUNT}/nodes/{node_id}"


def node_secret_paths(node_id: uuid.UUID) -> list[str]:
    """The node-scoped paths a full decommission deletes."""
    root = node_secret_root(node_id)
    return [f"{root}/agent", f"{root}/bmc"]
