"""The Temporal server main of our own (temporal-authz/): the stock server with a ClaimMapper
that verifies the control plane's signed tokens (core/temporal_identity.py) and an Authorizer
that lets each identity make only the calls it needs (docs/temporal.md, "Identities and the
Authorizer"). Not the stack's default yet: the tests start it on PostgreSQL the way
devstack/temporal_cluster.py starts the stock server.

Built once per version of its Go sources into the tools cache (the cached name carries a hash
of them, so an edit rebuilds), from the Go build and module caches the stock server's build
warmed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.allocation import allocation_workflow_id
from contracts.host_tasks import HOST_TASK_PROGRESS_SIGNAL
from contracts.node_presence import HEARTBEAT_SIGNAL, WORKFLOW_NAME, node_presence_workflow_id
from contracts.storage import WORKFLOW_ID_PREFIX as ATTACHMENT_WORKFLOW_ID_PREFIX
from contracts.terminal_session import STREAM_ATTACHED_SIGNAL, terminal_workflow_id
from core.task_queues import node_task_queue
from devstack.go_tools import TOOLS_DIR, _built_once
from devstack.postgres import PostgresCluster
from devstack.private_files import write_private
from devstack.processes import port_in_use
from devstack.temporal_cluster import (
    ENV_NAME,
    SQL_PLUGIN,
    TEMPORAL_SERVER_VERSION,
    TUNING,
    Ports,
    dynamic_config_document,
    server_config,
    server_process,
    server_tools,
    wait_frontend_serving,
)

SOURCE_DIR = Path(__file__).resolve().parent.parent / "temporal-authz"
# Where the server reads its policy (temporal-authz/main.go, PolicyEnv).
POLICY_ENV = "TEMPORAL_AUTHZ_POLICY"
# Its own role and databases: never those of the stock cluster a test session may be running
# on the same PostgreSQL (a second ensure_login_role would change that role's password).
ROLE = "temporal_authz"
DATABASES = ("temporal_authz", "temporal_authz_visibility")


def source_digest(source_dir: Path = SOURCE_DIR) -> str:
    """A hash of the Go sources (go.mod, go.sum, every .go file): part of the cached name."""
    digest = hashlib.sha256()
    for path in sorted(source_dir.iterdir()):
        if path.name in ("go.mod", "go.sum") or path.suffix == ".go":
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def authz_server_path(*, build: bool = True) -> Path:
    """Our server binary from the tools cache, built there first if these sources never were.
    A local package (not a module at a version), so `go build` in its folder: its go.mod
    requires go.temporal.io/server as a dependency, whose replace directives (none in
    v1.29.1, some in other versions) Go ignores, as it does for go_wrapper_build's wrapper."""
    name = f"temporal-authz-{TEMPORAL_SERVER_VERSION}-{source_digest()}"

    def build_into(work: Path) -> Path:
        output = work / name
        subprocess.run(["go", "build", "-o", str(output), "."], check=True, cwd=SOURCE_DIR)
        return output

    built = _built_once(name, build, build_into)
    # Each edit of the sources builds a binary of ~100 MB: older ones go (a process still
    # running one keeps its open file).
    for pattern in (f"temporal-authz-{TEMPORAL_SERVER_VERSION}-*", ".temporal-authz-*.lock"):
        for stale in TOOLS_DIR.glob(pattern):
            if name not in stale.name and stale.is_file():
                stale.unlink(missing_ok=True)
    return built


def policy_document(
    public_keys_pem: list[str], *, namespace: str, control_plane_queue: str
) -> dict[str, Any]:
    """What the server enforces (temporal-authz/policy.go), every name taken from the contracts
    the agent and the workflows use: a node's queue, its presence report, and which signal it
    may send to which kind of workflow."""
    queue_prefix = node_task_queue("")
    return {
        "public_keys": public_keys_pem,
        "namespace": namespace,
        "node_queue_prefix": queue_prefix,
        "presence_workflow_id_prefix": node_presence_workflow_id(""),
        "presence_workflow_type": WORKFLOW_NAME,
        "presence_signal": HEARTBEAT_SIGNAL,
        "presence_task_queue": control_plane_queue,
        "node_signals": {
            # agent/host_activities.py reports to the workflow that scheduled the host task;
            # only these two handle the report (any other would drop it unread).
            HOST_TASK_PROGRESS_SIGNAL: [allocation_workflow_id(""), ATTACHMENT_WORKFLOW_ID_PREFIX],
            # agent/terminal.py: the PTY is bridged to the tenant's stream.
            STREAM_ATTACHED_SIGNAL: [terminal_workflow_id("")],
        },
    }


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """Ports below 32768 like Ports.around (the membership table keeps them in a smallint)."""
    picked: list[int] = []
    while len(picked) < count:
        port = random.randrange(20000, 32000)  # a port, not a secret
        if port not in taken and not port_in_use("127.0.0.1", port):
            taken.add(port)
            picked.append(port)
    return picked


