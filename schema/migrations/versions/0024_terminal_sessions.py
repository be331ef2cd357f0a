"""terminal sessions (docs/lifecycles/terminal-session.md): the terminal_sessions read model and its
event rows

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-25 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLOCK = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "terminal_sessions",
        sa.Column("id", postgresql.UUID(), nullable=False),
        sa.Column("allocation_id", postgresql.UUID(), nullable=False),
        sa.Column("project_id", postgresql.UUID(), nullable=False),
        sa.Column("node_id", postgresql.UUID(), nullable=False),
        sa.Column("workflow_id", sa.String(100), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("close_reason", sa.String(64), nullable=True),
        sa.Column("closed_by", sa.String(16), nullable=True),
        sa.Column("open_token_sha256", sa.String(64), nullable=False),
        sa.Column("open_token_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.Column("active_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("closing_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.CheckConstraint(
            "status IN ('opening', 'active', 'closing', 'closed', 'error')",
            name="terminal_sessions_status",
        ),
        sa.ForeignKeyConstraint(["allocation_id"], ["allocations.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    # One live session per allocation (docs/lifecycles/terminal-session.md): a second open is
    # refused by this index.
    op.create_index(
        "terminal_sessions_one_live",
        "terminal_sessions",
        ["allocation_id"],
        unique=True,
        postgresql_where=sa.text("status IN ('opening', 'active', 'closing')"),
    )
    op.create_index(
        "terminal_sessions_allocation", "terminal_sessions", ["allocation_id", "created_at"]
    )
    op.create_index("terminal_sessions_status", "terminal_sessions", ["status", "created_at"])
    op.create_table(
        "terminal_session_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("session_id", postgresql.UUID(), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=True),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(16), nullable=True),
        sa.Column("reason", sa.String(64), nullable=True),
        sa.Column("occurred_at", sa.DateTime(timezone=True), server_default=CLOCK, nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["terminal_sessions.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "terminal_session_events_session", "terminal_session_events", ["session_id", "id"]
    )
    # The function comes from revision 0001.
    op.execute(
        "CREATE TRIGGER terminal_session_events_append_only BEFORE UPDATE OR DELETE ON "
        "terminal_session_events FOR EACH ROW EXECUTE FUNCTION reject_event_mutation()"
    )


def downgrade() -> None:
    op.execute(
        "DROP TRIGGER IF EXISTS terminal_session_events_append_only ON terminal_session_events"
    )
    op.drop_index("terminal_session_events_session", table_name="terminal_session_events")
    op.drop_table("terminal_session_events")
    op.drop_index("terminal_sessions_status", table_name="terminal_sessions")
    op.drop_index("terminal_sessions_allocation", table_name="terminal_sessions")
    op.drop_index("terminal_sessions_one_live", table_name="terminal_sessions")
    op.drop_table("terminal_sessions")
