"""node_onboardings_live_machine: one live onboarding job per MAAS machine and site (issue 35),
the claim two concurrent discoveries race for. A node's own binding (node_maas_state) is already
unique per site and machine, and a full decommission deletes it with the node.

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-30 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = (
    "status IN ('pending', 'running', 'compensating', 'failed_retryable', "
    "'failed_manual_intervention')"
)


def upgrade() -> None:
    op.create_index(
        "node_onboardings_live_machine",
        "node_onboardings",
        ["site_id", "maas_system_id"],
        unique=True,
        postgresql_where=sa.text(f"maas_system_id IS NOT NULL AND {LIVE}"),
    )


def downgrade() -> None:
    op.drop_index("node_onboardings_live_machine", table_name="node_onboardings")
