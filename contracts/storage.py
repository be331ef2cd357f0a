"""Storage namespaces and attachments (docs/lifecycles/storage-attachment.md): the
StorageAttachmentWorkflow contract (id scheme, states, update and query names, inputs and results),
the control-plane activity names, the node agent's typed mount tasks, the namespace admin operations
and the error types the gateway maps to HTTP. Kept apart from the workflow so the gateway, the
activities and the agent import no workflow code.

A storage namespace is project-owned persistent storage with a `quota_bytes`, kept by a storage
provider (activities/storage_provider.py). An attachment binds one namespace to one allocation's
node: the control plane grants the node access at the provider, then the node's agent mounts it
(STORAGE_MOUNT on `node-{id}`); a detach unmounts (STORAGE_UNMOUNT) and revokes the grant. No
detach and no allocation release ever deletes a namespace's data; only deleting the namespace
itself (refused while it is attached) does.
"""

# Annotations here are evaluated on purpose: see contracts/allocation.py.

import uuid
from dataclasses import dataclass, field
from enum import StrEnum

from contracts.admin_operation import STORAGE_NAMESPACE_CREATE, STORAGE_NAMESPACE_DELETE, Actor
from contracts.host_tasks import STORAGE_MOUNT as STORAGE_MOUNT
from contracts.host_tasks import STORAGE_UNMOUNT as STORAGE_UNMOUNT
from contracts.host_tasks import HostPhase

WORKFLOW_NAME = "StorageAttachmentWorkflow"
WORKFLOW_ID_PREFIX = "storage-attachment-"
OPEN_UPDATE = "open"  # update-with-start: answers once the attachment is on record (or refused)
DETACH_UPDATE = "detach"
# An admin's way out of detach_failed on a node observed gone (issue 35): revoke, no unmount.
ABANDON_UPDATE = "abandon"
STATUS_QUERY = "status"


def attachment_workflow_id(attachment_id: str) -> str:
    return f"{WORKFLOW_ID_PREFIX}{attachment_id}"


def virtiofs_tag(attachment_id: str) -> str:
    """The tag a slice VM mounts an attachment by (`mount -t virtiofs <tag> <dir>`): the
    attachment's id, 36 characters, which is virtiofs's limit. (A shorter prefixed form would
    read as a secret token to the log and API redaction, core/redaction.py.)"""
    return str(uuid.UUID(attachment_id))


class AttachmentStatus(StrEnum):
    REQUESTED = "requested"
    PRECHECKING = "prechecking"
    GRANT_APPLYING = "grant_applying"
    GRANT_APPLIED = "grant_applied"
    MOUNTING = "mounting"
    MOUNTED = "mounted"
    DETACHING = "detaching"
    DETACHED = "detached"
    FAILED = "failed"
    DETACH_FAILED = "detach_failed"


# docs/lifecycles/storage-attachment.md's transitions, the one table both the workflow and the SQL
# compare-and-set use.
TRANSITIONS: dict[AttachmentStatus, frozenset[AttachmentStatus]] = {
    AttachmentStatus.REQUESTED: frozenset({AttachmentStatus.PRECHECKING, AttachmentStatus.FAILED}),
    AttachmentStatus.PRECHECKING: frozenset(
        {AttachmentStatus.GRANT_APPLYING, AttachmentStatus.FAILED}
    ),
    AttachmentStatus.GRANT_APPLYING: frozenset(
        {AttachmentStatus.GRANT_APPLIED, AttachmentStatus.FAILED}
    ),
    AttachmentStatus.GRANT_APPLIED: frozenset({AttachmentStatus.MOUNTING, AttachmentStatus.FAILED}),
    AttachmentStatus.MOUNTING: frozenset({AttachmentStatus.MOUNTED, AttachmentStatus.FAILED}),
    AttachmentStatus.MOUNTED: frozenset(
        {AttachmentStatus.DETACHING, AttachmentStatus.DETACH_FAILED}
    ),
    AttachmentStatus.DETACHING: frozenset(
        {AttachmentStatus.DETACHED, AttachmentStatus.DETACH_FAILED}
    ),
    AttachmentStatus.FAILED: frozenset({AttachmentStatus.DETACHING}),
    AttachmentStatus.DETACH_FAILED: frozenset({AttachmentStatus.DETACHING}),
    AttachmentStatus.DETACHED: frozenset(),
}
# Where a detach can start at once; from any other live state it waits for the attach to settle.
DETACHABLE = frozenset(
    {AttachmentStatus.MOUNTED, AttachmentStatus.FAILED, AttachmentStatus.DETACH_FAILED}
)
# What an operator must look at (the admin view of stuck attachments).
STUCK = frozenset({AttachmentStatus.FAILED, AttachmentStatus.DETACH_FAILED})
# Attachments that still hold (or may still come to hold) a grant or a mount.
LIVE = frozenset(AttachmentStatus) - {AttachmentStatus.DETACHED}


