"""Tables. Lifecycle tables are read models written by activities; the gateway only reads them
(except for the identity tables it owns: projects, tokens, SSH keys, audit)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Computed,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, INET, INT4RANGE, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from contracts.node_drain import DrainStatus
from contracts.states import (
    LIVE_ALLOCATION_STATUSES,
    AllocationGroupStatus,
    AllocationStatus,
    ClaimKind,
    ClaimStatus,
    NodeStatus,
    NodeTaskStatus,
    SkuShape,
    SlotStatus,
    TokenRole,
)
from contracts.storage import AttachmentStatus, NamespaceStatus, WriteMode
from contracts.terminal_session import TerminalSessionStatus


def _check_in(column: str, values: type[Any]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


NOW = text("now()")
CLOCK = text("clock_timestamp()")


class Base(DeclarativeBase):
    pass


# --- identity -----------------------------------------------------------------------------------


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)


class ApiToken(Base):
    """Bearer tokens, stored as SHA-256 of the token (tokens are 256-bit random, so a fast hash is
    enough); the plaintext is shown once at issue time."""

    __tablename__ = "api_tokens"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    display_prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(16))
    project_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("projects.id"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        CheckConstraint(_check_in("role", TokenRole), name="api_tokens_role"),
        CheckConstraint(
            "(role = 'admin' AND project_id IS NULL)"
            " OR (role = 'tenant' AND project_id IS NOT NULL)",
            name="api_tokens_scope",
        ),
    )


class SshKey(Base):
    """A tenant's SSH *public* key. The key material is stored (the node needs it) but never
    returned by the API, logged or written to history in plaintext; responses show the
    fingerprint."""

    __tablename__ = "ssh_keys"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(100))
    key_type: Mapped[str] = mapped_column(String(40))
    public_key: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        UniqueConstraint("project_id", "name", name="ssh_keys_project_name"),
        UniqueConstraint("project_id", "fingerprint", name="ssh_keys_project_fingerprint"),
    )


class AuditEntry(Base):
    """Every admin mutation: who, in which role, why, what, on what, from which state to which,
    and the workflows it touched."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    actor: Mapped[str] = mapped_column(String(200))
    actor_token_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    role: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    action: Mapped[str] = mapped_column(String(100))
    target_type: Mapped[str] = mapped_column(String(50))
    target_id: Mapped[str] = mapped_column(String(100))
    prior_state: Mapped[str | None] = mapped_column(String(50))
    expected_state: Mapped[str | None] = mapped_column(String(50))
    workflow_ids: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'"))
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    __table_args__ = (Index("audit_log_target", "target_type", "target_id"),)


# --- catalog and fleet ---------------------------------------------------------------------------


class Sku(Base):
    __tablename__ = "sku_catalog"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    region: Mapped[str] = mapped_column(String(50), primary_key=True)
    shape: Mapped[str] = mapped_column(String(16))
    gpu_model: Mapped[str] = mapped_column(String(100))
    allowed_gpu_counts: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    price_per_gpu_hour_minor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # What one GPU of a slice brings along (bare metal gets the whole node).
    vcpus_per_gpu: Mapped[int] = mapped_column(Integer, server_default=text("8"))
    memory_mb_per_gpu: Mapped[int] = mapped_column(Integer, server_default=text("65536"))
    image: Mapped[str] = mapped_column(String(200), server_default=text("'ubuntu-22.04-cuda'"))
    image_sha256: Mapped[str] = mapped_column(String(64), server_default=text("''"))
    active: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    __table_args__ = (
        CheckConstraint(_check_in("shape", SkuShape), name="sku_catalog_shape"),
        CheckConstraint("cardinality(allowed_gpu_counts) > 0", name="sku_catalog_counts"),
    )


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    # Unique among nodes that are not deleted: re-onboarding after a full decommission makes a
    # new node record with the same hostname (docs/lifecycles/node.md#who-moves-it).
    hostname: Mapped[str] = mapped_column(String(253))
    region: Mapped[str] = mapped_column(String(50))
    sku: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(32))
    # "maas" for nodes a MaasNodeOnboardWorkflow created; NULL for manually registered ones.
    onboarding_mode: Mapped[str | None] = mapped_column(String(16))
    gpu_count: Mapped[int] = mapped_column(Integer)
    # [{"numa_node": 0, "cpus": "0-47", "memory_mb": 1024000, "gpus": 4}, ...]
    numa_layout: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, server_default=text("'[]'"))
    host_address: Mapped[str | None] = mapped_column(String(255))
    # How an operator reaches the host (docs/lifecycles/node.md#access-fields): onboarding sets the
    # site's deploy user.
    port: Mapped[int] = mapped_column(Integer, server_default=text("22"))
    ssh_username: Mapped[str] = mapped_column(String(64), server_default=text("'root'"))
    access_method: Mapped[str] = mapped_column(String(32), server_default=text("'node_agent'"))
    last_agent_contact_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    enrolled_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    # The agent's last GPU inventory report, and whether it matches this node's GPU slots.
    gpu_inventory: Mapped[list[dict[str, Any]]] = mapped_column(
        JSONB, server_default=text("'[]'::jsonb")
    )
    inventory_matches: Mapped[bool | None] = mapped_column(Boolean)
    # Ironic's "protected": while set, every destructive or trust-granting step refuses with
    # node_protected (MAAS release/erase/power-off/delete, force-release, scratch wipe). Set and
    # cleared only by audited admin calls; migration 0029.
    protected: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    protected_reason: Mapped[str | None] = mapped_column(String(500))
    # How many of the node's GPU slots are free: in all, by NUMA node number (the array is
    # subscripted by it) and on the NUMA node with the most. Kept by triggers on gpu_slots
    # (migration 0013), never written here: placement ranks nodes by these instead of counting
    # every free slot of a region.
    free_gpus: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    free_gpus_by_numa: Mapped[list[int]] = mapped_column(
        ARRAY(Integer), server_default=text("'{}'")
    )
    free_gpus_one_numa: Mapped[int] = mapped_column(
        Integer, Computed("int_array_largest(free_gpus_by_numa)", persisted=True)
    )
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(_check_in("status", NodeStatus), name="nodes_status"),
        CheckConstraint("port BETWEEN 1 AND 65535", name="nodes_port"),
        # In placement's ranking order, with the NUMA-fit counter checked on its entries
        # (migration 0017, activities/placement_sql.py).
        Index(
            "nodes_placement",
            "region",
            "sku",
            "status",
            "free_gpus",
            "id",
            "free_gpus_one_numa",
        ),
        Index("nodes_numa_fit", "region", "sku", "status", "free_gpus_one_numa"),
        Index("nodes_inventory_order", "created_at", "id"),  # the admin inventory's pages
        Index(
            "nodes_hostname_live",
            "hostname",
            unique=True,
            postgresql_where=text("status <> 'deleted'"),
        ),
    )


