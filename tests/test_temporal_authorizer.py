"""Our Temporal server main (temporal-authz/) authorises every call by the identity its signed
token names: a hostile node, holding its own real token, can poll, answer and signal only what
its own work needs; no token, an expired or a forged one gets nothing. Started on the session's
PostgreSQL like the stock cluster (devstack/temporal_authz.py)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.duration_pb2 import Duration
from temporalio import activity, workflow
from temporalio.api.errordetails.v1 import PermissionDeniedFailure
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DescribeNamespaceRequest,
    ListNamespacesRequest,
    PollActivityTaskQueueRequest,
    RegisterNamespaceRequest,
    RespondActivityTaskCompletedByIdRequest,
    ShutdownWorkerRequest,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from agent.heartbeat import send_heartbeat
from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import HOST_TASK_PROGRESS_SIGNAL
from contracts.terminal_session import STREAM_ATTACHED_SIGNAL
from core import temporal_identity
from core.task_queues import node_task_queue
from devstack.go_tools import TOOLS_DIR
from devstack.postgres import PostgresCluster
from devstack.processes import free_port
from devstack.temporal_authz import (
    AuthzServer,
    authz_server_path,
    policy_document,
    running_authz_server,
    source_digest,
)

NAMESPACE = "default"
CONTROL_PLANE_QUEUE = "control-plane-authz"


def _buildable() -> bool:
    if shutil.which("go") or os.access("/usr/local/go/bin/go", os.X_OK):
        return True
    return any(TOOLS_DIR.glob(f"temporal-authz-*-{source_digest()}"))


pytestmark = pytest.mark.skipif(
    not _buildable(),
    reason="Go is not installed and temporal-authz is not built (CI has Go; bin/bootstrap)",
)

NODE_A = str(uuid.uuid4())
NODE_B = str(uuid.uuid4())


@activity.defn(name="authz_probe")
async def authz_probe(queue: str) -> str:
    return f"done on {queue}"


@workflow.defn(name="AuthzProbeWorkflow", sandboxed=False)
class AuthzProbeWorkflow:
    """Schedules one activity on a node's queue, as the control plane's workflows do."""

    @workflow.run
    async def run(self, queue: str) -> str:
        return str(
            await workflow.execute_activity(
                "authz_probe",
                queue,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=5),
            )
        )


class Server:
    def __init__(self, server: AuthzServer, key: Ed25519PrivateKey) -> None:
        self.server = server
        self.key = key

    def token(self, subject: str, *, now: float | None = None) -> str:
        return temporal_identity.mint(self.key, subject, now=now)

    async def client(self, token: str | None) -> Client:
        # Plaintext like the stock cluster here (the SDK turns TLS on with an api_key by default).
        return await Client.connect(
            self.server.address, namespace=NAMESPACE, api_key=token, tls=False
        )

    async def node(self, node_id: str) -> Client:
        return await self.client(self.token(temporal_identity.node_subject(node_id)))

    def log(self) -> str:
        return (self.server.root / "server.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def authz_server(
    pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    authz_server_path()  # built before the clock of the server's start runs (minutes, once)
    key = temporal_identity.generate_signing_key()
    policy = policy_document(
        [temporal_identity.public_key_pem(key)],
        namespace=NAMESPACE,
        control_plane_queue=CONTROL_PLANE_QUEUE,
    )
    root: Path = tmp_path_factory.mktemp("temporal-authz")
    with running_authz_server(pg_cluster, root, free_port(), policy) as server:
        yield Server(server, key)


@pytest.fixture(scope="module")
async def control_plane(authz_server: Server) -> AsyncIterator[Client]:
    """The control plane's client (may call anything): registers the namespace, then runs the
    probe workflow's worker."""
    client = await authz_server.client(authz_server.token(temporal_identity.CONTROL_PLANE))
    service = client.workflow_service
    try:
        await service.describe_namespace(DescribeNamespaceRequest(namespace=NAMESPACE))
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        await service.register_namespace(
            RegisterNamespaceRequest(
                namespace=NAMESPACE,
                workflow_execution_retention_period=Duration(seconds=72 * 3600),
            )
        )
    async with Worker(
        client,
        task_queue=CONTROL_PLANE_QUEUE,
        workflows=[AuthzProbeWorkflow],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        yield client


async def _start_probe(control_plane: Client, node_id: str) -> WorkflowHandle[object, str]:
    """A workflow whose id says allocation (so progress signals to it are allowed) and which
    waits on an activity on `node_id`'s queue. Retried while a namespace just registered
    reaches the frontend's cache."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await control_plane.start_workflow(
                "AuthzProbeWorkflow",
                node_task_queue(node_id),
                id=allocation_workflow_id(str(uuid.uuid4())),
                task_queue=CONTROL_PLANE_QUEUE,
                result_type=str,
            )
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise


async def _refused(call: Awaitable[object]) -> str:
    """Why the server refused an awaitable that must be refused (PermissionDenied's reason)."""
    with pytest.raises(RPCError) as refused:
        await call
    assert refused.value.status == RPCStatusCode.PERMISSION_DENIED, refused.value
    failure = PermissionDeniedFailure()
    (detail,) = refused.value.grpc_status.details
    assert detail.Unpack(failure)
    return failure.reason


def _poll(queue: str) -> PollActivityTaskQueueRequest:
    return PollActivityTaskQueueRequest(
        namespace=NAMESPACE, task_queue=TaskQueue(name=queue), identity="hostile"
    )


async def test_a_node_does_its_own_work_and_nothing_else(
    authz_server: Server, control_plane: Client
) -> None:
    on_b = await _start_probe(control_plane, NODE_B)
    node_a = await authz_server.node(NODE_A)
    service = node_a.workflow_service

    # Another node's queue: refused before the poll reaches matching.
    message = await _refused(service.poll_activity_task_queue(_poll(node_task_queue(NODE_B))))
    assert "own task queue" in message
    # Reads, starts, lists, queues and namespaces of the control plane: refused.
    a_handle = node_a.get_workflow_handle(on_b.id)
    await _refused(a_handle.describe())
    await _refused(a_handle.fetch_history())
    await _refused(
        node_a.start_workflow(
            "AuthzProbeWorkflow", "x", id=f"hostile-{uuid.uuid4()}", task_queue=CONTROL_PLANE_QUEUE
        )
    )
    await _refused(anext(aiter(node_a.list_workflows())))
    await _refused(a_handle.terminate("hostile"))
    await _refused(service.poll_activity_task_queue(_poll(CONTROL_PLANE_QUEUE)))
    # Completing B's activity by its ids instead of the task token it never received.
    await _refused(
        service.respond_activity_task_completed_by_id(
            RespondActivityTaskCompletedByIdRequest(
                namespace=NAMESPACE, workflow_id=on_b.id, run_id=on_b.result_run_id or "",
                activity_id="1",
            )
        )
    )  # fmt: skip
    # Signals: only the progress and stream-attached names, to the workflows that take them.
    await _refused(a_handle.signal("release"))
    await _refused(a_handle.signal(STREAM_ATTACHED_SIGNAL))
    await a_handle.signal(HOST_TASK_PROGRESS_SIGNAL, {"task_id": "x"})
    # Its own presence, as the agent reports it; never another node's.
    await send_heartbeat(node_a, NODE_A, control_plane_queue=CONTROL_PLANE_QUEUE)
    await _refused(send_heartbeat(node_a, NODE_B, control_plane_queue=CONTROL_PLANE_QUEUE))
    await _refused(send_heartbeat(node_a, NODE_A, control_plane_queue=node_task_queue(NODE_A)))

    # Its own queue, through the SDK's worker as the agent polls it: the task is done.
    on_a = await _start_probe(control_plane, NODE_A)
    async with Worker(node_a, task_queue=node_task_queue(NODE_A), activities=[authz_probe]):
        assert await on_a.result() == f"done on {node_task_queue(NODE_A)}"

    # A worker stopping names no sticky queue (it would drop a control plane's sticky tasks).
    await _refused(
        service.shutdown_worker(ShutdownWorkerRequest(namespace=NAMESPACE, sticky_task_queue="x"))
    )

    # B's task never went to A: B's own token polls B's queue and completes it, and nothing
    # its worker calls from start to shutdown is refused.
    node_b = await authz_server.node(NODE_B)
    async with Worker(node_b, task_queue=node_task_queue(NODE_B), activities=[authz_probe]):
        assert await on_b.result() == f"done on {node_task_queue(NODE_B)}"
    refused = [
        line
        for line in authz_server.log().splitlines()
        if "call refused" in line and temporal_identity.node_subject(NODE_B) in line
    ]
    assert refused == []


def _claims_part(token: str) -> dict[str, object]:
    claims: dict[str, object] = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    return claims


async def test_no_forged_or_expired_token_gets_anything(
    authz_server: Server, control_plane: Client
) -> None:
    on_b = await _start_probe(control_plane, NODE_B)
    node_b = temporal_identity.node_subject(NODE_B)
    expired = authz_server.token(node_b, now=time.time() - 3600)
    foreign_key = temporal_identity.generate_signing_key()
    forged = temporal_identity.mint(foreign_key, temporal_identity.CONTROL_PLANE)
    # A's real token with its subject rewritten to the control plane: the signature breaks.
    version, _, signature = authz_server.token(temporal_identity.node_subject(NODE_A)).split(".")
    claims = dict(_claims_part(authz_server.token(temporal_identity.node_subject(NODE_A))))
    claims["sub"] = temporal_identity.CONTROL_PLANE
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    tampered = f"{version}.{payload}.{signature}"

    for token in (None, expired, forged, tampered, "not a token"):
        client = await authz_server.client(token)  # connecting (GetSystemInfo) is allowed
        service = client.workflow_service
        assert "no valid identity" in await _refused(
            service.poll_activity_task_queue(_poll(node_task_queue(NODE_B)))
        )
        await _refused(client.get_workflow_handle(on_b.id).describe())
        await _refused(service.describe_namespace(DescribeNamespaceRequest(namespace=NAMESPACE)))
        await _refused(client.get_workflow_handle(on_b.id).signal(HOST_TASK_PROGRESS_SIGNAL, {}))
    await on_b.terminate("test over")


async def test_an_operator_reads_but_does_not_write(
    authz_server: Server, control_plane: Client
) -> None:
    on_b = await _start_probe(control_plane, NODE_B)
    operator = await authz_server.client(authz_server.token(temporal_identity.OPERATOR))
    handle = operator.get_workflow_handle(on_b.id)
    assert (await handle.describe()).id == on_b.id
    assert (await handle.fetch_history()).events
    # Cluster-wide reads Temporal Web makes (no namespace in the request).
    listed = await operator.workflow_service.list_namespaces(ListNamespacesRequest())
    assert NAMESPACE in {n.namespace_info.name for n in listed.namespaces}
    await _refused(
        operator.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace="temporal-system")
        )
    )
    await _refused(handle.terminate("operator"))
    await _refused(handle.signal(HOST_TASK_PROGRESS_SIGNAL, {}))
    await _refused(
        operator.start_workflow(
            "AuthzProbeWorkflow", "x", id=f"op-{uuid.uuid4()}", task_queue=CONTROL_PLANE_QUEUE
        )
    )
    await _refused(
        operator.workflow_service.poll_activity_task_queue(_poll(node_task_queue(NODE_B)))
    )
    await on_b.terminate("test over")


def test_token_round_trip_and_refusals() -> None:
    key = temporal_identity.generate_signing_key()
    public = [key.public_key()]
    subject = temporal_identity.node_subject(NODE_A.upper())
    assert subject == f"node:{NODE_A}"
    claims = temporal_identity.verify(temporal_identity.mint(key, subject), public)
    assert claims.node_id == NODE_A
    assert claims.expires_at - claims.issued_at == temporal_identity.TOKEN_TTL_SECONDS
    with pytest.raises(temporal_identity.InvalidToken, match="expired"):
        temporal_identity.verify(
            temporal_identity.mint(key, subject, now=time.time() - 3600), public
        )
    with pytest.raises(temporal_identity.InvalidToken, match="trusted"):
        temporal_identity.verify(
            temporal_identity.mint(temporal_identity.generate_signing_key(), subject), public
        )
    with pytest.raises(temporal_identity.InvalidToken):
        temporal_identity.mint(key, "node:not-a-uuid")
