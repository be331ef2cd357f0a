"""Host activities through a real Temporal worker: a tiny workflow in this module calls one host
activity on the node's queue, served by a real agent worker (tests/agent_fixtures.py) backed by a
SimulatedHost."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    TimeoutError,
    TimeoutType,
)
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from agent.backend import (
    BAREMETAL_DEPROVISION_PHASES,
    BAREMETAL_PROVISION_PHASES,
    SLICE_PROVISION_PHASES,
    SLICE_RELEASE_PHASES,
)
from contracts.host_tasks import (
    BAREMETAL_DEPROVISION_USER,
    BAREMETAL_PROVISION_USER,
    NON_RETRYABLE_HOST_ERRORS,
    SLICE_VM_PROVISION,
    SLICE_VM_RELEASE,
    GpuAssignment,
    HostErrorType,
    HostPhase,
    HostProvisionInput,
    HostProvisionResult,
    HostReleaseInput,
    HostReleaseResult,
)
from core.codec import ENCODING
from core.task_queues import node_task_queue
from sim.config import SimHostConfig
from sim.demo_fleet import SLICE_SKU, seed_demo_fleet
from sim.fleet import SimFleet, load_agent_nodes
from sim.host import SimulatedHost
from tests.agent_fixtures import StartNodeAgent
from tests.lifecycle_support import eventually

# --------------------------------------------------------------------------- the test workflow


@dataclass
class HostCall:
    activity: str
    node_id: str
    provision: HostProvisionInput | None = None
    release: HostReleaseInput | None = None
    max_attempts: int = 1
    heartbeat_timeout_s: float = 5.0
    start_to_close_s: float = 30.0
    schedule_to_start_s: float = 10.0


@dataclass
class HostCallResult:
    provision: HostProvisionResult | None = None
    release: HostReleaseResult | None = None


@workflow.defn(name="AgentTestHostCall")
class HostCallWorkflow:
    @workflow.run
    async def run(self, call: HostCall) -> HostCallResult:
        options: dict[str, Any] = {
            "task_queue": node_task_queue(call.node_id),
            "schedule_to_start_timeout": timedelta(seconds=call.schedule_to_start_s),
            "start_to_close_timeout": timedelta(seconds=call.start_to_close_s),
            "heartbeat_timeout": timedelta(seconds=call.heartbeat_timeout_s),
            "retry_policy": RetryPolicy(
                initial_interval=timedelta(milliseconds=100),
                backoff_coefficient=1.0,
                maximum_attempts=call.max_attempts,
                non_retryable_error_types=[e.value for e in NON_RETRYABLE_HOST_ERRORS],
            ),
            "cancellation_type": workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        }
        if call.provision is not None:
            provisioned = await workflow.execute_activity(
                call.activity, call.provision, result_type=HostProvisionResult, **options
            )
            return HostCallResult(provision=provisioned)
        assert call.release is not None
        released = await workflow.execute_activity(
            call.activity, call.release, result_type=HostReleaseResult, **options
        )
        return HostCallResult(release=released)


class HostCaller:
    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

    async def start(self, call: HostCall) -> WorkflowHandle[Any, HostCallResult]:
        return await self.client.start_workflow(
            HostCallWorkflow.run, call, id=f"agent-test-{uuid.uuid4()}", task_queue=self.task_queue
        )

    async def provision(
        self, activity: str, spec: HostProvisionInput, **kw: Any
    ) -> HostProvisionResult:
        handle = await self.start(HostCall(activity, spec.node_id, provision=spec, **kw))
        result = await handle.result()
        assert result.provision is not None
        return result.provision

    async def release(self, activity: str, spec: HostReleaseInput, **kw: Any) -> HostReleaseResult:
        handle = await self.start(HostCall(activity, spec.node_id, release=spec, **kw))
        result = await handle.result()
        assert result.release is not None
        return result.release

    async def failure(self, call: HostCall) -> BaseException:
        """Run a call that must fail; answers the activity failure's cause."""
        handle = await self.start(call)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        activity_error = failed.value.cause
        assert isinstance(activity_error, ActivityError)
        assert activity_error.cause is not None
        return activity_error.cause


