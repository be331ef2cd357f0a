"""A drained node refuses new tenant work (non-retryable node_draining) but still releases, and
reports the tenant tasks still running when it was drained."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from agent.backend import Progress, ProvisionOutcome
from agent.host_activities import HostActivities
from agent.node_worker import NodeServices, node_activities
from contracts.host_tasks import (
    BAREMETAL_PROVISION_USER,
    NODE_DRAIN,
    NODE_UNDRAIN,
    HostErrorType,
    HostProvisionInput,
    NodeMaintenanceInput,
)
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from sim.node_services import machine_maintenance
from tests.test_agent_host import baremetal_spec, release_spec, slice_spec


async def test_draining_node_refuses_provisioning_and_still_releases() -> None:
    host = SimulatedHost("node-1")
    draining = False
    activities = HostActivities(host, node_id="node-1", is_draining=lambda: draining)
    env = ActivityEnvironment()
    spec = slice_spec("node-1")
    await env.run(activities.provision_slice_vm, spec)

    draining = True
    with pytest.raises(ApplicationError) as refused:
        await env.run(activities.provision_slice_vm, slice_spec("node-1"))
    assert refused.value.type == HostErrorType.NODE_DRAINING
    assert refused.value.non_retryable
    released = await env.run(activities.release_slice_vm, release_spec(spec))
    assert released.cleanup_proven


class HeldHost(SimulatedHost):
    """A bare-metal provision that holds until the test lets it go."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id, config=SimHostConfig())
        self.entered = threading.Event()
        self.go = threading.Event()

    def provision_baremetal_user(
        self, spec: HostProvisionInput, progress: Progress
    ) -> ProvisionOutcome:
        self.entered.set()
        self.go.wait(timeout=30)
        return super().provision_baremetal_user(spec, progress)


async def test_drain_reports_the_tenant_tasks_the_agent_is_running(tmp_path: Path) -> None:
    """node.drain counts what the agent's registration really runs (one HostActivities per node),
    not a figure a backend makes up: 1 while a provision is in flight, 0 once it finished."""
    node = "00000000-0000-0000-0000-0000000000d1"
    host = HeldHost(node)
    bound = {
        activity._Definition.must_from_callable(fn).name or "": fn
        for fn in node_activities(NodeServices(host, machine_maintenance(tmp_path)), node)
    }
    env = ActivityEnvironment()
    provisioning = asyncio.create_task(
        env.run(bound[BAREMETAL_PROVISION_USER], baremetal_spec(node))
    )
    await asyncio.to_thread(host.entered.wait, 10)
    drained = await env.run(bound[NODE_DRAIN], NodeMaintenanceInput(task_id="t1", node_id=node))
    assert drained.draining
    assert drained.running_tasks == 1
    host.go.set()
    await provisioning
    await env.run(bound[NODE_UNDRAIN], NodeMaintenanceInput(task_id="t2", node_id=node))
    again = await env.run(bound[NODE_DRAIN], NodeMaintenanceInput(task_id="t3", node_id=node))
    assert again.running_tasks == 0
