"""allocation list indexes: the admin list's order, and by status in that order

The admin allocation list (GET /api/v1/admin/allocations) pages through every project's
allocations newest first, and filters by status in the same order. Without an index in that
order each page sorted the whole table: 55-100 ms per page at 100,000 allocations
(bench/queries.py, bench/README.md). `allocations_status` (status alone) is replaced by one that
also serves status lookups on their own.

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-25 00:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("allocations_created", "allocations", ["created_at", "id"])
    op.create_index("allocations_status_created", "allocations", ["status", "created_at", "id"])
    op.drop_index("allocations_status", table_name="allocations")


def downgrade() -> None:
    op.create_index("allocations_status", "allocations", ["status"])
    op.drop_index("allocations_status_created", table_name="allocations")
    op.drop_index("allocations_created", table_name="allocations")