@pytest.fixture
async def caller(temporal_client: Client) -> AsyncIterator[HostCaller]:
    task_queue = f"agent-test-{uuid.uuid4()}"
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[HostCallWorkflow],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        yield HostCaller(temporal_client, task_queue)


# --------------------------------------------------------------------------- helpers


def tenant_key() -> str:
    """A realistic public key with a unique body, easy to search for."""
    body = base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519" + uuid.uuid4().bytes * 2).decode()
    return f"ssh-ed25519 {body} tenant@laptop"


def slice_spec(
    node_id: str, allocation_id: str | None = None, gpus: int = 2, **kw: Any
) -> HostProvisionInput:
    return HostProvisionInput(
        task_id=str(uuid.uuid4()),
        allocation_id=allocation_id or str(uuid.uuid4()),
        node_id=node_id,
        shape="gpu_slice",
        username="ubuntu",
        ssh_public_keys=kw.pop("keys", [tenant_key()]),
        gpus=[
            GpuAssignment(
                pci_address=f"0000:{0x17 + 0x1A * i:02x}:00.0", numa_node=i // 4, gpu_index=i
            )
            for i in range(gpus)
        ],
        vcpus=8 * gpus,
        memory_mb=65536 * gpus,
        image="ubuntu-22.04-cuda-12.4",
        image_sha256="0" * 64,
        **kw,
    )


def baremetal_spec(node_id: str, allocation_id: str | None = None, **kw: Any) -> HostProvisionInput:
    return HostProvisionInput(
        task_id=str(uuid.uuid4()),
        allocation_id=allocation_id or str(uuid.uuid4()),
        node_id=node_id,
        shape="baremetal",
        username=kw.pop("username", "tenant"),
        ssh_public_keys=kw.pop("keys", [tenant_key()]),
        **kw,
    )


def release_spec(provision: HostProvisionInput, force: bool = False) -> HostReleaseInput:
    return HostReleaseInput(
        task_id=str(uuid.uuid4()),
        allocation_id=provision.allocation_id,
        node_id=provision.node_id,
        shape=provision.shape,
        username=provision.username,
        force=force,
    )


def succeeded(phases: list[HostPhase]) -> list[str]:
    return [p.phase for p in phases if p.status == "succeeded"]


def new_node() -> str:
    return str(uuid.uuid4())


# --------------------------------------------------------------------------- happy paths


async def test_slice_provision_reports_phases_in_order(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)

    result = await caller.provision(SLICE_VM_PROVISION, spec)

    assert result.task_id == spec.task_id
    assert succeeded(result.phases) == list(SLICE_PROVISION_PHASES)
    # Each phase starts before it succeeds, one after another.
    assert [(p.phase, p.status) for p in result.phases[:2]] == [
        ("image_prepared", "started"),
        ("image_prepared", "succeeded"),
    ]
    times = [datetime.fromisoformat(p.at) for p in result.phases]
    assert all(t.tzinfo == UTC for t in times)
    assert times == sorted(times)
    assert datetime.fromisoformat(result.started_at) <= datetime.fromisoformat(result.finished_at)
    assert result.connect_host.startswith("10.")
    assert not result.adopted_existing
    domain = agent.host.domain(spec.allocation_id)
    assert domain is not None
    assert domain.state == "running"
    assert set(agent.host.gpu_leases) == {g.pci_address for g in spec.gpus}


async def test_slice_release_cleans_up_and_proves_it(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, spec)

    result = await caller.release(SLICE_VM_RELEASE, release_spec(spec))

    assert succeeded(result.phases) == list(SLICE_RELEASE_PHASES)
    assert (result.released, result.hard_stopped, result.wiped, result.leases_released) == (
        True,
        False,
        True,
        True,
    )
    assert result.cleanup_proven
    assert agent.host.domain(spec.allocation_id) is None
    assert agent.host.gpu_leases == {}