class GpuSlot(Base):
    __tablename__ = "gpu_slots"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    gpu_index: Mapped[int] = mapped_column(Integer)
    numa_node: Mapped[int] = mapped_column(Integer)
    pci_address: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), server_default=text("'free'"))
    allocation_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    # Set when a health check after release failed, or a failed provision's cleanup was not
    # proven (`provision_cleanup_unconfirmed`): the slot is `disabled` until an operator returns
    # it to service.
    quarantine_reason: Mapped[str | None] = mapped_column(Text)
    quarantined_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(_check_in("status", SlotStatus), name="gpu_slots_status"),
        CheckConstraint(
            "(status = 'reserved') = (allocation_id IS NOT NULL)", name="gpu_slots_reserved_owner"
        ),
        UniqueConstraint("node_id", "pci_address", name="gpu_slots_node_pci"),
        UniqueConstraint("node_id", "gpu_index", name="gpu_slots_node_index"),
        Index("gpu_slots_free", "node_id", postgresql_where=text("status = 'free'")),
    )


# --- allocations ---------------------------------------------------------------------------------


class Allocation(Base):
    __tablename__ = "allocations"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    sku: Mapped[str] = mapped_column(String(100))
    region: Mapped[str] = mapped_column(String(50))
    shape: Mapped[str] = mapped_column(String(16))
    gpu_count: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    ssh_key_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID), server_default=text("'{}'"))
    status: Mapped[str] = mapped_column(String(32))
    workflow_id: Mapped[str] = mapped_column(String(100))
    failure_reason: Mapped[str | None] = mapped_column(String(64))
    failure_message: Mapped[str | None] = mapped_column(Text)
    release_requested_by: Mapped[str | None] = mapped_column(String(16))
    release_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    hard_stopped: Mapped[bool | None] = mapped_column(Boolean)
    # Where the tenant connects (host or IP reported by the agent); never a credential.
    connect_host: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    provisioning_started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    active_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    releasing_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    released_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    release_failed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # Set when an admin detached it from release_failed (it is then `released`, its node or GPU
    # slots quarantined for cleanup; docs/lifecycles/allocation.md).
    detached_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    # A member of an allocation group (docs/lifecycles/allocation-group.md); `same_node_forbidden`:
    # its group's anti-affinity, held by the partial unique index below.
    allocation_group_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("allocation_groups.id")
    )
    same_node_forbidden: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    __table_args__ = (
        CheckConstraint(_check_in("status", AllocationStatus), name="allocations_status"),
        CheckConstraint(
            "detached_at IS NULL OR status = 'released'", name="allocations_detached_released"
        ),
        CheckConstraint(_check_in("shape", SkuShape), name="allocations_shape"),
        UniqueConstraint("project_id", "idempotency_key", name="allocations_idempotency"),
        Index("allocations_project_created", "project_id", "created_at", "id"),
        Index("allocations_node_created", "node_id", "created_at", "id"),
        # The admin list's pages, unfiltered and by status (newest first; migration 0023).
        Index("allocations_created", "created_at", "id"),
        Index("allocations_status_created", "status", "created_at", "id"),
        Index(
            "allocations_group_same_node",
            "allocation_group_id",
            "node_id",
            unique=True,
            postgresql_where=text(
                "same_node_forbidden AND status IN ("
                + ", ".join(repr(s.value) for s in sorted(LIVE_ALLOCATION_STATUSES))
                + ")"
            ),
        ),
    )


class AllocationGroup(Base):
    """docs/lifecycles/allocation-group.md: an aggregate over member allocations; its status is
    derived by AllocationGroupWorkflow and applied by its activities. It holds no capacity
    itself."""

    __tablename__ = "allocation_groups"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_fingerprint: Mapped[str] = mapped_column(String(64))
    spread: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32))
    workflow_id: Mapped[str] = mapped_column(String(100))
    release_requested_by: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint(
            _check_in("status", AllocationGroupStatus), name="allocation_groups_status"
        ),
        CheckConstraint(
            "spread IN ('same_node_forbidden', 'any')", name="allocation_groups_spread"
        ),
        UniqueConstraint("project_id", "idempotency_key", name="allocation_groups_idempotency"),
        Index("allocation_groups_project_created", "project_id", "created_at", "id"),
        Index("allocation_groups_status", "status"),
    )


class AllocationGroupMember(Base):
    """A group's member as asked for. Its allocation row exists once placement reserved it; a
    member placement refused has none, only its `rejection_reason` here."""

    __tablename__ = "allocation_group_members"
    allocation_id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    group_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocation_groups.id"))
    position: Mapped[int] = mapped_column(Integer)
    required: Mapped[bool] = mapped_column(Boolean)
    sku: Mapped[str] = mapped_column(String(100))
    region: Mapped[str] = mapped_column(String(50))
    gpu_count: Mapped[int] = mapped_column(Integer)
    rejection_reason: Mapped[str | None] = mapped_column(String(64))
    __table_args__ = (
        UniqueConstraint("group_id", "position", name="allocation_group_members_position"),
    )


class AllocationGroupEvent(Base):
    """Append-only: one row per group transition, written with it."""

    __tablename__ = "allocation_group_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    group_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocation_groups.id"))
    event: Mapped[str] = mapped_column(String(64))
    from_status: Mapped[str | None] = mapped_column(String(32))
    to_status: Mapped[str | None] = mapped_column(String(32))
    actor: Mapped[str | None] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("allocation_group_events_group", "group_id", "id"),)


class AllocationResourceClaim(Base):
    """What an allocation holds. The exclusion constraint in the migration makes a double
    booking impossible: a held claim covers a range of GPU indexes on its node (a whole-node
    claim covers all of them), and two held claims on one node may not overlap."""

    __tablename__ = "allocation_resource_claims"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    allocation_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocations.id"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    slot_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("gpu_slots.id"))
    kind: Mapped[str] = mapped_column(String(16))
    footprint: Mapped[Any] = mapped_column(INT4RANGE)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    released_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        CheckConstraint(_check_in("kind", ClaimKind), name="claims_kind"),
        CheckConstraint(_check_in("status", ClaimStatus), name="claims_status"),
        CheckConstraint("(kind = 'gpu_slot') = (slot_id IS NOT NULL)", name="claims_slot"),
        Index("claims_allocation", "allocation_id"),
    )


