"""storage_attachments.guest_mount_tag: the virtiofs tag a slice VM mounts its attachment by

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-29 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "storage_attachments", sa.Column("guest_mount_tag", sa.String(length=36), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("storage_attachments", "guest_mount_tag")
