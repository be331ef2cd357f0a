"""Two site-policy knobs of the MAAS site reconciler (issue 35):

- release_retired_machines: whether the reconciler releases and powers off the MAAS machine of a
  `retired` node (docs/lifecycles/node.md#reconciliation-rules's "Deployed + retired" row). Off by
  default: retire leaves the machine alone; when on, the release still needs a fresh observation
  that agrees.
- reconcile_max_quarantine: how many nodes one reconcile run may quarantine. A run that would
  quarantine more quarantines none and records a refused reconcile (reconcile_suspect) instead.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-01 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "maas_site_policies",
        sa.Column(
            "release_retired_machines",
            sa.Boolean(),
            server_default=sa.text("false"),
            nullable=False,
        ),
    )
    op.add_column(
        "maas_site_policies",
        sa.Column(
            "reconcile_max_quarantine", sa.Integer(), server_default=sa.text("10"), nullable=False
        ),
    )
    op.create_check_constraint(
        "policy_reconcile_max_quarantine",
        "maas_site_policies",
        "reconcile_max_quarantine BETWEEN 1 AND 100000",
    )


def downgrade() -> None:
    op.drop_constraint("policy_reconcile_max_quarantine", "maas_site_policies", type_="check")
    op.drop_column("maas_site_policies", "reconcile_max_quarantine")
    op.drop_column("maas_site_policies", "release_retired_machines")
