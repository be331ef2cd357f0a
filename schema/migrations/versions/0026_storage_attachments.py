"""storage namespaces and attachments (docs/lifecycles/storage-attachment.md)

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-25 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLOCK = sa.text("clock_timestamp()")
ATTACHMENT_STATUSES = (
    "requested",
    "prechecking",
    "grant_applying",
    "grant_applied",
    "mounting",
    "mounted",
    "detaching",
    "detached",
    "failed",
    "detach_failed",
)


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.create_table(
        "storage_namespaces",
        sa.Column("id", sa.UUID(), primary_key=True),
        sa.Column("project_id", sa.UUID(), sa.ForeignKey("projects.id"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("quota_bytes", sa.BigInteger(), nullable=False),
        sa.Column(
            "allow_multi_writer", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("status", sa.String(16), server_default=sa.text("'active'"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(_in("status", ("active", "deleted")), name="storage_namespaces_status"),
        sa.CheckConstraint("quota_bytes > 0", name="storage_namespaces_quota_positive"),
    )
    op.create_index(
        "storage_namespaces_name",
        "storage_namespaces",
        ["project_id", "name"],
        unique=True,
        postgresql_where=sa.text("status = 'active'"),
    )
    op.create_table(
        "storage_attachments",
        sa.Column("id", sa.UUID(), primary_key=True),
        sa.Column("project_id", sa.UUID(), sa.ForeignKey("projects.id"), nullable=False),
        sa.Column(
            "namespace_id", sa.UUID(), sa.ForeignKey("storage_namespaces.id"), nullable=False
        ),
        sa.Column("allocation_id", sa.UUID(), sa.ForeignKey("allocations.id"), nullable=False),
        sa.Column("node_id", sa.UUID(), sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("workflow_id", sa.String(100), nullable=False),
        sa.Column("requested_by", sa.String(100), nullable=False),
        sa.Column("mount_path", sa.Text()),
        sa.Column("failure_reason", sa.String(64)),
        sa.Column("failure_message", sa.Text()),
        sa.Column("detach_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.Column("mounted_at", sa.DateTime(timezone=True)),
        sa.Column("detached_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(_in("status", ATTACHMENT_STATUSES), name="storage_attachments_status"),
        sa.CheckConstraint(
            _in("mode", ("read_only", "single_writer", "multi_writer")),
            name="storage_attachments_mode",
        ),
    )
    op.create_index(
        "storage_attachments_allocation", "storage_attachments", ["allocation_id", "created_at"]
    )
    op.create_index(
        "storage_attachments_live_namespace",
        "storage_attachments",
        ["namespace_id"],
        postgresql_where=sa.text("status <> 'detached'"),
    )
    op.create_index(
        "storage_attachments_stuck",
        "storage_attachments",
        ["status", "updated_at"],
        postgresql_where=sa.text("status IN ('failed', 'detach_failed')"),
    )
    op.create_table(
        "storage_attachment_events",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column(
            "attachment_id", sa.UUID(), sa.ForeignKey("storage_attachments.id"), nullable=False
        ),
        sa.Column("from_status", sa.String(16)),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(100)),
        sa.Column("reason", sa.Text()),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("occurred_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
    )
    op.create_index(
        "storage_attachment_events_attachment",
        "storage_attachment_events",
        ["attachment_id", "id"],
    )


def downgrade() -> None:
    op.drop_table("storage_attachment_events")
    op.drop_table("storage_attachments")
    op.drop_table("storage_namespaces")
