"""A simulated MAAS region (the MAAS 2.0 REST API, as shared/maas-api-notes.md describes it), run
as its own process: `python -m sim.maas` (sim.maas.cli). It authenticates OAuth 1.0 PLAINTEXT
requests, routes `?op=` actions, answers with MAAS's status names and numbers, error codes and
bodies, and moves machines through realistic transitions over configurable time. A scenario file
(sim.maas.scenario) declares the site's networks and physical machines with their faults
(sim.maas.faults); an out-of-band control API (sim.maas.control) lets tests drift MAAS behind
the product's back and read per-operation request counters.

    region.py     store + clock-driven step queue      lifecycle.py  transitions and their steps
    build.py      region from a scenario               network.py    links, addresses
    storage.py    block devices, layouts               render.py     the JSON MAAS answers with
    routes.py     resources and their (method, op)     api_*.py      handlers
    auth.py       OAuth checks                         server.py     the ASGI app
"""
