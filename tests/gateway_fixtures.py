"""Gateway fixtures: the app over the real PostgreSQL and Temporal of conftest, and factories for
identity and read-model rows.

    async def test_x(api, make_project, make_token):
        project = await make_project()
        client = await api(token=await make_token("tenant", project))
        response = await client.get("/api/v1/ssh-keys")

`api(...)` builds a fresh app per call (its lifespan runs until the test ends); pass
`settings=` / `temporal_client=` to build one against something else (e.g. nothing listening,
for the 503 tests).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, Protocol

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio.client import Client

from contracts.states import AllocationStatus, SkuShape, TokenRole
from core.config import Settings
from gateway import tokens
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.sshkeys import parse_public_key
from schema.models import Allocation, ApiToken, Project, SshKey
from tests.factories import (
    BAREMETAL_SKU,
    REGION,
    SLICE_SKU,
    STARTING_CREDIT_MINOR,
    create_node,
    fund_project,
)
from tests.lifecycle_support import Tenant, server_started

TEMPORAL_UI_ORIGIN = "http://localhost:8233"
_UNSET: Any = object()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- SSH keys in OpenSSH format ---


def _openssh(public_key: Any) -> str:
    data: bytes = public_key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return data.decode()


def ed25519_public_key(comment: str = "user@laptop") -> str:
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    return f"{_openssh(key)} {comment}".strip()


def rsa_public_key(bits: int = 2048) -> str:
    return _openssh(rsa.generate_private_key(public_exponent=65537, key_size=bits).public_key())


def ecdsa_public_key(curve: ec.EllipticCurve | None = None) -> str:
    return _openssh(ec.generate_private_key(curve or ec.SECP256R1()).public_key())


def _ssh_string(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def sk_ed25519_public_key() -> str:
    raw = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    key_type = b"sk-ssh-ed25519@openssh.com"
    blob = _ssh_string(key_type) + _ssh_string(raw) + _ssh_string(b"ssh:")
    return f"{key_type.decode()} {base64.b64encode(blob).decode()} yubikey"


def sk_ecdsa_public_key() -> str:
    point = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    )
    key_type = b"sk-ecdsa-sha2-nistp256@openssh.com"
    blob = (
        _ssh_string(key_type) + _ssh_string(b"nistp256") + _ssh_string(point) + _ssh_string(b"ssh:")
    )
    return f"{key_type.decode()} {base64.b64encode(blob).decode()}"


def ed25519_private_key() -> str:
    data = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    return data.decode()


# --- the app ---


class ApiFactory(Protocol):
    def __call__(
        self,
        *,
        token: str | None = None,
        settings: Settings | None = None,
        temporal_client: Client | None = ...,
        config: GatewayConfig | None = None,
    ) -> Awaitable[httpx.AsyncClient]: ...


@contextlib.asynccontextmanager
async def _lifespan_in_own_task(app: Any) -> AsyncIterator[None]:
    """Run the app's lifespan in one task from start to end: anyio's cancel scopes inside it must
    be exited by the task that entered them, and pytest-asyncio tears fixtures down elsewhere."""
    started, stop = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with app.lifespan():
            started.set()
            await stop.wait()

    task = asyncio.create_task(hold())
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiter.cancel()
        task.result()  # startup failed: raise its error here
    try:
        yield
    finally:
        stop.set()
        await task


@pytest.fixture
async def api(settings: Settings, temporal_client: Client) -> AsyncIterator[ApiFactory]:
    async with AsyncExitStack() as stack:

        async def build(
            *,
            token: str | None = None,
            settings: Settings | None = None,
            temporal_client: Client | None = _UNSET,
            config: GatewayConfig | None = None,
        ) -> httpx.AsyncClient:
            app = create_app(
                settings or default_settings,
                temporal_client=default_client if temporal_client is _UNSET else temporal_client,
                config=config or GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
            )
            # The app runs on the test's own event loop (httpx.ASGITransport), beside the
            # in-process workers: Litestar's AsyncTestClient would block this loop on a portal
            # thread while a request waits for a workflow that needs this loop to progress.
            await stack.enter_async_context(_lifespan_in_own_task(app))
            client: httpx.AsyncClient = await stack.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app),
                    base_url="http://testserver.local",
                    timeout=30,
                )
            )
            if token is not None:
                client.headers.update(bearer(token))
            return client

        default_settings, default_client = settings, temporal_client
        yield build


@pytest.fixture
def unreachable_settings(settings: Settings) -> Callable[..., Settings]:
    """Settings pointing Temporal and/or PostgreSQL at a loopback port where nothing listens."""
    from devstack.processes import free_port

    def build(*, temporal: bool = False, database: bool = False) -> Settings:
        changes: dict[str, Any] = {}
        if temporal:
            changes["temporal_address"] = f"127.0.0.1:{free_port()}"
        if database:
            changes["database_url"] = (
                f"postgresql+asyncpg://gpucloud@127.0.0.1:{free_port()}/gpucloud"
            )
        return dataclasses.replace(settings, **changes)

    return build


# --- identity factories ---


@pytest.fixture
def make_project(
    db_sessions: async_sessionmaker[AsyncSession],
) -> Callable[..., Awaitable[Project]]:
    """A project with a starting credit (a project without one cannot allocate:
    docs/lifecycles/balance.md); `credit_minor=0` for one that starts at 0, depleted."""

    async def make(
        name: str | None = None, *, credit_minor: int = STARTING_CREDIT_MINOR
    ) -> Project:
        project = Project(id=uuid.uuid4(), name=name or f"project-{uuid.uuid4().hex[:8]}")
        async with db_sessions() as session, session.begin():
            session.add(project)
        await fund_project(db_sessions, project.id, credit_minor)
        return project

    return make


@pytest.fixture
def make_token(
    db_sessions: async_sessionmaker[AsyncSession],
    make_project: Callable[..., Awaitable[Project]],
) -> Callable[..., Awaitable[str]]:
    """make_token("admin") or make_token("tenant", project); returns the plaintext token."""

    async def make(
        role: str = "tenant",
        project: Project | uuid.UUID | None = None,
        *,
        name: str | None = None,
        revoked: bool = False,
    ) -> str:
        token_role = TokenRole(role)
        project_id: uuid.UUID | None = None
        if token_role == TokenRole.TENANT:
            if project is None:
                project = await make_project()
            project_id = project.id if isinstance(project, Project) else project
        async with db_sessions() as session, session.begin():
            row, token = await tokens.create_token(
                session,
                name=name or f"{role}-{uuid.uuid4().hex[:6]}",
                role=token_role,
                project_id=project_id,
            )
            if revoked:
                row.revoked_at = dt.datetime.now(dt.UTC)
        return token

    return make


@pytest.fixture
def make_ssh_key(db_sessions: async_sessionmaker[AsyncSession]) -> Callable[..., Awaitable[SshKey]]:
    async def make(
        project: Project | uuid.UUID,
        *,
        name: str | None = None,
        public_key: str | None = None,
        age: dt.timedelta | None = None,  # how long ago it was registered
    ) -> SshKey:
        parsed = parse_public_key(public_key or ed25519_public_key())
        key = SshKey(
            id=uuid.uuid4(),
            project_id=project.id if isinstance(project, Project) else project,
            name=name or f"key-{uuid.uuid4().hex[:6]}",
            key_type=parsed.key_type,
            public_key=parsed.openssh,
            fingerprint=parsed.fingerprint,
        )
        if age is not None:
            key.created_at = dt.datetime.now(dt.UTC) - age
        async with db_sessions() as session, session.begin():
            session.add(key)
        return key

    return make


# --- read-model rows (what the allocation activities write; here as test data) ---


@pytest.fixture
def make_allocation(
    db_sessions: async_sessionmaker[AsyncSession],
) -> Callable[..., Awaitable[Allocation]]:
    async def make(
        project: Project | uuid.UUID,
        *,
        status: AllocationStatus = AllocationStatus.ACTIVE,
        shape: SkuShape = SkuShape.GPU_SLICE,
        gpus: int = 1,
        idempotency_key: str | None = None,
        allocation_id: uuid.UUID | None = None,
        ssh_key_ids: list[uuid.UUID] | None = None,
        created_at: dt.datetime | None = None,
        **fields: Any,
    ) -> Allocation:
        sku = SLICE_SKU if shape == SkuShape.GPU_SLICE else BAREMETAL_SKU
        node = await create_node(db_sessions, sku=sku)
        allocation_id = allocation_id or uuid.uuid4()
        row = Allocation(
            id=allocation_id,
            project_id=project.id if isinstance(project, Project) else project,
            idempotency_key=idempotency_key,
            sku=sku,
            region=REGION,
            shape=shape.value,
            gpu_count=gpus,
            node_id=node.id,
            ssh_key_ids=ssh_key_ids or [],
            status=status.value,
            workflow_id=f"allocation-{allocation_id}",
            **({"created_at": created_at} if created_at else {}),
            **fields,
        )
        async with db_sessions() as session, session.begin():
            session.add(row)
        async with db_sessions() as session:
            fresh = await session.get(Allocation, allocation_id)
            assert fresh is not None
            return fresh

    return make


@pytest.fixture
def count_rows(db_sessions: async_sessionmaker[AsyncSession]) -> Callable[..., Awaitable[int]]:
    async def count(model: type[Any], **where: Any) -> int:
        async with db_sessions() as session:
            query = select(func.count()).select_from(model).filter_by(**where)
            return int(await session.scalar(query) or 0)

    return count


@pytest.fixture
def token_row(
    db_sessions: async_sessionmaker[AsyncSession],
) -> Callable[[str], Awaitable[ApiToken]]:
    async def load(token: str) -> ApiToken:
        async with db_sessions() as session:
            row = await session.scalar(
                select(ApiToken).where(ApiToken.token_sha256 == tokens.hash_token(token))
            )
            assert row is not None
            return row

    return load


@pytest.fixture
async def tenant(api: ApiFactory, make_project: Any, make_token: Any) -> Tenant:
    """A tenant's API client for a fresh project with one registered SSH key (the lifecycle
    tests' tenant; a module may define its own `tenant` instead)."""
    project = await make_project()
    client = await api(token=await make_token("tenant", project))
    public_key = ed25519_public_key("alice@laptop")
    response = await client.post(
        "/api/v1/ssh-keys", json={"name": "alice", "public_key": public_key}
    )
    assert response.status_code == 201, response.text
    return Tenant(client, project.id, response.json()["id"], public_key)


@pytest.fixture
async def admin(api: ApiFactory, make_token: Any) -> httpx.AsyncClient:
    """An admin's API client."""
    return await api(token=await make_token("admin"))


@contextlib.asynccontextmanager
async def served_over_http(app: Any) -> AsyncIterator[str]:
    """The app under uvicorn on a free loopback port, on this test's event loop (beside its
    in-process workers); yields the base URL, for clients in other processes."""
    import uvicorn

    from devstack.processes import free_port

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await server_started(server, serving)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout=15)
