"""OAuth 1.0 as the region checks it (maasserver/api/auth.py over piston3's oauth server).

An API key is `consumer_key:token_key:token_secret` with an empty consumer secret. A request that
carries all the OAuth parameters is checked, in this order: version, consumer, token, timestamp
(older than 300 s is refused), nonce (single use, stored before the signature is checked),
signature method, signature; any failure is a 401 and the request is not downgraded to anonymous.
A request without them (or with only some) is anonymous.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote

from sim.maas.errors import ApiError, unauthorized

REQUIRED = (
    "oauth_consumer_key",
    "oauth_token",
    "oauth_signature",
    "oauth_signature_method",
    "oauth_timestamp",
    "oauth_nonce",
)
TIMESTAMP_THRESHOLD = 300
SIGNATURE_METHODS = ("PLAINTEXT", "HMAC-SHA1")
_PARAM = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


@dataclass(frozen=True)
class ApiKey:
    consumer_key: str
    token_key: str
    token_secret: str

    @classmethod
    def parse(cls, text: str) -> ApiKey:
        parts = text.strip().split(":")
        if len(parts) != 3 or not all(parts):
            raise ValueError("an API key is consumer_key:token_key:token_secret")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.consumer_key}:{self.token_key}:{self.token_secret}"


def parse_authorization(header: str | None) -> dict[str, str] | None:
    """The OAuth parameters of an `Authorization: OAuth k="v", ...` header, percent-decoded."""
    if not header or not header.strip().lower().startswith("oauth"):
        return None
    return {key: unquote(value) for key, value in _PARAM.findall(header)}


def _escape(text: str) -> str:
    return quote(text, safe="~")


def plaintext_signature(token_secret: str, consumer_secret: str = "") -> str:
    return f"{_escape(consumer_secret)}&{_escape(token_secret)}"


def hmac_base_string(method: str, url: str, params: Iterable[tuple[str, str]]) -> str:
    pairs = sorted((_escape(k), _escape(v)) for k, v in params if k != "oauth_signature")
    normalized = "&".join(f"{k}={v}" for k, v in pairs)
    return "&".join(_escape(part) for part in (method.upper(), url, normalized))


@dataclass
class RequestFacts:
    """What the HMAC-SHA1 check needs beyond the header."""

    method: str
    url: str  # scheme://host/path, no query
    params: list[tuple[str, str]]  # query + urlencoded form


@dataclass(frozen=True)
class User:
    username: str
    is_superuser: bool


class Authenticator:
    """Checks requests against the keys. The configured keys (the command line's) belong to the
    site's admin user, `username`; the control API may add other users, each with a key of its
    own (`add_user`), e.g. a non-admin whose key validates but may not call admin operations.
    Added users are forgotten on reset."""

    def __init__(
        self,
        keys: Iterable[ApiKey],
        username: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = list(keys)
        self.username = username
        self._clock = clock
        self._nonces: dict[tuple[str, str], dict[str, int]] = {}
        # (consumer_key, token_key) -> the added user that key belongs to
        self._added: dict[tuple[str, str], tuple[ApiKey, User]] = {}

    def add_user(self, username: str, *, is_superuser: bool) -> ApiKey:
        """A new user with a fresh API key (the key is what the answer shows, once)."""
        if not username or username == self.username or username in self.added_users():
            raise ValueError(f"user {username!r} exists already")
        key = ApiKey(uuid.uuid4().hex[:18], uuid.uuid4().hex[:18], uuid.uuid4().hex)
        self._added[(key.consumer_key, key.token_key)] = (key, User(username, is_superuser))
        return key

    def added_users(self) -> dict[str, User]:
        return {user.username: user for _, user in self._added.values()}

    def forget_users(self) -> None:
        self._added.clear()

    def user(self, username: str | None) -> User | None:
        """The user a request authenticated as (None: anonymous)."""
        if username is None:
            return None
        if username == self.username:
            return User(username, True)
        return self.added_users().get(username)

    def _all_keys(self) -> list[tuple[ApiKey, str]]:
        return [(k, self.username) for k in self.keys] + [
            (key, user.username) for key, user in self._added.values()
        ]

    def authenticate(self, header: str | None, facts: RequestFacts | None = None) -> str | None:
        """The user a request acts as; None for an anonymous request."""
        params = parse_authorization(header)
        if params is None or not all(key in params for key in REQUIRED):
            return None
        version = params.get("oauth_version")
        if version and version != "1.0":
            raise _oauth_error(f"OAuth version {version} not supported.")
        consumer = params["oauth_consumer_key"]
        keys = self._all_keys()
        if not any(k.consumer_key == consumer for k, _ in keys):
            raise unauthorized("Authorization Error: Invalid API key.")
        key, owner = next(
            (
                (k, name)
                for k, name in keys
                if k.consumer_key == consumer and k.token_key == params["oauth_token"]
            ),
            (None, ""),
        )
        if key is None:
            raise _oauth_error(f"Invalid access token: {params['oauth_token']}")
        try:
            timestamp = int(params["oauth_timestamp"])
        except ValueError:
            raise ApiError(400, "Invalid oauth_timestamp: it must be an integer.") from None
        now = int(self._clock())
        if now - timestamp > TIMESTAMP_THRESHOLD:
            raise _oauth_error(
                f"Expired timestamp: given {timestamp} and now {now} has a greater difference "
                f"than threshold {TIMESTAMP_THRESHOLD}"
            )
        self._check_nonce(key, params["oauth_nonce"], now)
        method = params["oauth_signature_method"]
        if method not in SIGNATURE_METHODS:
            raise _oauth_error(
                f"Signature method {method} not supported try one of the following: "
                f"{', '.join(SIGNATURE_METHODS)}"
            )
        if method == "PLAINTEXT":
            expected = plaintext_signature(key.token_secret)
            if not hmac.compare_digest(params["oauth_signature"], expected):
                # Real MAAS echoes the expected PLAINTEXT "base string" here.
                raise _oauth_error(f"Invalid signature. Expected signature base string: {expected}")
        else:
            self._check_hmac(key, params, facts)
        return owner

    def _check_nonce(self, key: ApiKey, nonce: str, now: int) -> None:
        seen = self._nonces.setdefault((key.consumer_key, key.token_key), {})
        for old, stamp in list(seen.items()):  # the region's nonces_cleanup, inline
            if now - stamp > 2 * TIMESTAMP_THRESHOLD:
                del seen[old]
        if nonce in seen:
            raise _oauth_error(f"Nonce already used: {nonce}")
        seen[nonce] = now

    def _check_hmac(self, key: ApiKey, params: dict[str, str], facts: RequestFacts | None) -> None:
        if facts is None:
            raise _oauth_error("Invalid signature. Expected signature base string: ")
        oauth_params = [(k, v) for k, v in params.items() if k.startswith("oauth_")]
        base = hmac_base_string(facts.method, facts.url, [*facts.params, *oauth_params])
        secret = plaintext_signature(key.token_secret).encode()
        expected = base64.b64encode(hmac.new(secret, base.encode(), hashlib.sha1).digest()).decode()
        if not hmac.compare_digest(params["oauth_signature"], expected):
            raise _oauth_error(f"Invalid signature. Expected signature base string: {base}")

    def forget_nonces(self) -> None:
        self._nonces.clear()


def _oauth_error(message: str) -> ApiError:
    """OAuthUnauthorized: "Authorization Error: %r" % message."""
    return unauthorized(f"Authorization Error: {message!r}")


def oauth_header(
    api_key: str | ApiKey, nonce: str | None = None, timestamp: int | None = None
) -> str:
    """A PLAINTEXT Authorization header for `api_key`, as python-libmaas/oauthlib build it."""
    key = api_key if isinstance(api_key, ApiKey) else ApiKey.parse(api_key)
    values = {
        "oauth_version": "1.0",
        "oauth_signature_method": "PLAINTEXT",
        "oauth_consumer_key": key.consumer_key,
        "oauth_token": key.token_key,
        "oauth_signature": plaintext_signature(key.token_secret),
        "oauth_nonce": nonce or uuid.uuid4().hex,
        "oauth_timestamp": str(timestamp if timestamp is not None else int(time.time())),
    }
    return "OAuth " + ", ".join(f'{k}="{_escape(v)}"' for k, v in values.items())
