"""The decommission workflow's own reads and read-model writes that are not stages: the
node's status, progress, and `record_node_task`, which mirrors the host tasks the workflow
dispatches on the node's queue (node.drain, node.storage_cleanup, ...) into node_tasks.

Separate so the stage modules hold stages only; the writes themselves live in read_model.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select
from temporalio import activity

from activities.decommission import read_model
from activities.decommission.stage_runtime import StageRuntime
from contracts.decommission import NodeTaskRecord, ProgressRecord
from schema.models import Node


class DecommissionBookkeeping(StageRuntime):
    @activity.defn(name="decommission.node_status")
    async def node_status(self, node_id: str) -> str | None:
        async with self.deps.sessions() as session:
            status: str | None = await session.scalar(
                select(Node.status).where(Node.id == uuid.UUID(node_id))
            )
            return status

    @activity.defn(name="decommission.record_progress")
    async def record_progress(self, record: ProgressRecord) -> None:
        async with self.deps.sessions() as session, session.begin():
            await read_model.record_progress(session, record)

    @activity.defn(name="decommission.record_node_task")
    async def record_node_task(self, record: NodeTaskRecord) -> None:
        async with self.deps.sessions() as session, session.begin():
            await read_model.record_node_task(session, record)
