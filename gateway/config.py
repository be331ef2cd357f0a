"""Gateway-only settings (bind address, browser-facing codec options), read from the
environment. Everything shared with the worker lives in core.config.Settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from core.config import env

DEFAULT_TEMPORAL_UI_ORIGIN = "http://localhost:8233"


@dataclass(frozen=True)
class GatewayConfig:
    # Each field's variable and meaning: core.config.env (docs/gen_configuration.py).
    host: str = field(
        default="127.0.0.1",
        metadata=env("GPUCLOUD_GATEWAY_HOST", "gateway, `bin/stack`", "the gateway's bind address"),
    )
    port: int = field(
        default=8000,
        metadata=env("GPUCLOUD_GATEWAY_PORT", "gateway, `bin/stack`", "the gateway's port"),
    )
    temporal_ui_origin: str = field(
        default=DEFAULT_TEMPORAL_UI_ORIGIN,
        metadata=env(
            "GPUCLOUD_TEMPORAL_UI_ORIGIN",
            "gateway",
            "Temporal Web's browser origin, allowed by CORS on the codec endpoint (`bin/stack` "
            "sets the gateway's own: Temporal Web is served under `/temporal/`)",
        ),
    )
    codec_session_ttl_seconds: int = field(
        default=900,
        metadata=env(
            "GPUCLOUD_CODEC_SESSION_TTL_S",
            "gateway",
            "lifetime of the codec session cookie (Temporal Web cannot send our bearer token)",
        ),
    )
    console_session_ttl_seconds: int = field(
        default=8 * 3600,
        metadata=env(
            "GPUCLOUD_CONSOLE_SESSION_TTL_S",
            "gateway",
            "lifetime of the operator console's session cookie (it also opens the codec endpoint)",
        ),
    )
    cookie_secure: bool | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_COOKIE_SECURE",
            "gateway",
            "force the cookies' Secure flag on (`1`) or off; unset: only over https",
        ),
    )
    codec_max_body_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata=env(
            "GPUCLOUD_CODEC_MAX_BODY_BYTES",
            "gateway",
            "body limit of the codec endpoint (requests carry whole payloads)",
        ),
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        e = os.environ if env is None else env
        secure = e.get("GPUCLOUD_COOKIE_SECURE")
        return cls(
            host=e.get("GPUCLOUD_GATEWAY_HOST", "127.0.0.1"),
            port=int(e.get("GPUCLOUD_GATEWAY_PORT", "8000")),
            temporal_ui_origin=e.get("GPUCLOUD_TEMPORAL_UI_ORIGIN", DEFAULT_TEMPORAL_UI_ORIGIN),
            codec_session_ttl_seconds=int(e.get("GPUCLOUD_CODEC_SESSION_TTL_S", "900")),
            console_session_ttl_seconds=int(e.get("GPUCLOUD_CONSOLE_SESSION_TTL_S", "28800")),
            cookie_secure=None if secure is None else secure.lower() in {"1", "true", "yes"},
            codec_max_body_bytes=int(e.get("GPUCLOUD_CODEC_MAX_BODY_BYTES", str(4 * 1024 * 1024))),
        )
