"""onboarding site concurrency: onboarding_site_slots, the per-site permits that bound the
onboardings in flight on a site by its policy's batch_max_parallel
(docs/lifecycles/onboarding.md#batches)

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-24 23:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "onboarding_site_slots",
        sa.Column("onboarding_id", postgresql.UUID(), nullable=False),
        sa.Column("site_id", postgresql.UUID(), nullable=False),
        sa.Column(
            "acquired_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["onboarding_id"],
            ["node_onboardings.onboarding_id"],
            name="onboarding_site_slots_onboarding_id_fkey",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["site_id"],
            ["maas_sites.id"],
            name="onboarding_site_slots_site_id_fkey",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("onboarding_id", name="onboarding_site_slots_pkey"),
    )
    op.create_index("onboarding_site_slots_site", "onboarding_site_slots", ["site_id"])


def downgrade() -> None:
    op.drop_index("onboarding_site_slots_site", table_name="onboarding_site_slots")
    op.drop_table("onboarding_site_slots")
