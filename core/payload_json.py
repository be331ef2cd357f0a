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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from temporalio.api.common.v1 import Payload
from temporalio.converter import (
    CompositePayloadConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)

_encoder = msgspec.json.Encoder()


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
                return msgspec.json.decode(payload.data, type=type_hint)
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