class AllocationEvent(Base):
    """Append-only (a trigger rejects UPDATE and DELETE): one row per lifecycle transition,
    written in the same transaction as the transition."""

    __tablename__ = "allocation_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    allocation_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocations.id"))
    event: Mapped[str] = mapped_column(String(64))
    from_status: Mapped[str | None] = mapped_column(String(32))
    to_status: Mapped[str | None] = mapped_column(String(32))
    actor: Mapped[str | None] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("allocation_events_allocation", "allocation_id", "id"),)


class SliceVlanPool(Base):
    """The VLAN ids slice networks of a region (the slice hosts' site) are drawn from: what the
    site's switches trunk to the slice nodes' uplinks. A region without a row draws from the
    placement's default range (activities/placement_sql.py DEFAULT_SLICE_VLAN_POOL)."""

    __tablename__ = "slice_vlan_pools"
    region: Mapped[str] = mapped_column(String(50), primary_key=True)
    first_vid: Mapped[int] = mapped_column(Integer)
    last_vid: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(
            "1 <= first_vid AND first_vid <= last_vid AND last_vid <= 4094",
            name="slice_vlan_pools_range",
        ),
    )


class ProjectSliceVlan(Base):
    """The VLAN a project's slice network holds in a region: assigned by the placement of its
    first live slice allocation there (in the same statement), deleted with the release of its
    last one. The unique constraints are what keep two projects off one VLAN."""

    __tablename__ = "project_slice_vlans"
    region: Mapped[str] = mapped_column(String(50), primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    vlan_id: Mapped[int] = mapped_column(Integer)
    assigned_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint("vlan_id BETWEEN 1 AND 4094", name="project_slice_vlans_vid"),
        UniqueConstraint("region", "vlan_id", name="project_slice_vlans_vid_once"),
    )


class NodeTask(Base):
    """One host call on a node's agent (a Temporal activity on `node-{id}`), mirrored for the
    timeline. Output is sanitised before it is stored."""

    __tablename__ = "node_tasks"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    allocation_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("allocations.id"))
    kind: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    workflow_id: Mapped[str] = mapped_column(String(100))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    dispatched_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    output: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    error_type: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (
        CheckConstraint(_check_in("status", NodeTaskStatus), name="node_tasks_status"),
        Index("node_tasks_allocation", "allocation_id", "created_at"),
    )


class NodeTaskEvent(Base):
    __tablename__ = "node_task_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    node_task_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("node_tasks.id"))
    allocation_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    phase: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # The host activity's attempt that went through the phase (0: recorded before attempts were).
    attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    __table_args__ = (
        Index("node_task_events_task", "node_task_id", "occurred_at"),
        UniqueConstraint(
            "node_task_id", "attempt", "phase", "status", name="node_task_events_once"
        ),
    )


# --- MAAS sites (docs/maas-sites.md)
# ----------------------------------------------------------------


class MaasSite(Base):
    """A MAAS region controller. Secrets live in Vault; the row holds only their paths."""

    __tablename__ = "maas_sites"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    region_code: Mapped[str] = mapped_column(String(50))
    api_base_url: Mapped[str] = mapped_column(String(500))
    api_token_vault_path: Mapped[str] = mapped_column(String(300))
    default_power_creds_vault_path: Mapped[str] = mapped_column(String(300))
    deploy_password_vault_path: Mapped[str] = mapped_column(String(300))
    pxe_iface: Mapped[str] = mapped_column(String(64))
    pxe_vlan_vid: Mapped[int] = mapped_column(Integer)
    node_pxe_iface: Mapped[str] = mapped_column(String(64))
    distro_series: Mapped[str] = mapped_column(String(64), server_default=text("'ubuntu/noble'"))
    architecture: Mapped[str] = mapped_column(String(64), server_default=text("'amd64/generic'"))
    deploy_user: Mapped[str] = mapped_column(String(64), server_default=text("'hpcadmin'"))
    deploy_ssh_iface: Mapped[str] = mapped_column(String(64), server_default=text("'eno8303'"))
    upstream_dns_servers: Mapped[list[str]] = mapped_column(
        ARRAY(Text), server_default=text("'{1.1.1.1,8.8.8.8}'")
    )
    status: Mapped[str] = mapped_column(String(16), server_default=text("'active'"))
    # When the MAAS token was last validated and written to Vault (never the token itself).
    credentials_updated_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    maas_version: Mapped[str | None] = mapped_column(String(64))
    # The profile a request that names none runs with (docs/maas-sites.md#site-profiles); created
    # with the site.
    default_profile_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("maas_site_profiles.id", use_alter=True)
    )
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint("status IN ('active', 'disabled')", name="maas_sites_status"),
        CheckConstraint("pxe_vlan_vid BETWEEN 0 AND 4094", name="maas_sites_vlan"),
    )


