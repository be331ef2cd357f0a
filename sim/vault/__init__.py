"""A Vault simulator for the embedded default and the tests: a KV version 2 server of our own that
answers hvac exactly as HashiCorp Vault does (paths, versions, 403/404 bodies), because no package
registry we build from ships a Vault binary. Production uses a real Vault.

    python -m sim.vault --host 127.0.0.1 --port 8200 --root-token-file .state/vault-token \\
        [--data-file .state/vault-data.json] [--mount kv ...]

`sim.vault.kv` is the engine (versions, check-and-set, soft delete, destroy, metadata),
`sim.vault.app` the HTTP API, `sim.vault.server` the command line.
"""
