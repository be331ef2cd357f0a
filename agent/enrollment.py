"""Agent enrollment: the agent starts from a config file written by cloud-init, redeems its
single-use enrollment token once through the gateway, stores the identity it gets back, and from
then on talks to Temporal only.

The config file (default /etc/gpucloud/agent.toml, or GPUCLOUD_AGENT_CONFIG), TOML:

    api_url = "https://api.gpucloud.example"      # the gateway
    enrollment_token = "gpe_…"                   # single-use, TTL-bound
    state_dir = "/var/lib/gpucloud-agent"        # where the identity is kept (default shown)
    payload_key_file = "/etc/…/payload.key"      # optional; default state_dir/payload.key

The identity (state_dir/identity.json, mode 0600) holds the node id and the Temporal address,
namespace and task queue. The enrollment answer also carries the node's own payload key (derived
for this node from the control plane's cluster key, core/codec.py): it goes to the payload key
file (mode 0600, before the identity, so an identity never names a key that is not on disk) and
the identity keeps its key id. A reimaged node has an empty state dir and a fresh token, and
enrolls again as the same node. The token is never logged and never kept after enrollment.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.config_file import ConfigError, read_agent_config
from contracts.node_files import DEFAULT_STATE_DIR
from core.codec import key_id

ENROLL_PATH = "/api/v1/internal/agent/enroll"
PAYLOAD_KEY_NAME = "payload.key"


class EnrollmentError(RuntimeError):
    """Enrollment did not succeed; `code` is the gateway's machine-readable error code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AgentConfig:
    api_url: str
    enrollment_token: str = field(repr=False)
    state_dir: Path = DEFAULT_STATE_DIR
    # Where enrollment writes the node's payload key; None: state_dir/payload.key.
    payload_key_file: Path | None = None

    @property
    def payload_key_path(self) -> Path:
        return self.payload_key_file or self.state_dir / PAYLOAD_KEY_NAME

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        """`path` with its agent.d drop-ins (agent/config_file.py)."""
        try:
            data = read_agent_config(path)
        except ConfigError as err:
            raise EnrollmentError(str(err), "config") from None
        return cls.from_data(data, source=path)

    @classmethod
    def from_data(cls, data: dict[str, Any], *, source: Path) -> AgentConfig:
        api_url, token = data.get("api_url"), data.get("enrollment_token")
        if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
            raise EnrollmentError(f"{source}: api_url must be an http(s) URL", "config")
        if not isinstance(token, str) or not token:
            raise EnrollmentError(f"{source}: enrollment_token is missing", "config")
        state_dir = Path(data.get("state_dir", DEFAULT_STATE_DIR))
        key_file = data.get("payload_key_file")
        if key_file is not None and (not isinstance(key_file, str) or not key_file.startswith("/")):
            raise EnrollmentError(f"{source}: payload_key_file must be an absolute path", "config")
        return cls(
            api_url=api_url.rstrip("/"),
            enrollment_token=token,
            state_dir=state_dir,
            payload_key_file=Path(key_file) if key_file else None,
        )


@dataclass(frozen=True)
class AgentIdentity:
    node_id: str
    hostname: str | None
    temporal_address: str
    temporal_namespace: str
    task_queue: str
    # Empty in an identity stored before the gateway answered it: the agent's own setting then.
    control_plane_task_queue: str = ""
    # The id of the node payload key enrollment wrote to the payload key file; empty in an
    # identity from before node keys (the agent then uses the key its cloud-init gave it).
    payload_key_id: str = ""


def identity_path(state_dir: Path) -> Path:
    return state_dir / "identity.json"


def load_identity(state_dir: Path) -> AgentIdentity | None:
    path = identity_path(state_dir)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    uuid.UUID(data["node_id"])  # a corrupt identity fails loudly here, not later in Temporal
    return AgentIdentity(**data)


def attempt_path(state_dir: Path) -> Path:
    return state_dir / "enrollment-attempt"


def enrollment_attempt(state_dir: Path) -> str:
    """This enrollment's id, kept (mode 0600) until the identity is stored, so every retry of it
    (the agent restarted by systemd after a 503, say) is the same attempt: if the gateway used the
    token but its answer never arrived, the retry gets that answer instead of `used`."""
    path = attempt_path(state_dir)
    if path.exists():
        return path.read_text().strip()
    attempt = secrets.token_hex(16)
    _write_private(path, attempt)
    return attempt


def _write_private(path: Path, text: str) -> None:
    """Replace `path` atomically with `text`, readable by the agent's user only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def store_identity(state_dir: Path, identity: AgentIdentity) -> None:
    _write_private(identity_path(state_dir), json.dumps(asdict(identity), indent=2))


async def ensure_enrolled(
    config: AgentConfig,
    *,
    agent_version: str = "dev",
    http: httpx.AsyncClient | None = None,
) -> AgentIdentity:
    """The stored identity, or enroll once and store it."""
    known = load_identity(config.state_dir)
    if known is not None:
        return known
    owned = http is None
    client = http or httpx.AsyncClient(base_url=config.api_url, timeout=15)
    try:
        response = await client.post(
            ENROLL_PATH,
            json={
                "enrollment_token": config.enrollment_token,
                "agent_version": agent_version,
                "attempt": enrollment_attempt(config.state_dir),
            },
        )
    except httpx.HTTPError as err:
        raise EnrollmentError(
            f"the gateway at {config.api_url} is not reachable ({type(err).__name__})",
            "unreachable",
        ) from None
    finally:
        if owned:
            await client.aclose()
    if response.status_code != 200:
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "http_error", f"HTTP {response.status_code}"
        raise EnrollmentError(f"enrollment refused: {message}", code)
    body = response.json()
    payload_key_id = ""
    if body.get("payload_key"):
        payload_key_id = _store_payload_key(config.payload_key_path, str(body["payload_key"]))
    identity = AgentIdentity(
        node_id=str(body["node_id"]),
        hostname=body.get("hostname"),
        temporal_address=str(body["temporal_address"]),
        temporal_namespace=str(body["temporal_namespace"]),
        task_queue=str(body["task_queue"]),
        control_plane_task_queue=str(body.get("control_plane_task_queue") or ""),
        payload_key_id=payload_key_id,
    )
    store_identity(config.state_dir, identity)
    attempt_path(config.state_dir).unlink(missing_ok=True)
    return identity


def _store_payload_key(path: Path, key_b64: str) -> str:
    """Write the node's payload key (mode 0600, replacing whatever key file was there: a
    cloud-init from before node keys left the cluster key in it) and return its key id."""
    try:
        key = base64.b64decode(key_b64, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) not in (16, 24, 32):
        raise EnrollmentError("the gateway answered a malformed payload key", "bad_answer")
    _write_private(path, key_b64 + "\n")
    return key_id(key)
