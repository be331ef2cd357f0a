"""Strict decoding of JSON request bodies, before anything is stored or any workflow called.

Litestar converts a handler's `data` with msgspec in its lax mode (`"1"` becomes 1, `"true"`
becomes True). The gateway's request class decodes the body itself first, once, with these rules:

- the body is UTF-8 JSON (else 400 `malformed_json`), nested at most `MAX_JSON_DEPTH` levels
  (else 400 `json_too_deep`); its size is bounded by Litestar's `request_max_body_size`
  (`Settings.max_request_body_bytes`, 413 `payload_too_large`);
- it decodes *strictly* into the handler's `data` type: no type coercion (400 `invalid_request`
  naming the field, as Litestar's own validation errors);
- a string outside `gateway.schemas.Text` (NUL, other control characters, lone surrogates) is
  422 `invalid_text` naming the field: such a string could not be stored in PostgreSQL.

A refusal is an ApiError: the exception handler answers it and logs one line, no traceback.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import msgspec
from litestar import Request
from litestar.types import Empty

from gateway.errors import FieldError, InvalidRequest, unprocessable
from gateway.schemas import BAD_TEXT, MAX_JSON_DEPTH, TEXT_PATTERN

_MSGSPEC_LOCATION = re.compile(r" - at `\$\.?(?P<key>[^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `(?P<key>[^`]+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<key>[^`]+)`")


def _malformed(message: str, code: str = "malformed_json") -> InvalidRequest:
    return InvalidRequest(
        message, code=code, details={"errors": [{"source": "body", "message": message}]}
    )


def _depth(value: Any, limit: int) -> int:
    """How deep `value` nests (a scalar is 0), counting no further than `limit` + 1."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        current, level = todo.pop()
        if isinstance(current, dict):
            children: Any = current.values()
        elif isinstance(current, list):
            children = current
        else:
            continue
        deepest = max(deepest, level)
        if level > limit:
            return level
        todo.extend((child, level + 1) for child in children)
    return deepest


def decode_body(raw: bytes) -> Any:
    """The body as plain JSON values, or 400 malformed_json / json_too_deep."""
    try:
        value = msgspec.json.decode(raw or b"null")
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise _malformed("the request body is not valid UTF-8 JSON") from None
    except RecursionError:
        raise _malformed(
            f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "json_too_deep"
        ) from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise _malformed(
            f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "json_too_deep"
        )
    return value


def _bad_text_key(value: Any) -> str | None:
    """The path (`members[0].sku`) of the first string, key or value, outside Text."""
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        current, path = todo.pop()
        if isinstance(current, str):
            if BAD_TEXT.search(current):
                return path
        elif isinstance(current, dict):
            for key, child in current.items():
                child_path = f"{path}.{key}" if path else str(key)
                if BAD_TEXT.search(key):
                    return path or "(key)"
                todo.append((child, child_path))
        elif isinstance(current, list):
            todo.extend((child, f"{path}[{i}]") for i, child in enumerate(current))
    return None


def invalid_text(key: str) -> Exception:
    """422 invalid_text naming the field."""
    name = key or "the body"
    return unprocessable(
        [
            FieldError(
                key,
                "invalid_text",
                f"{name} holds a NUL, another control character or a lone surrogate",
            )
        ]
    )


@lru_cache(maxsize=512)
def _decoder(annotation: Any) -> msgspec.json.Decoder[Any] | None:
    try:
        return msgspec.json.Decoder(annotation, strict=True)
    except TypeError:  # not a type msgspec knows: Litestar's own conversion still applies
        return None


def _field_error(message: str) -> tuple[str, str]:
    """(key, message) of a msgspec validation error: 'Expected `int`, got `str` - at `$.gpus`'."""
    key = ""
    if match := _MSGSPEC_LOCATION.search(message):
        key = match.group("key")
        message = message[: match.start()]
    for pattern in (_MISSING_FIELD, _UNKNOWN_FIELD):
        if found := pattern.search(message):
            key = f"{key}.{found.group('key')}" if key else found.group("key")
    return key, message


def check_strictly(raw: bytes, annotation: Any) -> None:
    """Refuse a body that only a lax conversion would accept into `annotation`."""
    decoder = _decoder(annotation)
    if decoder is None:
        return
    try:
        decoder.decode(raw or b"null")
    except msgspec.ValidationError as err:
        key, message = _field_error(str(err))
        if repr(TEXT_PATTERN) in message:
            raise invalid_text(key) from None
        errors = [{"key": key, "source": "body", "message": message}]
        raise InvalidRequest(
            "the request is malformed or failed validation", details={"errors": errors}
        ) from None


def data_annotation(request: Request[Any, Any, Any]) -> Any:
    """The type of the route handler's `data` parameter, or None when it takes none."""
    try:
        parameter = request.route_handler.parsed_fn_signature.parameters.get("data")
    except Exception:
        return None
    return None if parameter is None else parameter.annotation


class StrictRequest(Request[Any, Any, Any]):
    """Litestar's Request whose `json()` decodes as the module docstring says."""

    async def json(self) -> Any:
        state = self._connection_state
        if state.json is not Empty:
            return state.json
        raw = await self.body()
        value = decode_body(raw)
        if (bad := _bad_text_key(value)) is not None:
            raise invalid_text(bad)
        annotation = data_annotation(self)
        if annotation is not None:
            check_strictly(raw, annotation)
        state.json = value
        return value
