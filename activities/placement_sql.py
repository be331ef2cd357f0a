"""The SQL of placement, the hot spot of every POST /allocations: what is offered, which nodes
rank first, locking their free slots, and writing the whole reservation.

Written against the asyncpg connection directly, in plain SQL, because this path runs once per
POST and SQLAlchemy's statement building, compilation and ORM bookkeeping cost more CPU than the
queries themselves; asyncpg also keeps each statement prepared per connection. Everything else
in the control plane uses SQLAlchemy. The tables are those of schema/models.py. Only the state
names of schema/states.py are interpolated into these strings; every value is a `$n` parameter.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from activities.placement import FreeSlot
from schema.states import (
    AllocationStatus,
    ClaimKind,
    ClaimStatus,
    NodeStatus,
    NodeTaskStatus,
    SlotStatus,
)

# A whole-node claim overlaps every GPU index on the node.
WHOLE_NODE_FOOTPRINT = (0, 2**31 - 1)


@dataclass(frozen=True)
class SkuSizing:
    """What one GPU of a slice brings along (bare metal gets the whole node)."""

    vcpus_per_gpu: int
    memory_mb_per_gpu: int
    image: str
    image_sha256: str


@dataclass(frozen=True)
class Offer:
    """The SKU as offered in a region, with what placement checks against it."""

    shape: str | None  # None: not offered there
    active: bool
    allowed_gpu_counts: list[int]
    sizing: SkuSizing
    billing_state: str | None
    ssh_public_keys: list[str]  # the requested keys found in the project, oldest first


_OFFER = """
SELECT s.shape, s.active, s.allowed_gpu_counts, s.vcpus_per_gpu, s.memory_mb_per_gpu, s.image,
       s.image_sha256,
       (SELECT b.state FROM billing_accounts b WHERE b.project_id = $3),
       (SELECT array_agg(k.public_key ORDER BY k.created_at) FROM ssh_keys k
         WHERE k.id = ANY($4::uuid[]) AND k.project_id = $3)
FROM (SELECT 1) AS one
LEFT JOIN sku_catalog s ON s.name = $1 AND s.region = $2
"""


async def load_offer(
    pg: asyncpg.Connection,
    *,
    sku: str,
    region: str,
    project_id: uuid.UUID,
    ssh_key_ids: Sequence[uuid.UUID],
) -> Offer:
    row = await pg.fetchrow(_OFFER, sku, region, project_id, list(ssh_key_ids))
    assert row is not None
    return Offer(
        shape=row[0],
        active=bool(row[1]),
        allowed_gpu_counts=list(row[2] or []),
        sizing=SkuSizing(row[3] or 0, row[4] or 0, row[5] or "", row[6] or ""),
        billing_state=row[7],
        ssh_public_keys=list(row[8] or []),
    )


# Bare metal: the first active node of the SKU (by hostname) with no held claim, skipping nodes
# a concurrent placement has locked.
_FREE_NODE = f"""
SELECT n.id FROM nodes n
WHERE n.region = $1 AND n.sku = $2 AND n.status = '{NodeStatus.ACTIVE}' AND n.gpu_count = $3
  AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c
                  WHERE c.node_id = n.id AND c.status = '{ClaimStatus.HELD}')
ORDER BY n.hostname
"""
_LOCK_FREE_NODE = _FREE_NODE + " LIMIT 1 FOR UPDATE OF n SKIP LOCKED"
_COUNT_FREE_NODES = f"SELECT count(*) FROM ({_FREE_NODE}) AS free"


async def lock_free_node(
    pg: asyncpg.Connection, *, region: str, sku: str, gpus: int
) -> tuple[uuid.UUID | None, bool]:
    """(the locked node, or None; whether free nodes exist that others hold locked)."""
    node_id: uuid.UUID | None = await pg.fetchval(_LOCK_FREE_NODE, region, sku, gpus)
    if node_id is not None:
        return node_id, False
    return None, bool(await pg.fetchval(_COUNT_FREE_NODES, region, sku, gpus))


# Slices (seed 000): nodes where one NUMA node fits the request rank first, then best-fit
# (fewest free GPUs that still fit), so big requests keep finding room.
_RANKED_SLICE_NODES = f"""
WITH free AS (
  SELECT g.node_id, g.numa_node, count(*) AS free
  FROM gpu_slots g JOIN nodes n ON n.id = g.node_id
  WHERE n.region = $1 AND n.sku = $2 AND n.status = '{NodeStatus.ACTIVE}'
    AND g.status = '{SlotStatus.FREE}'
  GROUP BY g.node_id, g.numa_node
), ranked AS (
  SELECT node_id,
         row_number() OVER (ORDER BY max(free) >= $3 DESC, sum(free), node_id) AS position
  FROM free
  GROUP BY node_id
  HAVING sum(free) >= $3
  ORDER BY position
  LIMIT $4
)
"""
# Of the best `$4`, the first node no concurrent placement holds is locked in the same statement:
# concurrent placements spread over the ranking instead of queueing on its head, and none has to
# retry while fewer than `$4` run at once.
_LOCK_BEST_SLICE_NODE = (
    _RANKED_SLICE_NODES
    + """
