"""The SQL of placement, the hot spot of every POST /allocations: what is offered, then one
statement that ranks the nodes, locks the best one nobody else holds and its slots, picks the
slots (docs/lifecycles/allocation.md#placement: NUMA-fit, then best-fit), takes a slice's project
VLAN and writes the whole reservation.

Written against the asyncpg connection directly, in plain SQL, because this path runs once per
POST and SQLAlchemy's statement building, compilation and ORM bookkeeping cost more CPU than the
queries themselves; asyncpg also keeps each statement prepared per connection. Everything else
in the control plane uses SQLAlchemy. The tables are those of schema/models.py. Only the state
names of contracts/states.py (and the balance state of contracts/billing_meter.py) are
interpolated into these strings; every value is a `$n` parameter.

Each placement is two round trips, both outside any explicit transaction: the offer (a read), and
one statement that locks and writes, checking again what the offer's read could have seen change
(the project's balance state, capacity). A single statement is atomic on its own, its locks last
exactly as long as it runs, and a placement no longer pays BEGIN and COMMIT round trips.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg

from contracts.billing_meter import BalanceState
from contracts.states import (
    LIVE_ALLOCATION_STATUSES,
    AllocationStatus,
    ClaimKind,
    ClaimStatus,
    NodeStatus,
    NodeTaskStatus,
    SlotStatus,
)

# A whole-node claim overlaps every GPU index on the node.
WHOLE_NODE_FOOTPRINT = (0, 2**31 - 1)
# The VLAN ids of a region that has no slice_vlan_pools row: clear of VLAN 1 (the usual native
# VLAN) and of the low ids sites tend to keep for infrastructure.
DEFAULT_SLICE_VLAN_POOL = (1000, 3999)


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


# --- the reservation, written by the same statement that locked what it reserves ---
#
# Every statement below takes the same leading parameters:
#   $1 region, $2 sku, $3 gpus, $4 allocation id, $5 project id, $6 idempotency key, $7 shape,
#   $8 ssh key ids, $9 workflow id, $10 host task id, $11 host task kind, $12 allocation group id
#   (NULL outside a group), $13 whether the group forbids two live members on one node
# and expects a CTE `placed(node_id)` holding the node to place on (no row: write nothing) and
# `details`, the placement's event details. It writes the allocation (created `requested`: seed
# 000's reservation; the workflow's allocation.begin_provisioning moves it on) and its queued host
# task; the claims and slots are the shape's own. Foreign keys to the
# new allocation are checked at the end of the statement, and the claims' exclusion constraint
# stays the last word on double booking.
_WRITE_ALLOCATION = f"""
allocation AS (
  INSERT INTO allocations (id, project_id, idempotency_key, sku, region, shape, gpu_count, node_id,
                           ssh_key_ids, status, workflow_id, created_at, allocation_group_id,
                           same_node_forbidden)
  SELECT $4::uuid, $5::uuid, $6::text, $2::text, $1::text, $7::text, $3::int, placed.node_id,
         $8::uuid[], '{AllocationStatus.REQUESTED}', $9::text, stamp.at, $12::uuid, $13::bool
  FROM placed, (SELECT clock_timestamp() AS at) AS stamp
  RETURNING id, node_id, created_at
), events AS (
  INSERT INTO allocation_events (allocation_id, event, from_status, to_status, details)
  SELECT allocation.id, e.event, e.from_status, e.to_status, e.details
  FROM allocation, (VALUES
      (1, 'requested', NULL, '{AllocationStatus.REQUESTED}', '{{}}'::jsonb),
      (2, 'placement_reserved', NULL, NULL, (SELECT details FROM details))
  ) AS e(position, event, from_status, to_status, details)
  ORDER BY e.position
), task AS (
  INSERT INTO node_tasks (id, node_id, allocation_id, kind, status, workflow_id)
  SELECT $10::uuid, allocation.node_id, allocation.id, $11::text, '{NodeTaskStatus.QUEUED}',
         $9::text
  FROM allocation
  ON CONFLICT (id) DO NOTHING
)"""

# docs/lifecycles/balance.md: a project allocates only while its balance is positive, i.e. its
# billing account exists and is not `depleted` (no account: nothing was ever credited). Checked by
# the statement that reserves, on the account row read FOR SHARE: a state change (the meter, a
# credit; both lock the row FOR UPDATE, activities/billing/accounts.py) either commits first, and
# this statement then sees `depleted` and writes nothing, or waits for this statement, after which
# the meter sees the new allocation and releases it. No account row, or a depleted one: every
# CTE below finds nothing and nothing is written or locked.
_FUNDED = f"""
funded AS (
  SELECT b.project_id FROM billing_accounts b
  WHERE b.project_id = $5::uuid AND b.state <> '{BalanceState.DEPLETED}'
  FOR SHARE
)"""

# Bare metal: the first active node of the SKU (by hostname) with no held claim, skipping nodes
# a concurrent placement has locked; its claim covers every GPU index on the node.
_FREE_NODES = f"""
SELECT n.id FROM nodes n
WHERE n.region = $1 AND n.sku = $2 AND n.status = '{NodeStatus.ACTIVE}' AND n.gpu_count = $3
  AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c
                  WHERE c.node_id = n.id AND c.status = '{ClaimStatus.HELD}')
  AND EXISTS (SELECT 1 FROM funded)
