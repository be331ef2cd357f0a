"""msgspec Structs for every request and response body. They are the API contract (and the
OpenAPI schema); Temporal dataclasses stay separate and are converted at the edges."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from typing import Annotated, Any, Literal

import msgspec

from contracts.decommission import DiskDisposition

# --- limits of every request, declared once (gateway.request_decoding enforces them) ---

# How deep a JSON body may nest; deeper is 400 json_too_deep. The size limit is
# Settings.max_request_body_bytes (413 payload_too_large).
MAX_JSON_DEPTH = 32
# Query, path and header parameters (gateway.request_decoding checks them before a handler
# runs; gateway.openapi documents them as maxLength / maxItems): a string value at most
# MAX_PARAMETER_CHARS characters unless its declaration says fewer (400 invalid_request), a
# repeatable query parameter at most MAX_PARAMETER_ITEMS times, any other at most once (400).
MAX_PARAMETER_CHARS = 500
MAX_PARAMETER_ITEMS = 20
# What no string of a JSON body or parameter may hold, whatever its field: NUL (PostgreSQL
# cannot store it), the other C0 control characters but tab, newline and carriage return, DEL,
# and lone surrogates. Any string holding one is 422 invalid_text naming the field.
BAD_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
# Free text (Text below) is one line: no control character at all.
TEXT_FORBIDDEN = r"\x00-\x1f\x7f\ud800-\udfff"
# `(?![\s\S])` and not `$`: Python's `$` also matches before a trailing newline.
TEXT_PATTERN = rf"^[^{TEXT_FORBIDDEN}]*(?![\s\S])"


# The one type of free text in a request; bound its length where used:
# `Annotated[Text, msgspec.Meta(min_length=1, max_length=100)]`.
Text = Annotated[
    str,
    msgspec.Meta(
        pattern=TEXT_PATTERN,
        extra_json_schema={"description": "No NUL, control character or lone surrogate"},
    ),
]


# Names of projects, tokens and SSH keys (also checked by the admin CLI).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$"
NAME_MAX_CHARS = 100
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX_CHARS, pattern=NAME_PATTERN)]
Reason = Annotated[Text, msgspec.Meta(min_length=1, max_length=500)]


class Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies: unknown fields are errors, so typos do not pass silently."""


# --- decommission operator actions (the others take ActionRequest: a reason) ---


class DiskDispositionRecord(Request):
    """record-disk-disposition (issue 35): where the disks of a machine that vanished from
    MAAS unreleased went, as the operator who dealt with them says; `reference` names the
    evidence (a certificate of destruction, a custody ticket)."""

    disposition: DiskDisposition
    reason: Reason
    reference: Annotated[Text, msgspec.Meta(min_length=1, max_length=200)] | None = None


# --- errors (documentation only; gateway.errors builds the body) ---


class ErrorInfo(msgspec.Struct, kw_only=True):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


# --- health ---


class Health(msgspec.Struct, kw_only=True):
    status: str


class Readiness(msgspec.Struct, kw_only=True):
    status: str
    checks: dict[str, str]


# --- projects ---


class ProjectCreate(Request):
    name: Name
    reason: Reason | None = None


class ProjectView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    created_at: dt.datetime


class ProjectList(msgspec.Struct, kw_only=True):
    items: list[ProjectView]


# --- tokens ---


class TokenCreate(Request):
    name: Name
    role: Literal["admin", "tenant"]
    project_id: uuid.UUID | None = None
    reason: Reason | None = None


class TokenRevoke(Request):
    reason: Reason | None = None


class TokenView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    role: str
    project_id: uuid.UUID | None
    display_prefix: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None = None


class TokenIssued(msgspec.Struct, kw_only=True):
    """The only response that ever holds a token in plaintext."""

    id: uuid.UUID
    name: str
    role: str
    project_id: uuid.UUID | None
    display_prefix: str
    created_at: dt.datetime
    token: str


class TokenList(msgspec.Struct, kw_only=True):
    items: list[TokenView]


# --- audit ---


class AuditView(msgspec.Struct, kw_only=True):
    id: int
    occurred_at: dt.datetime
    actor: str
    actor_token_id: uuid.UUID | None
    role: str
    reason: str | None
    action: str
    target_type: str
    target_id: str
    prior_state: str | None
    expected_state: str | None
    workflow_ids: list[str]
    details: dict[str, Any]


class AuditList(msgspec.Struct, kw_only=True):
    items: list[AuditView]


# --- SSH keys ---


class SshKeyCreate(Request):
    name: Name
    # Up to 16 KiB: enough for a 16384-bit RSA key with a comment.
    # Not Text: a pasted key may end in a newline (gateway.sshkeys parses and judges it).
    public_key: Annotated[str, msgspec.Meta(min_length=1, max_length=16384)]


class SshKeyView(msgspec.Struct, kw_only=True):
    """Never the key material: name, type and fingerprint only."""

    id: uuid.UUID
    name: str
    key_type: str
    fingerprint: str
    created_at: dt.datetime


