"""The admin's browser session cookies: Temporal Web calls the codec endpoint from the browser and
cannot send our bearer token, so an admin trades the token for a short-lived cookie. Two cookies
share the scheme, each signed with a key of its own so neither passes for the other: the codec
cookie (POST /api/v1/admin/codec/session, scoped to the codec endpoint) and the operator
console's (gateway/console/, path `/`: it opens the console and the codec endpoint, so Temporal
Web opened from the console decodes payloads).

The cookie value is `v1.<token id>.<expiry unix seconds>.<HMAC-SHA256>`: never the token itself.
Each use re-checks the token row, so revoking the token ends its sessions at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import uuid

COOKIE_NAME = "gpucloud_codec_session"
COOKIE_PATH = "/api/v1/admin/codec"
CONSOLE_COOKIE_NAME = "gpucloud_console_session"
CONSOLE_COOKIE_PATH = "/"
_VERSION = "v1"


def signing_key(codec_key: bytes) -> bytes:
    """A key of its own, derived from the codec key (never the codec key itself)."""
    return hmac.new(codec_key, b"gpucloud codec session cookie v1", hashlib.sha256).digest()


def console_signing_key(codec_key: bytes) -> bytes:
    """The console cookie's key: derived like the codec cookie's, for another purpose."""
    return hmac.new(codec_key, b"gpucloud console session cookie v1", hashlib.sha256).digest()


def csrf_token(key: bytes, cookie_value: str) -> str:
    """The console forms' anti-forgery token: bound to one session cookie, so a page of another
    origin (which cannot read the HttpOnly cookie) cannot compute it."""
    return _mac(key, f"csrf.{cookie_value}")


def _mac(key: bytes, message: str) -> str:
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def issue(
    key: bytes, token_id: uuid.UUID, ttl_seconds: int, *, now: float | None = None
) -> tuple[str, int]:
    expires = int((time.time() if now is None else now) + ttl_seconds)
    message = f"{_VERSION}.{token_id}.{expires}"
    return f"{message}.{_mac(key, message)}", expires


def verify(key: bytes, value: str, *, now: float | None = None) -> uuid.UUID | None:
    """The token id of a valid, unexpired cookie, else None."""
    parts = value.split(".")
    if len(parts) != 4 or parts[0] != _VERSION:
        return None
    message = ".".join(parts[:3])
    if not hmac.compare_digest(_mac(key, message), parts[3]):
        return None
    try:
        token_id = uuid.UUID(parts[1])
        expires = int(parts[2])
    except ValueError:
        return None
    if expires <= (time.time() if now is None else now):
        return None
    return token_id