SELECT n.id FROM nodes n JOIN ranked ON ranked.node_id = n.id
ORDER BY ranked.position
LIMIT 1
FOR UPDATE OF n SKIP LOCKED
"""
)
_COUNT_RANKED_SLICE_NODES = _RANKED_SLICE_NODES + "SELECT count(*) FROM ranked"

_LOCK_FREE_SLOTS = f"""
SELECT id, gpu_index, numa_node, pci_address FROM gpu_slots
WHERE node_id = $1 AND status = '{SlotStatus.FREE}'
ORDER BY gpu_index
FOR UPDATE SKIP LOCKED
"""


async def lock_best_slice_node(
    pg: asyncpg.Connection, *, region: str, sku: str, gpus: int, candidates: int
) -> tuple[uuid.UUID | None, bool]:
    """(the locked node, or None; whether any node has room, held by others or not)."""
    node_id: uuid.UUID | None = await pg.fetchval(
        _LOCK_BEST_SLICE_NODE, region, sku, gpus, candidates
    )
    if node_id is not None:
        return node_id, True
    ranked = await pg.fetchval(_COUNT_RANKED_SLICE_NODES, region, sku, gpus, candidates)
    return None, bool(ranked)


async def lock_free_slots(pg: asyncpg.Connection, node_id: uuid.UUID) -> list[FreeSlot]:
    """The free slots of a node (a release in flight may still hold some)."""
    return [FreeSlot(*row) for row in await pg.fetch(_LOCK_FREE_SLOTS, node_id)]


# The whole reservation in one statement: the allocation (created already `provisioning`, both
# transitions in its event log), the slots it reserves, its claims and its queued host task.
# Foreign keys to the new allocation are checked at the end of the statement.
_WRITE_PLACEMENT = f"""
WITH allocation AS (
  INSERT INTO allocations (id, project_id, idempotency_key, sku, region, shape, gpu_count, node_id,
                           ssh_key_ids, status, workflow_id, provisioning_started_at)
  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::uuid[], '{AllocationStatus.PROVISIONING}', $10,
          clock_timestamp())
  RETURNING id, created_at
), events AS (
  INSERT INTO allocation_events (allocation_id, event, from_status, to_status, details)
  SELECT allocation.id, e.event, e.from_status, e.to_status, e.details
  FROM allocation, (VALUES
      (1, 'requested', NULL, '{AllocationStatus.REQUESTED}', '{{}}'::jsonb),
      (2, 'placement_reserved', NULL, NULL, $11::jsonb),
      (3, 'provisioning_started', '{AllocationStatus.REQUESTED}',
          '{AllocationStatus.PROVISIONING}', '{{}}'::jsonb)
  ) AS e(position, event, from_status, to_status, details)
  ORDER BY e.position
), slots AS (
  UPDATE gpu_slots SET status = '{SlotStatus.RESERVED}', allocation_id = $1,
                       updated_at = clock_timestamp()
  WHERE id = ANY($12::uuid[])
), claims AS (
  INSERT INTO allocation_resource_claims (id, allocation_id, node_id, slot_id, kind, footprint,
                                          status)
  SELECT gen_random_uuid(), $1, $8, c.slot_id, $13, int4range(c.lower, c.upper),
         '{ClaimStatus.HELD}'
  FROM unnest($14::uuid[], $15::int[], $16::int[]) AS c(slot_id, lower, upper)
), task AS (
  INSERT INTO node_tasks (id, node_id, allocation_id, kind, status, workflow_id)
  VALUES ($17, $8, $1, $18, '{NodeTaskStatus.QUEUED}', $10)
  ON CONFLICT (id) DO NOTHING
)
SELECT created_at FROM allocation
"""


async def write_placement(
    pg: asyncpg.Connection,
    *,
    allocation_id: uuid.UUID,
    project_id: uuid.UUID,
    idempotency_key: str | None,
    sku: str,
    region: str,
    shape: str,
    gpu_count: int,
    node_id: uuid.UUID,
    ssh_key_ids: Sequence[uuid.UUID],
    workflow_id: str,
    placement: dict[str, Any],
    slots: Sequence[FreeSlot],
    task_id: uuid.UUID,
    task_kind: str,
) -> Any:
    """Returns the allocation's created_at. A lost race (the exclusion constraint on claims) or
    an allocation placed before raises asyncpg.IntegrityConstraintViolationError."""
    if slots:
        kind = ClaimKind.GPU_SLOT
        claim_slots: list[uuid.UUID | None] = [s.slot_id for s in slots]
        lower = [s.gpu_index for s in slots]
        upper = [s.gpu_index + 1 for s in slots]
    else:
        kind = ClaimKind.NODE_EXCLUSIVE
        claim_slots, lower, upper = [None], [WHOLE_NODE_FOOTPRINT[0]], [WHOLE_NODE_FOOTPRINT[1]]
    return await pg.fetchval(
        _WRITE_PLACEMENT,
        allocation_id,
        project_id,
        idempotency_key,
        sku,
        region,
        shape,
        gpu_count,
        node_id,
        list(ssh_key_ids),
        workflow_id,
        json.dumps(placement),
        [s.slot_id for s in slots],
        kind,
        claim_slots,
        lower,
        upper,
        task_id,
        task_kind,
    )
