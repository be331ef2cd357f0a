"""The embedded default: start PostgreSQL, the Temporal dev server, the worker, simulated node
agents and the gateway on one machine. Tests and benchmarks start their servers through the same
modules, so there is one way to run each part."""