ORDER BY n.hostname
"""
_PLACE_BAREMETAL = f"""
WITH {_FUNDED}, node AS ({_FREE_NODES} LIMIT 1 FOR UPDATE OF n SKIP LOCKED
), placed AS (
  SELECT id AS node_id FROM node
), details AS (
  SELECT '{{"claim": "node"}}'::jsonb AS details
), {_WRITE_ALLOCATION}, claims AS (
  INSERT INTO allocation_resource_claims (id, allocation_id, node_id, slot_id, kind, footprint,
                                          status)
  SELECT gen_random_uuid(), allocation.id, allocation.node_id, NULL, '{ClaimKind.NODE_EXCLUSIVE}',
         int4range({WHOLE_NODE_FOOTPRINT[0]}, {WHOLE_NODE_FOOTPRINT[1]}), '{ClaimStatus.HELD}'
  FROM allocation
)
SELECT (SELECT id FROM node), (SELECT created_at FROM allocation),
       CASE WHEN (SELECT id FROM node) IS NULL THEN EXISTS ({_FREE_NODES}) ELSE true END,
       EXISTS (SELECT 1 FROM funded)
"""

# The VLAN of the project's slice network in the region, taken by the same statement that
# reserves the slots, only once they fit (`fits`), so a placement that writes nothing assigns
# nothing. The project's row, when it has one, is read FOR KEY SHARE: placements
# of one project share it, while the release of the project's last allocation locks it FOR UPDATE
# before it counts what is left and deletes it (activities/allocations.py, _return_slice_vlan),
# so a VLAN is never returned while a placement is using it. Without a row, the lowest vid of the
# region's pool (its slice_vlan_pools row, else `$14..$15`) that no project holds is inserted;
# the unique constraints decide between concurrent first placements: ON CONFLICT DO NOTHING
# waits for the other insert and yields nothing, so the loser writes nothing and ranks again
# (free_vid set, vlan empty), and no free vid at all is the pool being exhausted. Bare metal
# gets no VLAN: a whole node has no neighbours on its host bridge.
_SLICE_VLAN = """
held_vlan AS (
  SELECT v.vlan_id FROM project_slice_vlans v
  WHERE v.region = $1 AND v.project_id = $5::uuid AND (SELECT ok FROM fits)
  FOR KEY SHARE
), pool AS (
  SELECT coalesce(p.first_vid, $14::int) AS first_vid, coalesce(p.last_vid, $15::int) AS last_vid
  FROM (SELECT 1) AS one LEFT JOIN slice_vlan_pools p ON p.region = $1
), free_vid AS (
  SELECT s.vid FROM pool, generate_series(pool.first_vid, pool.last_vid) AS s(vid)
  WHERE (SELECT ok FROM fits) AND NOT EXISTS (SELECT 1 FROM held_vlan)
    AND NOT EXISTS (SELECT 1 FROM project_slice_vlans v WHERE v.region = $1 AND v.vlan_id = s.vid)
  ORDER BY s.vid
  LIMIT 1
), new_vlan AS (
  INSERT INTO project_slice_vlans (region, project_id, vlan_id, assigned_at)
  SELECT $1::text, $5::uuid, vid, clock_timestamp() FROM free_vid
  ON CONFLICT DO NOTHING
  RETURNING vlan_id
), vlan_assigned AS (
  INSERT INTO domain_events (type, subject_type, subject_id, payload)
  SELECT 'project.slice_vlan_assigned', 'project', $5::uuid::text,
         jsonb_build_object('region', $1::text, 'vlan_id', vlan_id, 'allocation_id',
                            $4::uuid::text)
  FROM new_vlan
), vlan AS (
  SELECT vlan_id FROM held_vlan UNION ALL SELECT vlan_id FROM new_vlan
)"""


# Anti-affinity of an allocation group (docs/lifecycles/allocation-group.md, `spread:
# same_node_forbidden`): a member is not placed on a node where a live member of its group is. Only
# slices need the test: a bare-metal member's whole-node claim already keeps every other allocation
# off its node. Two members placed at once cannot both see the node free and both land there: the
# partial unique index `allocations_group_same_node` (migration 0025) refuses the second insert, and
# placement ranks again (allocation.place retries an integrity violation), now seeing the first.
_NOT_BESIDE_GROUP_MEMBER = f"""NOT ($13::bool AND EXISTS (
      SELECT 1 FROM allocations m
      WHERE m.allocation_group_id = $12::uuid AND m.same_node_forbidden AND m.node_id = n.id
        AND m.status IN ({", ".join(f"'{s}'" for s in sorted(LIVE_ALLOCATION_STATUSES))})))"""


# Slices: nodes where one NUMA node fits the request rank first, then best-fit (fewest free GPUs
# that still fit), so big requests keep finding room; ties go to the lower node id. The ranking
# is two walks down the `nodes_placement` index (region, sku, status, free_gpus, id,
# free_gpus_one_numa; migration 0017), each in ranking order and stopping at the first node no
# concurrent placement holds (`SKIP LOCKED`): the NUMA-fitting nodes first and, only when none of
# them could be locked, the rest. The NUMA-fit test is checked on the index entries, so a walk
# reads the row of the node it locks and of those it skips as locked, whatever the fleet's size:
# its cost follows the placements running at once, not the fleet (bench/placement.py). Nodes
# ranked before the first that fits but not fitting are passed over on their index entries alone,
# and when no node fits in one NUMA node at all, that walk is not made (`_NUMA_FIT_ANYWHERE`). The
# counters (kept by triggers on gpu_slots, migration 0013) only rank: on the locked node the slots
# themselves are locked and counted. They come from one NUMA node when one fits (the one with the
# fewest free slots that fits, best-fit again), else from the NUMA nodes with the most free slots
# first. If fewer slots than asked could be locked (a release in flight holds some), nothing is
# written and it ranks again. With the slots, the project's slice VLAN (`_SLICE_VLAN`): no VLAN,
# nothing written. Nothing locked while some node of the SKU has room, locked or not, is
# contention (`any_room`): retried, never answered sku_unavailable.
def _slice_walk(numa_condition: str) -> str:
    return f"""
  SELECT n.id FROM nodes n
  WHERE n.region = $1 AND n.sku = $2 AND n.status = '{NodeStatus.ACTIVE}' AND n.free_gpus >= $3
    AND {numa_condition} AND EXISTS (SELECT 1 FROM funded) AND {_NOT_BESIDE_GROUP_MEMBER}
  ORDER BY n.free_gpus, n.id
  LIMIT 1
  FOR UPDATE OF n SKIP LOCKED"""


# Some node of the SKU has room for the request, whether or not others hold it (`any_room`);
# a node the group's anti-affinity rules out has no room for this member.
_SLICE_ROOM = f"""
SELECT 1 FROM nodes n
WHERE n.region = $1 AND n.sku = $2 AND n.status = '{NodeStatus.ACTIVE}' AND n.free_gpus >= $3
  AND {_NOT_BESIDE_GROUP_MEMBER}
"""

# The placement_reserved event's details, and the reservation of the `chosen` slots with their
# claims, for the allocation `_WRITE_ALLOCATION` wrote.
_SLOT_DETAILS = """
details AS (
  SELECT jsonb_build_object(
           'claim', 'gpu_slots',
           'numa_nodes', (SELECT jsonb_agg(DISTINCT numa_node ORDER BY numa_node) FROM chosen)
         ) AS details
)"""
_RESERVE_CHOSEN = f"""
reserved AS (
  UPDATE gpu_slots g SET status = '{SlotStatus.RESERVED}', allocation_id = allocation.id,
                         updated_at = clock_timestamp()
  FROM allocation
  WHERE g.id IN (SELECT id FROM chosen)
), claims AS (
  INSERT INTO allocation_resource_claims (id, allocation_id, node_id, slot_id, kind, footprint,
                                          status)
  SELECT gen_random_uuid(), allocation.id, allocation.node_id, c.id, '{ClaimKind.GPU_SLOT}',
         int4range(c.gpu_index, c.gpu_index + 1), '{ClaimStatus.HELD}'
  FROM allocation, chosen c
)"""

# Whether one NUMA node of any node of the SKU fits the request, from the `nodes_numa_fit` index:
# when none does (eight GPUs on nodes of two NUMA nodes of four, say), the NUMA-fit walk is not
# made, rather than passing over the index entry of every node with room.
_NUMA_FIT_ANYWHERE = f"""
SELECT 1 FROM nodes f
WHERE f.region = $1 AND f.sku = $2 AND f.status = '{NodeStatus.ACTIVE}'
  AND f.free_gpus_one_numa >= $3
