"""The JSON payload converter every Temporal client and worker of ours uses (through
core.temporal.data_converter): the SDK's `json/plain` format, with dataclasses encoded and
decoded by msgspec.

Why: the SDK rebuilds a dataclass from JSON by resolving its type hints and walking them in
Python on every conversion. A `Placement` (the allocation's first activity's result) took about
220 µs to decode and 60 µs to encode that way, against 5 and 2 with msgspec, and the POST
/allocations path converts a dozen such payloads in the worker and the gateway: about a tenth
of the worker's CPU there.

Same wire format, so either side reads the other's payloads (and recorded histories replay):
JSON objects keyed by field name, enums by value. Keys come in field order rather than sorted,
which no reader depends on. Anything msgspec does not take (a value that is not a dataclass, a
type it cannot encode, a payload it would judge stricter than the SDK) goes the SDK's way.

Each dataclass type gets one `msgspec.json.Decoder`, built under a lock. That lock is what keeps
the worker alive: the SDK converts a workflow's payloads in its workflow-task threads, and
msgspec (0.22.0 and its source today) caches a dataclass's field table on the class *before*
filling it in, so a second thread decoding the same type for the first time can read the
half-built table and dereference a NULL field. That is the segfault the worker once died of
seconds after start (when the first activations of many workflows arrive at once);
tests/msgspec_first_decode_race.py reproduces it with plain `msgspec.json.decode`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import msgspec
from temporalio.api.common.v1 import Payload
from temporalio.converter import (
    CompositePayloadConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_decoders_built = threading.Lock()


def dataclass_decoder(type_hint: type) -> msgspec.json.Decoder[Any]:
    """The one decoder of `type_hint`; the first call builds msgspec's type tables (for this
    type and every type in its fields) while no other thread is building any."""
    decoder = _decoders.get(type_hint)
    if decoder is None:
        with _decoders_built:
            decoder = _decoders.get(type_hint)
            if decoder is None:
                decoder = _decoders[type_hint] = msgspec.json.Decoder(type_hint)
    return decoder


class DataclassJSONPayloadConverter(JSONPlainPayloadConverter):
    """`json/plain` with msgspec for dataclass values and dataclass type hints."""

    def to_payload(self, value: Any) -> Payload | None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            try:
                data = _encoder.encode(value)
            except (TypeError, msgspec.EncodeError):
                return super().to_payload(value)
            return Payload(metadata={"encoding": self.encoding.encode()}, data=data)
        return super().to_payload(value)

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        if isinstance(type_hint, type) and dataclasses.is_dataclass(type_hint):
            try:
                return dataclass_decoder(type_hint).decode(payload.data)
            except (msgspec.ValidationError, msgspec.DecodeError, TypeError):
                pass  # the SDK's own rules decide, and word the error if there is one
        return super().from_payload(payload, type_hint)


class PayloadConverter(CompositePayloadConverter):
    """The SDK's default converters, in its order, with DataclassJSONPayloadConverter in place
    of its JSON one."""

    def __init__(self) -> None:
        super().__init__(
            *(
                DataclassJSONPayloadConverter()
                if isinstance(converter, JSONPlainPayloadConverter)
                else converter
                for converter in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )
