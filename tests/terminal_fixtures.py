"""Terminal session rig: the gateway served over HTTP by uvicorn (WebSockets need a real server),
the control-plane worker, a bare-metal node whose agent is a real `gpucloud-agent` process (the
production backend on a simulated machine's disk), and a WebSocket terminal client.

    async def test_x(terminal_rig):
        rig = await terminal_rig()                      # gateway, agent, tenant, active allocation
        created = await rig.open_session()
        async with rig.terminal(created) as term:       # authenticated, `ready` received
            await term.run("echo hi")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from websockets.asyncio.client import ClientConnection, connect

from core.config import Settings
from core.task_queues import node_task_queue
from devstack.processes import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.terminal_relay import UVICORN_WS_OPTIONS
from sim.libvirt_hosts import GpuPlacement
from sim.machine_image import build_machine
from tests.gateway_fixtures import bearer, ed25519_public_key
from tests.lifecycle_support import baremetal_request, create_fleet, eventually

TEMPORAL_UI_ORIGIN = "http://localhost:8233"


@dataclass
class Gateway:
    url: str
    settings: Settings


@dataclass
class AgentProcess:
    node_id: str
    root: Path
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL: the node's agent dies with its sockets (nothing is closed cleanly)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


class Terminal:
    """A tenant's terminal over the real WebSocket: output collected, control frames kept."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.output = bytearray()
        self.controls: list[dict[str, Any]] = []

    async def _next(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            message = await self.ws.recv()
        if isinstance(message, bytes):
            self.output.extend(message)
        else:
            self.controls.append(json.loads(message))

    async def control(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        """The first control frame of `kind` (already received or next)."""
        async with asyncio.timeout(timeout):
            while True:
                for control in self.controls:
                    if control.get("type") == kind:
                        return control
                await self._next(timeout)

    async def read_until(self, marker: bytes, timeout: float = 30.0) -> bytes:
        async with asyncio.timeout(timeout):
            while marker not in self.output:
                await self._next(timeout)
        return bytes(self.output)

    async def run(self, command: str, marker: bytes, timeout: float = 30.0) -> bytes:
        await self.ws.send(command.encode() + b"\n")
        return await self.read_until(marker, timeout)

    async def send_control(self, **frame: Any) -> None:
        await self.ws.send(json.dumps(frame))


@dataclass
class TerminalRig:
    gateway: Gateway
    tenant: httpx.AsyncClient
    admin: httpx.AsyncClient
    project_id: uuid.UUID
    agent: AgentProcess
    allocation_id: str
    temporal: Client
    tenant_token: str = field(default="", repr=False)
    _opened: list[ClientConnection] = field(default_factory=list)

    async def open_session(self, client: httpx.AsyncClient | None = None) -> dict[str, Any]:
        response = await (client or self.tenant).post(
            f"/api/v1/allocations/{self.allocation_id}/terminal-sessions"
        )
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    async def connect(self, created: dict[str, Any], token: str | None = None) -> Terminal:
        """A WebSocket to the session's stream with its auth frame sent."""
        ws = await connect(created["stream_url"], open_timeout=10, max_size=2**20)
        self._opened.append(ws)
        await ws.send(json.dumps({"type": "auth", "token": token or created["open_token"]}))
        return Terminal(ws)

    @contextlib.asynccontextmanager
    async def terminal(self, created: dict[str, Any]) -> AsyncIterator[Terminal]:
        term = await self.connect(created)
        ready = await term.control("ready", timeout=60)
        assert ready["session_id"] == created["session_id"]
        try:
            yield term
        finally:
            await term.ws.close()

    async def session(self, session_id: str) -> dict[str, Any]:
        response = await self.tenant.get(
            f"/api/v1/allocations/{self.allocation_id}/terminal-sessions"
        )
        assert response.status_code == 200, response.text
        for item in response.json()["items"]:
            if item["session_id"] == session_id:
                found: dict[str, Any] = item
                return found
        raise AssertionError(f"session {session_id} not listed")

    async def wait_session(
        self, session_id: str, status: str, timeout: float = 60.0
    ) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            row = await self.session(session_id)
            return row if row["status"] == status else None

        try:
            return await eventually(reached, timeout=timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(
                f"session never {status}: {await self.session(session_id)}\n"
                f"agent log:\n{self.agent.log_tail()}"
            ) from None

    async def close(self) -> None:
        for ws in self._opened:
            with contextlib.suppress(Exception):
                await ws.close()


TRANSIENT_RPC_STATUSES = {
    RPCStatusCode.CANCELLED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.UNAVAILABLE,
}


async def wait_polled(client: Client, queue: str, timeout: float = 60.0) -> None:
    async def polled() -> bool:
        try:
            response = await client.workflow_service.describe_task_queue(
                DescribeTaskQueueRequest(
                    namespace=client.namespace,
                    task_queue=TaskQueue(name=queue),
                    task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
                )
            )
        except RPCError as err:
            # A loaded dev server may cancel or time out one describe (seen in CI under load):
            # that says nothing about the pollers; ask again.
            if err.status in TRANSIENT_RPC_STATUSES:
                return False
            raise
        return bool(response.pollers)

    await eventually(polled, timeout=timeout, interval=0.2)


def start_agent_process(
    settings: Settings,
    node_id: str,
    directory: Path,
    *,
    backend: str = "host",
    agent_config: str = "",
    gpus: Sequence[GpuPlacement] = (),
    extra_env: dict[str, str] | None = None,
) -> AgentProcess:
    """`gpucloud-agent --node-id` on a fresh simulated machine: with the production backend
    (`host`) its bare-metal users are real account files under the machine's root and its slice
    VMs are libvirt test-driver domains on the machine's host.xml (`gpus`: the node's, as the
    inventory has them); `simulated` is the demo fleet's plugin. `agent_config`: tables of
    agent.toml (as cloud-init writes them)."""
    machine = build_machine(directory, address="127.0.0.1", gpus=gpus, machine_key=node_id)
    config = machine.root / "etc/gpucloud/agent.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("# written by the terminal tests; facts in agent.d/\n" + agent_config)
    log = directory / "agent.log"
    env = {
        **os.environ,
        "GPUCLOUD_AGENT_ROOT": str(machine.root),
        "GPUCLOUD_TEMPORAL_ADDRESS": settings.temporal_address,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
        # Liveness reports go to a queue nobody serves: the test's node is not re-inventoried.
        "GPUCLOUD_TASK_QUEUE": f"terminal-test-no-control-plane-{uuid.uuid4()}",
        **(extra_env or {}),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent.main",
                "--node-id",
                node_id,
                "--config",
                "/etc/gpucloud/agent.toml",
                "--hostname",
                f"terminal-{node_id[:8]}",
                "--heartbeat-seconds",
                "3600",
                "--backend",
                backend,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return AgentProcess(node_id, machine.root, process, log)


@pytest.fixture
async def serve_gateway(
    settings: Settings, temporal_client: Client
) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    """Start the gateway under uvicorn on a free port (settings changes as keywords)."""
    running: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def serve(**changes: Any) -> Gateway:
        port = free_port()
        gateway_settings = dataclasses.replace(
            settings, public_api_url=f"http://127.0.0.1:{port}", **changes
        )
        app = create_app(
            gateway_settings,
            temporal_client=temporal_client,
            config=GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=port,
                log_config=None,
                lifespan="on",
                **UVICORN_WS_OPTIONS,  # as gateway.serve runs it
            )
        )
        task = asyncio.create_task(server.serve())
        running.append((server, task))
        await eventually(lambda: asyncio.sleep(0, result=server.started or task.done()), timeout=30)
        assert server.started, "the gateway did not start"
        return Gateway(f"http://127.0.0.1:{port}", gateway_settings)

    yield serve
    for server, _ in running:
        server.should_exit = True
    await asyncio.gather(*(task for _, task in running), return_exceptions=True)


@pytest.fixture
async def terminal_rig(
    serve_gateway: Callable[..., Awaitable[Gateway]],
    control_plane: None,
    temporal_client: Client,
    db_sessions: async_sessionmaker[AsyncSession],
    make_project: Any,
    make_token: Any,
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[TerminalRig]]]:
    rigs: list[TerminalRig] = []
    clients: list[httpx.AsyncClient] = []

    def client(gateway: Gateway, token: str) -> httpx.AsyncClient:
        http = httpx.AsyncClient(base_url=gateway.url, headers=bearer(token), timeout=60)
        clients.append(http)
        return http

    async def build(
        backend: str = "host",
        *,
        agent_config: str = "",
        agent_env: dict[str, str] | None = None,
        **settings_changes: Any,
    ) -> TerminalRig:
        gateway = await serve_gateway(**settings_changes)
        (node,) = await create_fleet(db_sessions, slice_nodes=0, baremetal_nodes=1)
        node_id = str(node.id)
        machine = tmp_path / f"machine-{node_id[:8]}"
        agent = start_agent_process(
            gateway.settings,
            node_id,
            machine,
            backend=backend,
            agent_config=agent_config,
            extra_env=agent_env,
        )
        project = await make_project()
        tenant_token = await make_token("tenant", project)
        tenant = client(gateway, tenant_token)
        admin = client(gateway, await make_token("admin"))
        rig = TerminalRig(
            gateway, tenant, admin, project.id, agent, "", temporal_client, tenant_token
        )
        rigs.append(rig)
        try:
            await wait_polled(temporal_client, node_task_queue(node_id))
        except AssertionError:
            raise AssertionError(f"the agent never polled:\n{agent.log_tail()}") from None
        key = await tenant.post(
            "/api/v1/ssh-keys", json={"name": "laptop", "public_key": ed25519_public_key()}
        )
        assert key.status_code == 201, key.text
        created = await tenant.post("/api/v1/allocations", json=baremetal_request(key.json()["id"]))
        assert created.status_code == 201, created.text
        rig.allocation_id = created.json()["allocation_id"]

        async def active() -> bool:
            body = (await tenant.get(f"/api/v1/allocations/{rig.allocation_id}")).json()
            assert body["status"] not in ("failed", "released"), body
            return bool(body["status"] == "active")

        try:
            await eventually(active, timeout=60, interval=0.2)
        except AssertionError:
            raise AssertionError(f"allocation never active:\n{agent.log_tail()}") from None
        return rig

    yield build
    for rig in rigs:
        await rig.close()
        rig.agent.stop()
    for http in clients:
        await http.aclose()
