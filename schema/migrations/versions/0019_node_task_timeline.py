"""node task timeline: the attempt each recorded phase belongs to
(docs/lifecycles/allocation.md#task-timeline)

A retried host task goes through its phases again; each attempt's phases are kept, so a phase is
recorded once per attempt instead of once per task.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-24 23:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # 0: recorded before attempts were (the attempt is not known).
    op.add_column(
        "node_task_events",
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.drop_constraint("node_task_events_once", "node_task_events", type_="unique")
    op.create_unique_constraint(
        "node_task_events_once", "node_task_events", ["node_task_id", "attempt", "phase", "status"]
    )


def downgrade() -> None:
    op.drop_constraint("node_task_events_once", "node_task_events", type_="unique")
    op.execute(
        "DELETE FROM node_task_events e USING node_task_events k"
        " WHERE e.node_task_id = k.node_task_id AND e.phase = k.phase AND e.status = k.status"
        " AND e.id > k.id"
    )
    op.create_unique_constraint(
        "node_task_events_once", "node_task_events", ["node_task_id", "phase", "status"]
    )
    op.drop_column("node_task_events", "attempt")
