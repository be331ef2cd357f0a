"""Gateway-only settings (bind address, browser-facing codec options), read from the
environment. Everything shared with the worker lives in core.config.Settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_TEMPORAL_UI_ORIGIN = "http://localhost:8233"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The browser origin of Temporal Web, allowed by CORS to call the codec endpoint.
    temporal_ui_origin: str = DEFAULT_TEMPORAL_UI_ORIGIN
    # Lifetime of the codec session cookie (Temporal Web cannot send our bearer token).
    codec_session_ttl_seconds: int = 900
    # Lifetime of the operator console's session cookie (gateway/console/): a working shift.
    console_session_ttl_seconds: int = 8 * 3600
    # Mark the codec cookie Secure. None: only when the request itself came over https.
    cookie_secure: bool | None = None
    # Codec requests carry whole payloads; they get their own, larger body limit.
    codec_max_body_bytes: int = 4 * 1024 * 1024

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
