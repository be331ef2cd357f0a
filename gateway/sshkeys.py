"""OpenSSH public-key validation and fingerprints.

A key line is `<type> <base64 blob> [comment]`. The blob is the SSH wire encoding whose first
string repeats the type; the rest is parsed per type and must be exactly consumed. Errors say what
is wrong in general terms and never quote the submitted text.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec

ED25519 = "ssh-ed25519"
RSA = "ssh-rsa"
ECDSA_P256 = "ecdsa-sha2-nistp256"
ECDSA_P384 = "ecdsa-sha2-nistp384"
ECDSA_P521 = "ecdsa-sha2-nistp521"
SK_ED25519 = "sk-ssh-ed25519@openssh.com"
SK_ECDSA_P256 = "sk-ecdsa-sha2-nistp256@openssh.com"

ALLOWED_TYPES = (ED25519, RSA, ECDSA_P256, ECDSA_P384, ECDSA_P521, SK_ED25519, SK_ECDSA_P256)

MIN_RSA_BITS = 2048
MAX_RSA_BITS = 16384
MAX_COMMENT_CHARS = 255

_CURVES: dict[str, ec.EllipticCurve] = {
    "nistp256": ec.SECP256R1(),
    "nistp384": ec.SECP384R1(),
    "nistp521": ec.SECP521R1(),
}
_BASE64_RE = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")
_PRIVATE_MARKERS = ("PRIVATE KEY", "BEGIN OPENSSH", "BEGIN SSH2 ENCRYPTED", "PuTTY-User-Key-File")


class SshKeyInvalid(ValueError):
    """The message is safe to return: it never contains the submitted key."""


@dataclass(frozen=True)
class ParsedKey:
    key_type: str
    blob: bytes
    comment: str
    fingerprint: str

    @property
    def openssh(self) -> str:
        """The normalised line that is stored (single spaces, no trailing whitespace)."""
        line = f"{self.key_type} {base64.b64encode(self.blob).decode()}"
        return f"{line} {self.comment}" if self.comment else line


def fingerprint(blob: bytes) -> str:
    """OpenSSH's `ssh-keygen -lf` format: SHA256: + unpadded base64 of sha256(blob)."""
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def string(self) -> bytes:
        if self._pos + 4 > len(self._data):
            raise SshKeyInvalid("the key data is truncated")
        (length,) = struct.unpack(">I", self._data[self._pos : self._pos + 4])
        self._pos += 4
        if length > len(self._data) - self._pos:
            raise SshKeyInvalid("the key data is truncated")
        value = self._data[self._pos : self._pos + length]
        self._pos += length
        return value

    def mpint(self) -> int:
        raw = self.string()
        if raw and raw[0] & 0x80:
            raise SshKeyInvalid("the key holds a negative number")
        return int.from_bytes(raw, "big")

    def done(self) -> None:
        if self._pos != len(self._data):
            raise SshKeyInvalid("the key data has trailing bytes")


def _check_ec_point(curve_name: str, point: bytes) -> None:
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(_CURVES[curve_name], point)
    except (ValueError, KeyError) as err:
        raise SshKeyInvalid("the ECDSA public point is not on its curve") from err


def _check_blob(key_type: str, blob: bytes) -> None:
    reader = _Reader(blob)
    try:
        embedded = reader.string().decode("ascii")
    except UnicodeDecodeError as err:
        raise SshKeyInvalid("the key data does not start with a key type") from err
    if embedded != key_type:
        raise SshKeyInvalid("the key type does not match the type inside the key data")
    if key_type in (ED25519, SK_ED25519):
        if len(reader.string()) != 32:
            raise SshKeyInvalid("an Ed25519 public key is 32 bytes")
    elif key_type == RSA:
        exponent = reader.mpint()
        modulus = reader.mpint()
        if exponent < 3 or exponent % 2 == 0:
            raise SshKeyInvalid("the RSA public exponent is invalid")
        bits = modulus.bit_length()
        if bits < MIN_RSA_BITS:
            raise SshKeyInvalid(f"RSA keys must be at least {MIN_RSA_BITS} bits")
        if bits > MAX_RSA_BITS:
            raise SshKeyInvalid(f"RSA keys may be at most {MAX_RSA_BITS} bits")
    else:  # ECDSA, plain or security-key
        expected_curve = key_type.removeprefix("sk-").removesuffix("@openssh.com").split("-")[-1]
        if reader.string() != expected_curve.encode():
            raise SshKeyInvalid("the ECDSA curve does not match the key type")
        _check_ec_point(expected_curve, reader.string())
    if key_type.startswith("sk-"):
        application = reader.string()
        if not application.startswith(b"ssh:"):
            raise SshKeyInvalid("a security-key public key needs an ssh: application")
    reader.done()


def parse_public_key(text: str) -> ParsedKey:
    """Validate one OpenSSH public key line, or raise SshKeyInvalid."""
    if any(marker in text for marker in _PRIVATE_MARKERS):
        raise SshKeyInvalid("this looks like a private key; upload the public key (the .pub file)")
    line = text.strip()
    if not line or "\n" in line or "\r" in line or "\x00" in line:
        raise SshKeyInvalid("expected exactly one line: '<type> <base64> [comment]'")
    fields = line.split(None, 2)
    if len(fields) < 2:
        raise SshKeyInvalid("expected '<type> <base64> [comment]'")
    key_type, encoded = fields[0], fields[1]
    comment = fields[2].strip() if len(fields) == 3 else ""
    if key_type not in ALLOWED_TYPES:
        raise SshKeyInvalid(
            "unsupported key type (authorized_keys options are not accepted); allowed: "
            + ", ".join(ALLOWED_TYPES)
        )
    if not _BASE64_RE.match(encoded):
        raise SshKeyInvalid("the key data is not base64")
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise SshKeyInvalid("the key data is not base64") from err
    _check_blob(key_type, blob)
    if len(comment) > MAX_COMMENT_CHARS or not comment.isprintable():
        raise SshKeyInvalid(f"the comment must be printable and at most {MAX_COMMENT_CHARS} chars")
    return ParsedKey(key_type=key_type, blob=blob, comment=comment, fingerprint=fingerprint(blob))
