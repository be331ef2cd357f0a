"""Simulators that belong to the product: they let a newcomer run the whole control plane on one
machine. `sim.host` is a node's host behind the agent's HostBackend seam, `sim.fleet` runs the
agents of many simulated nodes in one process, `sim.demo_fleet` is the embedded default's
catalog and fleet."""