class MaasSitePolicy(Base):
    """The site's implicit default profile: every knob of docs/maas-sites.md#policy-knobs with its
    default."""

    __tablename__ = "maas_site_policies"
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"), primary_key=True)
    strict_pxe_preflight: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    enable_phase2_roce: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    require_hw_sync: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    hardware_sync_interval: Mapped[str] = mapped_column(String(16), server_default=text("'15m'"))
    release_fallback_no_erase: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    enable_deploy_retry_on_datasource_failure: Mapped[bool] = mapped_column(
        Boolean, server_default=text("true")
    )
    max_deploy_retry_attempts: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    auto_claim_single_new_machine: Mapped[bool] = mapped_column(
        Boolean, server_default=text("false")
    )
    batch_max_parallel: Mapped[int] = mapped_column(Integer, server_default=text("10"))
    site_bootstrap_bundle_ref: Mapped[str | None] = mapped_column(String(300))
    enrollment_token_ttl_seconds: Mapped[int] = mapped_column(Integer, server_default=text("7200"))
    # How often the site reconciler (Temporal Schedule maas-reconciler-{site_id}) runs.
    reconcile_interval_seconds: Mapped[int] = mapped_column(Integer, server_default=text("300"))
    # docs/lifecycles/onboarding.md#timeouts-and-preflight: how often onboarding waits poll MAAS,
    # and how long each wait may take.
    maas_poll_interval_ms: Mapped[int] = mapped_column(Integer, server_default=text("10000"))
    discovery_timeout_seconds: Mapped[int] = mapped_column(Integer, server_default=text("900"))
    commission_timeout_seconds: Mapped[int] = mapped_column(Integer, server_default=text("3600"))
    deploy_timeout_seconds: Mapped[int] = mapped_column(Integer, server_default=text("3600"))
    hw_sync_seed_timeout_seconds: Mapped[int] = mapped_column(Integer, server_default=text("900"))
    hw_sync_health_timeout_seconds: Mapped[int] = mapped_column(
        Integer, server_default=text("1800")
    )
    enrollment_timeout_seconds: Mapped[int] = mapped_column(Integer, server_default=text("1800"))
    # Whether a RoCE phase-2 link MAAS refuses stops the onboarding
    # (docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions: it does not).
    roce_failures_stop_job: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # The share of the site's bound machines a machines list may miss before the reconciler
    # takes the list as suspect and changes nothing.
    reconcile_max_missing_share: Mapped[float] = mapped_column(Float, server_default=text("0.1"))
    # Whether the reconciler releases and powers off a retired node's Deployed machine (off:
    # retire leaves the machine alone), and how many nodes one reconcile may quarantine (more:
    # it quarantines none and records a refused reconcile), since 0031.
    release_retired_machines: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    reconcile_max_quarantine: Mapped[int] = mapped_column(Integer, server_default=text("10"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(
            "reconcile_max_missing_share BETWEEN 0 AND 1", name="policy_reconcile_missing_share"
        ),
        CheckConstraint(
            "reconcile_max_quarantine BETWEEN 1 AND 100000", name="policy_reconcile_max_quarantine"
        ),
        CheckConstraint("max_deploy_retry_attempts BETWEEN 0 AND 10", name="policy_deploy_retries"),
        CheckConstraint("batch_max_parallel BETWEEN 1 AND 500", name="policy_batch_parallel"),
        CheckConstraint("enrollment_token_ttl_seconds > 0", name="policy_enrollment_ttl"),
        CheckConstraint("hardware_sync_interval ~ '^[0-9]+[smh]$'", name="policy_hw_sync_interval"),
        CheckConstraint("maas_poll_interval_ms BETWEEN 10 AND 600000", name="policy_poll_interval"),
        CheckConstraint(
            "LEAST(discovery_timeout_seconds, commission_timeout_seconds, deploy_timeout_seconds,"
            " hw_sync_seed_timeout_seconds, hw_sync_health_timeout_seconds,"
            " enrollment_timeout_seconds) > 0",
            name="policy_timeouts_positive",
        ),
    )


class MaasSiteProfile(Base):
    """A policy bundle and runtime shape one site can run (docs/maas-sites.md#site-profiles): every
    knob a run uses (contracts.onboarding.SitePolicyView) but the site-only ones, plus the
    profile-scoped site values of §3.6.
    NULL columns fall back to the site's own values and policy; a disabled profile takes no new
    onboardings or decommissions (running ones go on with the policy they resolved)."""

    __tablename__ = "maas_site_profiles"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    name: Mapped[str] = mapped_column(String(100))
    description: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), server_default=text("'active'"))
    distro_series: Mapped[str | None] = mapped_column(String(64))
    architecture: Mapped[str | None] = mapped_column(String(64))
    node_pxe_iface: Mapped[str | None] = mapped_column(String(64))
    pxe_vlan_vid: Mapped[int | None] = mapped_column(Integer)
    strict_pxe_preflight: Mapped[bool | None] = mapped_column(Boolean)
    enable_phase2_roce: Mapped[bool | None] = mapped_column(Boolean)
    require_hw_sync: Mapped[bool | None] = mapped_column(Boolean)
    # No hardware_sync_interval: site-only (contracts.onboarding.SITE_ONLY_KNOBS), since 0027.
    release_fallback_no_erase: Mapped[bool | None] = mapped_column(Boolean)
    enable_deploy_retry_on_datasource_failure: Mapped[bool | None] = mapped_column(Boolean)
    max_deploy_retry_attempts: Mapped[int | None] = mapped_column(Integer)
    auto_claim_single_new_machine: Mapped[bool | None] = mapped_column(Boolean)
    batch_max_parallel: Mapped[int | None] = mapped_column(Integer)
    site_bootstrap_bundle_ref: Mapped[str | None] = mapped_column(String(300))
    enrollment_token_ttl_seconds: Mapped[int | None] = mapped_column(Integer)
    maas_poll_interval_ms: Mapped[int | None] = mapped_column(Integer)
    discovery_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    commission_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    deploy_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    hw_sync_seed_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    hw_sync_health_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    enrollment_timeout_seconds: Mapped[int | None] = mapped_column(Integer)
    roce_failures_stop_job: Mapped[bool | None] = mapped_column(Boolean)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        UniqueConstraint("site_id", "name", name="maas_site_profile_name"),
        CheckConstraint("status IN ('active', 'disabled')", name="maas_site_profiles_status"),
        CheckConstraint(
            "max_deploy_retry_attempts BETWEEN 0 AND 10", name="profile_deploy_retries"
        ),
        CheckConstraint("batch_max_parallel BETWEEN 1 AND 500", name="profile_batch_parallel"),
        CheckConstraint("enrollment_token_ttl_seconds > 0", name="profile_enrollment_ttl"),
        CheckConstraint(
            "maas_poll_interval_ms BETWEEN 10 AND 600000", name="profile_poll_interval"
        ),
        CheckConstraint(
            "LEAST(discovery_timeout_seconds, commission_timeout_seconds, deploy_timeout_seconds,"
            " hw_sync_seed_timeout_seconds, hw_sync_health_timeout_seconds,"
            " enrollment_timeout_seconds) > 0",
            name="profile_timeouts_positive",
        ),
        CheckConstraint("pxe_vlan_vid BETWEEN 0 AND 4094", name="profile_vlan"),
    )


class MaasPowerCredentialOverride(Base):
    """A per-node exception to the site's default BMC credentials
    (docs/maas-sites.md#power-credential-overrides)."""

    __tablename__ = "maas_power_credential_overrides"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    selector_type: Mapped[str] = mapped_column(String(16))
    selector_value: Mapped[str] = mapped_column(String(255))
    vault_path: Mapped[str] = mapped_column(String(300))
    status: Mapped[str] = mapped_column(String(16), server_default=text("'active'"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        UniqueConstraint("site_id", "selector_type", "selector_value", name="power_override_once"),
        CheckConstraint(
            "selector_type IN ('hostname', 'ipmi_ip', 'pxe_mac')", name="power_override_selector"
        ),
        CheckConstraint("status IN ('active', 'disabled')", name="power_override_status"),
    )


class MaasRoceAssignment(Base):
    __tablename__ = "maas_roce_assignments"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    hostname: Mapped[str] = mapped_column(String(253))
    interface: Mapped[str] = mapped_column(String(64))
    ipv4_cidr: Mapped[str] = mapped_column(String(43))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        UniqueConstraint("site_id", "hostname", "interface", name="roce_assignment_once"),
    )


