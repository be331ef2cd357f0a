"""free GPU counters on nodes, kept by triggers on gpu_slots: placement ranks nodes by them
instead of counting every free slot of a region on every POST /allocations

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-22 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Deltas, never recounts: two releases on one node commit one after the other, and the second's
# UPDATE re-reads the row the first wrote (a recount would read its own statement's snapshot and
# lose the first). `free_gpus_by_numa` is subscripted by NUMA node number.
_COUNT_FREE = """
CREATE FUNCTION gpu_slots_count_free() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status = 'free' THEN
    UPDATE nodes
       SET free_gpus = free_gpus - 1,
           free_gpus_by_numa[OLD.numa_node] = coalesce(free_gpus_by_numa[OLD.numa_node], 0) - 1
     WHERE id = OLD.node_id;
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.status = 'free' THEN
    UPDATE nodes
       SET free_gpus = free_gpus + 1,
           free_gpus_by_numa[NEW.numa_node] = coalesce(free_gpus_by_numa[NEW.numa_node], 0) + 1
     WHERE id = NEW.node_id;
  END IF;
  RETURN NULL;
END
$$
"""

_BACKFILL = """
DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT node_id, numa_node, count(*)::int AS free FROM gpu_slots
           WHERE status = 'free' GROUP BY node_id, numa_node LOOP
    UPDATE nodes
       SET free_gpus = free_gpus + r.free,
           free_gpus_by_numa[r.numa_node] = coalesce(free_gpus_by_numa[r.numa_node], 0) + r.free
     WHERE id = r.node_id;
  END LOOP;
END
$$
"""


# The most free GPUs on any one NUMA node, computed when the counters change rather than for
# every node each time placement ranks them (a generated column needs an immutable function).
_LARGEST = (
    "CREATE FUNCTION int_array_largest(integer[]) RETURNS integer IMMUTABLE PARALLEL SAFE "
    "LANGUAGE sql AS 'SELECT coalesce(max(n), 0) FROM unnest($1) AS n'"
)


def upgrade() -> None:
    op.add_column(
        "nodes", sa.Column("free_gpus", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column(
        "nodes",
        sa.Column(
            "free_gpus_by_numa",
            postgresql.ARRAY(sa.Integer()),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
    )
    op.execute(_LARGEST)
    op.add_column(
        "nodes",
        sa.Column(
            "free_gpus_one_numa",
            sa.Integer(),
            sa.Computed("int_array_largest(free_gpus_by_numa)", persisted=True),
            nullable=False,
        ),
    )
    op.execute(_COUNT_FREE)
    op.execute(
        "CREATE TRIGGER gpu_slots_count_free_added_or_removed AFTER INSERT OR DELETE ON gpu_slots "
        "FOR EACH ROW EXECUTE FUNCTION gpu_slots_count_free()"
    )
    op.execute(
        "CREATE TRIGGER gpu_slots_count_free_changed AFTER UPDATE ON gpu_slots FOR EACH ROW "
        "WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.node_id IS DISTINCT FROM NEW.node_id"
        " OR OLD.numa_node IS DISTINCT FROM NEW.numa_node) "
        "EXECUTE FUNCTION gpu_slots_count_free()"
    )
    op.execute(_BACKFILL)


def downgrade() -> None:
    op.execute("DROP TRIGGER gpu_slots_count_free_changed ON gpu_slots")
    op.execute("DROP TRIGGER gpu_slots_count_free_added_or_removed ON gpu_slots")
    op.execute("DROP FUNCTION gpu_slots_count_free()")
    op.drop_column("nodes", "free_gpus_one_numa")
    op.execute("DROP FUNCTION int_array_largest(integer[])")
    op.drop_column("nodes", "free_gpus_by_numa")
    op.drop_column("nodes", "free_gpus")