"""

_PLACE_SLICE = f"""
WITH {_FUNDED}, numa_fit_node AS ({
    _slice_walk(f"n.free_gpus_one_numa >= $3 AND EXISTS ({_NUMA_FIT_ANYWHERE})")
}
), other_node AS ({
    _slice_walk("n.free_gpus_one_numa < $3 AND NOT EXISTS (SELECT 1 FROM numa_fit_node)")
}
), node AS (
  SELECT id FROM numa_fit_node UNION ALL SELECT id FROM other_node
), slots AS (
  SELECT g.id, g.gpu_index, g.numa_node, g.pci_address FROM gpu_slots g
  WHERE g.node_id = (SELECT id FROM node) AND g.status = '{SlotStatus.FREE}'
  FOR UPDATE SKIP LOCKED
), numa AS (
  SELECT numa_node, count(*) AS numa_free FROM slots GROUP BY numa_node
), ordered AS (
  SELECT s.id, s.gpu_index, s.numa_node, s.pci_address,
         row_number() OVER (ORDER BY numa.numa_free >= $3 DESC,
                                     CASE WHEN numa.numa_free >= $3 THEN numa.numa_free
                                          ELSE -numa.numa_free END,
                                     s.numa_node, s.gpu_index) AS pick
  FROM slots s JOIN numa USING (numa_node)
), chosen AS (
  SELECT * FROM ordered WHERE pick <= $3
), fits AS (
  SELECT (SELECT count(*) FROM chosen) = $3 AS ok
), {_SLICE_VLAN}, placed AS (
  SELECT id AS node_id FROM node WHERE (SELECT ok FROM fits) AND EXISTS (SELECT 1 FROM vlan)
), {_SLOT_DETAILS}, {_WRITE_ALLOCATION}, {_RESERVE_CHOSEN}
SELECT (SELECT id FROM node), (SELECT created_at FROM allocation),
       CASE WHEN (SELECT id FROM node) IS NULL THEN EXISTS ({_SLICE_ROOM}) ELSE true END,
       ARRAY(SELECT id FROM chosen ORDER BY pick),
       ARRAY(SELECT gpu_index FROM chosen ORDER BY pick),
       ARRAY(SELECT numa_node FROM chosen ORDER BY pick),
       ARRAY(SELECT pci_address FROM chosen ORDER BY pick),
       (SELECT ok FROM fits), (SELECT vlan_id FROM vlan), (SELECT vid FROM free_vid),
       EXISTS (SELECT 1 FROM funded)
