"""Garbage-collector settings for long-running services (worker, gateway).

Everything imported at start-up (SQLAlchemy, the Temporal SDK, Litestar: hundreds of thousands
of objects) lives as long as the process, yet every full collection would walk it again; frozen,
it is left out. Young generations are collected less often, because a request allocates
thousands of short-lived objects that reference counting frees anyway: the default threshold
(700) ran a collection several times per request on the POST path.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def tune_for_service() -> None:
    """Call once, after start-up imports and before serving."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
