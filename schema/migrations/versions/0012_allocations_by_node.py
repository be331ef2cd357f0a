"""allocations by node, newest first: what runs on a node (the admin list's node_id filter, and
decommission's look at a node's live allocations)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-22 04:15:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "allocations_node_created", "allocations", ["node_id", "created_at", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("allocations_node_created", table_name="allocations")
