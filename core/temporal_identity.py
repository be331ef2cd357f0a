"""Who is calling Temporal: a short-lived token signed by the control plane, which the Temporal
server we build (temporal-authz/) verifies and authorises each call by (docs/temporal.md,
"Identities and the Authorizer").

A token is `v1.<base64url(JSON claims)>.<base64url(Ed25519 signature of "v1.<claims>")>`, the
claims `{"sub": ..., "iat": ..., "exp": ...}` (Unix seconds) and the subject one of
`node:<uuid>`, `control-plane` or `operator`. A client sends it as `authorization: Bearer
<token>` (the SDK's `api_key`).

Why a signed token and not a client certificate: there is no CA to run (the server holds the
public key only, the private key stays with the control plane), a node renews through the
gateway it already talks to, and revocation is simply not renewing: a token outlives the
decision to revoke it by at most its TTL (TOKEN_TTL), with no revocation list to distribute.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

VERSION = "v1"
CONTROL_PLANE = "control-plane"
OPERATOR = "operator"
NODE_PREFIX = "node:"
# Short enough that a revoked node is locked out within minutes of its last renewal; long
# enough that a gateway hiccup of a few minutes does not cut a healthy agent off (it renews
# when a third of the TTL is left).
TOKEN_TTL_SECONDS = 15 * 60
# A token issued further in the future than this is refused (the server allows the same).
CLOCK_SKEW_SECONDS = 60


class InvalidToken(ValueError):
    """Malformed, not signed by a trusted key, expired, or naming no known subject."""


def node_subject(node_id: uuid.UUID | str) -> str:
    """The subject of a node's token: the canonical (lower-case) UUID, as the server expects."""
    return NODE_PREFIX + str(node_id if isinstance(node_id, uuid.UUID) else uuid.UUID(node_id))


@dataclass(frozen=True)
class TokenClaims:
    subject: str
    issued_at: int
    expires_at: int

    @property
    def node_id(self) -> str | None:
        return self.subject.removeprefix(NODE_PREFIX) if self.is_node else None

    @property
    def is_node(self) -> bool:
        return self.subject.startswith(NODE_PREFIX)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check_subject(subject: str) -> None:
    if subject in (CONTROL_PLANE, OPERATOR):
        return
    if subject.startswith(NODE_PREFIX):
        node = subject.removeprefix(NODE_PREFIX)
        try:
            if str(uuid.UUID(node)) == node:
                return
        except ValueError:
            pass
    raise InvalidToken(f"unknown subject {subject!r}")


def mint(
    key: Ed25519PrivateKey,
    subject: str,
    *,
    ttl_seconds: int = TOKEN_TTL_SECONDS,
    now: float | None = None,
) -> str:
    """A token for `subject` valid for `ttl_seconds` from `now`."""
    _check_subject(subject)
    issued = int(time.time() if now is None else now)
    claims = {"sub": subject, "iat": issued, "exp": issued + ttl_seconds}
    signed = f"{VERSION}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
    return f"{signed}.{_b64(key.sign(signed.encode()))}"


def verify(token: str, keys: list[Ed25519PublicKey], *, now: float | None = None) -> TokenClaims:
    """The claims of a token signed by any of `keys` and valid at `now`; InvalidToken else.
    The same checks as the server's ClaimMapper (temporal-authz/token.go)."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise InvalidToken("not a v1 token")
    signed = f"{parts[0]}.{parts[1]}".encode()
    try:
        signature = _unb64(parts[2])
    except ValueError as err:
        raise InvalidToken("malformed signature") from err
    for key in keys:
        try:
            key.verify(signature, signed)
            break
        except InvalidSignature:
            continue
    else:
        raise InvalidToken("not signed by a trusted key")
    try:
        claims = json.loads(_unb64(parts[1]))
        parsed = TokenClaims(str(claims["sub"]), int(claims["iat"]), int(claims["exp"]))
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidToken("malformed claims") from err
    at = time.time() if now is None else now
    if at >= parsed.expires_at:
        raise InvalidToken("expired")
    if parsed.issued_at > at + CLOCK_SKEW_SECONDS:
        raise InvalidToken("issued in the future")
    _check_subject(parsed.subject)
    return parsed


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public half as PEM (SubjectPublicKeyInfo), what the server's policy lists."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def load_public_key(pem: str) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem.encode())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")
    return key


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    """The signing key as unencrypted PKCS#8 PEM, for a file only the control plane reads."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 private key")
    return key
