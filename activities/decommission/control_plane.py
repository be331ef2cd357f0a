"""The control-plane activities of NodeDecommissionWorkflow (docs/lifecycles/decommission.md,
docs/lifecycles/decommission.md#failures-and-recommended-actions), one class composed from the
per-job modules so the worker registers one instance: node inventory transitions (node_inventory),
emptying the node of tenant work (draining), MAAS release / power-off / delete (maas_release),
record removal and secrets cleanup (removal), the operator's observe and compensate
(operator_actions), and the workflow's read-model writes (bookkeeping). All of them share
stage_runtime. Host work (node.drain, node.storage_cleanup, ...) is dispatched by the workflow
itself on the node's queue; the reimage stages are in reimage.py.
"""

from __future__ import annotations

from activities.decommission.bookkeeping import DecommissionBookkeeping
from activities.decommission.draining import DrainStages
from activities.decommission.maas_release import MaasReleaseStages
from activities.decommission.node_inventory import NodeInventoryStages
from activities.decommission.operator_actions import OperatorActions
from activities.decommission.removal import RemovalStages
from activities.decommission.stage_runtime import DecommissionDeps

__all__ = ["DecommissionActivities", "DecommissionDeps"]


class DecommissionActivities(
    NodeInventoryStages,
    DrainStages,
    MaasReleaseStages,
    RemovalStages,
    OperatorActions,
    DecommissionBookkeeping,
):
    """Every `decommission.*` activity; the names (`@activity.defn(name=...)`) are in recorded
    histories and never change."""
