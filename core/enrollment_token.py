"""The shape of a node enrollment token: `gpe_` and 43 url-safe characters (256 random bits).
Only its SHA-256 is ever stored or sent to the worker; the plaintext exists in the answer to the
operator who asked for it, in the node's cloud-init and in the agent's one redemption call."""

from __future__ import annotations

import hashlib
import re
import secrets

PREFIX = "gpe_"
_TOKEN_RE = re.compile(r"^gpe_[A-Za-z0-9_-]{43}$")
DEFAULT_TTL_SECONDS = 7200  # docs/maas-sites.md#policy-knobs enrollment_token_ttl_seconds


def new_enrollment_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def hash_enrollment_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def is_well_formed(token: str) -> bool:
    return _TOKEN_RE.match(token) is not None
