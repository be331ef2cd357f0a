"""nodes.protected: a node no destructive or trust-granting step may touch while it is set

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29 06:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "nodes",
        sa.Column("protected", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("nodes", sa.Column("protected_reason", sa.String(length=500), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "protected_reason")
    op.drop_column("nodes", "protected")
