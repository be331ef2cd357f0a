"""balance states as docs/lifecycles/balance.md defines them, the tenant notification outbox and
webhooks, and the payment session event log

An account starts `depleted` (a balance of 0 or less is depleted) and every account is
reclassified from its ledger once here, so none keeps a `healthy` it never had. Notices go to an
outbox (`notifications`, once per kind and balance episode) that tenants read and the worker
delivers to the project's webhook. Payment sessions get an append-only event log and a review
flag (a payment that succeeded after its session expired).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("billing_accounts", "state", server_default=sa.text("'depleted'"))
    op.add_column(
        "billing_accounts",
        sa.Column("episode", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    # Reclassify every account from its ledger (the meter only looked at accounts with usage
    # or not healthy, so an account opened without credit could read `healthy` at 0).
    op.execute(
        """
        WITH balances AS (
          SELECT b.project_id,
                 CASE WHEN coalesce(sum(l.amount_minor), 0) <= b.depleted_threshold_minor
                        THEN 'depleted'
                      WHEN coalesce(sum(l.amount_minor), 0) <= b.low_balance_threshold_minor
                        THEN 'low_balance'
                      ELSE 'healthy' END AS state
          FROM billing_accounts b LEFT JOIN ledger_entries l ON l.project_id = b.project_id
          GROUP BY b.project_id
        )
        UPDATE billing_accounts a SET state = balances.state, state_changed_at = clock_timestamp()
        FROM balances
        WHERE balances.project_id = a.project_id AND a.state <> balances.state
        """
    )

    op.create_table(
        "notifications",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("project_id", sa.UUID(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("episode", sa.Integer(), nullable=False),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.Column(
            "delivery_status",
            sa.String(length=16),
            server_default=sa.text("'none'"),
            nullable=False,
        ),
        sa.Column("delivery_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "delivery_status IN ('none', 'pending', 'delivered', 'failed')",
            name="notifications_delivery_status",
        ),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "kind", "episode", name="notifications_once_per_episode"),
    )
    op.create_index("notifications_project", "notifications", ["project_id", "created_at", "id"])
    op.create_index(
        "notifications_due",
        "notifications",
        ["next_attempt_at"],
        postgresql_where=sa.text("delivery_status = 'pending'"),
    )
    op.create_table(
        "project_notification_webhooks",
        sa.Column("project_id", sa.UUID(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("secret_path", sa.String(length=300), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("project_id"),
    )

    op.add_column("payment_sessions", sa.Column("review_reason", sa.String(64), nullable=True))
    op.add_column(
        "payment_sessions",
        sa.Column("flagged_for_review_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "payment_session_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("payment_session_id", sa.UUID(), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("from_status", sa.String(length=32), nullable=True),
        sa.Column("to_status", sa.String(length=32), nullable=True),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "occurred_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["payment_session_id"], ["payment_sessions.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "payment_session_events_session", "payment_session_events", ["payment_session_id", "id"]
    )
    # The function comes from revision 0001.
    op.execute(
        "CREATE TRIGGER payment_session_events_append_only BEFORE UPDATE OR DELETE ON "
        "payment_session_events FOR EACH ROW EXECUTE FUNCTION reject_event_mutation()"
    )


def downgrade() -> None:
    op.execute(
        "DROP TRIGGER IF EXISTS payment_session_events_append_only ON payment_session_events"
    )
    op.drop_index("payment_session_events_session", table_name="payment_session_events")
    op.drop_table("payment_session_events")
    op.drop_column("payment_sessions", "flagged_for_review_at")
    op.drop_column("payment_sessions", "review_reason")
    op.drop_table("project_notification_webhooks")
    op.drop_index("notifications_due", table_name="notifications")
    op.drop_index("notifications_project", table_name="notifications")
    op.drop_table("notifications")
    op.drop_column("billing_accounts", "episode")
    op.alter_column("billing_accounts", "state", server_default=sa.text("'healthy'"))
