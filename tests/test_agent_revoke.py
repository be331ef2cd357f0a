"""allocation.revoke_user through a real agent worker: login disabled and keys removed, the
account and data kept (the file-based backend's revoke is tested in test_agent_users.py)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.worker import Worker

from agent.backend import BAREMETAL_REVOKE_PHASES
from contracts.host_tasks import (
    BAREMETAL_PROVISION_USER,
    BAREMETAL_REVOKE_USER,
    HostProvisionInput,
    HostProvisionResult,
    HostReleaseInput,
    HostRevokeResult,
)
from core.task_queues import node_task_queue
from tests.test_agent_host import baremetal_spec, release_spec, succeeded


@workflow.defn(sandboxed=False)
class ProvisionThenRevoke:
    @workflow.run
    async def run(self, spec: HostProvisionInput, revoke: HostReleaseInput) -> HostRevokeResult:
        queue = node_task_queue(spec.node_id)
        await workflow.execute_activity(
            BAREMETAL_PROVISION_USER, spec, result_type=HostProvisionResult, task_queue=queue,
            start_to_close_timeout=timedelta(seconds=30),
        )  # fmt: skip
        result: HostRevokeResult = await workflow.execute_activity(
            BAREMETAL_REVOKE_USER, revoke, result_type=HostRevokeResult, task_queue=queue,
            start_to_close_timeout=timedelta(seconds=30),
        )  # fmt: skip
        return result


async def test_revoke_through_a_real_agent_keeps_the_account(
    temporal_client: Any, start_node_agent: Any
) -> None:
    agent = await start_node_agent(str(uuid.uuid4()))
    spec = baremetal_spec(agent.node_id)
    queue = f"revoke-test-{uuid.uuid4()}"
    async with Worker(temporal_client, task_queue=queue, workflows=[ProvisionThenRevoke]):
        result = await temporal_client.execute_workflow(
            ProvisionThenRevoke.run,
            args=[spec, release_spec(spec)],
            id=f"revoke-{uuid.uuid4()}",
            task_queue=queue,
        )
    assert result.revoked is True
    assert succeeded(result.phases) == list(BAREMETAL_REVOKE_PHASES)
    user = agent.host.user(spec.allocation_id)
    assert user is not None, "the account stays"
    assert user.key_fingerprints == ()
