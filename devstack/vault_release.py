"""HashiCorp Vault itself, built once from its Go module into the tools cache: the tests check
the control plane's Vault auth (AppRole, path policies, token renewal) against it as well as
against our own store (sim/vault).

Why v1.13.0: every Vault release's go.mod replaces its `api` and `sdk` submodules with the
copies in its own tree, so it builds outside its repository only where the published `sdk` and
`api` it requires match those copies. Of the releases tried, v1.13.0 (sdk v0.8.1, api v1.9.0,
both published) is the one that does; README.md, "Why not HashiCorp Vault itself", lists the
others and how each failed.
"""

from __future__ import annotations

from pathlib import Path

from devstack.go_tools import go_wrapper_build

VAULT_MODULE = "github.com/hashicorp/vault"
VAULT_VERSION = "v1.13.0"


def vault_path(*, build: bool = True) -> Path:
    """The `vault` binary (bin/bootstrap builds it; about 5 minutes on a cold machine)."""
    return go_wrapper_build(f"vault-{VAULT_VERSION}", VAULT_MODULE, VAULT_VERSION, build=build)
