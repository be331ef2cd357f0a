"""Reconciliation admin routes (docs/maas-nodes.md#drift-between-maas-and-the-platform) over the
node_maas_state read model, and running a site's reconciler on demand through its schedule."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import insert, select

from contracts.maas_reconciler import reconciler_schedule_id
from schema.models import AuditEntry, NodeMaasState
from tests.admin_operation_support import admin_operations_worker
from tests.factories import create_node, create_sku
from tests.lifecycle_support import eventually
from tests.test_maas_sites import create_site


@pytest.fixture
async def admin_worker(temporal_client: Any, settings: Any, db_engine: Any) -> AsyncIterator[None]:
    """The worker that resolves drift (AdminOperationWorkflow)."""
    async with admin_operations_worker(temporal_client, settings, db_engine):
        yield


@pytest.fixture
async def admin(
    api: Any, make_token: Any, settings: Any, vault_server: Any, admin_worker: None
) -> Any:
    vault = dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )
    return await api(token=await make_token("admin"), settings=vault)


async def test_status_drift_resolve_and_run(
    admin: Any, maas_sim: Any, db_sessions: Any, temporal_client: Any, api: Any, make_token: Any
) -> None:
    site = await create_site(admin, maas_sim.base_url)
    site_id = uuid.UUID(site["id"])
    await create_sku(db_sessions)
    nodes = [await create_node(db_sessions) for _ in range(3)]
    async with db_sessions() as session, session.begin():
        await session.execute(
            insert(NodeMaasState),
            [
                {"node_id": nodes[0].id, "site_id": site_id, "maas_system_id": "aaa111",
                 "last_maas_status": "Deployed", "last_reconciled_at": None},
                {"node_id": nodes[1].id, "site_id": site_id, "maas_system_id": "bbb222",
                 "last_maas_status": "Ready", "drift_detected": True,
                 "drift_rule": "released_outside_workflow",
                 "drift_details": {"maas_status": "Ready", "expected": "Deployed"}},
                {"node_id": nodes[2].id, "site_id": site_id, "maas_system_id": "ccc333"},
            ],
        )  # fmt: skip

    status = (await admin.get("/api/v1/admin/reconciliation/status")).json()
    assert status == {"nodes": 3, "ok": 2, "drifted": 1, "unreconciled": 3, "refused": []}
    drift = (await admin.get("/api/v1/admin/reconciliation/drift")).json()["items"]
    assert [(d["node_id"], d["rule"]) for d in drift] == [
        (str(nodes[1].id), "released_outside_workflow")
    ]

    url = f"/api/v1/admin/reconciliation/drift/{nodes[1].id}/resolve"
    resolved = await admin.post(url, json={"reason": "re-deployed by hand, INC-7"})
    assert resolved.status_code == 200, resolved.text
    again = await admin.post(url, json={"reason": "twice"})
    assert again.status_code == 409
    assert (await admin.get("/api/v1/admin/reconciliation/drift")).json()["items"] == []
    async with db_sessions() as session:
        audit = await session.scalar(
            select(AuditEntry).where(AuditEntry.action == "reconciliation.resolve_drift")
        )
    assert audit is not None
    assert audit.reason == "re-deployed by hand, INC-7"

    run = await admin.post("/api/v1/admin/reconciliation/run", json={"site_id": str(site_id)})
    assert run.status_code == 202, run.text
    handle = temporal_client.get_schedule_handle(reconciler_schedule_id(str(site_id)))

    async def ran() -> bool:
        return (await handle.describe()).info.num_actions >= 1

    await eventually(ran)
    await handle.delete()
    missing = await admin.post(
        "/api/v1/admin/reconciliation/run", json={"site_id": str(uuid.uuid4())}
    )
    assert missing.status_code == 404
    tenant = await api(token=await make_token("tenant"))
    assert (await tenant.get("/api/v1/admin/reconciliation/status")).status_code == 403
