"""A Temporal server on PostgreSQL, as a production cluster runs it, on this machine.

The dev server (`temporal server start-dev`, SQLite) stays the default; this is the other mode:
the server binary and `temporal-sql-tool` built once from the server's Go module, its two
databases (`temporal`, `temporal_visibility`) on the stack's PostgreSQL, owned by a role of its
own that is no superuser and logs in with a password; the schema set up and upgraded to the
module's latest version by the SQL tool; the namespace and our search attributes (SQL visibility)
registered through the CLI. Everything a production deployment would set is in
`server_config` and `TUNING` (history shards, connection pools, dynamic config), one place, and
docker-compose.temporal.yml is checked against them (tests/test_temporal_cluster.py). Temporal
Web for either mode is `temporalio/ui-server` (`ui_server_config`), which can send the browser's
cookies to the gateway's codec endpoint (the dev server's embedded UI cannot); it listens on
loopback, with write actions off, and the gateway serves it to signed-in operators only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.search_attributes import ALL as SEARCH_ATTRIBUTES
from devstack.go_tools import TOOLS_DIR, go_module_dir, go_tool_path
from devstack.postgres import PostgresCluster
from devstack.private_files import write_private
from devstack.processes import Child, port_in_use
from devstack.temporal import LONG_POLLS_PER_NAMESPACE, temporal_cli_path

TEMPORAL_SERVER_MODULE = "go.temporal.io/server"
TEMPORAL_SERVER_VERSION = "v1.29.1"
DATABASES = ("temporal", "temporal_visibility")
ROLE = "temporal"
# Postgres 12+ plugin of the SQL persistence (the schema folder has the same name).
SQL_PLUGIN = "postgres12"
ENV_NAME = "gpucloud"


@dataclass(frozen=True)
class ClusterTuning:
    """What a production deployment tunes. The defaults are what bench/temporal_servers.py
    measured best for our workload on this machine, one change at a time (bench/README.md,
    "Temporal: dev server vs cluster"); the bench passes other values to compare."""

    # Fixed for a cluster's life: a change needs a fresh database. A production cluster sizes
    # them for its peak (Temporal's guidance: 512 for most, more for the largest).
    history_shards: int = 4
    # Each store's pool, per server process (Temporal's docker defaults: 20 and 10).
    max_conns: int = 20
    max_idle_conns: int = 20
    visibility_max_conns: int = 10
    visibility_max_idle_conns: int = 10
    # One partition per task queue: each node queue has one poller (its agent) and the control
    # plane's queue one worker per process; more partitions only spread sync matches thin.
    task_queue_partitions: int = 1
    # Any other dynamic config key and value, for the bench to try (none by default).
    extra_dynamic_config: tuple[tuple[str, Any], ...] = ()

    def dynamic_config(self) -> dict[str, Any]:
        return {
            # What our workflows need: update-with-start (ExecuteMultiOperation) and updates.
            "frontend.enableExecuteMultiOperation": True,
            "frontend.enableUpdateWorkflowExecution": True,
            "matching.numTaskqueueReadPartitions": self.task_queue_partitions,
            "matching.numTaskqueueWritePartitions": self.task_queue_partitions,
            "frontend.namespaceCount": LONG_POLLS_PER_NAMESPACE,
            **dict(self.extra_dynamic_config),
        }

    def server_image_environment(self) -> dict[str, str]:
        """The same settings as the `temporalio/server` image's variables (its config template),
        which docker-compose.temporal.yml sets."""
        return {
            "NUM_HISTORY_SHARDS": str(self.history_shards),
            "SQL_MAX_CONNS": str(self.max_conns),
            "SQL_MAX_IDLE_CONNS": str(self.max_idle_conns),
            "SQL_VIS_MAX_CONNS": str(self.visibility_max_conns),
            "SQL_VIS_MAX_IDLE_CONNS": str(self.visibility_max_idle_conns),
        }


TUNING = ClusterTuning()
DYNAMIC_CONFIG: dict[str, Any] = TUNING.dynamic_config()


@dataclass(frozen=True)
class ServerTools:
    server: Path
    sql_tool: Path
    schema_root: Path  # schema/postgresql/v12 of the server's module

    def schema_dir(self, database: str) -> Path:
        """The versioned schema folder of one of the two databases."""
        kind = "visibility" if database.endswith("visibility") else "temporal"
        return self.schema_root / kind / "versioned"


def server_tools(*, build: bool = True) -> ServerTools:
    """The Temporal server, `temporal-sql-tool` and the server's PostgreSQL schemas, built and
    copied once into the tools cache (so that running them needs no Go)."""
    at = f"@{TEMPORAL_SERVER_VERSION}"
    server = go_tool_path(
        f"temporal-server-{TEMPORAL_SERVER_VERSION}",
        f"{TEMPORAL_SERVER_MODULE}/cmd/server{at}",
        build=build,
        on_path=False,
    )
    sql_tool = go_tool_path(
        f"temporal-sql-tool-{TEMPORAL_SERVER_VERSION}",
        f"{TEMPORAL_SERVER_MODULE}/cmd/tools/sql{at}",
        build=build,
        on_path=False,
    )
    schema_root = TOOLS_DIR / f"temporal-schema-{TEMPORAL_SERVER_VERSION}"
    if not schema_root.exists():
        if not build:
            raise RuntimeError(f"{schema_root.name} not found; run bin/bootstrap")
        module = go_module_dir(f"{TEMPORAL_SERVER_MODULE}{at}")
        staging = schema_root.with_name(schema_root.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(module / "schema" / "postgresql" / "v12", staging)
        staging.replace(schema_root)
    return ServerTools(server, sql_tool, schema_root)


# Temporal Web for both modes of bin/stack: temporalio/ui-server built from its Go module (no
# replace directives), the same UI version the temporal CLI embeds for the dev server. The dev
# server's embedded UI cannot include credentials in its codec calls (its only codec flag is
# --ui-codec-endpoint), so the stack runs the dev server headless beside this one.
UI_SERVER_MODULE = "github.com/temporalio/ui-server/v2"
UI_SERVER_VERSION = "v2.42.1"
# Where the gateway serves Temporal Web (gateway.console.temporal_web.PUBLIC_PATH): the ui-server
# answers under the same path, so its pages, assets and API calls all go through the gateway.
TEMPORAL_WEB_PUBLIC_PATH = "/temporal"


def ui_server_path(*, build: bool = True) -> Path:
    """The UI server binary, built once into the tools cache (bin/bootstrap builds it: bin/stack
    runs it, and the console's browser test checks in it that payloads decode)."""
    return go_tool_path(
        f"temporal-ui-server-{UI_SERVER_VERSION}",
        f"{UI_SERVER_MODULE}/cmd/server@{UI_SERVER_VERSION}",
        build=build,
        on_path=False,
    )


def ui_server_build_problem() -> str | None:
    """Builds the UI server if it is not in the tools cache yet: None once it is there, else why
    it could not be built (no Go, or `go install` failed, e.g. offline), for the dev server to
    fall back on its embedded UI."""
    try:
        ui_server_path()
    except FileNotFoundError:
        return "Go is not installed"
    except subprocess.CalledProcessError as err:
        return (
            f"`go install {UI_SERVER_MODULE}/cmd/server@{UI_SERVER_VERSION}` failed "
            f"(exit {err.returncode}; offline?)"
        )
    return None


def ui_server_config(
    frontend: str,
    port: int,
    *,
    namespace: str,
    codec_endpoint: str,
    public_path: str = TEMPORAL_WEB_PUBLIC_PATH,
) -> dict[str, Any]:
    """Temporal Web's configuration (JSON is YAML): the cluster's frontend, and the gateway's
    codec endpoint called by the browser with its cookies (includeCredentials: the console's
    session cookie, same origin since the gateway serves the UI).

    For operators only (issue 36): it listens on loopback only, under `public_path`, where the
    gateway serves it to admins signed in to the console (gateway/console/temporal_web.py,
    GPUCLOUD_TEMPORAL_WEB_UPSTREAM); and with every write action off (`disableWriteActions`:
    the ui-server answers 405 to any API call but a read or a workflow query), so cancelling,
    terminating, resetting or signalling goes through the console's audited verbs only."""
    return {
        "temporalGrpcAddress": frontend,
        "host": "127.0.0.1",
        "port": port,
        "publicPath": public_path,
        "disableWriteActions": True,
        "enableUi": True,
        "defaultNamespace": namespace,
        "showTemporalSystemNamespace": False,
        "notifyOnNewVersion": False,  # nothing outside this machine is called
        "codec": {"endpoint": codec_endpoint, "includeCredentials": True, "passAccessToken": False},
    }


def temporal_web_child(
    root: Path, log_path: Path, frontend: str, port: int, *, namespace: str, codec_endpoint: str
) -> Child:
    """Temporal Web as bin/stack runs it (not started): the ui-server on `frontend`, on
    127.0.0.1:`port` under TEMPORAL_WEB_PUBLIC_PATH (the gateway serves it to signed-in
    operators), its configuration under `root`. Blocking: the first call may build the
    ui-server."""
    config = ui_server_config(frontend, port, namespace=namespace, codec_endpoint=codec_endpoint)
    argv = ui_server_argv(root, config)
    return Child("temporal-web", argv, log_path, dict(os.environ), root)


def ui_server_argv(root: Path, config: dict[str, Any]) -> list[str]:
    """Writes the configuration under `root/config` and returns the UI server's command line."""
    config_dir = root / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / f"{ENV_NAME}.yaml").write_text(json.dumps(config, indent=1))
    return [str(ui_server_path()), "--root", str(root), "--config", "config", "--env", ENV_NAME,
            "start"]  # fmt: skip


