"""placement at scale: the nodes_placement index also orders nodes by placement's ranking
(best-fit by free GPUs, then id) and carries the NUMA-fit counter, so a slice placement walks it
from the best candidate instead of sorting every node of a region; nodes_numa_fit answers whether
any node fits a request in one NUMA node

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-24 23:50:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# free_gpus_one_numa last: it does not order anything, but as a key column (unlike an INCLUDE
# column) its `>= gpus` test is checked on the index entries, so nodes that do not fit are
# passed over without reading their rows (activities/placement_sql.py, _PLACE_SLICE).
_RANKED = ["region", "sku", "status", "free_gpus", "id", "free_gpus_one_numa"]


def upgrade() -> None:
    op.drop_index("nodes_placement", table_name="nodes")
    op.create_index("nodes_placement", "nodes", _RANKED)
    op.create_index("nodes_numa_fit", "nodes", ["region", "sku", "status", "free_gpus_one_numa"])


def downgrade() -> None:
    op.drop_index("nodes_numa_fit", table_name="nodes")
    op.drop_index("nodes_placement", table_name="nodes")
    op.create_index("nodes_placement", "nodes", ["region", "sku", "status"])