def authz_server_config(
    pg: PostgresCluster, password: str, ports: Ports, *, dynamic_config: Path
) -> dict[str, Any]:
    """The stock cluster's configuration on our own databases and role, plus an
    internal-frontend: the server's own worker service (system workflows) calls the frontend
    without a token, and the internal-frontend is where it does so (Temporal gives it admin
    claims). It binds to loopback here; a deployment keeps it on the internode network, behind
    internode mTLS, where no node reaches it."""
    config = server_config(pg, password, ports, tuning=TUNING, dynamic_config=dynamic_config)
    for store, database in zip(("default", "visibility"), DATABASES, strict=True):
        config["persistence"]["datastores"][store]["sql"].update(user=ROLE, databaseName=database)
    internal, internal_membership, internal_http = _free_ports(
        3, {ports.frontend, *vars(ports).values()}
    )
    config["services"]["internal-frontend"] = {
        "rpc": {
            "grpcPort": internal,
            "membershipPort": internal_membership,
            "httpPort": internal_http,
            "bindOnLocalHost": True,
        }
    }
    return config


@dataclass
class AuthzServer:
    """One process of our server (frontend, internal-frontend, history, matching, worker) on
    `pg`, configured under `root`."""

    pg: PostgresCluster
    root: Path
    frontend_port: int
    policy: dict[str, Any]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.frontend_port}"

    def prepare(self) -> tuple[list[str], dict[str, str]]:
        """Databases, role, schema, configuration and policy files; returns the command line
        and environment."""
        tools = server_tools()
        self.root.mkdir(parents=True, exist_ok=True)
        password = secrets.token_hex(24)
        self.pg.ensure_login_role(ROLE, password)
        for database in DATABASES:
            self.pg.create_database(database, owner=ROLE)
            self._schema(tools.sql_tool, tools.schema_dir(database), database, password)
        config_dir = self.root / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        dynamic = config_dir / "dynamic.yaml"
        dynamic.write_text(json.dumps(dynamic_config_document(TUNING.dynamic_config()), indent=1))
        config = authz_server_config(
            self.pg, password, Ports.around(self.frontend_port), dynamic_config=dynamic
        )
        write_private(config_dir / f"{ENV_NAME}.yaml", json.dumps(config, indent=1))
        policy_file = config_dir / "authz-policy.json"
        policy_file.write_text(json.dumps(self.policy, indent=1))
        services = [*config["services"]]
        argv = [str(authz_server_path()), "--root", str(self.root), "--config", "config",
                "--env", ENV_NAME, "start"]  # fmt: skip
        for service in services:
            argv += ["--service", service]
        return argv, {**os.environ, POLICY_ENV: str(policy_file)}

    def _schema(self, sql_tool: Path, schema_dir: Path, database: str, password: str) -> None:
        env = {
            **os.environ,
            "SQL_PLUGIN": SQL_PLUGIN,
            "SQL_HOST": "127.0.0.1",
            "SQL_PORT": str(self.pg.port),
            "SQL_USER": ROLE,
            "SQL_PASSWORD": password,  # the environment, not the command line `ps` shows
            "SQL_DATABASE": database,
        }
        exists = self.pg.psql(
            "SELECT to_regclass('schema_version') IS NOT NULL", database=database
        ).strip()
        commands = [] if exists == "t" else [["setup-schema", "-v", "0.0"]]
        for args in [*commands, ["update-schema", "-d", str(schema_dir)]]:
            subprocess.run(
                [str(sql_tool), *args], env=env, check=True, capture_output=True, text=True
            )

    def wait_serving(self, timeout: float = 90.0) -> None:
        wait_frontend_serving(self.address, "temporal-authz", timeout)


@contextlib.contextmanager
def running_authz_server(
    pg: PostgresCluster, root: Path, frontend_port: int, policy: dict[str, Any]
) -> Iterator[AuthzServer]:
    """Our server prepared and started until it serves; stopped on exit (its databases stay on
    `pg`). Its log is `root/server.log`. The namespace is not registered: that takes a
    control-plane token (register_namespace)."""
    server = AuthzServer(pg, root, frontend_port, policy)
    argv, env = server.prepare()
    with server_process(argv, root, env):
        server.wait_serving()
        yield server