async def test_baremetal_user_lifecycle(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = baremetal_spec(agent.node_id)

    provisioned = await caller.provision(BAREMETAL_PROVISION_USER, spec)
    assert succeeded(provisioned.phases) == list(BAREMETAL_PROVISION_PHASES)
    assert provisioned.connect_host.startswith("10.")
    user = agent.host.user(spec.allocation_id)
    assert user is not None
    assert user.access_verified
    assert len(user.key_fingerprints) == 1

    released = await caller.release(BAREMETAL_DEPROVISION_USER, release_spec(spec))
    assert succeeded(released.phases) == list(BAREMETAL_DEPROVISION_PHASES)
    assert released.cleanup_proven
    assert not released.hard_stopped
    assert agent.host.user(spec.allocation_id) is None


async def test_baremetal_connect_host_follows_the_hostname(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    hosts = {"a": "h100-bm-01.demo", "b": "h100-bm-01.demo", "c": "h100-bm-02.demo"}
    answers = {}
    for name, hostname in hosts.items():
        node = new_node()
        await start_node_agent(node, SimulatedHost(node, hostname=hostname))
        result = await caller.provision(BAREMETAL_PROVISION_USER, baremetal_spec(node))
        answers[name] = result.connect_host
    assert answers["a"] == answers["b"] != answers["c"]


# --------------------------------------------------------------------------- heartbeats


async def test_heartbeats_carry_phases_while_a_slow_phase_runs(
    caller: HostCaller, start_node_agent: StartNodeAgent, temporal_client: Client
) -> None:
    node = new_node()
    # The slow phase lasts three heartbeat timeouts: only the background loop keeps it alive.
    host = SimulatedHost(node, config=SimHostConfig(phase_delays_s={"guest_reachable": 3.0}))
    await start_node_agent(node, host)
    spec = slice_spec(node)
    handle = await caller.start(
        HostCall(SLICE_VM_PROVISION, node, provision=spec, heartbeat_timeout_s=1.0)
    )

    async def pending_phases() -> list[HostPhase] | None:
        description = await handle.describe()
        for pending in description.raw_description.pending_activities:
            if pending.heartbeat_details.payloads:
                [phases] = await temporal_client.data_converter.decode(
                    pending.heartbeat_details.payloads, [list[HostPhase]]
                )
                if any(p.phase == "guest_reachable" for p in phases):
                    return list(phases)
        return None

    phases = await eventually(pending_phases)
    assert succeeded(phases) == list(SLICE_PROVISION_PHASES[:4])
    assert (phases[-1].phase, phases[-1].status) == ("guest_reachable", "started")
    result = await handle.result()
    assert succeeded(result.provision.phases if result.provision else []) == list(
        SLICE_PROVISION_PHASES
    )


async def test_hang_without_heartbeats_hits_the_heartbeat_timeout(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    agent.host.faults.hang(SLICE_VM_PROVISION)  # guest_reachable blocks, heartbeats stop
    spec = slice_spec(agent.node_id)

    cause = await caller.failure(
        HostCall(SLICE_VM_PROVISION, agent.node_id, provision=spec, heartbeat_timeout_s=1.0)
    )

    assert isinstance(cause, TimeoutError)
    assert cause.type == TimeoutType.HEARTBEAT
    # The hung thread is released when the agent stops (its task is cancelled).
    await agent.stop()
    assert [c.phase for c in agent.host.cancelled_phases] == ["guest_reachable"]


async def test_cancellation_reaches_the_backend(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    agent.host.faults.hang(SLICE_VM_PROVISION, phase="vm_started", heartbeats=True)
    spec = slice_spec(agent.node_id)
    handle = await caller.start(
        HostCall(SLICE_VM_PROVISION, agent.node_id, provision=spec, heartbeat_timeout_s=1.0)
    )

    async def hanging() -> bool:
        return agent.host.attempts(SLICE_VM_PROVISION, spec.allocation_id) == 1

    await eventually(hanging)
    # A bounded window past the 1 s heartbeat timeout (Temporal's, not an event to wait for):
    # heartbeats keep a hung phase alive, so the cancel below still finds it running.
    await asyncio.sleep(1.5)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    assert isinstance(failed.value.cause, CancelledError)
    assert [c.phase for c in agent.host.cancelled_phases] == ["vm_started"]


async def test_dead_node_is_detected_by_schedule_to_start(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    await agent.stop()
    assert not agent.running

    cause = await caller.failure(
        HostCall(
            SLICE_VM_PROVISION,
            agent.node_id,
            provision=slice_spec(agent.node_id),
            schedule_to_start_s=1.0,
        )
    )

    assert isinstance(cause, TimeoutError)
    assert cause.type == TimeoutType.SCHEDULE_TO_START
    assert agent.host.attempts(SLICE_VM_PROVISION) == 0


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    ("error_type", "phase"),
    [
        (HostErrorType.IMAGE_ERROR, "image_prepared"),
        (HostErrorType.VFIO_ERROR, "vm_started"),
        (HostErrorType.READINESS_TIMEOUT, "guest_reachable"),
    ],
)
async def test_provision_faults_are_typed_and_not_retried(
    caller: HostCaller, start_node_agent: StartNodeAgent, error_type: HostErrorType, phase: str
) -> None:
    agent = await start_node_agent(new_node())
    agent.host.faults.inject(SLICE_VM_PROVISION, error_type)
    spec = slice_spec(agent.node_id)

    cause = await caller.failure(
        HostCall(SLICE_VM_PROVISION, agent.node_id, provision=spec, max_attempts=3)
    )

    assert isinstance(cause, ApplicationError)
    assert cause.type == error_type.value
    assert cause.non_retryable
    assert agent.host.attempts(SLICE_VM_PROVISION, spec.allocation_id) == 1
    # The phases so far ride along as the first detail, ending with the failed phase.
    phases = cause.details[0]
    assert (phases[-1]["phase"], phases[-1]["status"]) == (phase, "failed")


async def test_lease_conflict_is_retried_then_succeeds(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    fault = agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.LEASE_CONFLICT, times=2)
    spec = slice_spec(agent.node_id)

    result = await caller.provision(SLICE_VM_PROVISION, spec, max_attempts=3)

    assert fault.fired == 2
    assert agent.host.attempts(SLICE_VM_PROVISION, spec.allocation_id) == 3
    assert succeeded(result.phases) == list(SLICE_PROVISION_PHASES)
    assert not result.adopted_existing  # the conflict struck before anything was defined


async def test_lease_conflict_exhausts_attempts_as_a_retryable_error(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    first = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, first)
    # A second allocation asking for the same GPUs meets the first one's leases.
    second = slice_spec(agent.node_id)

    cause = await caller.failure(
        HostCall(SLICE_VM_PROVISION, agent.node_id, provision=second, max_attempts=2)
    )

    assert isinstance(cause, ApplicationError)
    assert cause.type == HostErrorType.LEASE_CONFLICT.value
    assert not cause.non_retryable
    assert agent.host.attempts(SLICE_VM_PROVISION, second.allocation_id) == 2


async def test_release_error_is_retried_then_succeeds(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, spec)
    agent.host.faults.inject(SLICE_VM_RELEASE, HostErrorType.RELEASE_ERROR, times=2)

    result = await caller.release(SLICE_VM_RELEASE, release_spec(spec), max_attempts=3)

    assert result.cleanup_proven
    assert agent.host.attempts(SLICE_VM_RELEASE, spec.allocation_id) == 3
    assert agent.host.domain(spec.allocation_id) is None


async def test_release_error_exhausted_is_retryable_release_error(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = baremetal_spec(agent.node_id)
    await caller.provision(BAREMETAL_PROVISION_USER, spec)
    agent.host.faults.inject(BAREMETAL_DEPROVISION_USER, HostErrorType.RELEASE_ERROR, times=None)

    cause = await caller.failure(
        HostCall(
            BAREMETAL_DEPROVISION_USER, agent.node_id, release=release_spec(spec), max_attempts=2
        )
    )

    assert isinstance(cause, ApplicationError)
    assert cause.type == HostErrorType.RELEASE_ERROR.value
    assert not cause.non_retryable
    assert agent.host.attempts(BAREMETAL_DEPROVISION_USER) == 2


async def test_failed_graceful_shutdown_falls_back_to_hard_stop(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, spec)
    agent.host.faults.fail_graceful_shutdown()

    result = await caller.release(SLICE_VM_RELEASE, release_spec(spec))

    assert result.released
    assert result.hard_stopped
    assert result.cleanup_proven
    assert [(p.phase, p.status) for p in result.phases if p.status != "started"] == [
        ("graceful_shutdown", "failed"),
        ("hard_stop", "succeeded"),
        ("domain_destroyed", "succeeded"),
        ("domain_undefined", "succeeded"),
        ("leases_wiped", "succeeded"),
        ("gpus_health_checked", "succeeded"),
    ]


async def test_force_release_skips_the_graceful_shutdown(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, spec)

    result = await caller.release(SLICE_VM_RELEASE, release_spec(spec, force=True))

    assert result.hard_stopped
    assert result.cleanup_proven
    assert succeeded(result.phases) == ["hard_stop", *SLICE_RELEASE_PHASES[1:]]


# --------------------------------------------------------------------------- idempotency


async def test_provision_rerun_adopts_what_a_failed_attempt_built(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    agent.host.faults.inject(SLICE_VM_PROVISION, HostErrorType.READINESS_TIMEOUT)
    await caller.failure(HostCall(SLICE_VM_PROVISION, agent.node_id, provision=spec))
    assert agent.host.domain(spec.allocation_id) is not None  # defined and started, then failed

    rerun = await caller.provision(
        SLICE_VM_PROVISION, slice_spec(agent.node_id, spec.allocation_id)
    )

    assert rerun.adopted_existing
    assert succeeded(rerun.phases) == list(SLICE_PROVISION_PHASES)
    assert len(agent.host.domains) == 1


async def test_baremetal_provision_rerun_adopts_the_user(
    caller: HostCaller, start_node_agent: StartNodeAgent
) -> None:
    agent = await start_node_agent(new_node())
    spec = baremetal_spec(agent.node_id)
    first = await caller.provision(BAREMETAL_PROVISION_USER, spec)
    again = await caller.provision(BAREMETAL_PROVISION_USER, spec)
    assert not first.adopted_existing
    assert again.adopted_existing
    assert again.connect_host == first.connect_host


async def test_release_is_idempotent(caller: HostCaller, start_node_agent: StartNodeAgent) -> None:
    agent = await start_node_agent(new_node())
    spec = slice_spec(agent.node_id)
    await caller.provision(SLICE_VM_PROVISION, spec)

    first = await caller.release(SLICE_VM_RELEASE, release_spec(spec))
    second = await caller.release(SLICE_VM_RELEASE, release_spec(spec))
    never_provisioned = await caller.release(
        SLICE_VM_RELEASE, release_spec(slice_spec(agent.node_id))
    )
    baremetal_gone = await caller.release(
        BAREMETAL_DEPROVISION_USER, release_spec(baremetal_spec(agent.node_id))
    )

    for result in (first, second, never_provisioned, baremetal_gone):
        assert result.cleanup_proven
        assert not result.hard_stopped


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("activity", "make_spec"),
    [
        (SLICE_VM_PROVISION, lambda node: slice_spec(node, gpus=0)),
        (SLICE_VM_PROVISION, lambda node: baremetal_spec(node)),
        (BAREMETAL_PROVISION_USER, lambda node: slice_spec(node)),
        (BAREMETAL_PROVISION_USER, lambda node: baremetal_spec(node, username="Root; rm")),
        (BAREMETAL_PROVISION_USER, lambda node: baremetal_spec(node, keys=["ssh-rsa AAAA\nevil"])),
        (SLICE_VM_PROVISION, lambda node: slice_spec(str(uuid.uuid4()))),  # another node's task
    ],
    ids=[
        "no-gpus",
        "wrong-shape",
        "slice-as-baremetal",
        "bad-username",
        "multiline-key",
        "wrong-node",
    ],
)
async def test_invalid_specs_are_rejected_before_host_work(
    caller: HostCaller,
    start_node_agent: StartNodeAgent,
    activity: str,
    make_spec: Callable[[str], HostProvisionInput],
) -> None:
    agent = await start_node_agent(new_node())
    spec = make_spec(agent.node_id)

    cause = await caller.failure(HostCall(activity, agent.node_id, provision=spec, max_attempts=3))

    assert isinstance(cause, ApplicationError)
    assert cause.type == HostErrorType.INVALID_SPEC.value
    assert cause.non_retryable
    assert agent.host.attempts(activity) == 0
    assert "AAAA" not in cause.message


# --------------------------------------------------------------------------- secrets


async def test_ssh_keys_stay_out_of_logs_and_history(
    caller: HostCaller,
    start_node_agent: StartNodeAgent,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = await start_node_agent(new_node())
    key = tenant_key()
    key_body = key.split()[1]
    spec = baremetal_spec(agent.node_id, keys=[key])
    agent.host.faults.inject(BAREMETAL_PROVISION_USER, HostErrorType.LEASE_CONFLICT)

    handle = await caller.start(
        HostCall(BAREMETAL_PROVISION_USER, agent.node_id, provision=spec, max_attempts=2)
    )
    await handle.result()
    release = await caller.start(
        HostCall(BAREMETAL_DEPROVISION_USER, agent.node_id, release=release_spec(spec))
    )
    await release.result()
    # And a failing task whose error passes through every layer.
    bad = baremetal_spec(agent.node_id, keys=[key, key + "\nextra"])
    await caller.failure(HostCall(BAREMETAL_PROVISION_USER, agent.node_id, provision=bad))

    assert caplog.records, "the agent logs its phases"
    assert "ssh_keys_installed" in caplog.text
    for record in caplog.records:
        assert key_body not in record.getMessage()
    history = (await handle.fetch_history()).to_json()
    assert key_body not in history
    assert base64.b64encode(key_body.encode()).decode()[:40] not in history
    # The payloads are there, encrypted by the session's AES-GCM codec.
    assert base64.b64encode(ENCODING).decode() in history


# --------------------------------------------------------------------------- the simulated fleet


async def test_fleet_serves_every_active_node_from_the_database(
    caller: HostCaller, temporal_client: Client, db_sessions: Any
) -> None:
    async with db_sessions() as session:
        fleet_data = await seed_demo_fleet(session)
        await session.commit()
    async with db_sessions() as session:
        nodes = await load_agent_nodes(session)
    assert {n.node_id for n in nodes} == {str(n.id) for n in fleet_data.nodes}

    fleet = SimFleet(temporal_client)
    stop = asyncio.Event()
    run = asyncio.create_task(fleet.run(stop, refresh=lambda: asyncio.sleep(0, nodes)))
    try:
        await eventually(lambda: asyncio.sleep(0, len(fleet.hosts) == len(nodes)))
        node = fleet_data.nodes_of(SLICE_SKU)[0]
        spec = slice_spec(str(node.id))
        result = await caller.provision(SLICE_VM_PROVISION, spec)
        assert succeeded(result.phases) == list(SLICE_PROVISION_PHASES)
        assert fleet.hosts[str(node.id)].domain(spec.allocation_id) is not None
        assert fleet.hosts[str(node.id)].hostname == node.hostname
    finally:
        stop.set()
        await run
