"""Terminal sessions (docs/lifecycles/terminal-session.md): a shell into an allocation, bridged by
the gateway to a PTY on the node. The TerminalSessionWorkflow `terminal-{id}` owns the lifecycle;
this module is its contract (ids, message names, inputs, outputs, error types), the host tasks
`terminal.open` / `terminal.close` the node agent serves, and the frames the three parties exchange
on the WebSockets.

The stream never goes through Temporal: the tenant's WebSocket ends on the gateway, the agent
dials the gateway with its own outbound WebSocket, and the gateway relays the bytes between the
two. Temporal only carries control: open, attached, close.

Secrets: the tenant's open token is single-use and short-lived; only its sha256 is stored (the
workflow input and the `terminal_sessions` row). The agent's per-session secret is made by the
gateway that holds the tenant's socket when the token is claimed, travels to the agent inside the
`claim` update and the `terminal.open` task input (payloads, which the payload codec encrypts;
never a search attribute, log line or row), and the gateway keeps only its sha256 to check the
agent's WebSocket against.
"""

# Annotations here are evaluated on purpose: see contracts/allocation.py.

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

WORKFLOW_NAME = "TerminalSessionWorkflow"
OPEN_UPDATE = "open"  # update-with-start: the session row is created, or a typed refusal
CLAIM_UPDATE = "claim"  # the tenant's stream presents the open token (single use)
CLOSE_UPDATE = "close"  # close now with a reason; answers once the session has ended
STREAM_ATTACHED_SIGNAL = "stream_attached"  # the agent's PTY is bridged to the tenant
STATUS_QUERY = "status"

# Host tasks on `node-{id}` (also the node_tasks.kind on the allocation's timeline).
TERMINAL_OPEN = "terminal.open"
TERMINAL_CLOSE = "terminal.close"
TERMINAL_TASK_SUMMARIES = {
    TERMINAL_OPEN: "Terminal session stream",
    TERMINAL_CLOSE: "Closing a terminal session",
}

# Control-plane activities.
CREATE_SESSION = "terminal.create_session"
APPLY_CHANGE = "terminal.apply_change"
CLOSE_FOR_ALLOCATION = "terminal.close_for_allocation"

# AllocationWorkflow's release closes the allocation's sessions first (workflow.patched id).
RELEASE_CLOSES_TERMINAL_SESSIONS = "release-closes-terminal-sessions"

# The policy key of docs/lifecycles/terminal-session.md and its default.
MAX_TTL_POLICY_KEY = "terminal.session_max_ttl_seconds"
DEFAULT_MAX_TTL_SECONDS = 4 * 3600.0


class TerminalSessionStatus(StrEnum):
    OPENING = "opening"
    ACTIVE = "active"
    CLOSING = "closing"
    CLOSED = "closed"
    ERROR = "error"


TERMINAL_SESSION_TRANSITIONS: dict[TerminalSessionStatus, frozenset[TerminalSessionStatus]] = {
    TerminalSessionStatus.OPENING: frozenset(
        {TerminalSessionStatus.ACTIVE, TerminalSessionStatus.ERROR}
    ),
    TerminalSessionStatus.ACTIVE: frozenset(
        {TerminalSessionStatus.CLOSING, TerminalSessionStatus.ERROR}
    ),
    TerminalSessionStatus.CLOSING: frozenset({TerminalSessionStatus.CLOSED}),
    TerminalSessionStatus.CLOSED: frozenset(),
    TerminalSessionStatus.ERROR: frozenset(),
}
# A session that still counts as the allocation's one session (a way on from here).
LIVE_TERMINAL_STATUSES = frozenset(
    s for s, onward in TERMINAL_SESSION_TRANSITIONS.items() if onward
)


class CloseReason(StrEnum):
    CLIENT_CLOSED = "client_closed"  # the tenant closed its WebSocket (or the shell exited)
    SHELL_EXITED = "shell_exited"
    ALLOCATION_RELEASED = "allocation_released"
    ADMIN_FORCE_CLOSED = "admin_force_closed"
    SESSION_TTL_EXPIRED = "session_ttl_expired"  # terminal.session_max_ttl_seconds
    # Errors (→ error). The first two are retryable: the tenant may reopen with the full flow.
    NODE_STREAM_DROPPED = "node_stream_dropped"
    NODE_UNREACHABLE = "node_unreachable"
    OPEN_TOKEN_EXPIRED = "open_token_expired"  # noqa: S105 - a reason code
    OPEN_FAILED = "open_failed"


