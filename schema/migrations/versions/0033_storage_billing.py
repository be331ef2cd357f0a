"""Storage as a billed product (issue 37 item 3):

- storage_prices: the storage catalog, a price per decimal GB-hour of provisioned capacity per
  (provider, currency), in millionths of the currency's minor unit (storage prices are fractions
  of a cent per GB-hour); operator data like sku_catalog's compute prices. Without a row, the
  policy's default applies (activities/billing/storage_usage.py: 0.10 USD per GB-month, 13,699
  µ¢ per GB-hour at 730 h a month; no default in other currencies).
- storage_usage_records: one per namespace, opened with the namespace (its quota and the price
  for its account's currency), closed when it is deleted; the meter charges it per window like
  a compute usage record. Backfilled for the active namespaces from now on.
- ledger_entries.storage_usage_record_id and kind storage_debit: a storage debit names its
  record; debits (usage_debit, storage_debit) are the negative entries.
- billing_accounts.storage_grace_seconds: how long a depleted account keeps its storage attached
  (72 h by default); after that the meter has its attachments detached (data kept).
- storage_namespaces.used_bytes / usage_measured_at: the provider's last measure of the
  namespace, shown in the namespace view.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-08 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_GRACE_SECONDS = 72 * 3600


def upgrade() -> None:
    op.create_table(
        "storage_prices",
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("price_per_gb_hour_micro_minor", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("provider", "currency"),
        sa.CheckConstraint("price_per_gb_hour_micro_minor >= 0", name="storage_prices_nonnegative"),
    )
    op.create_table(
        "storage_usage_records",
        sa.Column("id", postgresql.UUID(), nullable=False),
        sa.Column("namespace_id", postgresql.UUID(), nullable=False),
        sa.Column("project_id", postgresql.UUID(), nullable=False),
        sa.Column("quota_bytes", sa.BigInteger(), nullable=False),
        sa.Column("price_per_gb_hour_micro_minor", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("billed_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("charged_minor", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.ForeignKeyConstraint(["namespace_id"], ["storage_namespaces.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("namespace_id"),
    )
    op.create_index(
        "storage_usage_open",
        "storage_usage_records",
        ["project_id"],
        postgresql_where=sa.text("ended_at IS NULL"),
    )
    op.add_column(
        "ledger_entries", sa.Column("storage_usage_record_id", postgresql.UUID(), nullable=True)
    )
    op.drop_constraint("ledger_debits_negative", "ledger_entries", type_="check")
    op.create_check_constraint(
        "ledger_debits_negative",
        "ledger_entries",
        "(kind IN ('usage_debit', 'storage_debit')) = (amount_minor < 0)",
    )
    op.add_column(
        "billing_accounts",
        sa.Column(
            "storage_grace_seconds",
            sa.Integer(),
            server_default=sa.text(str(DEFAULT_GRACE_SECONDS)),
            nullable=False,
        ),
    )
    op.create_check_constraint(
        "billing_storage_grace", "billing_accounts", "storage_grace_seconds >= 0"
    )
    op.add_column("storage_namespaces", sa.Column("used_bytes", sa.BigInteger(), nullable=True))
    op.add_column(
        "storage_namespaces",
        sa.Column("usage_measured_at", sa.DateTime(timezone=True), nullable=True),
    )
    # The namespaces kept so far are billed from now on, at the policy's default price (their
    # accounts' currency; the catalog is empty yet, and there is a default in usd only).
    op.execute(
        "INSERT INTO storage_usage_records (id, namespace_id, project_id, quota_bytes,"
        "  price_per_gb_hour_micro_minor, currency, started_at, billed_until)"
        " SELECT gen_random_uuid(), n.id, n.project_id, n.quota_bytes, 13699, 'usd',"
        "  clock_timestamp(), clock_timestamp()"
        " FROM storage_namespaces n"
        " LEFT JOIN billing_accounts a ON a.project_id = n.project_id"
        " WHERE n.status = 'active' AND lower(coalesce(a.currency, 'usd')) = 'usd'"
    )


def downgrade() -> None:
    op.drop_column("storage_namespaces", "usage_measured_at")
    op.drop_column("storage_namespaces", "used_bytes")
    op.drop_constraint("billing_storage_grace", "billing_accounts", type_="check")
    op.drop_column("billing_accounts", "storage_grace_seconds")
    # The ledger is append-only: storage debits stay, as the debits they are.
    op.execute("UPDATE ledger_entries SET kind = 'usage_debit' WHERE kind = 'storage_debit'")
    op.drop_constraint("ledger_debits_negative", "ledger_entries", type_="check")
    op.create_check_constraint(
        "ledger_debits_negative", "ledger_entries", "(kind = 'usage_debit') = (amount_minor < 0)"
    )
    op.drop_column("ledger_entries", "storage_usage_record_id")
    op.drop_index("storage_usage_open", table_name="storage_usage_records")
    op.drop_table("storage_usage_records")
    op.drop_table("storage_prices")