"""

# Reservations of slots the caller chose, written by the same statement parts as a placement's
# (allocation, events, host task, slots, claims) but without ranking, locking a node or taking a
# VLAN: for benchmarks that fill a fleet in bulk before they time real placements
# (bench/placement.py). `$14` the node, `$15` its free slots to reserve; a slot no longer free
# writes nothing.
_RESERVE_GIVEN_SLOTS = f"""
WITH chosen AS (
  SELECT g.id, g.gpu_index, g.numa_node FROM gpu_slots g
  WHERE g.id = ANY($15::uuid[]) AND g.node_id = $14::uuid AND g.status = '{SlotStatus.FREE}'
  FOR UPDATE
), placed AS (
  SELECT $14::uuid AS node_id WHERE (SELECT count(*) FROM chosen) = cardinality($15::uuid[])
), {_SLOT_DETAILS}, {_WRITE_ALLOCATION}, {_RESERVE_CHOSEN}
SELECT 1
"""


@dataclass(frozen=True)
class ReservedSlot:
    slot_id: uuid.UUID
    gpu_index: int
    numa_node: int
    pci_address: str


@dataclass(frozen=True)
class Placed:
    """What one placement statement did: `created_at` is set when it wrote the reservation.
    `any_room`: some node had room for the request when it ran, so writing nothing means
    contention (concurrent placements held those nodes, or the one it locked had slots held by
    a release in flight), not a lack of capacity."""

    node_id: uuid.UUID | None
    created_at: dt.datetime | None
    any_room: bool
    slots: list[ReservedSlot] = field(default_factory=list)
    # The project's balance allowed the placement when the statement ran
    # (docs/lifecycles/balance.md); False: nothing was written because the account is depleted (or
    # was never credited).
    funded: bool = True
    # Slices only. `fits`: the node it locked had the slots. `vlan_id`: the project's VLAN in
    # the region (held or assigned now). `free_vid`: the vid a first placement tried to take; set
    # with no `vlan_id`, a concurrent first placement took it (rank again); neither set while
    # `fits`, the region's pool is exhausted.
    fits: bool = False
    vlan_id: int | None = None
    free_vid: int | None = None

    @property
    def vlan_pool_exhausted(self) -> bool:
        return self.fits and self.vlan_id is None and self.free_vid is None

    @property
    def vlan_contended(self) -> bool:
        return self.fits and self.vlan_id is None and self.free_vid is not None

    @property
    def written(self) -> bool:
        return self.created_at is not None


@dataclass(frozen=True)
class PlacementRequest:
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    idempotency_key: str | None
    sku: str
    region: str
    shape: str
    gpus: int
    ssh_key_ids: Sequence[uuid.UUID]
    workflow_id: str
    task_id: uuid.UUID
    task_kind: str
    allocation_group_id: uuid.UUID | None = None
    same_node_forbidden: bool = False

    def parameters(self) -> tuple[object, ...]:
        """The leading parameters every placement statement takes, in order."""
        return (
            self.region,
            self.sku,
            self.gpus,
            self.allocation_id,
            self.project_id,
            self.idempotency_key,
            self.shape,
            list(self.ssh_key_ids),
            self.workflow_id,
            self.task_id,
            self.task_kind,
            self.allocation_group_id,
            self.same_node_forbidden,
        )


async def place_baremetal(pg: asyncpg.Connection, request: PlacementRequest) -> Placed:
    """Lock a free node and claim it whole, in one statement. A rerun of a placement already
    written, or a lost race, raises asyncpg.IntegrityConstraintViolationError."""
    row = await pg.fetchrow(_PLACE_BAREMETAL, *request.parameters())
    assert row is not None
    return Placed(node_id=row[0], created_at=row[1], any_room=bool(row[2]), funded=bool(row[3]))


async def place_slice(
    pg: asyncpg.Connection,
    request: PlacementRequest,
    *,
    default_vlan_pool: tuple[int, int] = DEFAULT_SLICE_VLAN_POOL,
) -> Placed:
    """Rank, lock the best free node and its slots, pick the slots, take the project's VLAN and
    reserve them, in one statement. Raises like place_baremetal."""
    row = await pg.fetchrow(_PLACE_SLICE, *request.parameters(), *default_vlan_pool)
    assert row is not None
    slots = [ReservedSlot(*fields) for fields in zip(row[3], row[4], row[5], row[6], strict=True)]
    return Placed(
        node_id=row[0],
        created_at=row[1],
        any_room=bool(row[2]),
        slots=slots,
        fits=bool(row[7]),
        vlan_id=row[8],
        free_vid=row[9],
        funded=bool(row[10]),
    )


async def explain_place_slice(
    pg: asyncpg.Connection,
    request: PlacementRequest,
    *,
    default_vlan_pool: tuple[int, int] = DEFAULT_SLICE_VLAN_POOL,
) -> list[str]:
    """The plan of place_slice's statement for `request`, run with EXPLAIN (ANALYZE, BUFFERS) in
    a transaction that is rolled back: a profile of one placement (bench/placement.py)."""
    transaction = pg.transaction()
    await transaction.start()
    try:
        rows = await pg.fetch(
            f"EXPLAIN (ANALYZE, BUFFERS) {_PLACE_SLICE}", *request.parameters(), *default_vlan_pool
        )
    finally:
        await transaction.rollback()
    return [row[0] for row in rows]


async def reserve_given_slots(
    pg: asyncpg.Connection,
    reservations: Sequence[tuple[PlacementRequest, uuid.UUID, Sequence[uuid.UUID]]],
) -> None:
    """Write each (request, node, slots) reservation as a placement writes it, with the slots
    chosen by the caller (`_RESERVE_GIVEN_SLOTS`), pipelined: a benchmark's bulk fill."""
    await pg.executemany(
        _RESERVE_GIVEN_SLOTS,
        [(*request.parameters(), node_id, list(slots)) for request, node_id, slots in reservations],
    )