@dataclass
class Ports:
    frontend: int
    frontend_http: int
    frontend_membership: int
    history: int
    history_membership: int
    matching: int
    matching_membership: int
    worker: int
    worker_membership: int

    @classmethod
    def around(cls, frontend: int) -> Ports:
        """The frontend where asked; every other service on a free port (nothing dials them
        but the cluster itself, which finds them through its membership table). Below 32768:
        the membership table keeps ports in a smallint, and the kernel's ephemeral range (where
        a port the kernel picks lands) starts above it."""
        taken: set[int] = {frontend}
        picked: list[int] = []
        while len(picked) < 8:
            port = random.randrange(20000, 32000)  # a port, not a secret
            if port not in taken and not port_in_use("127.0.0.1", port):
                taken.add(port)
                picked.append(port)
        return cls(frontend, *picked)


def server_config(
    pg: PostgresCluster,
    password: str,
    ports: Ports,
    *,
    tuning: ClusterTuning,
    dynamic_config: Path,
) -> dict[str, Any]:
    """The server's static configuration (JSON is YAML)."""

    def datastore(database: str, max_conns: int, max_idle_conns: int) -> dict[str, Any]:
        return {
            "sql": {
                "pluginName": SQL_PLUGIN,
                "databaseName": database,
                "connectAddr": f"127.0.0.1:{pg.port}",
                "connectProtocol": "tcp",
                "user": ROLE,
                "password": password,
                "maxConns": max_conns,
                "maxIdleConns": max_idle_conns,
                "maxConnLifetime": "1h",
            }
        }

    def service(grpc: int, membership: int, **extra: int) -> dict[str, Any]:
        rpc = {"grpcPort": grpc, "membershipPort": membership, "bindOnLocalHost": True, **extra}
        return {"rpc": rpc}

    return {
        "log": {"stdout": True, "level": "warn"},
        "persistence": {
            "defaultStore": "default",
            "visibilityStore": "visibility",
            "numHistoryShards": tuning.history_shards,
            "datastores": {
                "default": datastore(DATABASES[0], tuning.max_conns, tuning.max_idle_conns),
                "visibility": datastore(
                    DATABASES[1], tuning.visibility_max_conns, tuning.visibility_max_idle_conns
                ),
            },
        },
        "global": {
            "membership": {"maxJoinDuration": "30s", "broadcastAddress": "127.0.0.1"},
        },
        "services": {
            "frontend": service(
                ports.frontend, ports.frontend_membership, httpPort=ports.frontend_http
            ),
            "history": service(ports.history, ports.history_membership),
            "matching": service(ports.matching, ports.matching_membership),
            "worker": service(ports.worker, ports.worker_membership),
        },
        "clusterMetadata": {
            "enableGlobalNamespace": False,
            "failoverVersionIncrement": 10,
            "masterClusterName": "active",
            "currentClusterName": "active",
            "clusterInformation": {
                "active": {
                    "enabled": True,
                    "initialFailoverVersion": 1,
                    "rpcName": "frontend",
                    "rpcAddress": f"127.0.0.1:{ports.frontend}",
                }
            },
        },
        "dcRedirectionPolicy": {"policy": "noop"},
        "dynamicConfigClient": {"filepath": str(dynamic_config), "pollInterval": "10s"},
    }


