"""The Temporal cluster on PostgreSQL: docker-compose.temporal.yml says what
devstack/temporal_cluster.py runs (server version, schema, dynamic config, search attributes),
and a session on the cluster tier really persists its workflows in PostgreSQL."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from core.search_attributes import ALL as SEARCH_ATTRIBUTES
from devstack.postgres import PostgresCluster
from devstack.temporal_cluster import (
    DYNAMIC_CONFIG,
    SQL_PLUGIN,
    TEMPORAL_SERVER_VERSION,
    TUNING,
    UI_SERVER_VERSION,
    dynamic_config_document,
    ui_server_config,
)
from tests.conftest import TEST_TEMPORAL

COMPOSE = Path(__file__).resolve().parent.parent / "docker-compose.temporal.yml"


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def test_compose_runs_the_server_version_we_build() -> None:
    services = _compose()["services"]
    version = TEMPORAL_SERVER_VERSION.removeprefix("v")
    for name in ("temporal", "temporal-schema", "temporal-setup"):
        assert services[name]["image"].endswith(f":-{version}}}"), name


def test_compose_dynamic_config_is_ours() -> None:
    content = _compose()["configs"]["temporal-dynamic-config"]["content"]
    assert yaml.safe_load(content) == dynamic_config_document(DYNAMIC_CONFIG)


def test_compose_server_has_our_shards_and_connection_pools() -> None:
    environment = _compose()["services"]["temporal"]["environment"]
    wanted = TUNING.server_image_environment()
    assert {name: environment.get(name) for name in wanted} == wanted


def test_compose_registers_every_search_attribute_as_keyword() -> None:
    script = _compose()["services"]["temporal-setup"]["command"][0].replace("\\\n", " ")
    words = script.split()
    registered = {
        words[i + 1]: words[i + 3]
        for i, word in enumerate(words)
        if word == "--name" and words[i + 2] == "--type"
    }
    assert registered == {key.name: "Keyword" for key in SEARCH_ATTRIBUTES}


def test_compose_schema_is_the_sql_plugin_we_use() -> None:
    services = _compose()["services"]
    assert services["temporal"]["environment"]["DB"] == SQL_PLUGIN
    assert (
        f"schema/postgresql/v{SQL_PLUGIN.removeprefix('postgres')}"
        in (services["temporal-schema"]["command"][0])
    )


def test_compose_web_ui_is_the_one_the_stack_runs() -> None:
    """Same UI version as `bin/stack --temporal cluster`'s ui-server, the same codec endpoint,
    with credentials (the gateway's codec session cookie) and no access token."""
    ui = _compose()["services"]["temporal-ui"]
    assert ui["image"].endswith(f":-{UI_SERVER_VERSION.removeprefix('v')}}}")
    endpoint = "http://localhost:8000/api/v1/admin/codec"
    stack = ui_server_config("127.0.0.1:7233", 8233, namespace="default", codec_endpoint=endpoint)
    environment = ui["environment"]
    assert environment["TEMPORAL_CODEC_ENDPOINT"].endswith(f":-{endpoint}}}")
    assert stack["codec"] == {
        "endpoint": endpoint,
        "includeCredentials": environment["TEMPORAL_CODEC_INCLUDE_CREDENTIALS"] == "true",
        "passAccessToken": environment["TEMPORAL_CODEC_PASS_ACCESS_TOKEN"] == "true",
    }
    assert stack["codec"]["includeCredentials"] is True
    assert stack["defaultNamespace"] == environment["TEMPORAL_DEFAULT_NAMESPACE"]


@workflow.defn(name="ClusterPersistenceProbe")
class ClusterPersistenceProbe:
    @workflow.run
    async def run(self) -> str:
        return "persisted"


@pytest.mark.skipif(TEST_TEMPORAL != "cluster", reason="the cluster tier (bin/test) runs it")
async def test_cluster_tier_persists_workflows_in_postgresql(
    temporal_client: Client, pg_cluster: PostgresCluster
) -> None:
    workflow_id = f"cluster-probe-{uuid.uuid4()}"
    queue = f"cluster-probe-{uuid.uuid4()}"
    # Unsandboxed: the sandbox would re-import this test module and what it imports.
    async with Worker(
        temporal_client,
        task_queue=queue,
        workflows=[ClusterPersistenceProbe],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        result = await temporal_client.execute_workflow(
            ClusterPersistenceProbe.run, id=workflow_id, task_queue=queue
        )
    assert result == "persisted"
    rows = pg_cluster.psql(
        f"SELECT count(*) FROM executions_visibility WHERE workflow_id = '{workflow_id}'",  # noqa: S608
        database="temporal_visibility",
    )
    assert rows.strip() == "1"
