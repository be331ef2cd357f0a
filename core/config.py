"""Settings for every process, read from the environment once at start-up.

Everything has a default that matches the embedded dev stack, so a newcomer never has to export
anything; production sets the GPUCLOUD_* variables.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field

from core.build_id import workflow_code_build_id

# A fixed key for the embedded default only; production must set GPUCLOUD_CODEC_KEY.
DEV_CODEC_KEY_B64 = base64.b64encode(b"gpucloud-embedded-dev-codec-key!").decode()


@dataclass(frozen=True)
class Settings:
    database_url: str
    temporal_address: str
    temporal_namespace: str
    codec_key_b64: str
    control_plane_task_queue: str
    # How long a host activity may wait in a node's queue before the node counts as unreachable.
    node_schedule_to_start_seconds: float
    # Host-side provisioning budget (image, boot, readiness) for one attempt.
    host_provision_timeout_seconds: float
    host_heartbeat_timeout_seconds: float
    # Release retries before an allocation lands in release_failed.
    release_max_attempts: int
    release_retry_initial_seconds: float
    # Lease conflicts on the node agent are retried this many times before provisioning fails.
    lease_conflict_max_attempts: int
    # Gateway limits.
    max_request_body_bytes: int
    temporal_rpc_timeout_seconds: float
    database_connect_timeout_seconds: float
    # Keys that payloads may still be encrypted with after a rotation: decoded, never used to
    # encode (comma-separated base64 in GPUCLOUD_CODEC_OLD_KEYS). Each payload names its key id.
    codec_old_keys_b64: tuple[str, ...] = field(default=(), repr=False)
    # Temporal over TLS (a Temporal cluster with mTLS, or Temporal Cloud): the CA that signed the
    # frontend's certificate, and this process's client certificate and key. TLS is on when any
    # is set; with only the CA it is server-authenticated TLS.
    temporal_tls_ca_file: str | None = None
    temporal_tls_cert_file: str | None = None
    temporal_tls_key_file: str | None = None
    temporal_tls_server_name: str | None = None
    # Vault KV v2 (core.secrets). The token file, when set, wins over the token and is re-read on
    # every call, so a rotated token needs no restart. bin/stack sets the address and token file.
    vault_addr: str = "http://127.0.0.1:8200"
    vault_token: str | None = field(default=None, repr=False)
    vault_token_file: str | None = None
    vault_timeout_seconds: float = 5.0
    # AppRole login (production): with a role id and a secret id (each given directly or in a
    # file, re-read at every login so a rotated secret id needs no restart) the process logs in,
    # renews its token and logs in again when it expires; they win over the token settings.
    vault_role_id: str | None = None
    vault_role_id_file: str | None = None
    vault_secret_id: str | None = field(default=None, repr=False)
    vault_secret_id_file: str | None = None
    vault_approle_mount: str = "approle"
    # A node whose agent has not heartbeated for this long goes offline (no new allocations).
    node_offline_after_seconds: float = 300.0
    # What a node's agent calls to enroll; written into the cloud-init of every MAAS deploy.
    public_api_url: str = "http://127.0.0.1:8000"
    # host:port where this process serves its Temporal SDK metrics for Prometheus
    # (`/metrics`); unset, none are served. bin/stack sets it for the worker.
    metrics_address: str | None = None
    # Terminal sessions (seed 001 §6): policy key terminal.session_max_ttl_seconds (default 4 h),
    # and how long a close waits for the node agent's ack before it goes on regardless.
    terminal_session_max_ttl_seconds: float = 4 * 3600.0
    terminal_close_timeout_seconds: float = 15.0
    # How long a terminal session's single-use open token may wait for the tenant's stream.
    terminal_open_token_ttl_seconds: float = 60.0
    # Temporal Web (temporalio/ui-server, its publicPath `/temporal`) on a private, loopback
    # address, e.g. http://127.0.0.1:8233: the gateway serves it under /temporal/ to operators
    # signed in to the console (gateway/console/temporal_web.py). Unset, /temporal/ answers 503.
    temporal_web_upstream: str | None = None
    # The build id the control-plane worker reports to Temporal; the gateway starts workflows
    # with the BuildIds it implies (core.build_id). Unset, a checksum of the workflow code.
    build_id: str = field(default_factory=workflow_code_build_id)

    @property
    def codec_key(self) -> bytes:
        return _aes_key(self.codec_key_b64, "GPUCLOUD_CODEC_KEY")

    @property
    def codec_old_keys(self) -> tuple[bytes, ...]:
        return tuple(_aes_key(k, "GPUCLOUD_CODEC_OLD_KEYS") for k in self.codec_old_keys_b64)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        return cls(
            database_url=e.get(
                "GPUCLOUD_DATABASE_URL",
                "postgresql+asyncpg://gpucloud@127.0.0.1:55432/gpucloud",
            ),
            temporal_address=e.get("GPUCLOUD_TEMPORAL_ADDRESS", "127.0.0.1:7233"),
            temporal_namespace=e.get("GPUCLOUD_TEMPORAL_NAMESPACE", "default"),
            codec_key_b64=e.get("GPUCLOUD_CODEC_KEY", DEV_CODEC_KEY_B64),
            control_plane_task_queue=e.get("GPUCLOUD_TASK_QUEUE", "control-plane"),
            node_schedule_to_start_seconds=float(e.get("GPUCLOUD_NODE_SCHEDULE_TO_START_S", "60")),
            host_provision_timeout_seconds=float(e.get("GPUCLOUD_HOST_PROVISION_TIMEOUT_S", "900")),
            host_heartbeat_timeout_seconds=float(e.get("GPUCLOUD_HOST_HEARTBEAT_TIMEOUT_S", "30")),
            release_max_attempts=int(e.get("GPUCLOUD_RELEASE_MAX_ATTEMPTS", "3")),
            release_retry_initial_seconds=float(e.get("GPUCLOUD_RELEASE_RETRY_INITIAL_S", "1")),
            lease_conflict_max_attempts=int(e.get("GPUCLOUD_LEASE_CONFLICT_MAX_ATTEMPTS", "3")),
            max_request_body_bytes=int(e.get("GPUCLOUD_MAX_BODY_BYTES", str(64 * 1024))),
            temporal_rpc_timeout_seconds=float(e.get("GPUCLOUD_TEMPORAL_RPC_TIMEOUT_S", "10")),
            database_connect_timeout_seconds=float(e.get("GPUCLOUD_DB_CONNECT_TIMEOUT_S", "3")),
            codec_old_keys_b64=tuple(
                k.strip() for k in e.get("GPUCLOUD_CODEC_OLD_KEYS", "").split(",") if k.strip()
            ),
            temporal_tls_ca_file=e.get("GPUCLOUD_TEMPORAL_TLS_CA_FILE") or None,
            temporal_tls_cert_file=e.get("GPUCLOUD_TEMPORAL_TLS_CERT_FILE") or None,
            temporal_tls_key_file=e.get("GPUCLOUD_TEMPORAL_TLS_KEY_FILE") or None,
            temporal_tls_server_name=e.get("GPUCLOUD_TEMPORAL_TLS_SERVER_NAME") or None,
            vault_addr=e.get("GPUCLOUD_VAULT_ADDR", "http://127.0.0.1:8200"),
            vault_token=e.get("GPUCLOUD_VAULT_TOKEN") or None,
            vault_token_file=e.get("GPUCLOUD_VAULT_TOKEN_FILE") or None,
            vault_timeout_seconds=float(e.get("GPUCLOUD_VAULT_TIMEOUT_S", "5")),
            vault_role_id=e.get("GPUCLOUD_VAULT_ROLE_ID") or None,
            vault_role_id_file=e.get("GPUCLOUD_VAULT_ROLE_ID_FILE") or None,
            vault_secret_id=e.get("GPUCLOUD_VAULT_SECRET_ID") or None,
            vault_secret_id_file=e.get("GPUCLOUD_VAULT_SECRET_ID_FILE") or None,
            vault_approle_mount=e.get("GPUCLOUD_VAULT_APPROLE_MOUNT", "approle"),
            node_offline_after_seconds=float(e.get("GPUCLOUD_NODE_OFFLINE_AFTER_S", "300")),
            # Unset: this host's gateway on its configured port (GPUCLOUD_GATEWAY_PORT), so a
            # gateway on another port never hands out URLs of port 8000 (issue 36).
            public_api_url=e.get("GPUCLOUD_PUBLIC_API_URL")
            or f"http://127.0.0.1:{e.get('GPUCLOUD_GATEWAY_PORT') or '8000'}",
            metrics_address=e.get("GPUCLOUD_METRICS_ADDRESS") or None,
            terminal_session_max_ttl_seconds=float(
                e.get("GPUCLOUD_TERMINAL_SESSION_MAX_TTL_S", str(4 * 3600))
            ),
            terminal_close_timeout_seconds=float(e.get("GPUCLOUD_TERMINAL_CLOSE_TIMEOUT_S", "15")),
            terminal_open_token_ttl_seconds=float(
                e.get("GPUCLOUD_TERMINAL_OPEN_TOKEN_TTL_S", "60")
            ),
            temporal_web_upstream=e.get("GPUCLOUD_TEMPORAL_WEB_UPSTREAM") or None,
            build_id=e.get("GPUCLOUD_BUILD_ID") or workflow_code_build_id(),
        )


def _aes_key(b64: str, variable: str) -> bytes:
    key = base64.b64decode(b64)
    if len(key) not in (16, 24, 32):
        raise ValueError(f"{variable} must be base64 of a 16, 24 or 32 byte AES key")
    return key