class SshKeyList(msgspec.Struct, kw_only=True):
    items: list[SshKeyView]


# --- allocations ---


class AllocationCreate(Request):
    sku: Annotated[Text, msgspec.Meta(min_length=1, max_length=100)]
    gpus: Annotated[int, msgspec.Meta(ge=1, le=64)]
    region: Annotated[Text, msgspec.Meta(min_length=1, max_length=50)]
    ssh_key_ids: Annotated[list[uuid.UUID], msgspec.Meta(max_length=32)]


class AllocationCreated(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    status: str
    node_id: uuid.UUID
    shape: str
    sku: str
    region: str
    gpu_count: int
    created_at: dt.datetime | None


class AllocationSummary(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    sku: str
    region: str
    shape: str
    gpu_count: int
    node_id: uuid.UUID
    created_at: dt.datetime
    updated_at: dt.datetime
    # The allocation group it is a member of (GET /allocation-groups/{id}); null for one asked
    # for alone.
    allocation_group_id: uuid.UUID | None = None


class AllocationDetail(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    sku: str
    region: str
    shape: str
    gpu_count: int
    node_id: uuid.UUID
    ssh_key_ids: list[uuid.UUID]
    idempotency_key: str | None
    workflow_id: str
    failure_reason: str | None
    failure_message: str | None
    connect_host: str | None
    hard_stopped: bool | None
    release_requested_by: str | None
    release_attempts: int
    created_at: dt.datetime
    provisioning_started_at: dt.datetime | None
    active_at: dt.datetime | None
    releasing_at: dt.datetime | None
    released_at: dt.datetime | None
    release_failed_at: dt.datetime | None
    failed_at: dt.datetime | None
    # Set when an admin detached it from release_failed: `released` without a cleanup the node
    # proved; its node or GPU slots were quarantined instead.
    detached_at: dt.datetime | None
    updated_at: dt.datetime
    # The allocation group it is a member of; null for one asked for alone.
    allocation_group_id: uuid.UUID | None = None


class AllocationList(msgspec.Struct, kw_only=True):
    items: list[AllocationSummary]
    # Pass back as ?cursor= for the next page; null on the last page.
    next_cursor: str | None = None


class ForceRelease(Request):
    reason: Reason


class Detach(Request):
    reason: Reason


class DetachResponse(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    status: str  # released
    detached_at: dt.datetime
    node_id: uuid.UUID
    # What the detach took out of placement for an operator's cleanup: "node" (bare metal) or
    # "gpu_slots" (the allocation's slots on the node, now disabled).
    quarantined: str
    # The node's status now (bare metal: quarantined, unless it was already out of service).
    node_status: str


class ReleaseResponse(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    # Where the allocation is heading: "releasing", "released", or the current status when the
    # release waits for provisioning to settle (release_pending).
    status: str
    prior_status: str
    expected_status: str
    release_pending: bool


# --- timeline (docs/lifecycles/allocation.md#task-timeline) ---


class TimelinePhase(msgspec.Struct, kw_only=True):
    phase: str
    status: str
    at: dt.datetime | None
    message: str | None = None
    # The host task's attempt that went through it (None: not known, for older records).
    attempt: int | None = None


class TimelineStateItem(msgspec.Struct, kw_only=True, tag_field="kind", tag="allocation_state"):
    """A lifecycle transition (allocation_events)."""

    name: str
    status: str  # succeeded | failed
    started_at: dt.datetime
    # The allocation status after this event, who caused it and why.
    state: str | None = None
    actor: str | None = None
    reason: str | None = None
    details: dict[str, Any] | None = None


class TimelineTaskItem(msgspec.Struct, kw_only=True, tag_field="kind", tag="node_task"):
    """One host call on the node's agent (node_tasks), with its progress phases."""

    name: str
    status: str  # queued | running | succeeded | failed
    task_id: uuid.UUID
    started_at: dt.datetime
    completed_at: dt.datetime | None = None
    duration_seconds: float | None = None
    summary: str | None = None
    attempts: int = 0
    phases: list[TimelinePhase] = []
    # "database" (node_task_events) or "temporal" (live heartbeat of a running task).
    phases_source: str = "database"
    error_type: str | None = None
    details: dict[str, Any] | None = None


TimelineItem = TimelineStateItem | TimelineTaskItem


class Timeline(msgspec.Struct, kw_only=True):
    allocation_id: uuid.UUID
    status: str
    items: list[TimelineItem]
    # e.g. "live_phases_unavailable" when Temporal could not be asked for running tasks.
    warnings: list[str] = []


# --- codec (Temporal remote codec protocol) ---


class CodecPayload(msgspec.Struct, kw_only=True):
    # proto3 JSON: bytes are base64 strings.
    metadata: dict[str, str] = {}
    data: str = ""


class CodecPayloads(msgspec.Struct, kw_only=True):
    payloads: list[CodecPayload] = []


class CodecSession(msgspec.Struct, kw_only=True):
    expires_at: dt.datetime
