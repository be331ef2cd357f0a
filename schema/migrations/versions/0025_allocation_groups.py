"""allocation groups (docs/lifecycles/allocation-group.md): the groups' read model, their members
and events, and the member link on allocations with the anti-affinity index

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-25 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUSES = (
    "'requested', 'provisioning', 'active', 'degraded', 'releasing', 'released', 'failed', "
    "'release_failed'"
)
# The allocation statuses with a way on (contracts.states.LIVE_ALLOCATION_STATUSES).
_LIVE = "'active', 'provisioning', 'release_failed', 'releasing', 'requested'"
_CLOCK = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "allocation_groups",
        sa.Column("id", sa.UUID(), primary_key=True),
        sa.Column("project_id", sa.UUID(), sa.ForeignKey("projects.id"), nullable=False),
        sa.Column("idempotency_key", sa.String(200)),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("spread", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("workflow_id", sa.String(100), nullable=False),
        sa.Column("release_requested_by", sa.String(16)),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_CLOCK, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_CLOCK, nullable=False),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name="allocation_groups_status"),
        sa.CheckConstraint(
            "spread IN ('same_node_forbidden', 'any')", name="allocation_groups_spread"
        ),
        sa.UniqueConstraint("project_id", "idempotency_key", name="allocation_groups_idempotency"),
    )
    op.create_index(
        "allocation_groups_project_created",
        "allocation_groups",
        ["project_id", "created_at", "id"],
    )
    op.create_index("allocation_groups_status", "allocation_groups", ["status"])
    op.create_table(
        "allocation_group_members",
        sa.Column("allocation_id", sa.UUID(), primary_key=True),
        sa.Column("group_id", sa.UUID(), sa.ForeignKey("allocation_groups.id"), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("required", sa.Boolean(), nullable=False),
        sa.Column("sku", sa.String(100), nullable=False),
        sa.Column("region", sa.String(50), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("rejection_reason", sa.String(64)),
        sa.UniqueConstraint("group_id", "position", name="allocation_group_members_position"),
    )
    op.create_table(
        "allocation_group_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, primary_key=True),
        sa.Column("group_id", sa.UUID(), sa.ForeignKey("allocation_groups.id"), nullable=False),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("from_status", sa.String(32)),
        sa.Column("to_status", sa.String(32)),
        sa.Column("actor", sa.String(32)),
        sa.Column("reason", sa.Text()),
        sa.Column(
            "details",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("occurred_at", sa.DateTime(timezone=True), server_default=_CLOCK, nullable=False),
    )
    op.create_index("allocation_group_events_group", "allocation_group_events", ["group_id", "id"])
    op.execute(
        "CREATE TRIGGER allocation_group_events_append_only BEFORE UPDATE OR DELETE ON "
        "allocation_group_events FOR EACH ROW EXECUTE FUNCTION reject_event_mutation()"
    )
    op.add_column(
        "allocations",
        sa.Column("allocation_group_id", sa.UUID(), sa.ForeignKey("allocation_groups.id")),
    )
    op.add_column(
        "allocations",
        sa.Column("same_node_forbidden", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    # Anti-affinity as a database invariant: two live members of a group that forbids sharing a
    # node never hold one node, whatever placements race.
    op.create_index(
        "allocations_group_same_node",
        "allocations",
        ["allocation_group_id", "node_id"],
        unique=True,
        postgresql_where=sa.text(f"same_node_forbidden AND status IN ({_LIVE})"),
    )


def downgrade() -> None:
    op.drop_index("allocations_group_same_node", table_name="allocations")
    op.drop_column("allocations", "same_node_forbidden")
    op.drop_column("allocations", "allocation_group_id")
    op.drop_table("allocation_group_events")
    op.drop_table("allocation_group_members")
    op.drop_table("allocation_groups")
