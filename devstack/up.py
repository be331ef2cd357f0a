"""`gpucloud-stack` (bin/stack): the whole embedded default, in the foreground.

Starts, in order, with all state under .state/ in the repository:
  PostgreSQL        private cluster (.state/pg), database `gpucloud`, migrated to head
  Temporal          `temporal server start-dev` (.state/temporal.db keeps history across restarts)
                    with our search attributes and update-with-start, headless; with
                    --temporal cluster the Temporal server on PostgreSQL instead
  Temporal Web      temporalio/ui-server (built once) on either, on 127.0.0.1:--ui-port with
                    write actions off, served by the gateway under /temporal/ to admins signed
                    in to the console, with the gateway's codec endpoint and credentials
                    included; if it cannot be built, none (never the dev server's embedded UI)
  demo data         the demo catalog and fleet, project `demo`, an admin and a tenant token
                    (created once, kept in .state/tokens.json, mode 0600)
  vault             the Vault simulator (python -m sim.vault), KV v2 on mount `kv`; its root token
                    is generated once into .state/vault-token (0600), secrets are kept in
                    .state/vault-data.json (0600) across restarts; the root token provisions
                    an AppRole role and policy per component (devstack/vault_auth.py) and the
                    worker and the gateway get only their own role and secret ids; with
                    --vault hashicorp HashiCorp Vault itself (devstack/hashicorp_vault.py:
                    file storage in .state/hashicorp-vault/, initialised once, unsealed on
                    every start)
  worker            the control-plane Temporal worker (python -m worker); it reaches BMCs and
                    deployed hosts through the simulators (GPUCLOUD_HOST_ACCESS=simulated)
  fleet             simulated node agents, one Temporal worker per node queue (sim.fleet); with
                    `--hosts libvirt-test` each runs the real backends on libvirt's test driver
                    (files in .state/libvirt-hosts/<node id>/)
  gateway           the HTTP API (gateway.serve)
  maas-sim          the MAAS simulator (python -m sim.maas); its API key and control token are
                    generated once into .state/maas-api-key and .state/maas-control-token (0600)
  first-boot        the deployed OS of the MAAS simulator's machines (python -m sim.first_boot):
                    each machine MAAS deploys boots and its agent enrolls with the gateway

and prints where everything is. Ctrl-C or SIGTERM stops it all (PostgreSQL too); if a child dies,
the stack reports it, stops and exits 1. `--check` brings the stack up, runs the README's tenant
flow over HTTP (devstack.smoke), stops, and exits 0 or 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import stat
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from core import vault_policies
from core.config import Settings
from core.task_queues import node_task_queue
from devstack.dev_server_visibility import (
    drop_unused_visibility_indexes,
    guard_full_text_triggers,
)
from devstack.go_tools import TOOLS_DIR
from devstack.hashicorp_vault import VaultServerFiles, initialize_and_unseal, server_argv
from devstack.postgres import LegacyClusterError, PostgresCluster
from devstack.private_files import write_private
from devstack.processes import Child, http_ok, port_in_use, python_entry, tail
from devstack.stripe_mock import stripe_mock_argv
from devstack.temporal import DEV_SERVER_ENV, dev_server_extra_args, temporal_cli_path
from devstack.temporal_cluster import (
    TEMPORAL_WEB_PUBLIC_PATH,
    TUNING,
    UI_SERVER_VERSION,
    ClusterTuning,
    TemporalCluster,
    temporal_web_child,
    ui_server_build_problem,
)
from devstack.vault_auth import provision as provision_vault_auth
from devstack.vault_release import VAULT_VERSION

REPO_ROOT = Path(__file__).resolve().parent.parent
DATABASE = "gpucloud"
DEMO_PROJECT = "demo"
STACK_ACTOR = "gpucloud-stack"
READY_TIMEOUT_S = 90.0
DEMO_SITE = "demo-maas"
DEMO_POLL_MS = 1000
DEMO_STARTING_CREDIT_MINOR = 10_000_000  # $100,000 of demo money


class StackError(RuntimeError):
    """Startup cannot go on; the message says why and what to do."""


class StopRequested(Exception):  # a request, not an error
    pass


@dataclasses.dataclass(frozen=True)
class StackOptions:
    state_dir: Path
    pg_port: int
    temporal_port: int
    ui_port: int
    gateway_host: str
    gateway_port: int
    phase_delay: float
    jitter: float
    agents: bool
    check: bool
    reset: bool
    namespace: str = "default"
    vault_port: int = 8200
    maas_port: int = 5240
    stripe_port: int = 12111  # stripe-mock's HTTP port; its HTTPS listener takes the next one
    hosts: str = "simulated"  # sim.fleet --hosts: "simulated" | "libvirt-test"
    worker_metrics_port: int = 9464  # the worker's Temporal SDK metrics, for Prometheus
    # "dev": `temporal server start-dev` on SQLite (with Temporal Web); "cluster": the Temporal
    # server on the stack's PostgreSQL (devstack/temporal_cluster.py).
    temporal: str = "dev"
    # The cluster's shards, connection pools and dynamic config (bench/temporal_servers.py
    # compares others; the defaults are the measured ones).
    temporal_tuning: ClusterTuning = TUNING
    # "simulator": sim/vault; "hashicorp": HashiCorp Vault (devstack/hashicorp_vault.py).
    vault: str = "simulator"

    @property
    def worker_metrics_address(self) -> str:
        return f"127.0.0.1:{self.worker_metrics_port}"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def machines_dir(self) -> Path:
        """The MAAS simulator's deployed machines' disks (sim/first_boot.py)."""
        return (self.state_dir / "machines").resolve()

    @property
    def libvirt_hosts_dir(self) -> Path:
        return self.state_dir / "libvirt-hosts"

    @property
    def tokens_file(self) -> Path:
        return self.state_dir / "tokens.json"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "stack.env"

    @property
    def temporal_address(self) -> str:
        return f"127.0.0.1:{self.temporal_port}"

    @property
    def browser_host(self) -> str:
        """How a browser on this machine reaches our listeners."""
        if self.gateway_host in ("127.0.0.1", "0.0.0.0", "localhost", "::1", "::"):  # noqa: S104
            return "localhost"
        return self.gateway_host

    @property
    def gateway_url(self) -> str:
        return f"http://{self.browser_host}:{self.gateway_port}"

    @property
    def gateway_probe_url(self) -> str:
        host = "127.0.0.1" if self.browser_host == "localhost" else self.gateway_host
        return f"http://{host}:{self.gateway_port}"

    @property
    def public_api_url(self) -> str:
        """The one public API URL of the stack, derived from the gateway's port: every process
        the stack starts gets it (GPUCLOUD_PUBLIC_API_URL), so the stream URLs the gateway hands
        tenants and agents, and the enrollment URL the worker writes into cloud-init, reach
        this gateway whatever its port."""
        return self.gateway_probe_url

    @property
    def ui_url(self) -> str:
        """Temporal Web as operators open it: the gateway's guarded path (the console's
        sign-in), never the ui-server's own port."""
        return f"{self.gateway_url}{TEMPORAL_WEB_PUBLIC_PATH}/"

    @property
    def ui_upstream(self) -> str:
        """The ui-server's private address: loopback only, for the gateway to proxy to."""
        return f"http://127.0.0.1:{self.ui_port}"

    @property
    def vault_addr(self) -> str:
        return f"http://127.0.0.1:{self.vault_port}"

    @property
    def hashicorp_vault(self) -> VaultServerFiles:
        return VaultServerFiles(self.state_dir / "hashicorp-vault", self.vault_port)

    @property
    def vault_token_file(self) -> Path:
        if self.vault == "hashicorp":
            return self.hashicorp_vault.root_token_file
        return self.state_dir / "vault-token"

    @property
    def vault_data_file(self) -> Path:
        return self.state_dir / "vault-data.json"

    @property
    def maas_url(self) -> str:
        return f"http://127.0.0.1:{self.maas_port}/MAAS"

    @property
    def stripe_api_base(self) -> str:
        return f"http://127.0.0.1:{self.stripe_port}"

    @property
    def maas_api_key_file(self) -> Path:
        return self.state_dir / "maas-api-key"

    @property
    def maas_control_token_file(self) -> Path:
        return self.state_dir / "maas-control-token"

    @property
    def codec_endpoint(self) -> str:
        return f"{self.gateway_url}/api/v1/admin/codec"


