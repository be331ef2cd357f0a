"""Timestamps cross Temporal as ISO-8601 strings inside our dataclasses; this reads them back."""

from __future__ import annotations

import datetime as dt


def parse_iso(value: str | None) -> dt.datetime | None:
    """The instant, timezone-aware (a naive value is taken as UTC); None when empty or invalid."""
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)