CLOSE_REASONS = frozenset(r.value for r in CloseReason)
RETRYABLE_CLOSE_REASONS = frozenset({CloseReason.NODE_STREAM_DROPPED, CloseReason.NODE_UNREACHABLE})

# Error types the gateway maps to HTTP (gateway/terminal_sessions.py).
SESSION_ACTIVE = "terminal_session_active"  # 409, details.active_session_id
ALLOCATION_NOT_FOUND = "allocation_not_found"  # 404 (also another project's allocation)
ALLOCATION_NOT_ACTIVE = "allocation_not_active"  # 409
OPEN_TOKEN_INVALID = "open_token_invalid"  # noqa: S105 - the stream's token: unknown, used or expired
SESSION_NOT_LIVE = "terminal_session_not_live"  # close of a session that has ended
OPEN_REFUSALS = (SESSION_ACTIVE, ALLOCATION_NOT_FOUND, ALLOCATION_NOT_ACTIVE)

# Who closes (CloseRequest.actor).
ACTOR_USER = "user"
ACTOR_ADMIN = "admin"
ACTOR_SYSTEM = "system"


def terminal_workflow_id(session_id: str) -> str:
    return f"terminal-{session_id}"


def session_id_from_workflow_id(workflow_id: str) -> str:
    prefix = "terminal-"
    if not workflow_id.startswith(prefix):
        raise ValueError(f"not a terminal session workflow id: {workflow_id}")
    return workflow_id[len(prefix) :]


@dataclass
class TerminalPolicy:
    """Timeouts fixed at start so the workflow stays deterministic (core.config.Settings)."""

    max_ttl_seconds: float = DEFAULT_MAX_TTL_SECONDS
    # The open token must be presented on the stream within this.
    open_token_ttl_seconds: float = 60.0
    # How long terminal.open may wait in the node's queue before the node counts as unreachable.
    node_schedule_to_start_seconds: float = 30.0
    # From the claim until the agent's stream is attached.
    attach_timeout_seconds: float = 30.0
    # The agent heartbeats its stream; missing beats mean the node (or its agent) is gone.
    heartbeat_timeout_seconds: float = 30.0
    # A close waits this long for the agent's ack before the session is closed regardless.
    close_timeout_seconds: float = 15.0


@dataclass
class TerminalSessionInput:
    session_id: str
    allocation_id: str
    project_id: str
    open_token_sha256: str
    policy: TerminalPolicy = field(default_factory=TerminalPolicy)


@dataclass
class TerminalSessionOpened:
    """The `open` update's answer: the session row exists (status opening)."""

    session_id: str
    allocation_id: str
    node_id: str
    status: str
    open_token_expires_at: str  # ISO 8601


@dataclass
class ClaimRequest:
    """The gateway holding the tenant's socket presents the open token's hash and tells the
    workflow where the agent must dial, with the agent's secret (codec-encrypted payload)."""

    open_token_sha256: str
    node_stream_url: str
    agent_secret: str = field(repr=False)


@dataclass
class ClaimAccepted:
    session_id: str
    node_id: str


@dataclass
class CloseRequest:
    reason: str  # CloseReason value
    actor: str = ACTOR_USER
    note: str = ""  # an admin's free-text reason (audited by the gateway)


@dataclass
class CloseResult:
    session_id: str
    status: str  # closed | error
    close_reason: str | None
    acknowledged: bool  # the agent confirmed the PTY was gone before the close timeout


@dataclass
class TerminalSessionView:
    session_id: str
    allocation_id: str
    status: str
    close_reason: str | None


@dataclass
class TerminalSessionResult:
    session_id: str
    status: str  # closed | error, or "rejected" when the open was refused (no row)
    close_reason: str | None = None


REJECTED = "rejected"


# --- control-plane activities ---


@dataclass
class CreateSessionInput:
    session_id: str
    allocation_id: str
    project_id: str
    workflow_id: str
    open_token_sha256: str
    open_token_ttl_seconds: float