# --- helpers -----------------------------------------------------------------------------------


def _say(text: str = "") -> None:
    print(text, flush=True)


def _postgres_can_traverse(path: Path) -> bool:
    """Whether the `postgres` OS user can reach `path` (every ancestor searchable by others)."""
    if os.geteuid() != 0:
        return True  # the server runs as us
    for parent in [path, *path.parents]:
        if not parent.exists():
            continue
        if not parent.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def pg_datadir(state_dir: Path) -> Path:
    """.state/pg, unless the server's user cannot reach it (a checkout under /root): then a folder
    of our own under /var/lib/gpucloud, linked from .state/pg."""
    wanted = state_dir / "pg"
    if _postgres_can_traverse(state_dir):
        return wanted
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    real = Path("/var/lib/gpucloud") / f"pg-{digest}"
    real.parent.mkdir(parents=True, exist_ok=True)
    real.parent.chmod(0o755)
    if not wanted.is_symlink() and not wanted.exists():
        wanted.symlink_to(real)
    return real


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- demo data: catalog, fleet, project, tokens -----------------------------------------------


async def seed(database_url: str, tokens_file: Path) -> dict[str, str]:
    """Idempotent: demo catalog and fleet, project `demo`, and an admin and a tenant token that
    are reused across restarts while they are still valid in the database."""
    from activities.billing.ledger import EntryKind, post_entry
    from contracts.states import TokenRole
    from gateway import identity, tokens
    from schema.db import create_engine, session_factory
    from schema.models import ApiToken, Project
    from sim.demo_fleet import seed_demo_fleet

    saved = _load_json(tokens_file)
    engine = create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        async with session_factory(engine)() as session:
            await seed_demo_fleet(session)
            project = await session.scalar(select(Project).where(Project.name == DEMO_PROJECT))
            if project is None:
                project = await identity.create_project(
                    session, DEMO_PROJECT, actor=STACK_ACTOR, actor_token_id=None,
                    role=TokenRole.ADMIN.value, reason="embedded default: demo project",
                )  # fmt: skip

            async def valid(token: str | None, project_id: uuid.UUID | None) -> bool:
                if not token:
                    return False
                row = await session.scalar(
                    select(ApiToken).where(ApiToken.token_sha256 == tokens.hash_token(token))
                )
                return row is not None and row.revoked_at is None and row.project_id == project_id

            result: dict[str, str] = {}
            wanted = (
                ("admin_token", "stack-admin", TokenRole.ADMIN, None),
                ("tenant_token", "demo-tenant", TokenRole.TENANT, project.id),
            )
            for key, name, role, project_id in wanted:
                token = saved.get(key)
                if token is None or not await valid(token, project_id):
                    _, token = await identity.issue_token(
                        session, name=name, role=role, project_id=project_id,
                        actor=STACK_ACTOR, actor_token_id=None, actor_role=TokenRole.ADMIN.value,
                        reason="embedded default: local dev token",
                    )  # fmt: skip
                result[key] = token
            result["project_id"] = str(project.id)
            result["project_name"] = DEMO_PROJECT
            # A starting balance (once per project: the key makes it idempotent), so running
            # the demo flow again does not meet a depleted account and billing's force-release.
            await post_entry(
                session,
                project_id=project.id,
                amount_minor=DEMO_STARTING_CREDIT_MINOR,
                kind=EntryKind.ADMIN_CREDIT,
                idempotency_key=f"embedded-default-starting-credit-{project.id}",
                description="embedded default: demo starting balance",
            )
            await session.commit()
    finally:
        await engine.dispose()
    write_private(tokens_file, json.dumps(result, indent=2) + "\n")
    return result


