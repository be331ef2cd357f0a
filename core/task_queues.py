"""Task-queue names. Host work for a node runs on that node's own queue (ARCHITECTURE rule 7)."""

from __future__ import annotations

import uuid


def node_task_queue(node_id: uuid.UUID | str) -> str:
    return f"node-{node_id}"
