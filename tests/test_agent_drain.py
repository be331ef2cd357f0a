"""A drained node refuses new tenant work (non-retryable node_draining) but still releases."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from agent.contract import HostErrorType
from agent.host_activities import HostActivities
from sim.host import SimulatedHost
from tests.test_agent_host import release_spec, slice_spec


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