@dataclass
class SessionPlan:
    """What the create activity found: the node the session runs on and who logs in there."""

    node_id: str
    shape: str  # contracts.host_tasks.SHAPE_*
    username: str
    open_token_expires_at: str  # ISO 8601, the database's clock


@dataclass
class TaskRecord:
    """A terminal host task's node_tasks row: queued (no status yet), or its outcome."""

    task_id: str
    kind: str
    status: str = ""  # NodeTaskStatus value; "" queues the row
    error_type: str | None = None
    error_message: str | None = None


@dataclass
class TerminalChange:
    """One compare-and-set on the session row (with its event row) and the node tasks it
    touches, in one transaction."""

    session_id: str
    to_status: str = ""  # "" when only tasks change
    close_reason: str | None = None
    actor: str = ACTOR_SYSTEM
    tasks: list[TaskRecord] = field(default_factory=list)


@dataclass
class CloseForAllocationInput:
    allocation_id: str
    reason: str = CloseReason.ALLOCATION_RELEASED.value


@dataclass
class CloseForAllocationResult:
    closed: list[CloseResult] = field(default_factory=list)


# --- host tasks (node agent) ---


@dataclass
class TerminalOpenInput:
    task_id: str
    session_id: str
    allocation_id: str
    node_id: str
    shape: str
    username: str
    # Where the agent dials (ws:// or wss://), and the secret it authenticates with.
    stream_url: str
    agent_secret: str = field(repr=False)


@dataclass
class TerminalOpenResult:
    task_id: str
    session_id: str
    ended_by: str  # CloseReason value
    started_at: str
    finished_at: str


@dataclass
class TerminalCloseInput:
    task_id: str
    session_id: str
    reason: str


@dataclass
class TerminalCloseResult:
    session_id: str
    was_running: bool


# --- WebSocket frames ---
# Binary frames carry terminal bytes both ways. Text frames are JSON control messages with a
# "type": tenant → gateway: auth {token}, resize {cols, rows}, ping; gateway → tenant: ready,
# pong, closed {reason}, error {code, message}. Agent → gateway: auth {secret}, closed {reason};
# gateway → agent: attached, resize {cols, rows}, close {reason}.
FRAME_AUTH = "auth"
FRAME_READY = "ready"
FRAME_ATTACHED = "attached"
FRAME_RESIZE = "resize"
FRAME_PING = "ping"
FRAME_PONG = "pong"
FRAME_CLOSE = "close"
FRAME_CLOSED = "closed"
FRAME_ERROR = "error"
# Bounds on one frame and on a terminal size: larger frames end the stream (close code 1009).
MAX_FRAME_BYTES = 64 * 1024
MAX_TERMINAL_CELLS = 1000
# The first (auth) frame must arrive within this.
AUTH_TIMEOUT_SECONDS = 10.0
# The route the agent dials on the gateway (beneath the public API URL).
NODE_STREAM_PATH = "/api/v1/internal/agent/terminal-sessions/{session_id}/stream"
TENANT_STREAM_PATH = "/api/v1/terminal-sessions/{session_id}/stream"


def control_frame(kind: str, **fields: Any) -> str:
    """A text frame: the JSON control message `{"type": kind, ...}`."""
    return json.dumps({"type": kind, **fields})


def parse_control(text: object) -> dict[str, Any]:
    """A text frame's control message; {} for anything that is not a JSON object (ignored)."""
    if not isinstance(text, str):
        return {}
    try:
        control = json.loads(text)
    except ValueError:
        return {}
    return control if isinstance(control, dict) else {}


def terminal_size(control: dict[str, Any]) -> tuple[int, int] | None:
    """A resize frame's (cols, rows), or None when out of bounds or malformed."""
    cols, rows = control.get("cols"), control.get("rows")
    if not isinstance(cols, int) or not isinstance(rows, int):
        return None
    if not (0 < cols <= MAX_TERMINAL_CELLS and 0 < rows <= MAX_TERMINAL_CELLS):
        return None
    return cols, rows


def close_reason_of(control: dict[str, Any]) -> str:
    """A close/closed frame's reason: a known CloseReason value, else client_closed."""
    reason = control.get("reason")
    if isinstance(reason, str) and reason in CLOSE_REASONS:
        return reason
    return CloseReason.CLIENT_CLOSED.value
