"""Opaque keyset cursors over (a creation time, an id), and the newest-first page they walk."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import uuid
from typing import Any

from sqlalchemy import Select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from gateway.errors import InvalidRequest


def encode_cursor(created_at: dt.datetime, row_id: uuid.UUID) -> str:
    raw = json.dumps({"c": created_at.isoformat(), "i": str(row_id)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, uuid.UUID]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        created_at = dt.datetime.fromisoformat(data["c"])
        row_id = uuid.UUID(data["i"])
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise InvalidRequest(
            "the cursor is not one this API returned", details={"parameter": "cursor"}
        ) from err
    if created_at.tzinfo is None:
        raise InvalidRequest(
            "the cursor is not one this API returned", details={"parameter": "cursor"}
        )
    return created_at, row_id


async def newest_first_page(
    db: AsyncSession,
    query: Select[Any],
    *,
    created: InstrumentedAttribute[dt.datetime],
    row_id: InstrumentedAttribute[uuid.UUID],
    limit: int,
    cursor: str | None,
) -> tuple[list[Any], str | None]:
    """One page of `query`'s rows, newest first, after `cursor`; and the cursor of the next
    page, or None when this is the last. One row more than the page is read to know that."""
    if cursor:
        after_created, after_id = decode_cursor(cursor)
        query = query.where(tuple_(created, row_id) < (after_created, after_id))
    query = query.order_by(created.desc(), row_id.desc()).limit(limit + 1)
    rows = list((await db.scalars(query)).all())
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(getattr(last, created.key), getattr(last, row_id.key))