async def seed_stripe_secrets(o: StackOptions) -> None:
    """stripe-mock accepts any test key; the webhook secret is made once and kept in Vault (read
    it there to sign test webhooks). Nothing is overwritten on restart."""
    from core.payment_settings import STRIPE_API_KEY_PATH, STRIPE_WEBHOOK_SECRET_PATH
    from core.secrets import VaultSecretStore

    store = VaultSecretStore(o.vault_addr, token_file=o.vault_token_file)
    if await store.read(STRIPE_API_KEY_PATH) is None:
        await store.write(STRIPE_API_KEY_PATH, {"key": "sk_test_" + secrets.token_hex(12)})
    if await store.read(STRIPE_WEBHOOK_SECRET_PATH) is None:
        await store.write(STRIPE_WEBHOOK_SECRET_PATH, {"secret": "whsec_" + secrets.token_hex(24)})


def _maas_api_key(path: Path) -> str:
    """The demo MAAS simulator's API key, generated once (a local dev convenience, 0600)."""
    if path.exists():
        return path.read_text().strip().splitlines()[0]
    key = ":".join(secrets.token_urlsafe(n) for n in (14, 14, 24))
    write_private(path, key + "\n")
    return key


def _maas_control_token(path: Path) -> str:
    """The MAAS simulator's control-API token (/_sim/), generated once (0600). Its own token,
    not the API key: the worker gets it to power-cycle simulated BMCs, and the MAAS API key
    stays with the site's credentials in Vault."""
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    write_private(path, token + "\n")
    return token


