"""The AllocationGroupWorkflow contract (docs/lifecycles/allocation-group.md): its id scheme,
message names, inputs and outputs, and the one rule that derives a group's status from its members'.

A group is an aggregate over ordinary allocations: each member is its own AllocationWorkflow
(`allocation-{id}`, started by the group as a child) with its own placement, usage window and
billing; the group never holds capacity itself. Members report each status to the group
(MEMBER_STATUS_SIGNAL), and the group's status follows from those and its release intent."""

# Annotations evaluated at run time, as in contracts/allocation.py: the payload converter
# resolves them on every conversion.

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from contracts.allocation import REJECTED, AllocationInput, ReleaseRequest
from contracts.states import AllocationGroupStatus, AllocationStatus

WORKFLOW_NAME = "AllocationGroupWorkflow"
SUBMIT_UPDATE = "submit"
RELEASE_UPDATE = "request_group_release"
MEMBER_STATUS_SIGNAL = "member_status"
STATUS_QUERY = "status"
# AllocationWorkflow's patch for the member → group status reports (only group members run it).
MEMBER_STATUS_PATCH = "allocation-group-member-status"

# Error types the gateway maps to HTTP.
NOT_RELEASABLE = "allocation_group_not_releasable"
# A group's member is placed like any allocation; at most this many per group.
MAX_MEMBERS = 16

# Member statuses beyond an allocation's own: not placed yet, and refused by placement (no
# allocation row exists for it).
PLACING = "placing"
MEMBER_REJECTED = REJECTED


class Spread(StrEnum):
    """Placement across members: `same_node_forbidden` is anti-affinity (no two live members
    on one node, as Nova server groups do), held by a unique index in the database."""

    SAME_NODE_FORBIDDEN = "same_node_forbidden"
    ANY = "any"


def allocation_group_workflow_id(group_id: str) -> str:
    return f"allocation-group-{group_id}"


@dataclass
class GroupMember:
    """One member: the AllocationInput its own workflow starts with, and whether the group
    needs it (docs/lifecycles/allocation-group.md's required members)."""

    input: AllocationInput
    required: bool = True


@dataclass
class AllocationGroupInput:
    group_id: str
    project_id: str
    idempotency_key: str | None
    # sha256 of the canonical request body: the same idempotency key with another body is refused.
    request_fingerprint: str
    spread: str  # Spread value
    members: list[GroupMember] = field(default_factory=list)


@dataclass
class GroupAccepted:
    """The `submit` update's answer: the group as created (status requested)."""

    group_id: str
    status: str
    created_at: str  # ISO 8601, the database's clock
    member_ids: list[str] = field(default_factory=list)


@dataclass
class MemberStatus:
    """A member's report of its new status (AllocationWorkflow → its group)."""

    allocation_id: str
    status: str  # AllocationStatus value
    reason: str | None = None


@dataclass
class GroupReleaseAccepted:
    group_id: str
    prior_status: str
    expected_status: str
    # True when this request asked the members to release; False when an earlier one already
    # did (or there was nothing left to release).
    members_asked: bool


@dataclass
class GroupView:
    group_id: str
    status: str
    members: dict[str, str]
    release_requested: bool


@dataclass
class AllocationGroupResult:
    group_id: str
    status: str  # released | failed


# --- activities ---


@dataclass
class CreateGroupInput:
    group: AllocationGroupInput
    workflow_id: str


@dataclass
class GroupTransition:
    group_id: str
    from_status: str
    to_status: str
    actor: str | None = None
    reason: str | None = None
    details: dict[str, str] = field(default_factory=dict)


@dataclass
class MemberRejection:
    group_id: str
    allocation_id: str
    reason: str | None


@dataclass
class MemberReleases:
    """Ask each member's own workflow to release (its `request_release` update). `round`
    numbers the group's fan-outs, so a retried activity reuses its update ids and Temporal
    answers it from the first attempt: each fan-out asks each member once."""

    group_workflow_id: str
    round: int
    allocation_ids: list[str]
    request: ReleaseRequest


@dataclass
class MemberReleasesResult:
    asked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # not releasable, or its workflow ended


# --- the status rule (docs/lifecycles/allocation-group.md) ---

_PENDING = frozenset({PLACING, AllocationStatus.REQUESTED, AllocationStatus.PROVISIONING})
_USABLE = frozenset({AllocationStatus.ACTIVE})
# A member with nothing left to do: its workflow has ended or is about to.
MEMBER_ENDED = frozenset({AllocationStatus.RELEASED, AllocationStatus.FAILED, MEMBER_REJECTED})
_SETTLED_RELEASE = MEMBER_ENDED | {AllocationStatus.RELEASE_FAILED}


def derive_group_status(
    prior: AllocationGroupStatus,
    members: Iterable[tuple[str, bool]],
    *,
    release_intent: bool,
    releases_in_flight: bool = False,
) -> AllocationGroupStatus:
    """The group's status from its members' (status, required) and the group's release intent.

    - released and failed are final;
    - with release intent: releasing while any member still has a way to go (or a release the
      group asked for has not reached it yet), then release_failed if a member's release
      exhausted its retries, else released;
    - requested while no member has left placement, provisioning while any is still coming up;
    - failed (from requested/provisioning) when no required member can become usable (active);
    - once every member settled: active when every required member is, degraded when a required
      one is lost (failed, refused, or released on its own) while another member is usable; a
      group already active or degraded that loses its required members is degraded.
    """
    G = AllocationGroupStatus
    if prior in (G.RELEASED, G.FAILED):
        return prior
    listed = list(members)
    statuses = [status for status, _ in listed]
    if release_intent:
        if releases_in_flight or any(s not in _SETTLED_RELEASE for s in statuses):
            return G.RELEASING
        if any(s == AllocationStatus.RELEASE_FAILED for s in statuses):
            return G.RELEASE_FAILED
        return G.RELEASED
    required = [status for status, needed in listed if needed]
    early = prior in (G.REQUESTED, G.PROVISIONING)
    if not any(s in _PENDING | _USABLE for s in required):
        return G.FAILED if early else G.DEGRADED
    if any(s in _PENDING for s in statuses):
        if all(s in (PLACING, AllocationStatus.REQUESTED) for s in statuses) and early:
            return prior
        return G.PROVISIONING if early else prior
    if all(s in _USABLE for s in required):
        return G.ACTIVE if early or prior == G.ACTIVE else prior
    return G.DEGRADED
