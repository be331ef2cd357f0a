"""slice VLANs: a pool per region and the VLAN each project's slice network holds in it, so that
slice VMs of one project share an L2 segment across nodes and those of two projects never do

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-23 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # No rows: a region without one draws from the placement's default range
    # (activities/placement_sql.py DEFAULT_SLICE_VLAN_POOL); an operator adds a row to match
    # what the site's switches trunk to the slice nodes.
    op.create_table(
        "slice_vlan_pools",
        sa.Column("region", sa.String(50), primary_key=True),
        sa.Column("first_vid", sa.Integer(), nullable=False),
        sa.Column("last_vid", sa.Integer(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "1 <= first_vid AND first_vid <= last_vid AND last_vid <= 4094",
            name="slice_vlan_pools_range",
        ),
    )
    op.create_table(
        "project_slice_vlans",
        sa.Column("region", sa.String(50), primary_key=True),
        sa.Column("project_id", postgresql.UUID(), sa.ForeignKey("projects.id"), primary_key=True),
        sa.Column("vlan_id", sa.Integer(), nullable=False),
        sa.Column(
            "assigned_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.CheckConstraint("vlan_id BETWEEN 1 AND 4094", name="project_slice_vlans_vid"),
        sa.UniqueConstraint("region", "vlan_id", name="project_slice_vlans_vid_once"),
    )


def downgrade() -> None:
    op.drop_table("project_slice_vlans")
    op.drop_table("slice_vlan_pools")
