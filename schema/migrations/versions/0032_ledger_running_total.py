"""A ledger that scales, and storage limits per project (issue 37 items 3 and 5):

- billing_accounts.balance_minor: the account's running total, updated in the transaction of
  every posting (activities/billing/ledger.py), so a balance read, a credit and a meter run never
  sum the ledger; backfilled here from the ledger. activities/billing/ledger.py check_running_totals
  recomputes it.
- usage_records.charged_minor: what the record's windows were charged so far, updated with each
  posting of them; the usage export pages over usage records (usage_project_started) and never
  aggregates the ledger. Backfilled here.
- billing_accounts.storage_namespace_limit / storage_quota_limit_bytes: per-project limits on the
  number of active storage namespaces and their total quota, admin-set; the column defaults are
  the policy's defaults.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-05 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0032"
# 0032 is another change in flight; until it lands this follows 0031.
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "billing_accounts",
        sa.Column("balance_minor", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "billing_accounts",
        sa.Column(
            "storage_namespace_limit", sa.Integer(), server_default=sa.text("10"), nullable=False
        ),
    )
    op.add_column(
        "billing_accounts",
        sa.Column(
            "storage_quota_limit_bytes",
            sa.BigInteger(),
            server_default=sa.text(str(10 << 40)),
            nullable=False,
        ),
    )
    op.add_column(
        "usage_records",
        sa.Column("charged_minor", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    # Every project with postings has its account (post_entry opens it first); to be sure, open
    # any that is missing before the backfill, as post_entry would have (depleted until its next
    # credit or metering run reclassifies it).
    op.execute(
        "INSERT INTO billing_accounts (project_id)"
        " SELECT DISTINCT project_id FROM ledger_entries ON CONFLICT (project_id) DO NOTHING"
    )
    op.execute(
        "UPDATE billing_accounts a SET balance_minor = l.total"
        " FROM (SELECT project_id, sum(amount_minor) AS total FROM ledger_entries"
        "       GROUP BY project_id) l"
        " WHERE a.project_id = l.project_id"
    )
    op.execute(
        "UPDATE usage_records u SET charged_minor = l.total"
        " FROM (SELECT usage_record_id, -sum(amount_minor) AS total FROM ledger_entries"
        "       WHERE usage_record_id IS NOT NULL GROUP BY usage_record_id) l"
        " WHERE u.id = l.usage_record_id"
    )
    op.create_index("usage_project_started", "usage_records", ["project_id", "started_at", "id"])
    op.create_check_constraint(
        "billing_storage_limits",
        "billing_accounts",
        "storage_namespace_limit >= 0 AND storage_quota_limit_bytes >= 0",
    )


def downgrade() -> None:
    op.drop_constraint("billing_storage_limits", "billing_accounts", type_="check")
    op.drop_index("usage_project_started", table_name="usage_records")
    op.drop_column("usage_records", "charged_minor")
    op.drop_column("billing_accounts", "storage_quota_limit_bytes")
    op.drop_column("billing_accounts", "storage_namespace_limit")
    op.drop_column("billing_accounts", "balance_minor")
