"""Requests as the region's handlers see them: query parameters and form data as multi-valued
dicts (repeated keys are lists), parsed from `application/x-www-form-urlencoded` or
`multipart/form-data` bodies. Any other body (JSON included) leaves the form empty, as Piston's
Mimer does to request.POST."""

from __future__ import annotations

import email.parser
import email.policy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import msgspec

from sim.maas.errors import JSON, TEXT, field_errors

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off", ""})


@dataclass
class Params:
    data: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, str]]) -> Params:
        data: dict[str, list[str]] = {}
        for key, value in pairs:
            data.setdefault(key, []).append(value)
        return cls(data)

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def get(self, key: str, default: str | None = None) -> str | None:
        """The last value, as Django's QueryDict.get."""
        values = self.data.get(key)
        return values[-1] if values else default

    def getlist(self, key: str) -> list[str]:
        return list(self.data.get(key, []))

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.get(key)
        if value is None:
            return default
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise field_errors({key: f"'{value}' is not a valid boolean."})

    def int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise field_errors({key: "Enter a whole number."}) from None


@dataclass
class Request:
    method: str
    path: str
    query: Params
    form: Params
    headers: dict[str, str]  # lower-case names

    @property
    def params(self) -> Params:
        """Where a handler reads its arguments: the query for GET, the body otherwise."""
        return self.query if self.method in ("GET", "HEAD") else self.form


def parse_form(content_type: str, body: bytes) -> Params:
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        return Params.from_pairs(parse_qsl(body.decode(errors="replace"), keep_blank_values=True))
    if kind == "multipart/form-data":
        return _parse_multipart(content_type, body)
    return Params()


def _parse_multipart(content_type: str, body: bytes) -> Params:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    pairs: list[tuple[str, str]] = []
    if not message.is_multipart():
        return Params()
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        pairs.append((name, data.decode(errors="replace")))
    return Params.from_pairs(pairs)


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        # msgspec: a 20,000-machine list is ~240 MB of JSON, which json.dumps took seconds to
        # write (bench/reconciler.py); the same JSON, without the spaces after separators.
        return cls(status, msgspec.json.encode(value), JSON)

    @classmethod
    def text(cls, text: str, status: int = 200) -> Response:
        return cls(status, text.encode(), TEXT)
