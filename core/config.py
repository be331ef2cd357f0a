"""Settings for every process, read from the environment once at start-up.

Everything has a default that matches the embedded dev stack, so a newcomer never has to export
anything; production sets the GPUCLOUD_* variables.

Each field names its variable, the processes that read it and what it means in its metadata
(`env(...)` below), in one place: docs/gen_configuration.py writes the configuration reference
(docs/configuration.md) from it, and the default it shows is what `from_env({})` gives.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field

from core.build_id import workflow_code_build_id

# A fixed key for the embedded default only; production must set GPUCLOUD_CODEC_KEY.
DEV_CODEC_KEY_B64 = base64.b64encode(b"gpucloud-embedded-dev-codec-key!").decode()

# The key of a field's metadata under which `env` puts its EnvVar.
ENV_METADATA = "gpucloud_env"


@dataclass(frozen=True)
class EnvVar:
    """Where a setting comes from, for the configuration reference: its variable, the processes
    that read it, one line on what it means; `default` is shown instead of the real default when
    that is not worth printing (a key, a checksum, a value computed from another variable)."""

    name: str
    read_by: str
    meaning: str
    default: str | None = None


def env(name: str, read_by: str, meaning: str, *, default: str | None = None) -> dict[str, EnvVar]:
    """A settings field's metadata: `field(metadata=env(VARIABLE, READ_BY, MEANING))`."""
    return {ENV_METADATA: EnvVar(name, read_by, meaning, default)}