# --- node agent enrollment --------------------------------------------------------------------


class NodeEnrollmentToken(Base):
    """A single-use, TTL-bound token that lets a node's agent enroll once (stored hashed; the
    plaintext goes to the node through cloud-init and nowhere else)."""

    __tablename__ = "node_enrollment_tokens"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    used_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("node_enrollment_tokens_node", "node_id"),)


# --- billing (docs/billing.md#metering-and-balances, docs/lifecycles/balance.md,
# docs/lifecycles/payment-session.md)
# -------------------------------------------------------------------


class LedgerEntry(Base):
    """Credits (positive) and debits (negative) of a project's billing account, in minor units.
    The balance is their sum; nothing else stores money. `idempotency_key` makes every posting
    happen at most once: a debit per (usage record, window), a credit per payment session."""

    __tablename__ = "ledger_entries"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    amount_minor: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    # usage_debit | storage_debit | payment_credit | admin_credit
    kind: Mapped[str] = mapped_column(String(32))
    idempotency_key: Mapped[str] = mapped_column(String(200), unique=True)
    usage_record_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    storage_usage_record_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint("amount_minor <> 0", name="ledger_nonzero"),
        CheckConstraint(
            "(kind IN ('usage_debit', 'storage_debit')) = (amount_minor < 0)",
            name="ledger_debits_negative",
        ),
        Index("ledger_project", "project_id", "created_at"),
    )


class UsageRecord(Base):
    """One allocation's billable window: opened when it becomes active, closed when it is
    released or lands in release_failed (a failed release is not charged)."""

    __tablename__ = "usage_records"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    allocation_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocations.id"), unique=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    sku: Mapped[str] = mapped_column(String(100))
    gpu_count: Mapped[int] = mapped_column(Integer)
    price_per_gpu_hour_minor: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3), server_default=text("'usd'"))
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # Charged through this instant (windows are closed minute by minute).
    billed_until: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # What its windows were charged so far: updated with each posting of them (ledger.post_entries),
    # so the usage export never sums the ledger.
    charged_minor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    __table_args__ = (
        Index("usage_open", "project_id", postgresql_where=text("ended_at IS NULL")),
        # The usage export's keyset pages, newest first.
        Index("usage_project_started", "project_id", "started_at", "id"),
    )


# docs/lifecycles/balance.md defaults: low at 10.00 or less, depleted at 0 or less (minor units).
LOW_BALANCE_THRESHOLD_MINOR = 1000
DEPLETED_THRESHOLD_MINOR = 0
# Issue 37: a project's storage limits until an admin sets its own (billing_accounts columns).
DEFAULT_STORAGE_NAMESPACE_LIMIT = 10
DEFAULT_STORAGE_QUOTA_LIMIT_BYTES = 10 << 40  # 10 TiB
# How long a depleted account keeps its storage attached before the meter detaches it.
DEFAULT_STORAGE_GRACE_SECONDS = 72 * 3600


class BillingAccount(Base):
    """A project's balance state (healthy / low_balance / depleted) and its thresholds, and the
    balance: the ledger's running total, updated in the transaction of every posting
    (activities/billing/ledger.py), always equal to the sum of the project's entries."""

    __tablename__ = "billing_accounts"
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    currency: Mapped[str] = mapped_column(String(3), server_default=text("'usd'"))
    # docs/lifecycles/balance.md: a balance of 0 or less is depleted, so an account starts depleted;
    # every credit and every metering run recomputes it (activities/billing/accounts.py).
    state: Mapped[str] = mapped_column(String(16), server_default=text("'depleted'"))
    low_balance_threshold_minor: Mapped[int] = mapped_column(
        BigInteger, server_default=text(str(LOW_BALANCE_THRESHOLD_MINOR))
    )
    depleted_threshold_minor: Mapped[int] = mapped_column(
        BigInteger, server_default=text(str(DEPLETED_THRESHOLD_MINOR))
    )
    # One low-balance notification per episode: set when sent, cleared when healthy again.
    low_balance_notified_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    state_changed_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), server_default=CLOCK
    )
    # Counts the times the balance left `healthy`: a notice goes out once per (kind, episode).
    episode: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    balance_minor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Storage limits (issue 37): active namespaces, and the sum of their quotas; admin-set.
    storage_namespace_limit: Mapped[int] = mapped_column(
        Integer, server_default=text(str(DEFAULT_STORAGE_NAMESPACE_LIMIT))
    )
    storage_quota_limit_bytes: Mapped[int] = mapped_column(
        BigInteger, server_default=text(str(DEFAULT_STORAGE_QUOTA_LIMIT_BYTES))
    )
    # Depleted this long (since state_changed_at), its storage attachments are detached.
    storage_grace_seconds: Mapped[int] = mapped_column(
        Integer, server_default=text(str(DEFAULT_STORAGE_GRACE_SECONDS))
    )
    __table_args__ = (
        CheckConstraint("state IN ('healthy', 'low_balance', 'depleted')", name="billing_state"),
        CheckConstraint(
            "storage_namespace_limit >= 0 AND storage_quota_limit_bytes >= 0",
            name="billing_storage_limits",
        ),
        CheckConstraint("storage_grace_seconds >= 0", name="billing_storage_grace"),
    )


class StoragePrice(Base):
    """The storage catalog (like sku_catalog's compute prices): the price of a provisioned
    decimal GB (10^9 bytes) per hour, per provider and currency, in millionths of the currency's
    minor unit. A namespace is priced in its account's currency when it is created."""

    __tablename__ = "storage_prices"
    provider: Mapped[str] = mapped_column(String(32), primary_key=True)
    currency: Mapped[str] = mapped_column(String(3), primary_key=True)
    price_per_gb_hour_micro_minor: Mapped[int] = mapped_column(BigInteger)
    __table_args__ = (
        CheckConstraint("price_per_gb_hour_micro_minor >= 0", name="storage_prices_nonnegative"),
    )


