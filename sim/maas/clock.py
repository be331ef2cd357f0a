"""Time for the simulated region. Transitions are scheduled on the monotonic clock; what MAAS shows
(event times, last_sync) is wall-clock time derived from it, so a client comparing last_sync with
its own clock sees sensible values. Scenario durations are simulated seconds; the time scale says
how many real seconds one of them takes (0.001 turns a 300 s commissioning into 0.3 s)."""

from __future__ import annotations

import datetime as dt
import time


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time scale must be positive")
        self.time_scale = time_scale
        self._mono0 = time.monotonic()
        self._wall0 = time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self, mono: float) -> float:
        return self._wall0 + (mono - self._mono0)

    def real_seconds(self, simulated_seconds: float) -> float:
        return simulated_seconds * self.time_scale


def format_datetime(wall: float, aware: bool) -> str:
    """Django's JSON encoder: milliseconds; a trailing Z when USE_TZ=True (MAAS >= 3.6)."""
    stamp = dt.datetime.fromtimestamp(wall, dt.UTC)
    text = stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}"
    return text + "Z" if aware else text


def format_event_time(wall: float) -> str:
    """The events API's `created`: "%a, %d %b. %Y %H:%M:%S" (region time, UTC here)."""
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%a, %d %b. %Y %H:%M:%S")
