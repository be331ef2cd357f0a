"""allocation detach: `detached_at` marks a release_failed allocation an admin ended `released`
by quarantining what its node could not clean (docs/lifecycles/allocation.md, "admin removes the
assignment")

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-24 23:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("detached_at", sa.DateTime(timezone=True)))
    op.create_check_constraint(
        "allocations_detached_released",
        "allocations",
        "detached_at IS NULL OR status = 'released'",
    )


def downgrade() -> None:
    op.drop_constraint("allocations_detached_released", "allocations", type_="check")
    op.drop_column("allocations", "detached_at")