class StorageUsageRecord(Base):
    """One namespace's billable window: its provisioned quota at its price, opened with the
    namespace and closed when it is deleted; charged per window by the meter."""

    __tablename__ = "storage_usage_records"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    namespace_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("storage_namespaces.id"), unique=True
    )
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    quota_bytes: Mapped[int] = mapped_column(BigInteger)
    price_per_gb_hour_micro_minor: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    billed_until: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    charged_minor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    __table_args__ = (
        Index("storage_usage_open", "project_id", postgresql_where=text("ended_at IS NULL")),
    )


class BillingEvent(Base):
    """Append-only: balance state changes, notifications, enforcement actions."""

    __tablename__ = "billing_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    event: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)


class Notification(Base):
    """The tenant notification outbox (docs/lifecycles/balance.md's notification channel): one row
    per notice, at most one per (project, kind, balance episode), written in the transaction that
    classified the balance. Tenants read it (GET /api/v1/notifications); when the project has a
    webhook the worker delivers it there (`delivery_status` pending → delivered, or failed once its
    attempts are spent); `none`: no webhook was set when it was written."""

    __tablename__ = "notifications"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    kind: Mapped[str] = mapped_column(String(32))  # low_balance | depleted
    episode: Mapped[int] = mapped_column(Integer)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    delivery_status: Mapped[str] = mapped_column(String(16), server_default=text("'none'"))
    delivery_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Due for its next attempt (also the lease of an attempt in flight).
    next_attempt_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (
        UniqueConstraint("project_id", "kind", "episode", name="notifications_once_per_episode"),
        CheckConstraint(
            "delivery_status IN ('none', 'pending', 'delivered', 'failed')",
            name="notifications_delivery_status",
        ),
        Index("notifications_project", "project_id", "created_at", "id"),
        Index(
            "notifications_due",
            "next_attempt_at",
            postgresql_where=text("delivery_status = 'pending'"),
        ),
    )


class NotificationWebhook(Base):
    """A project's notification webhook (a project setting the tenant writes): notices are
    POSTed there signed with HMAC-SHA256; the signing secret lives in the secret store at
    `secret_path`, never here."""

    __tablename__ = "project_notification_webhooks"
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    secret_path: Mapped[str] = mapped_column(String(300))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)


# --- payments (docs/lifecycles/payment-session.md)
# ---------------------------------------------------------------------


class PaymentSession(Base):
    """Read model of PaymentSessionWorkflow `payment-session-{id}`: one Stripe Checkout Session
    (initiated → checkout_completed → credited | failed_reconcile | expired). Written only by the
    workflow's activities; `ledger_entry_id` is the one credit a session may ever post."""

    __tablename__ = "payment_sessions"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    stripe_checkout_session_id: Mapped[str | None] = mapped_column(String(255), unique=True)
    idempotency_key: Mapped[str] = mapped_column(String(200))
    requested_amount_minor: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    status: Mapped[str] = mapped_column(String(32), server_default=text("'initiated'"))
    credited_amount_minor: Mapped[int | None] = mapped_column(BigInteger)
    ledger_entry_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("ledger_entries.id"))
    checkout_url: Mapped[str | None] = mapped_column(Text)
    workflow_id: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    credited_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    # Set when the session needs a person to look at it although it settled (a payment that
    # succeeded after the session expired: credited, and flagged `late_success`).
    review_reason: Mapped[str | None] = mapped_column(String(64))
    flagged_for_review_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        UniqueConstraint("project_id", "idempotency_key", name="payment_sessions_idempotency"),
        CheckConstraint(
            "status IN ('initiated', 'checkout_completed', 'credited', 'failed_reconcile',"
            " 'expired')",
            name="payment_sessions_status",
        ),
        CheckConstraint("requested_amount_minor > 0", name="payment_sessions_positive"),
        CheckConstraint(
            "(status = 'credited') = (ledger_entry_id IS NOT NULL)",
            name="payment_sessions_credit_has_entry",
        ),
        Index("payment_sessions_status_created", "status", "created_at"),
    )


class PaymentSessionEvent(Base):
    """Append-only (a trigger rejects UPDATE and DELETE): one row per payment session
    transition, written in the transaction that applies it."""

    __tablename__ = "payment_session_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    payment_session_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("payment_sessions.id"))
    event: Mapped[str] = mapped_column(String(64))
    from_status: Mapped[str | None] = mapped_column(String(32))
    to_status: Mapped[str | None] = mapped_column(String(32))
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("payment_session_events_session", "payment_session_id", "id"),)


class StripeWebhookEvent(Base):
    """Inbox of verified Stripe webhook deliveries: one row per Stripe event id, so a redelivery
    is recognised; `processed` turns true once its effect (a signal, or nothing) is done."""

    __tablename__ = "stripe_webhook_events"
    id: Mapped[str] = mapped_column(String(255), primary_key=True)  # Stripe's evt_… id
    type: Mapped[str] = mapped_column(String(100))
    stripe_checkout_session_id: Mapped[str | None] = mapped_column(String(255))
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    processed: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    processed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (Index("stripe_webhook_events_session", "stripe_checkout_session_id"),)


# --- MAAS reconciliation (docs/lifecycles/node.md#drift-with-maas)
# ----------------------------------------------------------


class NodeMaasState(Base):
    """docs/lifecycles/node.md#drift-with-maas: the runtime reconciliation record of a node's
    current MAAS binding. The MaasSiteReconcilerWorkflow writes it each run; `drift_rule` names the
    §6.4 rule that matched (see activities/maas_reconcile.py), `drift_resolved_at` is set when the
    drift heals."""

    __tablename__ = "node_maas_state"
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    maas_system_id: Mapped[str] = mapped_column(Text)
    last_maas_status: Mapped[str | None] = mapped_column(Text)
    last_maas_power_state: Mapped[str | None] = mapped_column(Text)
    last_maas_ips: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    last_reconciled_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    drift_detected: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    drift_rule: Mapped[str | None] = mapped_column(Text)
    # {"rule": "...", "maas_status": "...", "expected": "...", ...}
    drift_details: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    drift_resolved_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        UniqueConstraint("site_id", "maas_system_id", name="node_maas_state_site_machine"),
        Index("node_maas_state_drift", "site_id", postgresql_where=text("drift_detected")),
    )


class NodeDriftEvent(Base):
    """Append-only: each drift the reconciler detects, with its §6.4 alert severity."""

    __tablename__ = "node_drift_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    rule: Mapped[str] = mapped_column(Text)
    severity: Mapped[str] = mapped_column(String(8))
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint(
            "severity IN ('CRITICAL', 'WARN', 'INFO', 'DEBUG')", name="node_drift_events_severity"
        ),
        Index("node_drift_events_node", "node_id", "occurred_at"),
        Index("node_drift_events_site", "site_id", "occurred_at"),
    )