def dynamic_config_document(values: dict[str, Any]) -> dict[str, Any]:
    return {key: [{"value": value}] for key, value in values.items()}


@dataclass
class TemporalCluster:
    """One Temporal server process (all four services) on `pg`, configured under `root`."""

    pg: PostgresCluster
    root: Path
    frontend_port: int
    namespace: str = "default"
    tuning: ClusterTuning = TUNING

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.frontend_port}"

    @property
    def password_file(self) -> Path:
        return self.root / "db-password"

    def _password(self) -> str:
        if not self.password_file.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            write_private(self.password_file, secrets.token_hex(24) + "\n")
        return self.password_file.read_text().strip()

    def prepare(self) -> list[str]:
        """Databases, role, schema at the module's latest version, configuration files; returns
        the server's command line. Idempotent: a restart upgrades the schema if the binary is
        newer and keeps the history."""
        tools = server_tools()
        password = self._password()
        self.pg.ensure_login_role(ROLE, password)
        for database in DATABASES:
            self.pg.create_database(database, owner=ROLE)
            self._schema(tools, database, password)
        config_dir = self.root / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        dynamic = config_dir / "dynamic.yaml"
        dynamic.write_text(
            json.dumps(dynamic_config_document(self.tuning.dynamic_config()), indent=1)
        )
        config = server_config(
            self.pg,
            password,
            Ports.around(self.frontend_port),
            tuning=self.tuning,
            dynamic_config=dynamic,
        )
        write_private(config_dir / f"{ENV_NAME}.yaml", json.dumps(config, indent=1))
        return [
            str(tools.server),
            "--root",
            str(self.root),
            "--config",
            "config",
            "--env",
            ENV_NAME,
            "--allow-no-auth",
            "start",
        ]

    def _schema(self, tools: ServerTools, database: str, password: str) -> None:
        env = {
            **os.environ,
            "SQL_PLUGIN": SQL_PLUGIN,
            "SQL_HOST": "127.0.0.1",
            "SQL_PORT": str(self.pg.port),
            "SQL_USER": ROLE,
            "SQL_PASSWORD": password,  # the environment, not the command line `ps` shows
            "SQL_DATABASE": database,
        }

        def tool(*args: str) -> None:
            subprocess.run(
                [str(tools.sql_tool), *args], env=env, check=True, capture_output=True, text=True
            )

        version = self.pg.psql(
            "SELECT to_regclass('schema_version') IS NOT NULL", database=database
        ).strip()
        if version != "t":
            tool("setup-schema", "-v", "0.0")
        tool("update-schema", "-d", str(tools.schema_dir(database)))

    def register(self, timeout: float = 60.0) -> None:
        """Once the frontend answers: the namespace and our search attributes (SQL visibility
        maps each onto one of its pre-made Keyword columns). Both are idempotent."""
        cli = str(temporal_cli_path(build=False))
        address = ["--address", self.address]
        wait_frontend_serving(self.address, "Temporal cluster", timeout)
        described = subprocess.run(
            [cli, "operator", "namespace", "describe", "--namespace", self.namespace, *address],
            capture_output=True,
            text=True,
        )
        if described.returncode != 0:
            subprocess.run(
                [cli, "operator", "namespace", "create", "--namespace", self.namespace,
                 "--retention", "72h", *address],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
        wanted: list[str] = []
        for key in SEARCH_ATTRIBUTES:
            wanted += ["--name", key.name, "--type", "Keyword"]
        deadline = time.monotonic() + timeout
        while True:
            # A namespace just created takes a moment to reach every service's cache.
            created = subprocess.run(
                [cli, "operator", "search-attribute", "create", "--namespace", self.namespace,
                 *wanted, *address],
                capture_output=True, text=True,
            )  # fmt: skip
            if created.returncode == 0 or "already" in created.stderr:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"search attributes not registered: {created.stderr.strip()}")
            time.sleep(0.5)


