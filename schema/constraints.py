"""Which constraint a failed write violated, for the writers that turn a unique index into an
answer (a 409) instead of an error."""

from __future__ import annotations

import sqlalchemy.exc


def constraint_name(err: sqlalchemy.exc.IntegrityError) -> str | None:
    """The violated constraint, from asyncpg's error under SQLAlchemy's wrapper."""
    for candidate in (err.orig, getattr(err.orig, "__cause__", None)):
        name = getattr(candidate, "constraint_name", None)
        if isinstance(name, str):
            return name
    return None
