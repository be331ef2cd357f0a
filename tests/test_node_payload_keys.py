"""Per-node payload keys (issue 36, item 3): a node holds only its own key, derived from the
cluster key for it at enrollment; everything bound for the node and everything it writes is
sealed with that key; the cluster key stays on the control plane and in no user data.

- The SDK hands the codec its serialization context where it matters: a workflow's activity on
  `node-{id}` gets its inputs sealed with that node's key, and the node's worker (holding only
  its key) seals results, failures and heartbeat details with it; the workflow, on the cluster
  key, reads them all.
- A real agent, onboarded through the API (MAAS simulator, rendered cloud-init, enrollment over
  HTTP), holds its own key only: with it, the payloads bound for another node and the cluster-key
  payloads cannot be opened; its own tasks work end to end.
- No rendered user data (as MAAS stores it) and no file on a node's disk holds the cluster key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHistory
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from activities.cloud_init import render_cloud_init
from contracts.allocation import allocation_workflow_id
from core.codec import (
    ENCODING,
    NODE_METADATA,
    AesGcmPayloadCodec,
    NodePayloadCodec,
    key_id,
    node_payload_key,
)
from core.config import Settings
from core.task_queues import node_task_queue
from core.temporal import with_node_payload_key
from tests.decommission_fixtures import DecommissionRig
from tests.factories import REGION
from tests.lifecycle_support import eventually, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU
from tests.test_cloud_init import body, files, make_input
from tests.test_real_node_e2e import agent_of, onboard_via_api, tenant_with_key

NONCE_BYTES = 12

# --------------------------------------------------------------------------- history helpers


def history_payloads(history: WorkflowHistory) -> Iterator[tuple[str, str | None, Payload]]:
    """Every payload of a history as (what it is, the node queue it is bound to or came from,
    the payload): workflow input and result, activity inputs, results and failures, signals."""
    queue_of: dict[int, str] = {}
    for event in history.events:
        yield from _event_payloads(event, queue_of)


def _event_payloads(
    event: HistoryEvent, queue_of: dict[int, str]
) -> Iterator[tuple[str, str | None, Payload]]:
    which = event.WhichOneof("attributes")
    if which == "workflow_execution_started_event_attributes":
        for p in event.workflow_execution_started_event_attributes.input.payloads:
            yield "workflow input", None, p
    elif which == "workflow_execution_completed_event_attributes":
        for p in event.workflow_execution_completed_event_attributes.result.payloads:
            yield "workflow result", None, p
    elif which == "workflow_execution_signaled_event_attributes":
        signaled = event.workflow_execution_signaled_event_attributes
        for p in signaled.input.payloads:
            yield f"signal {signaled.signal_name} from {signaled.identity}", None, p
    elif which == "activity_task_scheduled_event_attributes":
        scheduled = event.activity_task_scheduled_event_attributes
        queue_of[event.event_id] = scheduled.task_queue.name
        for p in scheduled.input.payloads:
            yield f"input of {scheduled.activity_type.name}", scheduled.task_queue.name, p
    elif which == "activity_task_started_event_attributes":
        started = event.activity_task_started_event_attributes
        if started.HasField("last_failure") and started.last_failure.HasField("encoded_attributes"):
            queue = queue_of.get(started.scheduled_event_id)
            yield "an earlier attempt's failure", queue, started.last_failure.encoded_attributes
    elif which == "activity_task_completed_event_attributes":
        completed = event.activity_task_completed_event_attributes
        for p in completed.result.payloads:
            yield "activity result", queue_of.get(completed.scheduled_event_id), p
    elif which == "activity_task_failed_event_attributes":
        failed = event.activity_task_failed_event_attributes
        if failed.failure.HasField("encoded_attributes"):
            queue = queue_of.get(failed.scheduled_event_id)
            yield "activity failure", queue, failed.failure.encoded_attributes


def sealed_for(payload: Payload) -> str | None:
    """The node whose key sealed `payload` (its metadata), None for the cluster key."""
    assert payload.metadata.get("encoding") == ENCODING, f"a plaintext payload: {payload}"
    node = payload.metadata.get(NODE_METADATA)
    return node.decode() if node is not None else None


def opens_with(key: bytes, payload: Payload) -> bool:
    """Whether `key` decrypts the payload's ciphertext at all, whatever its metadata claims."""
    nonce, sealed = payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:]
    try:
        AESGCM(key).decrypt(nonce, sealed, None)
    except InvalidTag:
        return False
    return True


async def node_decodes(codec: NodePayloadCodec, payload: Payload) -> bool:
    try:
        await codec.decode([payload])
    except ValueError:
        return False
    return True


def secret_forms(key: bytes) -> list[bytes]:
    """How a key could be written down: raw, base64, URL-safe base64, hex."""
    return [
        key,
        base64.b64encode(key),
        base64.urlsafe_b64encode(key),
        key.hex().encode(),
    ]


