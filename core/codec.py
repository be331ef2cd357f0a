"""AES-GCM payload codec: workflow and activity payloads (SSH keys, host specs) are encrypted
before they reach Temporal, so history never holds plaintext secrets.

Each encrypted payload keeps the key id in its metadata so keys can be rotated: payloads written
with an older key stay readable as long as that key is still configured.

Two kinds of key, so that one compromised node reads nothing but its own payloads:

- The cluster key (GPUCLOUD_CODEC_KEY) stays on the control plane (worker, gateway, replayer).
- Each node's key is derived from it (HKDF-SHA256, info naming the node). A node gets its own at
  enrollment and holds nothing else. Payloads bound for a node (the inputs of an activity on its
  `node-{id}` queue) and everything the node's agent writes (results, heartbeat details,
  failures, the signals it sends) are encrypted with that node's key; their metadata names the
  node (`encryption-node`), so the control plane derives the key from metadata alone and decodes
  any node's payloads, while a node's key opens no other node's payloads and no cluster-key ones.

`AesGcmPayloadCodec` is the control plane's codec (it picks the key from Temporal's
serialization context: the node's for an activity on a node queue, the cluster key otherwise);
`NodePayloadCodec` is the agent's.
"""

from __future__ import annotations

import copy
import hashlib
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Self

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec, SerializationContext, WithSerializationContext

from core.task_queues import node_task_queue

ENCODING = b"binary/encrypted-aesgcm"
KEY_ID_METADATA = "encryption-key-id"
# Which node's derived key sealed the payload (absent: the cluster key or an old one).
NODE_METADATA = "encryption-node"
NODE_KEY_INFO = b"gpucloud-node-payload:"
NODE_KEY_BYTES = 32
_NONCE_BYTES = 12
_NODE_QUEUE_PREFIX = node_task_queue("")
# Derived keys kept per codec; a fleet's worth, dropped all at once past this (rederiving is
# cheap, a few microseconds of HKDF).
_MAX_CACHED_NODES = 20_000


def key_id(key: bytes) -> str:
    """A short, non-reversible name for a key, stored beside each ciphertext."""
    return hashlib.sha256(b"gpucloud-codec-key-id:" + key).hexdigest()[:16]


def canonical_node_id(node_id: uuid.UUID | str) -> str:
    """The one spelling of a node id that keys are derived for (lower-case UUID)."""
    return str(node_id if isinstance(node_id, uuid.UUID) else uuid.UUID(node_id))


def node_payload_key(cluster_key: bytes, node_id: uuid.UUID | str) -> bytes:
    """The node's payload key: HKDF-SHA256 of the cluster key with the node in its info, so
    each node's key is independent of every other's and reveals nothing of the cluster key."""
    info = NODE_KEY_INFO + canonical_node_id(node_id).encode()
    hkdf = HKDF(algorithm=hashes.SHA256(), length=NODE_KEY_BYTES, salt=None, info=info)
    return hkdf.derive(cluster_key)


def node_of_task_queue(task_queue: str | None) -> str | None:
    """The node whose queue `task_queue` is (core.task_queues.node_task_queue), else None."""
    if not task_queue or not task_queue.startswith(_NODE_QUEUE_PREFIX):
        return None
    try:
        node_id = canonical_node_id(task_queue.removeprefix(_NODE_QUEUE_PREFIX))
    except ValueError:
        return None
    return node_id if node_task_queue(node_id) == task_queue else None


def node_of_context(context: SerializationContext) -> str | None:
    """The node a payload is bound for: an activity (not a local one) on a node's queue. Read by
    attribute, not by type: the workflow sandbox hands back contexts built inside it."""
    if getattr(context, "is_local", False):
        return None
    return node_of_task_queue(getattr(context, "activity_task_queue", None))


class _Sealer:
    """One key: encrypts under it and names it (and its node) in the payload's metadata."""

    def __init__(self, key: bytes, node_id: str | None = None) -> None:
        self.key_id = key_id(key)
        self.aead = AESGCM(key)
        metadata = {"encoding": ENCODING, KEY_ID_METADATA: self.key_id.encode()}
        if node_id is not None:
            metadata[NODE_METADATA] = node_id.encode()
        self._metadata: Mapping[str, bytes] = metadata

    def seal(self, payload: Payload) -> Payload:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self.aead.encrypt(nonce, payload.SerializeToString(), None)
        return Payload(metadata=dict(self._metadata), data=nonce + sealed)