@dataclass(frozen=True)
class Settings:
    database_url: str = field(
        metadata=env("GPUCLOUD_DATABASE_URL", "all", "PostgreSQL (SQLAlchemy async URL)")
    )
    temporal_address: str = field(
        metadata=env("GPUCLOUD_TEMPORAL_ADDRESS", "all", "Temporal frontend (`host:port`)")
    )
    temporal_namespace: str = field(
        metadata=env("GPUCLOUD_TEMPORAL_NAMESPACE", "all", "Temporal namespace")
    )
    codec_key_b64: str = field(
        metadata=env(
            "GPUCLOUD_CODEC_KEY",
            "control plane (worker, gateway, CLIs); agents only in development (`--node-id`)",
            "base64 of a 16/24/32-byte AES key for the payload codec, the cluster key; each node "
            "gets a key derived from it at enrollment and never this one; **set it in production**",
            default="a fixed development key",
        )
    )
    control_plane_task_queue: str = field(
        metadata=env("GPUCLOUD_TASK_QUEUE", "worker, gateway", "control-plane task queue")
    )
    node_schedule_to_start_seconds: float = field(
        metadata=env(
            "GPUCLOUD_NODE_SCHEDULE_TO_START_S",
            "worker, gateway",
            "how long host work may wait in a node's queue before the node counts as unreachable",
        )
    )
    host_provision_timeout_seconds: float = field(
        metadata=env(
            "GPUCLOUD_HOST_PROVISION_TIMEOUT_S",
            "worker, gateway",
            "host-side provisioning budget (image, boot, readiness) for one attempt",
        )
    )
    host_heartbeat_timeout_seconds: float = field(
        metadata=env(
            "GPUCLOUD_HOST_HEARTBEAT_TIMEOUT_S",
            "worker, gateway",
            "heartbeat timeout of host activities",
        )
    )
    release_max_attempts: int = field(
        metadata=env(
            "GPUCLOUD_RELEASE_MAX_ATTEMPTS",
            "worker, gateway",
            "release retries before an allocation lands in `release_failed`",
        )
    )
    release_retry_initial_seconds: float = field(
        metadata=env(
            "GPUCLOUD_RELEASE_RETRY_INITIAL_S", "worker, gateway", "first release retry interval"
        )
    )
    lease_conflict_max_attempts: int = field(
        metadata=env(
            "GPUCLOUD_LEASE_CONFLICT_MAX_ATTEMPTS",
            "worker, gateway",
            "GPU lease conflicts on the node agent retried before provisioning fails",
        )
    )
    max_request_body_bytes: int = field(
        metadata=env("GPUCLOUD_MAX_BODY_BYTES", "gateway", "request body limit")
    )
    temporal_rpc_timeout_seconds: float = field(
        metadata=env(
            "GPUCLOUD_TEMPORAL_RPC_TIMEOUT_S",
            "gateway",
            "bound on Temporal calls (then 503 `temporal_unavailable`)",
        )
    )
    database_connect_timeout_seconds: float = field(
        metadata=env("GPUCLOUD_DB_CONNECT_TIMEOUT_S", "all", "database connect timeout")
    )
    codec_old_keys_b64: tuple[str, ...] = field(
        default=(),
        repr=False,
        metadata=env(
            "GPUCLOUD_CODEC_OLD_KEYS",
            "all control-plane processes, the gateway's codec endpoint",
            "comma-separated base64 keys payloads may still be encrypted with after a rotation: "
            "decoded (each payload names its key id), never used to encode. Rotate by moving the "
            "old key here and setting a new `GPUCLOUD_CODEC_KEY` on every worker and gateway; an "
            "enrolled agent keeps its key until it re-enrolls, so keep the old one listed while "
            "agents use it",
        ),
    )
    # Temporal over TLS (a Temporal cluster with mTLS, or Temporal Cloud). TLS is on when any is
    # set; with only the CA it is server-authenticated TLS.
    temporal_tls_ca_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_TEMPORAL_TLS_CA_FILE",
            "all",
            "TLS to Temporal: the CA of the frontend's certificate (unset: plaintext)",
        ),
    )
    temporal_tls_cert_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_TEMPORAL_TLS_CERT_FILE",
            "all",
            "mTLS to Temporal: this process's client certificate (goes with the key)",
        ),
    )
    temporal_tls_key_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_TEMPORAL_TLS_KEY_FILE",
            "all",
            "mTLS to Temporal: this process's client key (goes with the certificate)",
        ),
    )
    temporal_tls_server_name: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_TEMPORAL_TLS_SERVER_NAME",
            "all",
            "the name to verify in the frontend's certificate when it differs from the address",
        ),
    )
    # Vault KV v2 (core.secrets). bin/stack sets the address and the AppRole files.
    vault_addr: str = field(
        default="http://127.0.0.1:8200",
        metadata=env("GPUCLOUD_VAULT_ADDR", "gateway, worker", "Vault (KV v2) address"),
    )
    vault_token: str | None = field(
        default=None,
        repr=False,
        metadata=env(
            "GPUCLOUD_VAULT_TOKEN",
            "gateway, worker",
            "the Vault token itself, when neither AppRole nor a token file is used",
        ),
    )
    vault_token_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_VAULT_TOKEN_FILE",
            "gateway, worker",
            "without AppRole: a file holding a Vault token, re-read on every call (rotation "
            "without restart); wins over `GPUCLOUD_VAULT_TOKEN`",
        ),
    )
    vault_timeout_seconds: float = field(
        default=5.0,
        metadata=env("GPUCLOUD_VAULT_TIMEOUT_S", "gateway, worker", "bound on each Vault call"),
    )
    # AppRole login (production): the process logs in, renews its token and logs in again when it
    # expires; the AppRole settings win over the token settings.
    vault_role_id: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_VAULT_ROLE_ID", "gateway, worker", "AppRole role id, when no file is used"
        ),
    )
    vault_role_id_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_VAULT_ROLE_ID_FILE",
            "gateway, worker",
            "AppRole login (production): a file holding the role id, re-read at every login "
            "(`.state/vault-approle/<role>/` under `bin/stack`)",
        ),
    )
    vault_secret_id: str | None = field(
        default=None,
        repr=False,
        metadata=env(
            "GPUCLOUD_VAULT_SECRET_ID", "gateway, worker", "AppRole secret id, when no file is used"
        ),
    )
    vault_secret_id_file: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_VAULT_SECRET_ID_FILE",
            "gateway, worker",
            "AppRole login: a file holding the secret id, re-read at every login (a rotated "
            "secret id needs no restart)",
        ),
    )
    vault_approle_mount: str = field(
        default="approle",
        metadata=env(
            "GPUCLOUD_VAULT_APPROLE_MOUNT",
            "gateway, worker",
            "where the AppRole auth method is mounted",
        ),
    )
    node_offline_after_seconds: float = field(
        default=300.0,
        metadata=env(
            "GPUCLOUD_NODE_OFFLINE_AFTER_S",
            "worker",
            "agent silence (no presence signal, no poll on its node queue) after which an active "
            "node goes offline (no new allocations); heard from again, it comes back",
        ),
    )
    public_api_url: str = field(
        default="http://127.0.0.1:8000",
        metadata=env(
            "GPUCLOUD_PUBLIC_API_URL",
            "worker, gateway",
            "the API URL a MAAS-deployed node's agent enrolls at (written into its cloud-init); "
            "the gateway builds its terminal stream URLs from it. Unset: this host's gateway on "
            "`GPUCLOUD_GATEWAY_PORT`",
        ),
    )
    metrics_address: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_METRICS_ADDRESS",
            "any",
            "`host:port` where the process serves its Temporal SDK metrics at `/metrics` for "
            "Prometheus (`127.0.0.1:9464` for the worker under `bin/stack`)",
        ),
    )
    # Terminal sessions: the policy key terminal.session_max_ttl_seconds (default 4 h).
    terminal_session_max_ttl_seconds: float = field(
        default=4 * 3600.0,
        metadata=env(
            "GPUCLOUD_TERMINAL_SESSION_MAX_TTL_S",
            "gateway",
            "policy `terminal.session_max_ttl_seconds`: a terminal session's longest life",
        ),
    )
    terminal_close_timeout_seconds: float = field(
        default=15.0,
        metadata=env(
            "GPUCLOUD_TERMINAL_CLOSE_TIMEOUT_S",
            "gateway",
            "how long a terminal close waits for the node agent's ack before it goes on",
        ),
    )
    terminal_open_token_ttl_seconds: float = field(
        default=60.0,
        metadata=env(
            "GPUCLOUD_TERMINAL_OPEN_TOKEN_TTL_S",
            "gateway",
            "how long a terminal session's single-use open token waits for the tenant's stream "
            "(then the session ends in error, `open_token_expired`)",
        ),
    )
    # Temporal Web (temporalio/ui-server, its publicPath `/temporal`) on a private, loopback
    # address: the gateway serves it under /temporal/ to operators signed in to the console
    # (gateway/console/temporal_web.py).
    temporal_web_upstream: str | None = field(
        default=None,
        metadata=env(
            "GPUCLOUD_TEMPORAL_WEB_UPSTREAM",
            "gateway",
            "the ui-server's private (loopback) address, served to signed-in admins under "
            "`/temporal/` (unset: 503 there)",
        ),
    )
    build_id: str = field(
        default_factory=workflow_code_build_id,
        metadata=env(
            "GPUCLOUD_BUILD_ID",
            "worker, gateway",
            "the build id the worker reports to Temporal; the gateway starts workflows with the "
            "`BuildIds` it implies (core.build_id). Set the same value on both, or leave it unset "
            "when both run the same tree",
            default="a checksum of `workflows/`",
        ),
    )

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