# --- MAAS onboarding (docs/lifecycles/onboarding.md#monitoring)
# ----------------------------------------------------

ONBOARDING_LIVE = (
    "status IN ('pending', 'running', 'compensating', 'failed_retryable', "
    "'failed_manual_intervention')"
)


class NodeOnboarding(Base):
    """The onboarding job's read model, kept current by MaasNodeOnboardWorkflow's activities."""

    __tablename__ = "node_onboardings"
    onboarding_id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    batch_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    # Assigned at submission; the node row itself is created by the render_cloud_init stage.
    node_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id"))
    profile_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_site_profiles.id"))
    sku_id: Mapped[str] = mapped_column(String(100))
    hostname: Mapped[str] = mapped_column(String(253))
    ipmi_ip: Mapped[str] = mapped_column(INET)
    pxe_mac: Mapped[str | None] = mapped_column(Text)
    maas_system_id: Mapped[str | None] = mapped_column(Text)
    requested_by: Mapped[str | None] = mapped_column(Text)
    current_stage: Mapped[str] = mapped_column(Text)
    current_attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    status: Mapped[str] = mapped_column(String(32))
    failure_class: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(Text)
    error_message: Mapped[str | None] = mapped_column(Text)
    error_details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    recommended_action: Mapped[str | None] = mapped_column(Text)
    last_maas_status: Mapped[str | None] = mapped_column(Text)
    last_maas_power_state: Mapped[str | None] = mapped_column(Text)
    last_maas_ips: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    boss_disk_id: Mapped[int | None] = mapped_column(Integer)
    cloud_init_version: Mapped[str | None] = mapped_column(Text)
    deploy_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    workflow_id: Mapped[str] = mapped_column(Text)
    workflow_run_id: Mapped[str | None] = mapped_column(Text)
    # The admin's X-Idempotency-Key (gateway): a retried request answers the same onboarding.
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    requested_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed_retryable', "
            "'failed_manual_intervention', 'cancelled', 'compensating', 'reconciled')",
            name="node_onboardings_status",
        ),
        # One live onboarding per hostname and site: a second request is a 409, not a race.
        Index(
            "node_onboardings_live_hostname",
            "site_id",
            "hostname",
            unique=True,
            postgresql_where=text(ONBOARDING_LIVE),
        ),
        Index("node_onboardings_batch", "batch_id"),
        Index("node_onboardings_site_status", "site_id", "status"),
        # One live job per MAAS machine and site: the claim concurrent discoveries race for.
        Index(
            "node_onboardings_live_machine",
            "site_id",
            "maas_system_id",
            unique=True,
            postgresql_where=text(f"maas_system_id IS NOT NULL AND {ONBOARDING_LIVE}"),
        ),
        # One row per key and hostname (a batch shares its key across its rows).
        Index(
            "node_onboardings_idempotency",
            "idempotency_key",
            "hostname",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )


class NodeOnboardingEvent(Base):
    """Append-only stage history of one onboarding (docs/lifecycles/onboarding.md#monitoring)."""

    __tablename__ = "node_onboarding_events"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    onboarding_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("node_onboardings.onboarding_id"))
    stage: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint(
            "status IN ('started', 'succeeded', 'failed', 'compensated', 'skipped')",
            name="node_onboarding_events_status",
        ),
        Index("node_onboarding_events_job", "onboarding_id", "occurred_at"),
    )


class OnboardingSiteSlot(Base):
    """A permit to run onboarding stages on a site (docs/lifecycles/onboarding.md#batches, open
    question 5): at most the site policy's batch_max_parallel rows per site, across every batch and
    single onboarding. Taken by the job's workflow before its first stage after load_site_config,
    given back when the run stops (settles, fails, is cancelled)."""

    __tablename__ = "onboarding_site_slots"
    onboarding_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("node_onboardings.onboarding_id", ondelete="CASCADE"), primary_key=True
    )
    site_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("maas_sites.id", ondelete="CASCADE"))
    acquired_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("onboarding_site_slots_site", "site_id"),)


class DomainEvent(Base):
    """Append-only domain events (node.onboarding.*, node.decommission.*), written in the same
    transaction as the state change they announce."""

    __tablename__ = "domain_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    type: Mapped[str] = mapped_column(Text)
    subject_type: Mapped[str] = mapped_column(Text)
    subject_id: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        Index("domain_events_subject", "subject_type", "subject_id", "occurred_at"),
        Index("domain_events_type", "type", "occurred_at"),
    )


class NodeDrain(Base):
    """The drain lifecycle's read model (NodeDrainWorkflow, contracts/node_drain.py): a node
    retired without being removed. At most one running drain per node."""

    __tablename__ = "node_drains"
    drain_id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    status: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str | None] = mapped_column(Text)
    workflow_id: Mapped[str] = mapped_column(Text)
    # Allocations still on the node at the drain's last look.
    live_allocations: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    requested_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(_check_in("status", DrainStatus), name="node_drains_status"),
        Index(
            "node_drains_running_node",
            "node_id",
            unique=True,
            postgresql_where=text("status = 'running'"),
        ),
        Index("node_drains_node", "node_id", "requested_at"),
    )


# --- node decommission (docs/lifecycles/decommission.md#monitoring,
# docs/lifecycles/decommission.md#job-states) --------------------------------------------

DECOMMISSION_LIVE = (
    "status IN ('pending', 'running', 'compensating', 'failed_retryable', "
    "'failed_manual_intervention')"
)


