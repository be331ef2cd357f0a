"""Namespace delete ends only when the data is gone (issue 37 item 3):
storage_namespaces.status takes `deleting` (asked to be deleted, StorageNamespaceDeleteWorkflow
removing its data) between `active` and `deleted` (the provider reported the data gone).

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-09 09:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0034"
down_revision: str | None = "0033"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint("storage_namespaces_status", "storage_namespaces", type_="check")
    op.create_check_constraint(
        "storage_namespaces_status",
        "storage_namespaces",
        "status IN ('active', 'deleting', 'deleted')",
    )


def downgrade() -> None:
    # A namespace still deleting has its data on the way out and is no longer billed: it reads
    # as deleted to the older build (which never removes its data again; an operator does).
    op.execute(
        "UPDATE storage_namespaces SET status = 'deleted', deleted_at = clock_timestamp() "
        "WHERE status = 'deleting'"
    )
    op.drop_constraint("storage_namespaces_status", "storage_namespaces", type_="check")
    op.create_check_constraint(
        "storage_namespaces_status", "storage_namespaces", "status IN ('active', 'deleted')"
    )