def _open(aead: AESGCM, payload: Payload) -> Payload:
    nonce, sealed = payload.data[:_NONCE_BYTES], payload.data[_NONCE_BYTES:]
    decoded = Payload()
    decoded.ParseFromString(aead.decrypt(nonce, sealed, None))
    return decoded


def _key_id_of(payload: Payload) -> str:
    return payload.metadata.get(KEY_ID_METADATA, b"").decode()


class _ClusterKeyring:
    """The cluster key, the old ones still decoded, and the node keys derived from each."""

    def __init__(self, key: bytes, old_keys: Iterable[bytes]) -> None:
        self.keys = (key, *old_keys)
        self.cluster = _Sealer(key)
        self.by_id = {key_id(k): AESGCM(k) for k in self.keys}
        self._node_sealers: dict[str, _Sealer] = {}
        self._node_openers: dict[str, dict[str, AESGCM]] = {}

    def node_sealer(self, node_id: str) -> _Sealer:
        sealer = self._node_sealers.get(node_id)
        if sealer is None:
            if len(self._node_sealers) >= _MAX_CACHED_NODES:
                self._node_sealers.clear()
            sealer = _Sealer(node_payload_key(self.keys[0], node_id), node_id)
            self._node_sealers[node_id] = sealer
        return sealer

    def node_openers(self, node_id: str) -> dict[str, AESGCM]:
        """The node's keys derived from the current and each old cluster key, by key id (a node
        enrolled before a rotation still writes with its key from the old one)."""
        openers = self._node_openers.get(node_id)
        if openers is None:
            if len(self._node_openers) >= _MAX_CACHED_NODES:
                self._node_openers.clear()
            derived = [node_payload_key(k, node_id) for k in self.keys]
            openers = {key_id(k): AESGCM(k) for k in derived}
            self._node_openers[node_id] = openers
        return openers


class AesGcmPayloadCodec(PayloadCodec, WithSerializationContext):
    """The control plane's codec: it holds the cluster key (and old ones). It encrypts payloads
    bound for a node with that node's derived key when Temporal's serialization context says
    so (an activity on `node-{id}`), everything else with the cluster key; it decrypts both."""

    def __init__(self, key: bytes, old_keys: Iterable[bytes] = ()) -> None:
        self._keyring = _ClusterKeyring(key, old_keys)
        self._sealer = self._keyring.cluster

    def with_context(self, context: SerializationContext) -> Self:
        node_id = node_of_context(context)
        codec = copy.copy(self)  # shares the keyring and its cache of derived keys
        codec._sealer = (
            self._keyring.node_sealer(node_id) if node_id is not None else self._keyring.cluster
        )
        return codec

    def for_node(self, node_id: str) -> AesGcmPayloadCodec:
        """This codec encrypting as for payloads bound for `node_id`."""
        codec = copy.copy(self)
        codec._sealer = self._keyring.node_sealer(canonical_node_id(node_id))
        return codec

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encode_one(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decode_one(p) for p in payloads]

    def encode_one(self, payload: Payload) -> Payload:
        return self._sealer.seal(payload)

    def decode_one(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        kid = _key_id_of(payload)
        aead = self._keyring.by_id.get(kid)
        node = payload.metadata.get(NODE_METADATA)
        if aead is None and node is not None:
            try:
                node_id = canonical_node_id(node.decode())
            except (UnicodeDecodeError, ValueError):
                raise ValueError(f"payload names a malformed node {node!r}") from None
            aead = self._keyring.node_openers(node_id).get(kid)
        if aead is None:
            raise ValueError(f"payload encrypted with unknown key id {kid!r}")
        return _open(aead, payload)


class NodePayloadCodec(PayloadCodec):
    """A node agent's codec: it holds only its node's derived key, encrypts everything with it
    and decrypts only payloads sealed with it (its own tasks' inputs, its own heartbeats)."""

    def __init__(self, node_key: bytes, node_id: str) -> None:
        self.node_id = canonical_node_id(node_id)
        self._sealer = _Sealer(node_key, self.node_id)

    @property
    def key_id(self) -> str:
        return self._sealer.key_id

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self._sealer.seal(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decode_one(p) for p in payloads]

    def decode_one(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        kid = _key_id_of(payload)
        if kid != self._sealer.key_id:
            raise ValueError(
                f"payload encrypted with key id {kid!r}, not this node's ({self._sealer.key_id})"
            )
        return _open(self._sealer.aead, payload)
