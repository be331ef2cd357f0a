"""Lifecycle states and the transitions allowed between them: the one definition
(docs/lifecycles/allocation.md, docs/lifecycles/allocation.md,
docs/lifecycles/node.md#states-and-transitions). Activities apply transitions as compare-and-set
against these tables."""

from __future__ import annotations

from enum import StrEnum


class AllocationStatus(StrEnum):
    REQUESTED = "requested"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    FAILED = "failed"
    RELEASE_FAILED = "release_failed"


ALLOCATION_TRANSITIONS: dict[AllocationStatus, frozenset[AllocationStatus]] = {
    AllocationStatus.REQUESTED: frozenset({AllocationStatus.PROVISIONING, AllocationStatus.FAILED}),
    AllocationStatus.PROVISIONING: frozenset({AllocationStatus.ACTIVE, AllocationStatus.FAILED}),
    AllocationStatus.ACTIVE: frozenset({AllocationStatus.RELEASING}),
    AllocationStatus.RELEASING: frozenset(
        {AllocationStatus.RELEASED, AllocationStatus.RELEASE_FAILED}
    ),
    # → releasing: a user retry or an admin force-release; → released: an admin detach
    # (docs/lifecycles/allocation.md, "removes the assignment"), which quarantines what the node
    # could not clean.
    AllocationStatus.RELEASE_FAILED: frozenset(
        {AllocationStatus.RELEASING, AllocationStatus.RELEASED}
    ),
    AllocationStatus.RELEASED: frozenset(),
    AllocationStatus.FAILED: frozenset(),
}
# An allocation that still holds (or may still hold) its node: one with a way on.
LIVE_ALLOCATION_STATUSES = frozenset(s for s, onward in ALLOCATION_TRANSITIONS.items() if onward)


class AllocationGroupStatus(StrEnum):
    """docs/lifecycles/allocation-group.md: an aggregate over member allocations, derived from their
    statuses and the group's release intent (contracts.allocation_group.derive_group_status)."""

    REQUESTED = "requested"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    DEGRADED = "degraded"
    RELEASING = "releasing"
    RELEASED = "released"
    FAILED = "failed"
    RELEASE_FAILED = "release_failed"


_G = AllocationGroupStatus
ALLOCATION_GROUP_TRANSITIONS: dict[AllocationGroupStatus, frozenset[AllocationGroupStatus]] = {
    # → releasing from every live state: a release may be asked for before the group is whole.
    _G.REQUESTED: frozenset({_G.PROVISIONING, _G.FAILED, _G.RELEASING}),
    # → degraded: every member settled, a required one lost while another is usable.
    _G.PROVISIONING: frozenset({_G.ACTIVE, _G.DEGRADED, _G.FAILED, _G.RELEASING}),
    _G.ACTIVE: frozenset({_G.DEGRADED, _G.RELEASING}),
    _G.DEGRADED: frozenset({_G.RELEASING}),
    _G.RELEASING: frozenset({_G.RELEASED, _G.RELEASE_FAILED}),
    # → releasing: a retry (admin force-release); → released: the failed member was detached.
    _G.RELEASE_FAILED: frozenset({_G.RELEASING, _G.RELEASED}),
    _G.RELEASED: frozenset(),
    _G.FAILED: frozenset(),
}


class NodeStatus(StrEnum):
    """Coarse node states of docs/lifecycles/node.md#states-and-transitions. Only `active` nodes
    receive new allocations."""

    BOOTSTRAP_ISSUED = "bootstrap_issued"
    ENROLLING = "enrolling"
    ACTIVE = "active"
    OFFLINE = "offline"
    QUARANTINED = "quarantined"
    DRAINING = "draining"
    RETIRED = "retired"
    REMOVING = "removing"
    DELETED = "deleted"


# docs/lifecycles/node.md#states-and-transitions: the allowed coarse node transitions (owners in
# §3.3). Activities apply them as compare-and-set; the MAAS reconciler uses active/offline ->
# quarantined, heartbeat/liveness detection active <-> offline.
NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.BOOTSTRAP_ISSUED: frozenset({NodeStatus.ENROLLING}),
    NodeStatus.ENROLLING: frozenset({NodeStatus.ACTIVE, NodeStatus.QUARANTINED}),
    NodeStatus.ACTIVE: frozenset({NodeStatus.OFFLINE, NodeStatus.QUARANTINED, NodeStatus.DRAINING}),
    NodeStatus.OFFLINE: frozenset({NodeStatus.ACTIVE, NodeStatus.QUARANTINED, NodeStatus.DRAINING}),
    NodeStatus.QUARANTINED: frozenset({NodeStatus.ACTIVE, NodeStatus.DRAINING}),
    NodeStatus.DRAINING: frozenset({NodeStatus.RETIRED, NodeStatus.OFFLINE}),
    NodeStatus.RETIRED: frozenset({NodeStatus.ACTIVE, NodeStatus.REMOVING}),
    NodeStatus.REMOVING: frozenset({NodeStatus.RETIRED, NodeStatus.DELETED}),
    NodeStatus.DELETED: frozenset(),
}


def node_transition_allowed(src: NodeStatus, dst: NodeStatus) -> bool:
    return dst in NODE_TRANSITIONS[src]


class SkuShape(StrEnum):
    BAREMETAL = "baremetal"
    GPU_SLICE = "gpu_slice"


class SlotStatus(StrEnum):
    FREE = "free"
    RESERVED = "reserved"
    DISABLED = "disabled"


class ClaimKind(StrEnum):
    NODE_EXCLUSIVE = "node_exclusive"
    GPU_SLOT = "gpu_slot"


class ClaimStatus(StrEnum):
    HELD = "held"
    RELEASED = "released"


class NodeTaskStatus(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"


class TokenRole(StrEnum):
    ADMIN = "admin"
    TENANT = "tenant"


class ReleaseActor(StrEnum):
    """Who asked for a release (docs/lifecycles/allocation.md: user release, billing or admin
    force-release)."""

    USER = "user"
    ADMIN = "admin"
    BILLING = "billing"
    # The allocation group the allocation belongs to (its members released because it failed).
    GROUP = "group"
