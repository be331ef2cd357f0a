"""Opaque keyset cursors over (created_at, id), newest first."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import uuid

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
