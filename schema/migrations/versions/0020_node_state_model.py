"""node state model: the drain lifecycle's job rows (node_drains), and the inventory's order

A node retired without being removed goes active|offline|quarantined → draining → retired through
NodeDrainWorkflow (docs/lifecycles/node.md#who-moves-it: entering draining creates its owning
lifecycle operation); its row is the job the node detail shows. At most one running drain per node.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-24 23:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "node_drains",
        sa.Column("drain_id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("node_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.Text(), nullable=True),
        sa.Column("workflow_id", sa.Text(), nullable=False),
        sa.Column("live_allocations", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "requested_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name="node_drains_node_id_fkey"),
        sa.CheckConstraint(
            "status IN ('running', 'completed', 'stopped')", name="node_drains_status"
        ),
    )
    op.create_index(
        "node_drains_running_node",
        "node_drains",
        ["node_id"],
        unique=True,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index("node_drains_node", "node_drains", ["node_id", "requested_at"])
    op.create_index("nodes_inventory_order", "nodes", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("nodes_inventory_order", table_name="nodes")
    op.drop_index("node_drains_node", table_name="node_drains")
    op.drop_index("node_drains_running_node", table_name="node_drains")
    op.drop_table("node_drains")