def holds_secret(data: bytes, key: bytes) -> bool:
    return any(form in data for form in secret_forms(key))


# --------------------------------------------------------------------------- the SDK's context


@activity.defn(name="node-key-probe.work")
async def probe_work(secret: str) -> str:
    """Attempt 1 heartbeats and fails; attempt 2 reads attempt 1's heartbeat details (the node
    decodes its own) and answers with them."""
    info = activity.info()
    if info.attempt == 1:
        activity.heartbeat(f"{secret}-heartbeat")
        # The failure only once the server holds the heartbeat: the retry gets it from there.
        assert info.workflow_id is not None
        run = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)

        async def recorded() -> bool:
            pending = (await run.describe()).raw_description.pending_activities
            return any(a.heartbeat_details.payloads for a in pending)

        await eventually(recorded)
        raise ApplicationError(f"first attempt of {secret} fails")
    (details,) = info.heartbeat_details
    return f"ok:{details}"


@activity.defn(name="node-key-probe.refuse")
async def probe_refuse(secret: str) -> str:
    raise ApplicationError(f"refused {secret}", non_retryable=True)


@workflow.defn(name="NodeKeyProbe", sandboxed=False)
class NodeKeyProbe:
    """A control-plane workflow with host tasks on a node's queue (a probe, not a lifecycle)."""

    @workflow.run
    async def run(self, node_id: str, secret: str) -> str:
        queue = node_task_queue(node_id)
        done = await workflow.execute_activity(
            "node-key-probe.work",
            secret,
            task_queue=queue,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100)),
            result_type=str,
        )
        try:
            await workflow.execute_activity(
                "node-key-probe.refuse",
                secret,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=30),
                result_type=str,
            )
        except ActivityError as err:
            cause = err.cause
            return f"{done}|{cause.message if isinstance(cause, ApplicationError) else cause}"
        raise AssertionError("the refusing activity succeeded")


async def test_node_bound_payloads_are_sealed_with_the_nodes_key_both_ways(
    temporal_client: Client, settings: Settings
) -> None:
    node_a, node_b = str(uuid.uuid4()), str(uuid.uuid4())
    key_a = node_payload_key(settings.codec_key, node_a)
    key_b = node_payload_key(settings.codec_key, node_b)
    # The node's worker as the agent runs it: a client that holds node A's key and nothing else.
    agent_client = with_node_payload_key(temporal_client, key_a, node_a)
    secret = f"secret-{uuid.uuid4().hex}"
    control_queue = f"node-key-probe-{uuid.uuid4()}"
    async with (
        Worker(temporal_client, task_queue=control_queue, workflows=[NodeKeyProbe]),
        Worker(
            agent_client,
            task_queue=node_task_queue(node_a),
            activities=[probe_work, probe_refuse],
        ),
    ):
        handle = await temporal_client.start_workflow(
            NodeKeyProbe.run,
            args=[node_a, secret],
            id=f"node-key-probe-{uuid.uuid4()}",
            task_queue=control_queue,
        )
        result = await handle.result()
    # The node decoded its own heartbeat on the retry; the workflow (cluster key) decoded the
    # node's result and its failure.
    assert result == f"ok:{secret}-heartbeat|refused {secret}"

    history = await handle.fetch_history()
    seen: dict[str, str | None] = {}
    codec_a = NodePayloadCodec(key_a, node_a)
    codec_b = NodePayloadCodec(key_b, node_b)
    for what, queue, payload in history_payloads(history):
        sealer = sealed_for(payload)
        seen[what] = sealer
        if queue == node_task_queue(node_a):
            assert sealer == node_a, what
            assert await node_decodes(codec_a, payload), what
        else:
            # The workflow's own input and result: the cluster key, closed to the node.
            assert sealer is None, what
            assert not await node_decodes(codec_a, payload), what
            assert not opens_with(key_a, payload), what
        # Node B's key opens none of it.
        assert not await node_decodes(codec_b, payload), what
        assert not opens_with(key_b, payload), what
        # The control plane reads everything.
        assert (await AesGcmPayloadCodec(settings.codec_key).decode([payload]))[0].data
    assert seen == {
        "workflow input": None,
        "input of node-key-probe.work": node_a,
        "an earlier attempt's failure": node_a,
        "activity result": node_a,
        "input of node-key-probe.refuse": node_a,
        "activity failure": node_a,
        "workflow result": None,
    }, seen


def test_rendered_user_data_holds_no_payload_key(settings: Settings) -> None:
    """The cloud-init the worker renders has no payload key file, no payload_key_file setting
    and the cluster key in no form: the agent gets its own key at enrollment."""
    rendered = render_cloud_init(make_input()).content
    assert "payload" not in rendered.lower()
    assert not [path for path in files(body(rendered)) if "key" in Path(path).name]
    assert not holds_secret(rendered.encode(), settings.codec_key)


# --------------------------------------------------------------------------- a real agent