class WriteMode(StrEnum):
    READ_ONLY = "read_only"
    SINGLE_WRITER = "single_writer"  # the only writer of the namespace
    MULTI_WRITER = "multi_writer"  # one of several writers: provider capability AND policy


WRITE_MODES = frozenset({WriteMode.SINGLE_WRITER, WriteMode.MULTI_WRITER})


class DetachActor(StrEnum):
    TENANT = "tenant"
    ADMIN = "admin"
    ALLOCATION_RELEASE = "allocation_release"


# The one provider (activities/storage_provider.py, agent/storage_mounts.py): a directory per
# namespace on a filesystem the control plane and the nodes share.
PROVIDER_SHARED_DIRECTORY = "shared_directory"
# Its namespaces' groups: the provider gives each namespace directory a gid of its own from this
# range (fleet-wide, as it is stored on the shared filesystem), and a node's agent makes the
# tenant of an allocation the namespace is attached to a member. Disjoint from system ids (< 1000)
# and from the agents' tenant uid range (baremetal_users.UserAccountConfig, 20000-29999).
NAMESPACE_GID_MIN = 3_000_000
NAMESPACE_GID_MAX = 3_999_999


class NamespaceStatus(StrEnum):
    ACTIVE = "active"
    # Asked to be deleted (StorageNamespaceDeleteWorkflow runs): takes no new attachment, no
    # longer billed or counted against the project's limits, its data still being removed.
    DELETING = "deleting"
    DELETED = "deleted"  # the provider reported its data gone


# StorageNamespaceDeleteWorkflow `storage-namespace-delete-{namespace id}` (workflows/
# storage_namespace.py): the gateway starts it with update-with-start (ACCEPT_DELETE_UPDATE
# answers once the namespace is `deleting`, or refuses); it removes the data through the provider
# in heartbeating, retried steps and marks the namespace `deleted` only once the provider reports
# its directory gone.
NAMESPACE_DELETE_WORKFLOW = "StorageNamespaceDeleteWorkflow"
NAMESPACE_DELETE_WORKFLOW_ID_PREFIX = "storage-namespace-delete-"
ACCEPT_DELETE_UPDATE = "accept_delete"


def namespace_delete_workflow_id(namespace_id: str) -> str:
    return f"{NAMESPACE_DELETE_WORKFLOW_ID_PREFIX}{namespace_id}"


# Control-plane activities (worker: activities/storage.py).
ATTACHMENT_OPEN = "storage.attachment_open"
ATTACHMENT_TRANSITION = "storage.attachment_transition"
ATTACHMENT_PRECHECK = "storage.attachment_precheck"  # measures, then decides (older builds)
NAMESPACE_USAGE = "storage.namespace_usage"  # the provider's measure, while `requested`
ATTACHMENT_PRECHECK_WITH_USAGE = "storage.attachment_precheck_with_usage"
ATTACHMENT_NODE_STATUS = "storage.attachment_node_status"  # before a detach asks the node
ATTACHMENT_NODE_OBSERVE = "storage.attachment_node_observe"  # before an abandon: is it gone?
GRANT_APPLY = "storage.grant_apply"
GRANT_REVOKE = "storage.grant_revoke"
HOST_TASK_QUEUE = "storage.host_task_queue"
HOST_TASK_FINISH = "storage.host_task_finish"
DETACH_FOR_RELEASE = "storage.detach_for_release"
# StorageNamespaceDeleteWorkflow's: active → deleting (or the refusal), a bounded removal of the
# data (heartbeating per chunk), deleting → deleted once the provider reports it gone.
NAMESPACE_DELETE_BEGIN = "storage.namespace_delete_begin"
NAMESPACE_REMOVE_DATA = "storage.namespace_remove_data"
NAMESPACE_DELETE_FINISH = "storage.namespace_delete_finish"

