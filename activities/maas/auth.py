"""MAAS API keys and the OAuth 1.0 PLAINTEXT header MAAS authenticates with.

A key is `consumer_key:token_key:token_secret` (the consumer secret is empty). MAAS accepts each
nonce once per consumer/token and rejects timestamps older than 300 s, so the header is built
per request (a retry included) with a fresh nonce and the current time.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import quote

KEY_PARTS = ("consumer_key", "token_key", "token_secret")


@dataclass(frozen=True)
class MaasApiKey:
    consumer_key: str
    token_key: str = field(repr=False)
    token_secret: str = field(repr=False)

    def secrets(self) -> tuple[str, ...]:
        """Every part of the key: MAAS's 401 bodies may echo the token key or the expected
        signature, so error messages are scrubbed of all three."""
        return (self.consumer_key, self.token_key, self.token_secret)


def parse_api_key(raw: str) -> MaasApiKey:
    """Validate the shape of a MAAS API key. Error messages describe the problem without
    quoting any of the key."""
    if not isinstance(raw, str):
        raise TypeError("MAAS API key must be a string")
    parts = raw.strip().split(":")
    if len(parts) != len(KEY_PARTS):
        raise ValueError(
            "MAAS API key must have the form consumer_key:token_key:token_secret "
            f"(found {len(parts)} colon-separated part(s), expected 3)"
        )
    for name, part in zip(KEY_PARTS, parts, strict=True):
        if not part:
            raise ValueError(f"MAAS API key has an empty {name}")
        if not part.isascii() or not part.isprintable() or any(c.isspace() for c in part):
            raise ValueError(f"MAAS API key's {name} may only hold printable ASCII without spaces")
    return MaasApiKey(*parts)


def _escape(value: str) -> str:
    # RFC 5849 §3.6 percent-encoding, as oauthlib does it: only unreserved characters stay.
    return quote(value, safe="~")


def oauth_header(key: MaasApiKey, *, nonce: str | None = None, timestamp: int | None = None) -> str:
    params = {
        "oauth_version": "1.0",
        "oauth_signature_method": "PLAINTEXT",
        "oauth_consumer_key": key.consumer_key,
        "oauth_token": key.token_key,
        # PLAINTEXT signature: consumer secret (empty) & token secret.
        "oauth_signature": f"&{key.token_secret}",
        "oauth_nonce": nonce if nonce is not None else secrets.token_hex(16),
        "oauth_timestamp": str(timestamp if timestamp is not None else int(time.time())),
    }
    return "OAuth " + ", ".join(f'{k}="{_escape(v)}"' for k, v in params.items())
