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

Query, path and header parameters are checked as strictly, before the handler's own conversion
(`check_parameters`, the app's before_request hook; guards have run):

- a value outside Text (percent-encoded NUL, control characters, invalid UTF-8) is 422
  `invalid_text` naming the parameter; so is invalid UTF-8 anywhere in the path or the query
  string, in a parameter the route declares or not (`(path)`, or the query key);
- no coercion surprises: an integer is decimal digits (not `1e1` or `5.0`), a boolean is `true`
  or `false` (not `1`, `yes` or `True`), a parameter that is not a list appears at most once;
- a string is at most `MAX_PARAMETER_CHARS` (or its declared maxLength), a list at most
  `MAX_PARAMETER_ITEMS` values (400 `invalid_request` naming the parameter); gateway.openapi
  documents both.

A refusal is an ApiError: the exception handler answers it and logs one line, no traceback.
"""

from __future__ import annotations

import enum
import re
import types
import typing
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, Literal
from urllib.parse import unquote_to_bytes

import msgspec
from litestar import Request
from litestar.constants import RESERVED_KWARGS
from litestar.handlers import HTTPRouteHandler
from litestar.params import CookieParameter, HeaderParameter, ParameterKwarg, QueryParameter
from litestar.types import Empty

from gateway.errors import FieldError, InvalidRequest, unprocessable
from gateway.schemas import (
    BAD_TEXT,
    MAX_JSON_DEPTH,
    MAX_PARAMETER_CHARS,
    MAX_PARAMETER_ITEMS,
    TEXT_PATTERN,
)

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


def invalid_text(key: str, source: str = "body") -> Exception:
    """422 invalid_text naming the field (or the query, path or header parameter)."""
    name = key or "the body"
    return unprocessable(
        [
            FieldError(
                key,
                "invalid_text",
                f"{name} holds a NUL, another control character, a lone surrogate or invalid UTF-8",
                source=source,
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


# --- query, path and header parameters ---

_INTEGER: Final = re.compile(r"-?[0-9]{1,18}")
_BOOLEANS: Final = frozenset({"true", "false"})
# The handler's own parameters that are not request parameters.
_NOT_PARAMETERS: Final = RESERVED_KWARGS | {"receive", "send"}

Kind = Literal["text", "integer", "boolean", "other"]


@dataclass(frozen=True)
class ParameterSpec:
    """What `check_parameters` knows of one declared parameter."""

    name: str  # the handler's argument
    alias: str  # as the client spells it
    source: Literal["query", "path", "header"]
    kind: Kind
    repeated: bool  # a list: the query parameter may appear more than once
    max_chars: int


def _unwrap(annotation: Any) -> Any:
    """`Annotated[X | None, ...]` -> X."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _kind(annotation: Any) -> tuple[Kind, bool]:
    """(kind of each value, whether it is a list) of a parameter's type."""
    base = _unwrap(annotation)
    origin = typing.get_origin(base)
    if origin in (list, tuple, set, frozenset, Sequence):
        args = typing.get_args(base)
        return (_kind(args[0])[0] if args else "other"), True
    if base is bool:
        return "boolean", False
    if base is int:
        return "integer", False
    if base is str or origin is Literal or (isinstance(base, type) and issubclass(base, enum.Enum)):
        return "text", False
    if base is uuid.UUID:
        return "other", False
    return "other", False


def parameter_specs(handler: HTTPRouteHandler, path_names: frozenset[str]) -> list[ParameterSpec]:
    """The query, path and header parameters `handler` declares."""
    dependencies = set(handler.resolve_dependencies())
    specs = []
    for name, field in handler.parsed_fn_signature.parameters.items():
        if name in _NOT_PARAMETERS or name in dependencies:
            continue
        kwarg = field.kwarg_definition
        if kwarg is not None and not isinstance(kwarg, ParameterKwarg):
            continue  # a body or a dependency
        if isinstance(kwarg, CookieParameter) or (
            isinstance(kwarg, ParameterKwarg) and kwarg.cookie
        ):
            continue
        kind, repeated = _kind(field.annotation)
        declared = kwarg.max_length if isinstance(kwarg, ParameterKwarg) else None
        max_chars = min(declared or MAX_PARAMETER_CHARS, MAX_PARAMETER_CHARS)
        source: Literal["query", "path", "header"]
        named = kwarg.name if isinstance(kwarg, ParameterKwarg) else None
        if isinstance(kwarg, HeaderParameter) or (
            isinstance(kwarg, ParameterKwarg) and kwarg.header
        ):
            source, alias = "header", (named or (kwarg.header if kwarg else None) or name)
        elif name in path_names:
            source, alias = "path", name
        else:
            source = "query"
            if isinstance(kwarg, QueryParameter):
                alias = named or kwarg.query or name
            else:
                alias = (kwarg.query if isinstance(kwarg, ParameterKwarg) else None) or name
        specs.append(ParameterSpec(name, alias, source, kind, repeated, max_chars))
    return specs


_SPECS: dict[int, tuple[HTTPRouteHandler, list[ParameterSpec]]] = {}


def _specs_of(request: Request[Any, Any, Any]) -> list[ParameterSpec]:
    handler = request.route_handler
    cached = _SPECS.get(id(handler))
    if cached is None or cached[0] is not handler:
        paths = frozenset(p for path in handler.paths for p in re.findall(r"{(\w+)", path))
        cached = _SPECS[id(handler)] = (handler, parameter_specs(handler, paths))
    return cached[1]


def _query_values(query_string: bytes) -> dict[str | None, list[str | None]]:
    """Each query key's values as sent, percent-decoded as UTF-8; None for a value, or a key,
    that is not UTF-8 (the framework would have turned it into U+FFFD)."""
    values: dict[str | None, list[str | None]] = {}
    for pair in query_string.split(b"&"):
        if not pair:
            continue
        raw_key, _, raw_value = pair.partition(b"=")
        try:
            key: str | None = unquote_to_bytes(raw_key.replace(b"+", b" ")).decode()
        except UnicodeDecodeError:
            key = None  # no declared parameter is spelled so
        try:
            value: str | None = unquote_to_bytes(raw_value.replace(b"+", b" ")).decode()
        except UnicodeDecodeError:
            value = None
        values.setdefault(key, []).append(value)
    return values


def _refuse(spec: ParameterSpec, message: str) -> InvalidRequest:
    errors = [{"key": spec.alias, "source": spec.source, "message": message}]
    return InvalidRequest(
        "the request is malformed or failed validation", details={"errors": errors}
    )


def _check_value(spec: ParameterSpec, value: str | None) -> None:
    if value is None or BAD_TEXT.search(value):
        raise invalid_text(spec.alias, spec.source)
    if len(value) > spec.max_chars:
        raise _refuse(spec, f"{spec.alias} is longer than {spec.max_chars} characters")
    if spec.kind == "integer" and not _INTEGER.fullmatch(value):
        raise _refuse(spec, f"{spec.alias} must be a decimal integer")
    if spec.kind == "boolean" and value not in _BOOLEANS:
        raise _refuse(spec, f"{spec.alias} must be true or false")


def _check_utf8(scope: Any) -> None:
    """The path and the whole query string, as sent, percent-decode to UTF-8, declared
    parameters or not (the server would have turned any other byte into U+FFFD silently)."""
    raw_path = scope.get("raw_path") or b""
    try:
        unquote_to_bytes(raw_path).decode()
    except UnicodeDecodeError:
        raise invalid_text("(path)", "path") from None
    for key, values in _query_values(scope.get("query_string", b"")).items():
        if key is None or None in values:
            raise invalid_text(key or "(key)", "query")


async def check_parameters(request: Request[Any, Any, Any]) -> None:
    """The app's before_request hook: the module docstring's rules for parameters."""
    _check_utf8(request.scope)
    specs = _specs_of(request)
    if not specs:
        return
    query: dict[str | None, list[str | None]] | None = None
    for spec in specs:
        if spec.source == "query":
            if query is None:
                query = _query_values(request.scope.get("query_string", b""))
            values = query.get(spec.alias, [])
            if len(values) > (MAX_PARAMETER_ITEMS if spec.repeated else 1):
                limit = f"at most {MAX_PARAMETER_ITEMS} times" if spec.repeated else "once"
                raise _refuse(spec, f"{spec.alias} may be given {limit}")
        elif spec.source == "header":
            values = list(request.headers.getall(spec.alias, []))
            if len(values) > 1:
                raise _refuse(spec, f"{spec.alias} may be given once")
        else:
            value = request.path_params.get(spec.name)
            values = [value] if isinstance(value, str) else []
        for value in values:
            _check_value(spec, value)