class NodeDecommission(Base):
    """The decommission job's read model (docs/lifecycles/decommission.md#monitoring), kept current
    by NodeDecommissionWorkflow and its activities; the gateway only reads it (and inserts the
    pending row it starts the workflow for). At most one live job per node: a second request is a
    409, not a race."""

    __tablename__ = "node_decommissions"
    decommission_id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    # No foreign key: the job row is kept as audit history after the node is deleted, and a
    # job can name a node id the gateway has just checked (the workflow re-checks).
    node_id: Mapped[uuid.UUID] = mapped_column(UUID)
    site_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    maas_system_id: Mapped[str | None] = mapped_column(Text)
    hostname: Mapped[str | None] = mapped_column(String(253))
    mode: Mapped[str] = mapped_column(String(32))
    erase: Mapped[str] = mapped_column(String(16), server_default=text("'none'"))
    storage_cleanup: Mapped[str] = mapped_column(String(16), server_default=text("'none'"))
    remove_maas_record: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    force_release_allocations: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    reason: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(32))
    current_stage: Mapped[str] = mapped_column(Text)
    current_attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    requested_by: Mapped[str | None] = mapped_column(Text)
    requested_by_token_id: Mapped[uuid.UUID | None] = mapped_column(UUID)
    failure_class: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(Text)
    error_message: Mapped[str | None] = mapped_column(Text)
    error_details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    recommended_action: Mapped[str | None] = mapped_column(Text)
    last_maas_status: Mapped[str | None] = mapped_column(Text)
    last_maas_power_state: Mapped[str | None] = mapped_column(Text)
    # Follow-up work a completed job left behind (secrets cleanup, MAAS record kept, ...).
    followups: Mapped[list[dict[str, Any]]] = mapped_column(
        JSONB, server_default=text("'[]'::jsonb")
    )
    workflow_id: Mapped[str] = mapped_column(Text)
    workflow_run_id: Mapped[str | None] = mapped_column(Text)
    requested_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=NOW)
    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed_retryable', "
            "'failed_manual_intervention', 'cancelled', 'compensating', 'reconciled')",
            name="node_decommissions_status",
        ),
        CheckConstraint(
            "mode IN ('soft_reset', 'reimage', 'full_decommission', 'storage_cleanup')",
            name="node_decommissions_mode",
        ),
        Index(
            "node_decommissions_live_node",
            "node_id",
            unique=True,
            postgresql_where=text(DECOMMISSION_LIVE),
        ),
        Index("node_decommissions_node", "node_id", "requested_at"),
        Index("node_decommissions_status", "status", "requested_at"),
    )


class NodeDecommissionEvent(Base):
    """Append-only stage history of one decommission
    (docs/lifecycles/decommission.md#monitoring)."""

    __tablename__ = "node_decommission_events"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    decommission_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("node_decommissions.decommission_id")
    )
    stage: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint(
            "status IN ('started', 'succeeded', 'failed', 'compensated', 'skipped')",
            name="node_decommission_events_status",
        ),
        Index("node_decommission_events_job", "decommission_id", "occurred_at"),
    )


# --- storage (docs/lifecycles/storage-attachment.md)
# ----------------------------------------------------------------------


class StorageNamespace(Base):
    """Project-owned persistent storage kept by a provider (activities/storage_provider.py), with
    its quota. Written by the worker only; `deleted` keeps the row (attachments refer to it)."""

    __tablename__ = "storage_namespaces"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(63))
    provider: Mapped[str] = mapped_column(String(32))
    quota_bytes: Mapped[int] = mapped_column(BigInteger)
    # Product policy half of multi_writer (the provider's capability is the other half).
    allow_multi_writer: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    status: Mapped[str] = mapped_column(String(16), server_default=text("'active'"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # The provider's last measure of the namespace (the meter's, or an attach's precheck).
    used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    usage_measured_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        CheckConstraint(_check_in("status", NamespaceStatus), name="storage_namespaces_status"),
        CheckConstraint("quota_bytes > 0", name="storage_namespaces_quota_positive"),
        Index(
            "storage_namespaces_name",
            "project_id",
            "name",
            unique=True,
            postgresql_where=text("status = 'active'"),
        ),
    )


class StorageAttachment(Base):
    """One namespace bound to one allocation's node: StorageAttachmentWorkflow's read model."""

    __tablename__ = "storage_attachments"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    namespace_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("storage_namespaces.id"))
    allocation_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocations.id"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    mode: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    workflow_id: Mapped[str] = mapped_column(String(100))
    requested_by: Mapped[str] = mapped_column(String(100))
    mount_path: Mapped[str | None] = mapped_column(Text)
    # A slice VM's virtiofs tag for the mount (contracts.storage.virtiofs_tag), while mounted.
    guest_mount_tag: Mapped[str | None] = mapped_column(String(36))
    failure_reason: Mapped[str | None] = mapped_column(String(64))
    failure_message: Mapped[str | None] = mapped_column(Text)
    detach_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    mounted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    detached_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        CheckConstraint(_check_in("status", AttachmentStatus), name="storage_attachments_status"),
        CheckConstraint(_check_in("mode", WriteMode), name="storage_attachments_mode"),
        Index("storage_attachments_allocation", "allocation_id", "created_at"),
        Index(
            "storage_attachments_live_namespace",
            "namespace_id",
            postgresql_where=text("status <> 'detached'"),
        ),
        Index(
            "storage_attachments_stuck",
            "status",
            "updated_at",
            postgresql_where=text("status IN ('failed', 'detach_failed')"),
        ),
    )


class StorageAttachmentEvent(Base):
    """Append-only: one row per attachment transition, written with the transition."""

    __tablename__ = "storage_attachment_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    attachment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("storage_attachments.id"))
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(100))
    reason: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("storage_attachment_events_attachment", "attachment_id", "id"),)


# --- terminal sessions (docs/lifecycles/terminal-session.md)
# -----------------------------------------------------------


class TerminalSession(Base):
    """The read model of TerminalSessionWorkflow `terminal-{id}`. The partial unique index keeps
    one live session per allocation; only the open token's sha256 is stored, never the token or
    the agent's stream secret."""

    __tablename__ = "terminal_sessions"
    id: Mapped[uuid.UUID] = mapped_column(UUID, primary_key=True)
    allocation_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("allocations.id"))
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"))
    workflow_id: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(16))
    close_reason: Mapped[str | None] = mapped_column(String(64))
    closed_by: Mapped[str | None] = mapped_column(String(16))
    open_token_sha256: Mapped[str] = mapped_column(String(64))
    open_token_expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    active_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    closing_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    closed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (
        CheckConstraint(
            _check_in("status", TerminalSessionStatus), name="terminal_sessions_status"
        ),
        Index(
            "terminal_sessions_one_live",
            "allocation_id",
            unique=True,
            postgresql_where=text("status IN ('opening', 'active', 'closing')"),
        ),
        Index("terminal_sessions_allocation", "allocation_id", "created_at"),
        Index("terminal_sessions_status", "status", "created_at"),
    )


class TerminalSessionEvent(Base):
    """Append-only: one row per terminal session transition, written with the transition."""

    __tablename__ = "terminal_session_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    session_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("terminal_sessions.id"))
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(64))
    occurred_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=CLOCK)
    __table_args__ = (Index("terminal_session_events_session", "session_id", "id"),)
