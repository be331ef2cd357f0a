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
    dynamic_config_document,
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
