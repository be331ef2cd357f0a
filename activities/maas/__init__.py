"""The MAAS 2.0 API at the control plane's boundary: `MaasClient` (client.py) answers typed
observed state (types.py) and raises errors classified with docs/runbooks/index.md (errors.py,
core/failures.py). shared/maas-api-notes.md is the contract it follows."""
