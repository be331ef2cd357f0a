"""hardware_sync_interval is site-only: site profiles no longer carry it (MAAS keeps one global
hardware_sync_interval config per region, so a per-profile value would overwrite another's)

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-26 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Any value a profile held was never the one MAAS used for all of them: dropped with it.
    op.drop_constraint("profile_hw_sync_interval", "maas_site_profiles", type_="check")
    op.drop_column("maas_site_profiles", "hardware_sync_interval")


def downgrade() -> None:
    op.add_column(
        "maas_site_profiles",
        sa.Column("hardware_sync_interval", sa.String(length=16), nullable=True),
    )
    op.create_check_constraint(
        "profile_hw_sync_interval", "maas_site_profiles", "hardware_sync_interval ~ '^[0-9]+[smh]$'"
    )
