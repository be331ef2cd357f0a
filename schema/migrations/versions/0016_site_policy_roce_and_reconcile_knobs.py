"""site policy knobs: whether a refused RoCE phase-2 link stops an onboarding, and the share of
bound machines a MAAS machines list may miss before the reconciler takes it as suspect

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24 23:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "maas_site_policies",
        sa.Column(
            "roce_failures_stop_job", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
    )
    op.add_column(
        "maas_site_policies",
        sa.Column(
            "reconcile_max_missing_share",
            sa.Float(),
            server_default=sa.text("0.1"),
            nullable=False,
        ),
    )
    op.create_check_constraint(
        "policy_reconcile_missing_share",
        "maas_site_policies",
        "reconcile_max_missing_share BETWEEN 0 AND 1",
    )


def downgrade() -> None:
    op.drop_constraint("policy_reconcile_missing_share", "maas_site_policies", type_="check")
    op.drop_column("maas_site_policies", "reconcile_max_missing_share")
    op.drop_column("maas_site_policies", "roce_failures_stop_job")
