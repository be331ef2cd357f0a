"""Temporal's remote codec protocol for Temporal Web and `temporal --codec-endpoint`:
POST {endpoint}/encode and {endpoint}/decode with {"payloads": [{"metadata": {k: base64},
"data": base64}]} (Payloads as proto3 JSON). Admin only: by bearer token, or by the short-lived
session cookie that POST /api/v1/admin/codec/session sets for the browser.

It decodes every payload of the cluster: those sealed with the cluster key (or an old one) and
those sealed with a node's derived key (their metadata names the node; core/codec.py). It
encodes with the cluster key."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
from typing import Any

from cryptography.exceptions import InvalidTag
from litestar import Controller, Request, Response, delete, post
from litestar.datastructures import Cookie
from litestar.di import NamedDependency
from litestar.params import JSONBody
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.api.common.v1 import Payload

from core.codec import AesGcmPayloadCodec
from gateway import audit, codec_session
from gateway.auth import Principal, admin_guard, codec_guard
from gateway.errors import InvalidRequest, Unprocessable
from gateway.openapi import errors
from gateway.runtime import Runtime
from gateway.schemas import CodecPayload, CodecPayloads, CodecSession

# Payloads can be large (Temporal allows 2 MiB each); the codec gets its own body limit.
CODEC_MAX_BODY_BYTES = 4 * 1024 * 1024
_URLSAFE = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def _b64(value: str, where: str) -> bytes:
    """proto3 JSON bytes: standard base64; the URL-safe alphabet is accepted too."""
    try:
        if _URLSAFE.fullmatch(value) and ("-" in value or "_" in value):
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidRequest("payload fields must be base64", details={"field": where}) from err


def _to_proto(payload: CodecPayload, index: int) -> Payload:
    return Payload(
        metadata={
            k: _b64(v, f"payloads[{index}].metadata.{k}") for k, v in payload.metadata.items()
        },
        data=_b64(payload.data, f"payloads[{index}].data"),
    )


def _from_proto(payload: Payload) -> CodecPayload:
    return CodecPayload(
        metadata={k: base64.b64encode(v).decode() for k, v in payload.metadata.items()},
        data=base64.b64encode(payload.data).decode(),
    )


def _codec(runtime: Runtime) -> AesGcmPayloadCodec:
    return AesGcmPayloadCodec(runtime.settings.codec_key, runtime.settings.codec_old_keys)


class CodecController(Controller):
    path = "/api/v1/admin/codec"
    tags = ["admin", "codec"]
    request_max_body_size = CODEC_MAX_BODY_BYTES

    @post(
        "/encode",
        guards=[codec_guard],
        status_code=200,
        summary="Encrypt payloads",
        responses=errors(400, 403, 413),
    )
    async def encode(
        self, data: JSONBody[CodecPayloads], runtime: NamedDependency[Runtime]
    ) -> CodecPayloads:
        payloads = [_to_proto(p, i) for i, p in enumerate(data.payloads)]
        encoded = await _codec(runtime).encode(payloads)
        return CodecPayloads(payloads=[_from_proto(p) for p in encoded])

    @post(
        "/decode",
        guards=[codec_guard],
        status_code=200,
        summary="Decrypt payloads",
        responses=errors(400, 403, 413, 422),
    )
    async def decode(
        self, data: JSONBody[CodecPayloads], runtime: NamedDependency[Runtime]
    ) -> CodecPayloads:
        payloads = [_to_proto(p, i) for i, p in enumerate(data.payloads)]
        try:
            decoded = await _codec(runtime).decode(payloads)
        except (InvalidTag, ValueError) as err:
            raise Unprocessable(
                "a payload could not be decrypted with the configured keys",
                code="payload_undecodable",
            ) from err
        return CodecPayloads(payloads=[_from_proto(p) for p in decoded])

    @post(
        "/session",
        guards=[admin_guard],
        status_code=200,
        summary="Trade the bearer token for a short-lived codec cookie (for Temporal Web)",
        responses=errors(403),
    )
    async def create_session(
        self,
        runtime: NamedDependency[Runtime],
        principal: NamedDependency[Principal],
        request: Request[Any, Any, Any],
        db: NamedDependency[AsyncSession],
    ) -> Response[CodecSession]:
        key = codec_session.signing_key(runtime.settings.codec_key)
        ttl = runtime.config.codec_session_ttl_seconds
        value, expires = codec_session.issue(key, principal.token_id, ttl)
        secure = runtime.config.cookie_secure
        if secure is None:
            secure = request.url.scheme == "https"
        audit.record_by(
            db,
            principal,
            action="codec.session_create",
            target_type="api_token",
            target_id=str(principal.token_id),
            expected_state="codec_session",
            details={"ttl_seconds": ttl},
        )
        await db.commit()
        return Response(
            CodecSession(expires_at=dt.datetime.fromtimestamp(expires, dt.UTC)),
            cookies=[
                Cookie(
                    key=codec_session.COOKIE_NAME,
                    value=value,
                    path=codec_session.COOKIE_PATH,
                    max_age=ttl,
                    httponly=True,
                    samesite="lax",
                    secure=secure,
                )
            ],
        )

    @delete("/session", status_code=204, summary="Drop the codec cookie")
    async def delete_session(self) -> Response[None]:
        return Response(
            None,
            status_code=204,
            cookies=[
                Cookie(
                    key=codec_session.COOKIE_NAME,
                    value="",
                    path=codec_session.COOKIE_PATH,
                    max_age=0,
                    httponly=True,
                    samesite="lax",
                )
            ],
        )
