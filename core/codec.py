"""AES-GCM payload codec: workflow and activity payloads (SSH keys, host specs) are encrypted
before they reach Temporal, so history never holds plaintext secrets.

Each encrypted payload keeps the key id in its metadata so keys can be rotated: payloads written
with an older key stay readable as long as that key is still configured.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

ENCODING = b"binary/encrypted-aesgcm"
_NONCE_BYTES = 12


def key_id(key: bytes) -> str:
    """A short, non-reversible name for a key, stored beside each ciphertext."""
    return hashlib.sha256(b"gpucloud-codec-key-id:" + key).hexdigest()[:16]


class AesGcmPayloadCodec(PayloadCodec):
    def __init__(self, key: bytes, old_keys: Iterable[bytes] = ()) -> None:
        self._key_id = key_id(key)
        self._aead = AESGCM(key)
        self._by_id = {key_id(k): AESGCM(k) for k in (key, *old_keys)}

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encode_one(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decode_one(p) for p in payloads]

    def encode_one(self, payload: Payload) -> Payload:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, payload.SerializeToString(), None)
        return Payload(
            metadata={"encoding": ENCODING, "encryption-key-id": self._key_id.encode()},
            data=nonce + sealed,
        )

    def decode_one(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        kid = payload.metadata.get("encryption-key-id", b"").decode()
        aead = self._by_id.get(kid)
        if aead is None:
            raise ValueError(f"payload encrypted with unknown key id {kid!r}")
        nonce, sealed = payload.data[:_NONCE_BYTES], payload.data[_NONCE_BYTES:]
        decoded = Payload()
        decoded.ParseFromString(aead.decrypt(nonce, sealed, None))
        return decoded
