"""The gateway starts without PostgreSQL or Temporal and answers 503 with the right code, fast;
a failed request leaves nothing behind."""

from __future__ import annotations

import time
import uuid

import pytest

from contracts.states import AllocationStatus, NodeTaskStatus
from schema.models import Allocation, AuditEntry, NodeTask
from tests.gateway_fixtures import bearer, ed25519_public_key
from tests.test_gateway_auth import assert_error

PROMPT_SECONDS = 5.0


async def timed(call):
    started = time.monotonic()
    response = await call
    return response, time.monotonic() - started


async def test_temporal_down_answers_503_fast(
    api, unreachable_settings, make_project, make_token, make_ssh_key, count_rows, caplog
):
    project = await make_project()
    key = await make_ssh_key(project)
    client = await api(
        token=await make_token("tenant", project),
        settings=unreachable_settings(temporal=True),
        temporal_client=None,  # the app connects (lazily) to where nothing listens
    )
    assert (await client.get("/healthz")).status_code == 200

    body = {"sku": "h100.slice", "gpus": 1, "region": "test-region-1", "ssh_key_ids": [str(key.id)]}
    for headers in ({}, {"X-Idempotency-Key": "k-" + uuid.uuid4().hex}):
        response, seconds = await timed(
            client.post("/api/v1/allocations", json=body, headers=headers)
        )
        assert_error(response, 503, "temporal_unavailable")
        assert response.headers["retry-after"]
        assert seconds < PROMPT_SECONDS
    assert await count_rows(Allocation) == 0
    # The log says why, down the cause chain (the client never connected), for the operator.
    logged = [r.getMessage() for r in caplog.records if r.name == "gateway.errors"]
    assert any(
        "temporal_unavailable (TemporalUnavailable <- " in m and "RuntimeError" in m for m in logged
    ), logged

    ready, seconds = await timed(client.get("/readyz"))
    body = assert_error(ready, 503, "temporal_unavailable")
    assert body["error"]["details"]["checks"] == {"database": "ok", "temporal": "unavailable"}
    assert seconds < PROMPT_SECONDS

    # Reads of the read model still work without Temporal.
    assert (await client.get("/api/v1/allocations")).status_code == 200
    created = await client.post(
        "/api/v1/ssh-keys", json={"name": "k2", "public_key": ed25519_public_key()}
    )
    assert created.status_code == 201


async def test_temporal_down_release_and_force_release(
    api, unreachable_settings, make_project, make_token, make_allocation, count_rows
):
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.ACTIVE)
    settings = unreachable_settings(temporal=True)
    tenant = await api(
        token=await make_token("tenant", project), settings=settings, temporal_client=None
    )
    response, seconds = await timed(tenant.post(f"/api/v1/allocations/{allocation.id}/release"))
    assert_error(response, 503, "temporal_unavailable")
    assert seconds < PROMPT_SECONDS

    admin = await api(token=await make_token("admin"), settings=settings, temporal_client=None)
    response, seconds = await timed(
        admin.post(
            f"/api/v1/admin/allocations/{allocation.id}/force-release",
            json={"reason": "stuck node"},
        )
    )
    assert_error(response, 503, "temporal_unavailable")
    assert seconds < PROMPT_SECONDS
    assert await count_rows(AuditEntry) == 0  # nothing was done, so nothing is audited


async def test_timeline_without_temporal_still_answers_from_the_database(
    api, unreachable_settings, make_project, make_token, make_allocation, db_sessions
):
    project = await make_project()
    allocation = await make_allocation(project, status=AllocationStatus.PROVISIONING)
    async with db_sessions() as session, session.begin():
        session.add(
            NodeTask(
                id=uuid.uuid4(),
                node_id=allocation.node_id,
                allocation_id=allocation.id,
                kind="slice.vm_provision",
                status=NodeTaskStatus.DISPATCHED.value,
                workflow_id=allocation.workflow_id,
            )
        )
    client = await api(
        token=await make_token("tenant", project),
        settings=unreachable_settings(temporal=True),
        temporal_client=None,
    )
    response, seconds = await timed(client.get(f"/api/v1/allocations/{allocation.id}/timeline"))
    assert response.status_code == 200, response.text
    assert seconds < PROMPT_SECONDS
    body = response.json()
    assert body["warnings"] == ["live_phases_unavailable"]
    assert [i["name"] for i in body["items"]] == ["slice.vm_provision"]
    assert body["items"][0]["status"] == "running"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/ssh-keys"),
        ("POST", "/api/v1/allocations"),
        ("GET", "/api/v1/admin/projects"),
        ("POST", "/api/v1/admin/codec/decode"),
    ],
)
async def test_database_down_answers_503_fast(api, unreachable_settings, method, path):
    client = await api(settings=unreachable_settings(database=True))
    token = "gpc_" + "B" * 43  # well-formed, so the gateway has to ask the database
    response, seconds = await timed(client.request(method, path, json={}, headers=bearer(token)))
    assert_error(response, 503, "database_unavailable")
    assert seconds < PROMPT_SECONDS
    assert "postgresql" not in response.text.lower()


async def test_database_down_readiness(api, unreachable_settings):
    client = await api(settings=unreachable_settings(database=True))
    assert (await client.get("/healthz")).status_code == 200
    ready, seconds = await timed(client.get("/readyz"))
    body = assert_error(ready, 503, "database_unavailable")
    assert body["error"]["details"]["checks"] == {"database": "unavailable", "temporal": "ok"}
    assert seconds < PROMPT_SECONDS


async def test_both_down_the_gateway_still_starts(api, unreachable_settings):
    client = await api(
        settings=unreachable_settings(database=True, temporal=True), temporal_client=None
    )
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/schema/openapi.json")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["error"]["details"]["checks"] == {
        "database": "unavailable",
        "temporal": "unavailable",
    }


async def test_ready_when_everything_is_up(api):
    client = await api()
    ready = await client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "checks": {"database": "ok", "temporal": "ok"}}