# AllocationWorkflow's release detaches the allocation's attachments first: when its release
# plan counts any; a plan recorded by an older build has no count, and this patch decided.
RELEASE_DETACHES_STORAGE_PATCH = "release-detaches-storage"
# StorageAttachmentWorkflow: a detach that ends `detached` answers every detach request waiting
# on it, also those accepted while it ran (before: they waited forever, and so did the workflow).
DETACHED_ANSWERS_ALL_PATCH = "storage-detached-answers-all"
# StorageAttachmentWorkflow: the provider measures the namespace before the precheck begins, so a
# provider that cannot fails the attachment from `requested` (before: the precheck measured, and
# a missing namespace directory measured as empty).
MEASURE_BEFORE_PRECHECK_PATCH = "storage-measure-before-precheck"
# StorageAttachmentWorkflow: a detach asked for before the mount began stops the attach once the
# grant is applied (grant_applied → failed, then detached) instead of mounting only to unmount.
DETACH_BEFORE_MOUNT_CANCELS_PATCH = "storage-detach-before-mount-cancels"
# StorageAttachmentWorkflow: a detach whose node is offline fails at once (a mounted attachment:
# mounted → detach_failed) instead of waiting out the unmount's schedule-to-start timeout.
OFFLINE_NODE_FAILS_DETACH_PATCH = "storage-offline-node-fails-detach"
# StorageAttachmentWorkflow: an admin abandons a detach_failed attachment whose node is observed
# gone (issue 35): detach_failed → detaching → detached, the grant revoked, nothing unmounted.
ABANDON_PATCH = "storage-abandon-on-dead-node"

# AdminOperationWorkflow operations (named, and listed in OPERATIONS, in contracts.admin_operation).
NAMESPACE_CREATE = STORAGE_NAMESPACE_CREATE
NAMESPACE_DELETE = STORAGE_NAMESPACE_DELETE

# Host tasks on `node-{id}` (agent/storage_mounts.py), STORAGE_MOUNT and STORAGE_UNMOUNT, are
# named in contracts/host_tasks.py with the other host tasks (imported above).

# Error types: API error codes (gateway) and attachment failure reasons (read model).
NAMESPACE_NOT_FOUND = "storage_namespace_not_found"
NAMESPACE_EXISTS = "storage_namespace_exists"
NAMESPACE_ATTACHED = "storage_namespace_attached"
# An attachment asked for a namespace being deleted (409).
NAMESPACE_DELETING = "storage_namespace_deleting"
# What a delete request is refused with (StorageNamespaceDeleteWorkflow's accept update).
NAMESPACE_DELETE_REFUSALS = (NAMESPACE_NOT_FOUND, NAMESPACE_ATTACHED)
ALLOCATION_NOT_ATTACHABLE = "allocation_not_attachable"
QUOTA_EXCEEDED = "quota_exceeded"
MULTI_WRITER_NOT_ALLOWED = "multi_writer_not_allowed"
WRITER_CONFLICT = "writer_conflict"
GRANT_FAILED = "storage_grant_failed"
MOUNT_FAILED = "storage_mount_failed"
UNMOUNT_FAILED = "storage_unmount_failed"
PROVIDER_UNAVAILABLE = "storage_provider_unavailable"  # the namespace could not be measured
DETACHED_BEFORE_MOUNT = "detached_before_mount"  # the attach stopped for a detach
NODE_OFFLINE = "node_offline"  # the node's agent is silent (docs/lifecycles/node.md#detection): no
# unmount to ask
# An allocation release whose attachments did not all detach: the release ends release_failed.
STORAGE_DETACH_FAILED = "storage_detach_failed"
OPEN_REFUSALS = (NAMESPACE_NOT_FOUND, ALLOCATION_NOT_ATTACHABLE, NAMESPACE_DELETING)
# Abandon (ABANDON_UPDATE): the refusals (409 codes) and the detached attachment's failure_reason.
ATTACHMENT_NOT_DETACH_FAILED = "attachment_not_detach_failed"
ATTACHMENT_DETACH_IN_PROGRESS = "attachment_detach_in_progress"  # a detach or abandon runs
NODE_ALIVE = "node_alive"  # its agent was heard from within the liveness window: retry-detach
NODE_LIVENESS_UNKNOWN = "node_liveness_unknown"  # Temporal could not say: silence not assumed
ABANDON_REFUSALS = (
    ATTACHMENT_NOT_DETACH_FAILED,
    ATTACHMENT_DETACH_IN_PROGRESS,
    NODE_ALIVE,
    NODE_LIVENESS_UNKNOWN,
    GRANT_FAILED,
)
ATTACHMENT_ABANDONED = "abandoned"  # failure_reason of a detached attachment an admin abandoned