async def seed_demo_site(o: StackOptions, admin_token: str, maas_key: str) -> str:
    """The demo MAAS site, created through the admin API like an operator would: the site, then
    its credentials (validated against the simulator, written to Vault). Idempotent."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=o.gateway_probe_url, headers=headers, timeout=15) as api:
        sites = (await api.get("/api/v1/admin/maas-sites")).json()["items"]
        site = next((s for s in sites if s["name"] == DEMO_SITE), None)
        if site is None:
            created = await api.post("/api/v1/admin/maas-sites", json={
                "name": DEMO_SITE, "region_code": "us-east-1", "api_base_url": o.maas_url,
                "pxe_iface": "ens19", "pxe_vlan_vid": 46, "node_pxe_iface": "eno8303",
                "reason": "embedded default: demo site"})  # fmt: skip
            created.raise_for_status()
            site = created.json()
        if site["credentials_updated_at"] is None or site["api_base_url"] != o.maas_url:
            if site["api_base_url"] != o.maas_url:
                moved = await api.patch(f"/api/v1/admin/maas-sites/{site['id']}",
                                        json={"api_base_url": o.maas_url})  # fmt: skip
                moved.raise_for_status()
            credentials = await api.post(
                f"/api/v1/admin/maas-sites/{site['id']}/credentials",
                json={"maas_api_key": maas_key,
                      "power": {"user": "root", "password": secrets.token_urlsafe(16)},
                      "deploy_password": secrets.token_urlsafe(16),
                      "reason": "embedded default: demo credentials"},
            )  # fmt: skip
            if credentials.status_code != 200:
                raise StackError(
                    f"the demo MAAS site's credentials were refused: {credentials.text[:300]}"
                )
        # The simulated site moves fast: poll MAAS every second rather than every ten.
        if site["policy"]["maas_poll_interval_ms"] != DEMO_POLL_MS:
            polled = await api.patch(
                f"/api/v1/admin/maas-sites/{site['id']}",
                json={"policy": {"maas_poll_interval_ms": DEMO_POLL_MS},
                      "reason": "embedded default: demo site polls MAAS every second"},
            )  # fmt: skip
            polled.raise_for_status()
    return str(site["id"])


# --- readiness ---------------------------------------------------------------------------------


async def _has_pollers(
    client: Client, namespace: str, queue: str, kind: TaskQueueType.ValueType
) -> bool:
    response = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=kind,
        ),
        timeout=timedelta(seconds=3),
    )
    return len(response.pollers) > 0


async def _nodes_offline(engine: AsyncEngine, node_ids: list[uuid.UUID]) -> int:
    """How many of these nodes are offline (a restarted stack's nodes went offline while it was
    down, and are active again once their agents' first heartbeats are recorded)."""
    from contracts.states import NodeStatus
    from schema.models import Node

    async with engine.connect() as connection:
        offline = await connection.scalar(
            select(func.count())
            .select_from(Node)
            .where(Node.id.in_(node_ids), Node.status == NodeStatus.OFFLINE)
        )
    return int(offline or 0)


# --- the stack ---------------------------------------------------------------------------------


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.o = options
        self.children: list[Child] = []
        self.cluster: PostgresCluster | None = None
        self.client: Client | None = None
        self.stop_requested = asyncio.Event()
        self.pg_log: Path | None = None
        # Temporal Web's line in the summary: which UI serves it, or why none does.
        self.temporal_web = options.ui_url

    # startup helpers

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise StopRequested

    async def _wait_for(
        self,
        what: str,
        probe: Callable[[], Awaitable[bool]],
        child: Child | None,
        limit_s: float = READY_TIMEOUT_S,
    ) -> None:
        deadline = time.monotonic() + limit_s
        while True:
            self._check_stop()
            if child is not None and not child.running:
                raise StackError(
                    f"{child.name} exited with code {child.returncode} while starting; "
                    f"last lines of {child.log_path}:\n{tail(child.log_path)}"
                )
            with contextlib.suppress(Exception):
                if await probe():
                    return
            if time.monotonic() > deadline:
                hint = f"; see {child.log_path}" if child else ""
                raise StackError(f"{what} was not ready after {limit_s:.0f}s{hint}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_requested.wait(), 0.3)

    def _child_env(self, database_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("GPUCLOUD_METRICS_ADDRESS", None)  # the worker's alone: one process per port
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "GPUCLOUD_DATABASE_URL": database_url,
                "GPUCLOUD_TEMPORAL_ADDRESS": self.o.temporal_address,
                "GPUCLOUD_TEMPORAL_NAMESPACE": self.o.namespace,
                "GPUCLOUD_GATEWAY_HOST": self.o.gateway_host,
                "GPUCLOUD_GATEWAY_PORT": str(self.o.gateway_port),
                "GPUCLOUD_PUBLIC_API_URL": self.o.public_api_url,
                # Temporal Web is served by the gateway itself (same origin): no other origin
                # is let call the codec endpoint with the browser's cookies.
                "GPUCLOUD_TEMPORAL_UI_ORIGIN": self.o.gateway_url,
                "GPUCLOUD_SIM_PHASE_DELAY_S": str(self.o.phase_delay),
                "GPUCLOUD_SIM_PHASE_JITTER": str(self.o.jitter),
                "GPUCLOUD_VAULT_ADDR": self.o.vault_addr,
                "GPUCLOUD_STRIPE_API_BASE": self.o.stripe_api_base,
                # The shared directory storage provider's tree: the worker's storage
                # activities and the simulated fleet's mounts (activities/storage_provider.py).
                "GPUCLOUD_STORAGE_ROOT": str((self.o.state_dir / "storage").resolve()),
            }
        )
        return env

    def process_envs(
        self,
        database_url: str,
        approle_env: dict[str, dict[str, str]],
        maas_control_token: str,
    ) -> dict[str, dict[str, str]]:
        """Each process's environment (worker, gateway, fleet): all from _child_env, so all
        with the same GPUCLOUD_PUBLIC_API_URL, the gateway's own port."""
        env = self._child_env(database_url)
        worker_env = {
            **env,
            **approle_env[vault_policies.WORKER.role],
            "GPUCLOUD_HOST_ACCESS": "simulated",
            "GPUCLOUD_SIM_MAAS_URL": self.o.maas_url,
            "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": maas_control_token,
            "GPUCLOUD_SIM_MACHINES_DIR": str(self.o.machines_dir),
            "GPUCLOUD_METRICS_ADDRESS": self.o.worker_metrics_address,
        }
        gateway_env = {
            **env,
            **approle_env[vault_policies.GATEWAY.role],
            # The ui-server the gateway serves under /temporal/ to signed-in operators.
            "GPUCLOUD_TEMPORAL_WEB_UPSTREAM": self.o.ui_upstream,
        }
        return {"worker": worker_env, "gateway": gateway_env, "fleet": env}

    def _preflight(self) -> None:
        busy = [
            f"{what} port {port}"
            for what, port in (
                ("Temporal gRPC", self.o.temporal_port),
                ("Temporal Web", self.o.ui_port),
                ("gateway", self.o.gateway_port),
                ("Vault", self.o.vault_port),
                ("MAAS simulator", self.o.maas_port),
                ("stripe-mock", self.o.stripe_port),
                ("worker metrics", self.o.worker_metrics_port),
            )
            if port_in_use("127.0.0.1", port)
        ]
        if busy:
            raise StackError(
                f"{', '.join(busy)} already in use: is another stack (or Temporal dev server) "
                "running? Stop it, or pick other ports (bin/stack --help)."
            )
        self._check_pg_port(PostgresCluster(pg_datadir(self.o.state_dir), self.o.pg_port))

    def _check_pg_port(self, cluster: PostgresCluster) -> None:
        # PostgresCluster.start() takes any server answering on the port for itself: make sure
        # that one is this stack's cluster (left running by a killed stack), not a stranger.
        if port_in_use("127.0.0.1", cluster.port) and not cluster.serves_this_datadir():
            raise StackError(
                f"port {cluster.port} is taken by something other than this stack's "
                f"PostgreSQL ({cluster.datadir}); use --pg-port or GPUCLOUD_PG_PORT"
            )

    def _start_postgres(self) -> str:
        datadir = pg_datadir(self.o.state_dir)
        cluster = PostgresCluster(datadir, self.o.pg_port)
        self._check_pg_port(cluster)
        self.cluster = cluster
        try:
            cluster.start()
        except LegacyClusterError as err:
            raise StackError(str(err)) from err
        self.pg_log = datadir / "server.log"
        link = self.o.logs_dir / "postgres.log"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(self.pg_log)
        cluster.create_database(DATABASE)
        url = cluster.url(DATABASE)
        from schema.migrate import upgrade

        upgrade(url)
        return url

    async def _start_temporal_cluster(self) -> Child:
        """The Temporal server on the stack's PostgreSQL: schema set up or upgraded, then the
        server, then the namespace and search attributes (devstack/temporal_cluster.py)."""
        assert self.cluster is not None
        cluster = TemporalCluster(
            self.cluster, self.o.state_dir / "temporal-cluster", self.o.temporal_port,
            namespace=self.o.namespace, tuning=self.o.temporal_tuning,
        )  # fmt: skip
        argv = await asyncio.to_thread(cluster.prepare)
        temporal = Child("temporal", argv, self.o.logs_dir / "temporal.log", dict(os.environ),
                         cluster.root)  # fmt: skip
        self.children.append(temporal)
        await temporal.start()
        _say(f"  temporal   cluster on PostgreSQL starting (pid {temporal.pid}), "
             f"log {temporal.log_path}")  # fmt: skip
        await asyncio.to_thread(cluster.register)
        return temporal

    def _build_temporal_web(self) -> str | None:
        """The UI server built once, on the first start of either mode: None when it is there,
        else why not (then there is no Temporal Web: the dev server's embedded UI has no
        sign-in and every write action on, so it stays off)."""
        if not (TOOLS_DIR / f"temporal-ui-server-{UI_SERVER_VERSION}").exists():
            _say(f"  temporal   building Temporal Web (ui-server {UI_SERVER_VERSION}) into "
                 f"{TOOLS_DIR} (once; a few minutes)")  # fmt: skip
        problem = ui_server_build_problem()
        if problem is None:
            self.temporal_web = (
                f"{self.o.ui_url}  (ui-server {UI_SERVER_VERSION} on {self.o.ui_upstream}, "
                "loopback; operators signed in to the console only; read-only: act through "
                "the console)"
            )
        else:
            _say(f"  temporal   ui-server not built ({problem}): no Temporal Web")
            self.temporal_web = f"not started: {problem}"
        return problem

    async def _start_temporal_web(self) -> Child:
        """Temporal Web (temporalio/ui-server) on the Temporal frontend, dev server or cluster,
        on loopback with write actions off, served by the gateway under /temporal/ to signed-in
        operators, decoding payloads through the gateway's codec endpoint with the browser's
        cookies."""
        o = self.o
        web = await asyncio.to_thread(
            temporal_web_child,
            o.state_dir / "temporal-web",
            o.logs_dir / "temporal-web.log",
            o.temporal_address,
            o.ui_port,
            namespace=o.namespace,
            codec_endpoint=o.codec_endpoint,
        )
        self.children.append(web)
        await web.start()
        return web

    async def _connect_temporal(self) -> bool:
        if self.client is None:
            self.client = await Client.connect(
                self.o.temporal_address,
                namespace=self.o.namespace,
                connect_timeout=timedelta(seconds=2),
                identity=STACK_ACTOR,
            )
        return await self.client.service_client.check_health(timeout=timedelta(seconds=2))

    async def start(self) -> dict[str, str]:
        """Every process of the stack, in the order their dependencies need, each waited for
        until it answers; returns the demo tokens (admin, tenant) and the demo site's id."""
        o = self.o
        o.state_dir.mkdir(parents=True, exist_ok=True)
        o.logs_dir.mkdir(parents=True, exist_ok=True)
        self._preflight()
        # Temporal Web is the ui-server in both modes, behind the gateway's console sign-in;
        # the dev server's embedded UI (no sign-in, every write action on) is never served.
        web_problem = await asyncio.to_thread(self._build_temporal_web)
        # The dev server first: it takes a few seconds, PostgreSQL and the migrations run
        # meanwhile. A cluster needs PostgreSQL first (below).
        temporal = await self._start_dev_temporal()
        vault, maas = await self._start_side_servers()

        t0 = time.monotonic()
        database_url = await asyncio.to_thread(self._start_postgres)
        _say(f"  postgres   ready on 127.0.0.1:{o.pg_port}, database migrated "
             f"({time.monotonic() - t0:.1f}s)")  # fmt: skip
        self._check_stop()
        tokens = await seed(database_url, o.tokens_file)
        _say("  demo data  catalog, fleet, project 'demo' and tokens in place")

        await self._ready_temporal(temporal, web_problem, t0)
        approle_env = await self._ready_vault(vault)
        started = await self._start_control_plane(database_url, approle_env)
        await self._wait_for("the MAAS simulator",
                             lambda: http_ok(f"{o.maas_url}/api/2.0/version/"), maas,
                             limit_s=30)  # fmt: skip
        maas_key = _maas_api_key(o.maas_api_key_file)
        tokens["maas_site_id"] = await seed_demo_site(o, tokens["admin_token"], maas_key)
        _say(f"  maas-sim   ready on {o.maas_url} (pid {maas.pid}), demo site 'demo-maas'")
        for child in started:
            _say(f"  {child.name:<10} ready (pid {child.pid}), log {child.log_path}")
        _say(f"  all up in {time.monotonic() - t0:.1f}s")
        return tokens

    async def _start_dev_temporal(self) -> Child:
        """The Temporal dev server's child; started here only in dev mode (a cluster is started
        once PostgreSQL is up, `_ready_temporal`)."""
        o = self.o
        temporal_argv = [
            str(temporal_cli_path(build=False)),
            "server",
            "start-dev",
            "--ip", "127.0.0.1",
            "--port", str(o.temporal_port),
            "--headless",
            "--db-filename", str(o.state_dir / "temporal.db"),
            "--namespace", o.namespace,
            *dev_server_extra_args(),
        ]  # fmt: skip
        temporal = Child("temporal", temporal_argv, o.logs_dir / "temporal.log",
                         {**os.environ, **DEV_SERVER_ENV}, REPO_ROOT)  # fmt: skip
        if o.temporal == "dev":
            self.children.append(temporal)
            await temporal.start()
            _say(f"  temporal   starting (pid {temporal.pid}), log {temporal.log_path}")
        return temporal

    async def _start_side_servers(self) -> tuple[Child, Child]:
        """Vault, the MAAS simulator with its first-boot machines, and stripe-mock: started, not
        yet waited for (returns the Vault and MAAS children, waited for later)."""
        o = self.o
        if o.vault == "hashicorp":
            vault_argv = server_argv(o.hashicorp_vault)
        else:
            vault_argv = [sys.executable, "-m", "sim.vault", "--host", "127.0.0.1",
                          "--port", str(o.vault_port),
                          "--root-token-file", str(o.vault_token_file),
                          "--data-file", str(o.vault_data_file)]  # fmt: skip
        vault = Child("vault", vault_argv, o.logs_dir / "vault.log", dict(os.environ), REPO_ROOT)
        self.children.append(vault)
        await vault.start()
        # Both files are made on first use, before the simulator reads them.
        _maas_api_key(o.maas_api_key_file)
        _maas_control_token(o.maas_control_token_file)
        maas_argv = [sys.executable, "-m", "sim.maas", "--host", "127.0.0.1",
                     "--port", str(o.maas_port),
                     "--api-key-file", str(o.maas_api_key_file),
                     "--control-token-file", str(o.maas_control_token_file)]  # fmt: skip
        maas = Child("maas-sim", maas_argv, o.logs_dir / "maas-sim.log", dict(os.environ),
                     REPO_ROOT)  # fmt: skip
        self.children.append(maas)
        await maas.start()
        # Polls the MAAS simulator (and retries until it and the gateway answer).
        # Each deployed machine's disk is a folder under machines/; its agent is a real
        # gpucloud-agent process started from the rendered cloud-init (logs in the folder).
        first_boot_argv = [sys.executable, "-m", "sim.first_boot", "--maas-url", o.maas_url,
                           "--control-token-file", str(o.maas_control_token_file),
                           "--machines-dir", str(o.machines_dir)]  # fmt: skip
        first_boot = Child("first-boot", first_boot_argv, o.logs_dir / "first-boot.log",
                           {**os.environ, "PYTHONUNBUFFERED": "1"}, REPO_ROOT)  # fmt: skip
        self.children.append(first_boot)
        await first_boot.start()
        stripe = Child("stripe-mock", stripe_mock_argv(o.stripe_port, o.stripe_port + 1),
                       o.logs_dir / "stripe-mock.log", dict(os.environ), REPO_ROOT)  # fmt: skip
        self.children.append(stripe)
        await stripe.start()
        return vault, maas

    async def _ready_temporal(self, temporal: Child, web_problem: str | None, t0: float) -> None:
        """Temporal answering (a cluster started first, now that PostgreSQL is up), Temporal
        Web in front of it, and the dev server's visibility store trimmed."""
        o = self.o
        if o.temporal == "cluster":
            temporal = await self._start_temporal_cluster()
        await self._wait_for("Temporal", self._connect_temporal, temporal)
        if web_problem is None:
            web = await self._start_temporal_web()
            await self._wait_for("Temporal Web", lambda: http_ok(
                f"{o.ui_upstream}{TEMPORAL_WEB_PUBLIC_PATH}/healthz"), web, limit_s=30)  # fmt: skip
        _say(f"  temporal   ready on {o.temporal_address} ({time.monotonic() - t0:.1f}s)")
        if o.temporal == "dev":
            temporal_db = o.state_dir / "temporal.db"
            dropped = await asyncio.to_thread(drop_unused_visibility_indexes, temporal_db)
            if dropped:
                _say(f"  temporal   dropped {dropped} visibility indexes nothing queries")
            if await asyncio.to_thread(guard_full_text_triggers, temporal_db):
                _say("  temporal   full-text visibility triggers now write only what changed")

    async def _ready_vault(self, vault: Child) -> dict[str, dict[str, str]]:
        """Vault answering (HashiCorp's initialised and unsealed), the Stripe secrets in it, and
        the AppRole logins of the worker and the gateway (returned), each with its own policy;
        the root token stays with the stack. Before the worker and the gateway start: they read
        secrets from it at call time."""
        o = self.o
        if o.vault == "hashicorp":
            # Answers while sealed or uninitialised too (sys/health would not say 200 then).
            await self._wait_for("Vault", lambda: http_ok(f"{o.vault_addr}/v1/sys/seal-status"),
                                 vault, limit_s=30)  # fmt: skip
            did = await asyncio.to_thread(initialize_and_unseal, o.hashicorp_vault)
            _say(f"  vault      HashiCorp Vault {VAULT_VERSION}: {did}")
        await self._wait_for("Vault", lambda: http_ok(f"{o.vault_addr}/v1/sys/health"), vault,
                             limit_s=30)  # fmt: skip
        _say(f"  vault      ready on {o.vault_addr} (pid {vault.pid}), log {vault.log_path}")
        await seed_stripe_secrets(o)
        return await asyncio.to_thread(
            provision_vault_auth, o.vault_addr, o.vault_token_file, o.state_dir / "vault-approle"
        )

    async def _start_control_plane(
        self, database_url: str, approle_env: dict[str, dict[str, str]]
    ) -> list[Child]:
        """The worker, the gateway and (with agents) the simulated fleet, started and waited for
        together: the worker polling its queue, the fleet's agents polling and none of the demo
        nodes offline, the gateway's health check answering. Returns them, in start order."""
        o = self.o
        maas_control_token = _maas_control_token(o.maas_control_token_file)
        envs = self.process_envs(database_url, approle_env, maas_control_token)
        env, worker_env, gateway_env = envs["fleet"], envs["worker"], envs["gateway"]
        worker = Child("worker", python_entry("worker"), o.logs_dir / "worker.log", worker_env,
                       REPO_ROOT)  # fmt: skip
        gateway = Child("gateway", python_entry("gateway.serve"), o.logs_dir / "gateway.log",
                        gateway_env, REPO_ROOT)  # fmt: skip
        fleet = Child("fleet", [*python_entry("sim.fleet"), "--refresh-seconds", "5", "--hosts",
                               o.hosts, "--state-dir", str(o.libvirt_hosts_dir),
                               "--machines-dir", str(o.state_dir / "fleet-machines")],
                      o.logs_dir / "fleet.log", env, REPO_ROOT)  # fmt: skip
        started = [worker, *([fleet] if o.agents else []), gateway]
        for child in started:
            self.children.append(child)
            await child.start()
        assert self.client is not None
        client = self.client
        settings = Settings.from_env(env)
        control_queue = settings.control_plane_task_queue

        async def worker_ready() -> bool:
            return await _has_pollers(
                client, o.namespace, control_queue, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW
            )

        from sim.demo_fleet import demo_fleet

        demo_nodes = [node.id for node in demo_fleet().nodes]

        async def fleet_ready() -> bool:
            polling = await _has_pollers(
                client,
                o.namespace,
                node_task_queue(demo_nodes[-1]),
                TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
            return polling and await _nodes_offline(readiness_db, demo_nodes) == 0

        async def gateway_ready() -> bool:
            return await http_ok(f"{o.gateway_probe_url}/healthz")

        from schema.db import create_engine

        readiness_db = create_engine(database_url, pool_size=1, max_overflow=0)
        try:
            waits = [self._wait_for("the control-plane worker", worker_ready, worker)]
            if o.agents:
                waits.append(self._wait_for("the simulated fleet", fleet_ready, fleet))
            waits.append(self._wait_for("the gateway", gateway_ready, gateway))
            await asyncio.gather(*waits)
        finally:
            await readiness_db.dispose()
        return started

    async def supervise(self) -> int:
        """Until a stop is requested (0) or a child exits on its own (1)."""
        waits = {asyncio.ensure_future(c.wait()): c for c in self.children}
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            done, _ = await asyncio.wait([stop, *waits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            for task in waits:
                task.cancel()
        for task in done:
            child = waits.get(task)
            if child is not None:
                _say(
                    f"\n!! {child.name} exited unexpectedly with code {child.returncode}; "
                    f"last lines of {child.log_path}:\n{tail(child.log_path)}\n"
                )
                return 1
        return 0

    async def shutdown(self) -> None:
        # Gateway, fleet and worker together, then Vault, then Temporal, then PostgreSQL.
        apps = [c for c in self.children if c.name not in ("temporal", "vault")]
        await asyncio.gather(*(c.stop() for c in apps), return_exceptions=True)
        for child in self.children:
            if child.name == "vault":
                await child.stop()
        if self.client is not None:
            self.client = None
        for child in self.children:
            if child.name == "temporal":
                await child.stop()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)

    def kill_all(self) -> None:
        for child in self.children:
            child.kill()


def _shown(path: Path) -> str:
    """A path as short as it can be shown: relative to the working directory when inside it."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def print_summary(o: StackOptions, tokens: dict[str, str], stack: Stack) -> None:
    api = o.gateway_url
    logs = [c.log_path.name for c in stack.children] + ["postgres.log"]
    temporal_web = stack.temporal_web
    if o.temporal == "cluster":
        temporal_kind = "Temporal server on PostgreSQL"
    else:
        temporal_kind = "dev server on SQLite"
    vault_kind = f"HashiCorp Vault {VAULT_VERSION}" if o.vault == "hashicorp" else "simulator"
    approle_dir = _shown(o.state_dir / "vault-approle")
    cluster = PostgresCluster(pg_datadir(o.state_dir), o.pg_port)
    pg_password_file = _shown(cluster.password_file)
    pg_url = f"postgresql://gpucloud@127.0.0.1:{o.pg_port}/{DATABASE}"
    env_lines = [
        f"export GPUCLOUD_API={api}",
        f"export ADMIN_TOKEN={tokens['admin_token']}",
        f"export TENANT_TOKEN={tokens['tenant_token']}",
        # gpucloud-admin and alembic straight against the stack's database.
        f"export GPUCLOUD_DATABASE_URL={cluster.url(DATABASE)}",
    ]
    write_private(o.env_file, "\n".join(env_lines) + "\n")
    agents = "simulated fleet of 5 demo nodes" if o.agents else "no node agents (--no-agents)"
    if o.agents and o.hosts != "simulated":
        agents += f", {o.hosts} hosts"
    _say(
        f"""
================================================================================
 gpucloud embedded stack is up ({agents}, phase delay {o.phase_delay:g}s)

 Temporal Web       {temporal_web}
 Temporal gRPC      {o.temporal_address}  (namespace {o.namespace}; {temporal_kind})
 Gateway            {api}
 Operator console   {api}/console/  (sign in with the admin token; README "Operator console")
 OpenAPI docs       {api}/schema/swagger
 Worker metrics     http://{o.worker_metrics_address}/metrics  (Temporal SDK, Prometheus)
 PostgreSQL         {pg_url}  (password in {pg_password_file})
 Vault              {o.vault_addr}  ({vault_kind}; root token in {_shown(o.vault_token_file)};
                    the worker and the gateway log in by AppRole: {approle_dir})
 Stripe (mock)      {o.stripe_api_base}  (stripe-mock; API key and webhook secret in Vault)
 MAAS (simulator)   {o.maas_url}  (site "demo-maas", API key in {_shown(o.maas_api_key_file)})
 Logs               {_shown(o.logs_dir)}/{{{",".join(logs)}}}

 Tokens             an admin and a demo tenant token (project "demo") in {_shown(o.tokens_file)}
                    (mode 0600; never printed, so terminal and CI logs do not keep them);
                    `source {_shown(o.env_file)}` exports them, GPUCLOUD_API and the DB URL

 Try it from another terminal:
   source {_shown(o.env_file)}
   curl -s -X POST $GPUCLOUD_API/api/v1/allocations \\
     -H "Authorization: Bearer $TENANT_TOKEN" -H "X-Idempotency-Key: try-$(date +%s)" \\
     -H 'Content-Type: application/json' \\
     -d '{{"sku": "h100.slice", "gpus": 2, "region": "us-east-1", "ssh_key_ids": []}}'
   curl -s $GPUCLOUD_API/api/v1/allocations -H "Authorization: Bearer $TENANT_TOKEN"
 The whole tenant flow: README.md, or `.venv/bin/python -m devstack.smoke`.

 Ctrl-C stops everything (PostgreSQL too); state survives restarts.
================================================================================
"""
    )


# --- entry point -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> StackOptions:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="gpucloud-stack",
        description="Run the whole embedded stack in the foreground (Ctrl-C stops it).",
    )
    add = parser.add_argument
    add(
        "--check",
        action="store_true",
        help="bring the stack up, run the scripted tenant flow over HTTP, stop; exit 0 or 1",
    )
    add(
        "--no-agents",
        dest="agents",
        action="store_false",
        help="do not start the simulated fleet (host work then times out: a dead-node demo)",
    )
    add(
        "--phase-delay",
        type=float,
        metavar="S",
        default=float(env.get("GPUCLOUD_SIM_PHASE_DELAY_S", "1") or 1),
        help="seconds each simulated host phase takes (default: %(default)s)",
    )
    add(
        "--jitter",
        type=float,
        metavar="F",
        default=float(env.get("GPUCLOUD_SIM_PHASE_JITTER", "0.2") or 0.2),
        help="random +-fraction applied to each phase delay (default: %(default)s)",
    )
    add(
        "--gateway-host",
        default=env.get("GPUCLOUD_GATEWAY_HOST", "127.0.0.1"),
        help="gateway bind address (default: %(default)s)",
    )
    add(
        "--gateway-port",
        type=int,
        default=int(env.get("GPUCLOUD_GATEWAY_PORT", "8000")),
        help="gateway port (default: %(default)s)",
    )
    add(
        "--pg-port",
        type=int,
        default=int(env.get("GPUCLOUD_PG_PORT", "55432")),
        help="PostgreSQL port (default: %(default)s)",
    )
    add(
        "--temporal-port",
        type=int,
        default=int(env.get("GPUCLOUD_TEMPORAL_PORT", "7233")),
        help="Temporal gRPC port (default: %(default)s)",
    )
    add(
        "--ui-port",
        type=int,
        default=int(env.get("GPUCLOUD_TEMPORAL_UI_PORT", "8233")),
        help="Temporal Web's private port on 127.0.0.1; operators open it at the gateway's "
        "/temporal/ (default: %(default)s)",
    )
    add(
        "--vault-port",
        type=int,
        default=int(env.get("GPUCLOUD_VAULT_PORT", "8200")),
        help="Vault simulator port (default: %(default)s)",
    )
    add(
        "--maas-port",
        type=int,
        default=int(env.get("GPUCLOUD_MAAS_SIM_PORT", "5240")),
        help="MAAS simulator port (default: %(default)s)",
    )
    add(
        "--stripe-port",
        type=int,
        default=int(env.get("GPUCLOUD_STRIPE_MOCK_PORT", "12111")),
        help="stripe-mock HTTP port; HTTPS takes the next (default: %(default)s)",
    )
    add(
        "--worker-metrics-port",
        type=int,
        default=int(env.get("GPUCLOUD_WORKER_METRICS_PORT", "9464")),
        help="where the worker serves its Temporal SDK metrics (default: %(default)s)",
    )
    add(
        "--state-dir",
        type=Path,
        default=Path(env.get("GPUCLOUD_STATE_DIR", REPO_ROOT / ".state")),
        help="PostgreSQL data, Temporal history, tokens and logs (default: %(default)s)",
    )
    add(
        "--reset",
        action="store_true",
        help="delete the state directory first: all data, history and tokens",
    )
    add(
        "--hosts",
        choices=("simulated", "libvirt-test"),
        default=env.get("GPUCLOUD_STACK_HOSTS") or "simulated",
        help="the fleet's hosts: simulated, or real backends on libvirt's test driver "
        "(default: %(default)s)",
    )
    add(
        "--vault",
        choices=("simulator", "hashicorp"),
        default=env.get("GPUCLOUD_STACK_VAULT") or "simulator",
        help="simulator: our Vault-compatible store; hashicorp: HashiCorp Vault itself "
        "(built by bin/bootstrap), with file storage, initialised once and unsealed on every "
        "start (default: %(default)s)",
    )
    add(
        "--temporal",
        choices=("dev", "cluster"),
        default=env.get("GPUCLOUD_STACK_TEMPORAL") or "dev",
        help="dev: the Temporal dev server on SQLite, with Temporal Web; cluster: the Temporal "
        "server on the stack's PostgreSQL, as production runs it (default: %(default)s)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    return StackOptions(
        state_dir=args.state_dir.resolve(),
        pg_port=args.pg_port,
        temporal=args.temporal,
        vault=args.vault,
        temporal_port=args.temporal_port,
        ui_port=args.ui_port,
        gateway_host=args.gateway_host,
        gateway_port=args.gateway_port,
        phase_delay=args.phase_delay,
        jitter=args.jitter,
        agents=args.agents,
        check=args.check,
        reset=args.reset,
        vault_port=args.vault_port,
        maas_port=args.maas_port,
        stripe_port=args.stripe_port,
        hosts=args.hosts,
        worker_metrics_port=args.worker_metrics_port,
    )


def reset_state(o: StackOptions) -> None:
    if not o.state_dir.exists():
        return
    datadir = pg_datadir(o.state_dir)
    PostgresCluster(datadir, o.pg_port).stop()
    if datadir != o.state_dir / "pg":
        shutil.rmtree(datadir, ignore_errors=True)
    PostgresCluster(datadir, o.pg_port).password_file.unlink(missing_ok=True)
    for entry in o.state_dir.iterdir():
        if entry.name == ".bootstrap.lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    _say(f"reset: removed everything under {o.state_dir}")


async def run(o: StackOptions) -> int:
    stack = Stack(o)
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signame: str) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            _say(f"\n{signame}: stopping the stack (again to kill at once)...")
            stack.stop_requested.set()
        else:
            stack.kill_all()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)

    rc = 1
    try:
        _say(f"Starting the gpucloud embedded stack (state in {o.state_dir})")
        tokens = await stack.start()
        if o.check:
            from devstack.smoke import run_smoke

            _say("\n--check: running the tenant flow against the gateway")
            ok = await asyncio.to_thread(
                run_smoke, o.gateway_probe_url, tokens["tenant_token"], tokens["admin_token"]
            )
            rc = 0 if ok else 1
            dead = [c for c in stack.children if not c.running]
            for child in dead:
                _say(f"!! {child.name} exited with code {child.returncode}; see {child.log_path}")
                rc = 1
        else:
            print_summary(o, tokens, stack)
            rc = await stack.supervise()
    except StopRequested:
        rc = 0
    except StackError as err:
        _say(f"\n!! {err}")
        rc = 1
    except Exception as err:
        _say(f"\n!! the stack failed to start: {type(err).__name__}: {err}")
        rc = 1
    finally:
        _say("Stopping: gateway, fleet, worker, Vault, Temporal, PostgreSQL ...")
        await stack.shutdown()
        _say("Stopped.")
    return rc


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    if o.reset:
        reset_state(o)
    o.state_dir.mkdir(parents=True, exist_ok=True)
    try:
        temporal_cli_path(build=False)
    except RuntimeError as err:
        print(f"!! {err}", file=sys.stderr)
        return 1
    return asyncio.run(run(o))


if __name__ == "__main__":
    sys.exit(main())