MACHINES = sim_scenario(
    sim_machine("keys-a", "10.176.21.10"),
    sim_machine("keys-b", "10.176.21.11"),
)
STATE_DIR = "var/lib/gpucloud-agent"


def read_tree(root: Path) -> Iterator[tuple[Path, bytes]]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield path, path.read_bytes()


async def allocate_on_each_node(
    api: Any, make_token: Any, make_project: Any, nodes: set[str]
) -> tuple[Any, dict[str, str]]:
    """One bare-metal allocation per node (8 GPUs each: each fills one node): node → allocation."""
    tenant, ssh_key = await tenant_with_key(api, make_token, make_project)
    on_node: dict[str, str] = {}
    for _ in nodes:
        created = await tenant.post(
            "/api/v1/allocations",
            json={"sku": ONBOARD_SKU, "gpus": 8, "region": REGION, "ssh_key_ids": [ssh_key]},
        )
        assert created.status_code == 201, created.text
        allocation_id = created.json()["allocation_id"]
        active = await wait_status(tenant, allocation_id, "active", timeout=90)
        on_node[active["node_id"]] = allocation_id
    assert set(on_node) == nodes
    return tenant, on_node


@pytest.mark.maas_scenario(MACHINES)
async def test_an_enrolled_agent_holds_only_its_own_key(
    decommission: DecommissionRig,
    api: Any,
    make_token: Any,
    make_project: Any,
    settings: Settings,
    temporal_client: Client,
) -> None:
    admin = await api(token=await make_token("admin"))
    jobs = await asyncio.gather(
        onboard_via_api(admin, decommission, "keys-a", "10.176.21.10", ONBOARD_SKU),
        onboard_via_api(admin, decommission, "keys-b", "10.176.21.11", ONBOARD_SKU),
    )
    assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
    node_a, node_b = (str(j["node_id"]) for j in jobs)
    agent_a, agent_b = agent_of(decommission, "keys-a"), agent_of(decommission, "keys-b")
    assert agent_a.root is not None
    assert agent_b.root is not None

    # What enrollment left on node A's disk: its own key (0600), named by its identity.
    key_file = agent_a.root / STATE_DIR / "payload.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key_a = base64.b64decode(key_file.read_text().strip())
    assert key_a == node_payload_key(settings.codec_key, node_a)
    identity = json.loads((agent_a.root / STATE_DIR / "identity.json").read_text())
    assert identity["node_id"] == node_a
    assert identity["payload_key_id"] == key_id(key_a)
    key_b = node_payload_key(settings.codec_key, node_b)
    assert key_a != key_b

    # Secret scan: the user data MAAS keeps and every file on A's disk. The cluster key is in
    # none of them, nor B's key; A's key only in its key file.
    for record in (agent_a, agent_b):
        machine = await decommission.onboarding.maas_sim.machine(record.system_id)
        user_data = base64.b64decode(machine["user_data"])
        assert b"payload" not in user_data.lower()
        assert not holds_secret(user_data, settings.codec_key)
        assert not holds_secret(user_data, key_a)
        assert not holds_secret(user_data, key_b)
    for path, data in read_tree(agent_a.root):
        assert not holds_secret(data, settings.codec_key), path
        assert not holds_secret(data, key_b), path
        if path != key_file:
            assert not holds_secret(data, key_a), path

    # Its own tasks work end to end, run by the agent that holds only its key: an allocation
    # on each node, provisioned (users, host tasks with progress) and released.
    tenant, on_node = await allocate_on_each_node(api, make_token, make_project, {node_a, node_b})
    for allocation_id in on_node.values():
        released = await tenant.post(f"/api/v1/allocations/{allocation_id}/release")
        assert released.status_code == 202, released.text
    for allocation_id in on_node.values():
        await wait_status(tenant, allocation_id, "released", timeout=90)

    # With A's key, as an attacker on node A would try: A's own payloads open; B's and the
    # control plane's do not, by key id nor by trying the key on the ciphertext.
    codec_a = NodePayloadCodec(key_a, node_a)
    sealers: dict[str | None, int] = {}
    agent_signals = 0
    for node, allocation_id in on_node.items():
        handle = temporal_client.get_workflow_handle(allocation_workflow_id(allocation_id))
        for what, queue, payload in history_payloads(await handle.fetch_history()):
            sealer = sealed_for(payload)
            sealers[sealer] = sealers.get(sealer, 0) + 1
            if queue is not None and queue.startswith("node-"):
                assert queue == node_task_queue(node), what
                assert sealer == node, what
            if what.startswith("signal") and f"agent-{node}@" in what:
                assert sealer == node, what  # progress the agent reported
                agent_signals += 1
            if sealer == node_a:
                assert await node_decodes(codec_a, payload), what
            else:
                assert not await node_decodes(codec_a, payload), what
                assert not opens_with(key_a, payload), what
    assert set(sealers) == {node_a, node_b, None}, sealers
    assert agent_signals, "no progress signal from an agent in the allocation histories"