@dataclass
class StoragePolicy:
    """Timeouts and retry bounds, fixed at start so the workflow stays deterministic."""

    node_schedule_to_start_seconds: float = 60.0
    host_task_timeout_seconds: float = 300.0
    host_heartbeat_timeout_seconds: float = 30.0
    mount_max_attempts: int = 3
    unmount_max_attempts: int = 3
    retry_initial_seconds: float = 1.0


@dataclass
class AttachmentInput:
    attachment_id: str
    project_id: str
    allocation_id: str
    namespace_id: str
    mode: str  # WriteMode
    requested_by: str  # the API token's name, for the event rows
    policy: StoragePolicy = field(default_factory=StoragePolicy)


@dataclass
class AttachmentView:
    """What the workflow answers (open, detach, status) and the activities return."""

    attachment_id: str
    status: str
    node_id: str | None = None
    mount_path: str | None = None
    failure_reason: str | None = None
    failure_message: str | None = None
    detach_attempts: int = 0
    guest_mount_tag: str | None = None


@dataclass
class DetachRequest:
    actor: str  # DetachActor
    reason: str | None = None
    # Answer once this request's detach ended (detached or detach_failed), not when accepted.
    wait: bool = False


@dataclass
class AbandonRequest:
    """ABANDON_UPDATE: an admin's, audited by the gateway. The liveness window is the control
    plane's (Settings.node_offline_after_seconds), fixed by the caller."""

    actor: str  # DetachActor.ADMIN
    reason: str
    liveness_window_seconds: float


@dataclass
class NodeObserveInput:
    attachment_id: str
    liveness_window_seconds: float


@dataclass
class NodeObservation:
    """What ATTACHMENT_NODE_OBSERVE saw now: `refusal` None means the node is gone (no node row,
    or its agent not heard from within the window, by its recorded contact and its queue's
    pollers as Temporal describes them now)."""

    node_id: str
    node_status: str | None  # None: no node row
    last_seen: str | None  # ISO 8601, the newest of recorded contact and pollers; None: never
    observed_at: str  # ISO 8601, the database clock
    refusal: str | None = None  # NODE_ALIVE | NODE_LIVENESS_UNKNOWN
    message: str = ""


# --- host tasks (node agent) ----------------------------------------------------------------------


@dataclass
class StorageMountInput:
    """The agent resolves `namespace_key` under its own configured export root and mounts at its
    own mount base: no path to act on comes from the control plane
    (docs/lifecycles/node.md#what-the-control-plane-asks-of-a-node)."""

    task_id: str
    attachment_id: str
    allocation_id: str
    node_id: str
    provider: str
    namespace_key: str
    mode: str  # WriteMode: read_only mounts read-only
    # SkuShape: a gpu_slice allocation's VM gets the mount as a virtiofs filesystem too. Empty
    # from workflows of older builds: the VM gets it if the node has one for the allocation.
    allocation_shape: str = ""