@contextlib.contextmanager
def running_cluster(
    pg: PostgresCluster, root: Path, frontend_port: int
) -> Iterator[TemporalCluster]:
    """A prepared, started and registered cluster for tests and benchmarks; the server is
    stopped on exit (its databases stay on `pg`, which the caller owns). Its log is
    `root/server.log`."""
    cluster = TemporalCluster(pg, root, frontend_port)
    argv = cluster.prepare()
    with server_process(argv, root):
        cluster.register()
        yield cluster


def wait_frontend_serving(address: str, what: str, timeout: float) -> None:
    """Until the frontend at `address` answers its health check SERVING (a call any caller
    may make, with or without an identity)."""
    cli = str(temporal_cli_path(build=False))
    deadline = time.monotonic() + timeout
    while True:
        health = subprocess.run(
            [cli, "operator", "cluster", "health", "--address", address],
            capture_output=True,
            text=True,
        )
        if health.returncode == 0 and "SERVING" in health.stdout:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not serving: {health.stderr.strip()}")
        time.sleep(0.5)


@contextlib.contextmanager
def server_process(
    argv: list[str], root: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A Temporal server process started in `root` (log: `root/server.log`), stopped on exit:
    terminated, killed if it has not exited within 30 s."""
    with (root / "server.log").open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