@dataclass
class StorageMountResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    mount_path: str  # as seen on the node
    read_only: bool
    adopted_existing: bool = False
    guest_mount_tag: str | None = None  # the slice VM's virtiofs tag (virtiofs_tag)


@dataclass
class StorageUnmountInput:
    task_id: str
    attachment_id: str
    allocation_id: str
    node_id: str
    allocation_shape: str = ""  # SkuShape: a gpu_slice VM gives the filesystem back first


@dataclass
class StorageUnmountResult:
    task_id: str
    started_at: str
    finished_at: str
    phases: list[HostPhase]
    was_mounted: bool


# --- activities -----------------------------------------------------------------------------------


@dataclass
class OpenInput:
    attachment_id: str
    project_id: str
    allocation_id: str
    namespace_id: str
    mode: str
    workflow_id: str
    requested_by: str


@dataclass
class TransitionInput:
    attachment_id: str
    to_status: str
    actor: str
    reason: str | None = None
    failure_reason: str | None = None
    failure_message: str | None = None
    mount_path: str | None = None
    guest_mount_tag: str | None = None


@dataclass
class PrecheckResult:
    """`refusal`: the failure reason (QUOTA_EXCEEDED, ...) when the mode is not allowed now."""

    node_id: str
    namespace_key: str
    provider: str
    refusal: str | None = None
    message: str = ""
    usage_bytes: int = 0
    quota_bytes: int = 0
    allocation_shape: str = ""  # SkuShape


@dataclass
class PrecheckInput:
    attachment_id: str
    usage_bytes: int  # NAMESPACE_USAGE's measure


@dataclass
class GrantInput:
    attachment_id: str
    namespace_key: str
    node_id: str
    mode: str


@dataclass
class HostTaskQueueInput:
    attachment_id: str
    task_id: str
    kind: str  # STORAGE_MOUNT | STORAGE_UNMOUNT
    workflow_id: str


@dataclass
class HostTaskFinishInput:
    task_id: str
    mount: StorageMountResult | None = None
    unmount: StorageUnmountResult | None = None
    error_type: str | None = None
    error_message: str | None = None
    phases: list[HostPhase] = field(default_factory=list)


@dataclass
class DetachForReleaseInput:
    allocation_id: str
    reason: str | None = None


@dataclass
class DetachForReleaseResult:
    detached: list[str] = field(default_factory=list)  # attachment ids
    failed: list[str] = field(default_factory=list)  # ended detach_failed


# --- namespaces (AdminOperationWorkflow operations) -----------------------------------------------


@dataclass
class NamespaceCreateInput:
    actor: Actor
    namespace_id: str
    project_id: str
    name: str
    quota_bytes: int
    allow_multi_writer: bool = False


@dataclass
class NamespaceDeleteInput:
    actor: Actor
    namespace_id: str
    project_id: str | None  # None: an admin, any project


@dataclass
class NamespaceDeleteWorkflowInput:
    """A continued run carries what the earlier runs removed."""

    actor: Actor
    namespace_id: str
    project_id: str | None  # None: an admin, any project
    removed_entries: int = 0
    chunks: int = 0


@dataclass
class NamespaceRemoveDataResult:
    """One NAMESPACE_REMOVE_DATA attempt: what it removed, in how many chunks, and whether the
    provider reports the namespace's data gone."""

    removed_entries: int = 0
    chunks: int = 0
    gone: bool = False


@dataclass
class NamespaceDeleteFinishInput:
    actor: Actor
    namespace_id: str
    removed_entries: int
    chunks: int


@dataclass
class NamespaceDeleteResult:
    """The delete workflow's result: `refusal` (NAMESPACE_DELETE_REFUSALS) when it was refused
    and deleted nothing, else the deleted namespace."""

    namespace_id: str
    status: str
    refusal: str | None = None
    removed_entries: int = 0
    chunks: int = 0


@dataclass
class NamespaceState:
    id: str
    project_id: str
    name: str
    provider: str
    quota_bytes: int
    allow_multi_writer: bool
    status: str
    created_at: str  # ISO 8601
    usage_bytes: int = 0
