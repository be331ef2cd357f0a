"""MAAS onboarding admin API (docs/lifecycles/onboarding.md) over real PostgreSQL and Temporal, and
the site profile routes (§3.7) and onboarding policy knobs (§4.14).

Most tests only submit: the worker's submission operation (AdminOperationWorkflow, the only
workflow the test's worker knows) writes the rows and starts the workflow on the test's own task
queue, where nothing runs it, so the tests check the API, the rows and what Temporal was asked
to start, independent of onboarding behaviour. The operator-action mapping runs against a stand-in
workflow of the same name (the contract's update, validator and errors); the few end-to-end
tests at the bottom run the real MaasNodeOnboardWorkflow (the `onboarding` rig: MAAS and Vault
simulators, the control-plane worker, a simulated first boot).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import func, select, update
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from contracts.admin_operation import ONBOARDING_SUBMIT
from contracts.onboarding import (
    WORKFLOW_NAME,
    BatchInput,
    OnboardInput,
    OperatorAction,
    batch_workflow_id,
    onboarding_workflow_id,
)
from contracts.states import NodeStatus, SkuShape
from core import search_attributes
from schema.models import AuditEntry, Node, NodeOnboarding, NodeOnboardingEvent
from tests.admin_operation_support import admin_operations_worker, nth_run, record
from tests.factories import create_node, create_sku
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import ONBOARD_SKU, Job
from tests.test_gateway_auth import assert_error

REGION = "us-east-1"
SKU = "h100.8x.baremetal"
NIL = "00000000-0000-4000-8000-000000000000"
ONBOARDINGS = "/api/v1/admin/onboardings"
ACTIONS = {
    "retry": OperatorAction.RETRY_STAGE,
    "resume": OperatorAction.RESUME,
    "rerun": OperatorAction.RERUN,
    "restart-clean": OperatorAction.RESTART_CLEAN,
    "cancel": OperatorAction.CANCEL,
    "adopt": OperatorAction.ADOPT,
    "mark-manual-intervention": OperatorAction.MARK_MANUAL_INTERVENTION,
}


# --- helpers -----------------------------------------------------------------------------------


@pytest.fixture
async def admin(
    api: Any, make_token: Any, temporal_client: Any, settings: Any, db_engine: Any
) -> AsyncIterator[Any]:
    """An admin's client, and the worker part that runs submissions (the lifecycle workflows
    they start do not run: this worker knows only AdminOperationWorkflow)."""
    async with admin_operations_worker(temporal_client, settings, db_engine):
        yield await api(token=await make_token("admin"))


@pytest.fixture
async def sku(db_sessions: Any) -> str:
    await create_sku(db_sessions, SKU, shape=SkuShape.BAREMETAL, region=REGION, allowed=(8,))
    return SKU


async def make_site(admin: Any, **extra: Any) -> dict[str, Any]:
    body = {
        "name": f"dc-{uuid.uuid4().hex[:6]}",
        "region_code": REGION,
        "api_base_url": "http://127.0.0.1:9/MAAS",  # never called by these tests
        "pxe_iface": "ens19",
        "pxe_vlan_vid": 46,
        "node_pxe_iface": "eno8303",
        **extra,
    }
    response = await admin.post("/api/v1/admin/maas-sites", json=body)
    assert response.status_code == 201, response.text
    site: dict[str, Any] = response.json()
    return site


def single(site: dict[str, Any], hostname: str = "c07u43", **extra: Any) -> dict[str, Any]:
    return {
        "site_id": site["id"],
        "profile_id": site["default_profile_id"],
        "sku_id": SKU,
        "ipmi_ip": "10.176.16.128",
        "hostname": hostname,
        **extra,
    }


def batch(site: dict[str, Any], nodes: list[tuple[str, str]], **extra: Any) -> dict[str, Any]:
    return {
        "site_id": site["id"],
        "profile_id": site["default_profile_id"],
        "sku_id": SKU,
        "nodes": [{"hostname": h, "ipmi_ip": ip} for h, ip in nodes],
        **extra,
    }


def field_errors(response: Any) -> dict[str, str]:
    """{key: code} of a 422's field errors."""
    errors = response.json()["error"]["details"]["errors"]
    for error in errors:
        assert set(error) == {"key", "source", "code", "message"}, error
    return {e["key"]: e["code"] for e in errors}


async def rows(db_sessions: Any, **where: Any) -> list[NodeOnboarding]:
    async with db_sessions() as session:
        found = await session.scalars(
            select(NodeOnboarding).filter_by(**where).order_by(NodeOnboarding.hostname)
        )
        return list(found)


async def audits(db_sessions: Any, action: str) -> list[AuditEntry]:
    async with db_sessions() as session:
        found = await session.scalars(
            select(AuditEntry).where(AuditEntry.action == action).order_by(AuditEntry.id)
        )
        return list(found)


async def set_status(db_sessions: Any, onboarding_id: str, status: str) -> None:
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(NodeOnboarding)
            .where(NodeOnboarding.onboarding_id == uuid.UUID(onboarding_id))
            .values(status=status)
        )


# --- auth ----------------------------------------------------------------------------------------

ROUTES = [
    ("POST", ONBOARDINGS),
    ("POST", f"{ONBOARDINGS}/batch"),
    ("GET", ONBOARDINGS),
    ("GET", f"{ONBOARDINGS}/{NIL}"),
    *[("POST", f"{ONBOARDINGS}/{NIL}/{action}") for action in ACTIONS],
    ("POST", f"/api/v1/admin/maas-sites/{NIL}/profiles"),
    ("GET", f"/api/v1/admin/maas-sites/{NIL}/profiles"),
    ("GET", f"/api/v1/admin/maas-sites/{NIL}/profiles/{NIL}"),
    ("PATCH", f"/api/v1/admin/maas-sites/{NIL}/profiles/{NIL}"),
    ("DELETE", f"/api/v1/admin/maas-sites/{NIL}/profiles/{NIL}"),
]


async def test_admin_only(api: Any, make_token: Any) -> None:
    anonymous = await api()
    tenant = await api(token=await make_token("tenant"))
    for method, path in ROUTES:
        assert_error(await anonymous.request(method, path, json={}), 401, "unauthenticated")
        assert_error(await tenant.request(method, path, json={}), 403, "forbidden")


# --- submit one node -----------------------------------------------------------------------------


async def test_create_starts_the_workflow_and_writes_the_row(
    admin: Any, sku: str, db_sessions: Any, temporal_client: Any, settings: Any
) -> None:
    site = await make_site(admin)
    response = await admin.post(ONBOARDINGS, json=single(site))
    assert response.status_code == 201, response.text
    body = response.json()
    assert set(body) == {"onboarding_id", "status", "node_id"}
    assert body["status"] == "pending"
    assert "idempotent-replayed" not in response.headers

    (row,) = await rows(db_sessions)
    assert str(row.onboarding_id) == body["onboarding_id"]
    assert str(row.node_id) == body["node_id"]
    assert (row.status, row.current_stage, row.current_attempt) == (
        "pending",
        "load_site_config",
        0,
    )
    assert (str(row.site_id), str(row.profile_id), row.sku_id) == (
        site["id"],
        site["default_profile_id"],
        SKU,
    )
    assert (row.hostname, str(row.ipmi_ip), row.batch_id) == ("c07u43", "10.176.16.128", None)
    assert row.workflow_id == onboarding_workflow_id(body["onboarding_id"])
    assert row.requested_by
    assert row.requested_by.startswith("admin-")

    # Temporal was asked for exactly this: the workflow, its input, its search attributes.
    handle = temporal_client.get_workflow_handle(row.workflow_id)
    described = await handle.describe()
    assert described.workflow_type == WORKFLOW_NAME
    assert described.status == WorkflowExecutionStatus.RUNNING
    assert described.task_queue == settings.control_plane_task_queue
    attributes = described.typed_search_attributes
    assert attributes.get(search_attributes.SITE_ID) == site["id"]
    assert attributes.get(search_attributes.HOSTNAME) == "c07u43"
    assert attributes.get(search_attributes.LIFECYCLE_STATUS) == "pending"
    assert attributes.get(search_attributes.CURRENT_STAGE) == "load_site_config"
    assert attributes.get(search_attributes.NODE_ID) == body["node_id"]
    (job,) = await started_input(temporal_client, row.workflow_id, OnboardInput)
    assert job == OnboardInput(
        onboarding_id=body["onboarding_id"],
        site_id=site["id"],
        profile_id=site["default_profile_id"],
        sku_id=SKU,
        hostname="c07u43",
        ipmi_ip="10.176.16.128",
        node_id=body["node_id"],
        requested_by=row.requested_by,
    )

    (entry,) = await audits(db_sessions, "onboarding.create")
    assert entry.target_id == body["onboarding_id"]
    assert entry.workflow_ids == [row.workflow_id]
    assert entry.details["hostname"] == "c07u43"

    # The read model, as the workflow will keep it.
    detail = await admin.get(f"{ONBOARDINGS}/{body['onboarding_id']}")
    assert detail.status_code == 200, detail.text
    shown = detail.json()
    assert shown["status"] == "pending"
    assert shown["events"] == []
    for field in (
        "failure_class",
        "error_code",
        "error_message",
        "error_details",
        "recommended_action",
        "last_maas_status",
        "last_maas_power_state",
        "last_maas_ips",
        "node_id",
        "maas_system_id",
        "current_stage",
        "current_attempt",
        "deploy_attempts",
        "cloud_init_version",
        "requested_at",
        "started_at",
        "completed_at",
        "updated_at",
    ):
        assert field in shown, field
    assert_error(await admin.get(f"{ONBOARDINGS}/{NIL}"), 404, "not_found")

    # IPv6 BMCs are fine too, in canonical form.
    other = await admin.post(ONBOARDINGS, json=single(site, "c07u44", ipmi_ip="2001:DB8:0:0::10"))
    assert other.status_code == 201, other.text
    assert str((await rows(db_sessions, hostname="c07u44"))[0].ipmi_ip) == "2001:db8::10"


async def started_input(client: Any, workflow_id: str, kind: type) -> list[Any]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    payloads = history.events[0].workflow_execution_started_event_attributes.input.payloads
    decoded: list[Any] = await client.data_converter.decode(payloads, [kind])
    return decoded


async def test_detail_shows_the_newest_fifty_events(admin: Any, sku: str, db_sessions: Any) -> None:
    site = await make_site(admin)
    created = (await admin.post(ONBOARDINGS, json=single(site))).json()
    onboarding_id = uuid.UUID(created["onboarding_id"])
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(NodeOnboarding)
            .where(NodeOnboarding.onboarding_id == onboarding_id)
            .values(
                status="failed_retryable",
                current_stage="wait_for_ready",
                current_attempt=2,
                failure_class="upstream_transient",
                error_code="maas_timeout",
                error_message="MAAS did not answer",
                error_details={"system_id": "abc123"},
                recommended_action="retry",
                last_maas_status="Commissioning",
                last_maas_power_state="on",
                last_maas_ips=["10.176.46.20"],
                maas_system_id="abc123",
            )
        )
        for n in range(55):
            session.add(
                NodeOnboardingEvent(
                    id=uuid.uuid4(),
                    onboarding_id=onboarding_id,
                    stage="wait_for_ready",
                    attempt=1,
                    status="started" if n % 2 else "failed",
                    message=f"event {n}",
                    details={"n": n},
                    occurred_at=start + dt.timedelta(seconds=n),
                )
            )
    shown = (await admin.get(f"{ONBOARDINGS}/{onboarding_id}")).json()
    assert [e["message"] for e in shown["events"]] == [f"event {n}" for n in range(54, 4, -1)]
    assert shown["events"][0]["details"] == {"n": 54}
    assert (shown["status"], shown["current_stage"], shown["current_attempt"]) == (
        "failed_retryable",
        "wait_for_ready",
        2,
    )
    assert shown["failure_class"] == "upstream_transient"
    assert shown["recommended_action"] == "retry"
    assert shown["error_details"] == {"system_id": "abc123"}
    assert shown["last_maas_ips"] == ["10.176.46.20"]
    assert shown["maas_system_id"] == "abc123"


async def test_input_errors_are_422_field_errors(
    admin: Any, sku: str, db_sessions: Any, make_token: Any
) -> None:
    site = await make_site(admin)
    other_site = await make_site(admin)

    for hostname in ("C07U43", "c07_u43", "-c07", "c07-", "a" * 64, "c07.u43", ""):
        response = await admin.post(ONBOARDINGS, json=single(site, hostname))
        assert_error(response, 422, "invalid_hostname")
        assert field_errors(response) == {"hostname": "invalid_hostname"}
    for ip in ("999.1.1.1", "10.0.0.1/24", "bmc-7", "010.0.0.1", "0.0.0.0", "fe80::1%eth0", ""):  # noqa: S104
        response = await admin.post(ONBOARDINGS, json=single(site, ipmi_ip=ip))
        assert_error(response, 422, "invalid_ipmi_ip")
        assert field_errors(response) == {"ipmi_ip": "invalid_ipmi_ip"}

    unknown_site = await admin.post(ONBOARDINGS, json=single(site, site_id=str(uuid.uuid4())))
    assert_error(unknown_site, 422, "unknown_site")
    assert field_errors(unknown_site) == {"site_id": "unknown_site"}
    foreign_profile = await admin.post(
        ONBOARDINGS, json=single(site, profile_id=other_site["default_profile_id"])
    )
    assert_error(foreign_profile, 422, "unknown_profile")
    unknown_profile = await admin.post(ONBOARDINGS, json=single(site, profile_id=NIL))
    assert field_errors(unknown_profile) == {"profile_id": "unknown_profile"}
    unknown_sku = await admin.post(ONBOARDINGS, json=single(site, sku_id="mi300x.192g.8gpu"))
    assert_error(unknown_sku, 422, "unknown_sku")
    elsewhere = await make_site(admin, region_code="eu-west-1")  # the SKU is in us-east-1 only
    assert_error(await admin.post(ONBOARDINGS, json=single(elsewhere)), 422, "unknown_sku")

    several = await admin.post(
        ONBOARDINGS, json=single(site, "Bad_Name", ipmi_ip="nope", sku_id="nope")
    )
    assert_error(several, 422, "validation_failed")
    assert field_errors(several) == {
        "hostname": "invalid_hostname",
        "ipmi_ip": "invalid_ipmi_ip",
        "sku_id": "unknown_sku",
    }

    disabled = await admin.delete(f"/api/v1/admin/maas-sites/{site['id']}")
    assert disabled.json()["status"] == "disabled"
    response = await admin.post(ONBOARDINGS, json=single(site))
    assert_error(response, 422, "site_disabled")
    assert field_errors(response) == {"site_id": "site_disabled"}

    # Malformed bodies stay 400, like every other route.
    assert_error(await admin.post(ONBOARDINGS, json={"hostname": "x"}), 400, "invalid_request")
    assert_error(
        await admin.post(ONBOARDINGS, json={**single(other_site), "pxe_mac": "aa"}),
        400,
        "invalid_request",
    )
    assert await rows(db_sessions) == []


async def test_live_duplicates_are_409(
    admin: Any, sku: str, db_sessions: Any, temporal_client: Any, settings: Any
) -> None:
    site = await make_site(admin)
    first = (await admin.post(ONBOARDINGS, json=single(site))).json()
    again = await admin.post(ONBOARDINGS, json=single(site, ipmi_ip="10.176.16.200"))
    body = assert_error(again, 409, "onboarding_in_progress")
    await record(await nth_run(temporal_client, settings, ONBOARDING_SUBMIT, 0), "submit_single")
    await record(
        await nth_run(temporal_client, settings, ONBOARDING_SUBMIT, 1), "submit_hostname_in_use"
    )
    assert body["error"]["details"]["onboarding_id"] == first["onboarding_id"]
    assert first["onboarding_id"] in body["error"]["message"]

    # Every live state blocks; a settled one does not.
    for status in ("running", "compensating", "failed_retryable", "failed_manual_intervention"):
        await set_status(db_sessions, first["onboarding_id"], status)
        assert_error(
            await admin.post(ONBOARDINGS, json=single(site)), 409, "onboarding_in_progress"
        )
    await set_status(db_sessions, first["onboarding_id"], "cancelled")
    retried = await admin.post(ONBOARDINGS, json=single(site))
    assert retried.status_code == 201, retried.text

    # Another site may onboard the same hostname (until a node has it).
    other_site = await make_site(admin)
    assert (await admin.post(ONBOARDINGS, json=single(other_site))).status_code == 201

    node = await create_node(db_sessions, hostname="c07u50", sku=SKU, region=REGION)
    exists = await admin.post(ONBOARDINGS, json=single(site, "c07u50"))
    body = assert_error(exists, 409, "node_exists")
    assert body["error"]["details"]["node_id"] == str(node.id)
    async with db_sessions() as session, session.begin():
        await session.execute(
            update(Node).where(Node.id == node.id).values(status=NodeStatus.DELETED.value)
        )
    assert (await admin.post(ONBOARDINGS, json=single(site, "c07u50"))).status_code == 201


async def test_idempotent_create(admin: Any, sku: str, db_sessions: Any) -> None:
    site = await make_site(admin)
    key = {"X-Idempotency-Key": f"onb-{uuid.uuid4().hex}"}
    first = await admin.post(ONBOARDINGS, json=single(site), headers=key)
    assert first.status_code == 201, first.text
    second = await admin.post(ONBOARDINGS, json=single(site), headers=key)
    assert second.status_code == 201
    assert second.json() == first.json()
    assert second.headers["idempotent-replayed"] == "true"
    (row,) = await rows(db_sessions)
    assert row.idempotency_key == key["X-Idempotency-Key"]

    # Still the same answer once the job has moved on.
    await set_status(db_sessions, first.json()["onboarding_id"], "running")
    assert (await admin.post(ONBOARDINGS, json=single(site), headers=key)).json() == first.json()

    reused = await admin.post(ONBOARDINGS, json=single(site, "c07u44"), headers=key)
    assert_error(reused, 422, "idempotency_key_reused")
    as_batch = await admin.post(
        f"{ONBOARDINGS}/batch", json=batch(site, [("c07u43", "10.176.16.128")]), headers=key
    )
    assert_error(as_batch, 422, "idempotency_key_reused")

    batch_key = {"X-Idempotency-Key": f"batch-{uuid.uuid4().hex}"}
    nodes = [("c08u01", "10.176.17.1"), ("c08u02", "10.176.17.2")]
    b1 = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, nodes), headers=batch_key)
    assert b1.status_code == 201, b1.text
    b2 = await admin.post(
        f"{ONBOARDINGS}/batch", json=batch(site, list(reversed(nodes))), headers=batch_key
    )
    assert b2.status_code == 201
    assert b2.headers["idempotent-replayed"] == "true"
    assert b2.json()["batch_id"] == b1.json()["batch_id"]
    assert {o["onboarding_id"] for o in b2.json()["onboardings"]} == {
        o["onboarding_id"] for o in b1.json()["onboardings"]
    }
    fewer = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, nodes[:1]), headers=batch_key)
    assert_error(fewer, 422, "idempotency_key_reused")
    assert len(await rows(db_sessions)) == 3

    assert_error(
        await admin.post(ONBOARDINGS, json=single(site, "x1"), headers={"X-Idempotency-Key": ""}),
        400,
        "invalid_request",
    )


# --- batches -------------------------------------------------------------------------------------


async def test_batch_inserts_rows_and_starts_the_batch_workflow(
    admin: Any, sku: str, db_sessions: Any, temporal_client: Any, settings: Any
) -> None:
    site = await make_site(admin, policy={"batch_max_parallel": 3})
    nodes = [("c07u43", "10.176.16.128"), ("c07u44", "10.176.16.129"), ("c07u45", "10.176.16.130")]
    response = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, nodes))
    assert response.status_code == 201, response.text
    body = response.json()
    await record(await nth_run(temporal_client, settings, ONBOARDING_SUBMIT, 0), "submit_batch")
    assert [o["hostname"] for o in body["onboardings"]] == ["c07u43", "c07u44", "c07u45"]

    stored = await rows(db_sessions, batch_id=uuid.UUID(body["batch_id"]))
    assert [(r.hostname, str(r.ipmi_ip), r.status) for r in stored] == [
        (h, ip, "pending") for h, ip in nodes
    ]
    by_host = {o["hostname"]: o for o in body["onboardings"]}
    for row in stored:
        assert str(row.onboarding_id) == by_host[row.hostname]["onboarding_id"]
        assert str(row.node_id) == by_host[row.hostname]["node_id"]
        assert row.workflow_id == onboarding_workflow_id(str(row.onboarding_id))

    workflow_id = batch_workflow_id(body["batch_id"])
    described = await temporal_client.get_workflow_handle(workflow_id).describe()
    assert described.workflow_type == "MaasNodeBatchOnboardWorkflow"
    assert described.task_queue == settings.control_plane_task_queue
    attributes = described.typed_search_attributes
    assert attributes.get(search_attributes.SITE_ID) == site["id"]
    assert attributes.get(search_attributes.BATCH_ID) == body["batch_id"]
    assert attributes.get(search_attributes.LIFECYCLE_STATUS) == "running"
    (job,) = await started_input(temporal_client, workflow_id, BatchInput)
    assert job.max_parallel == 3
    assert (job.batch_id, job.site_id, job.sku_id) == (body["batch_id"], site["id"], SKU)
    assert [(n.hostname, n.ipmi_ip, n.onboarding_id, n.node_id) for n in job.nodes] == [
        (o["hostname"], ip, o["onboarding_id"], o["node_id"])
        for o, (_, ip) in zip(body["onboardings"], nodes, strict=True)
    ]
    # The children are the batch workflow's to start, not the gateway's.
    for row in stored:
        with pytest.raises(RPCError) as missing:
            await temporal_client.get_workflow_handle(row.workflow_id).describe()
        assert missing.value.status == RPCStatusCode.NOT_FOUND

    (entry,) = await audits(db_sessions, "onboarding.batch_create")
    assert entry.target_id == body["batch_id"]
    assert entry.details["hostnames"] == ["c07u43", "c07u44", "c07u45"]


async def test_batch_input_errors_name_the_node(admin: Any, sku: str, db_sessions: Any) -> None:
    site = await make_site(admin)
    path = f"{ONBOARDINGS}/batch"

    empty = await admin.post(path, json=batch(site, []))
    assert_error(empty, 422, "empty_batch")
    assert field_errors(empty) == {"nodes": "empty_batch"}

    too_many = [(f"n{i}", f"10.1.{i // 250}.{i % 250 + 1}") for i in range(501)]
    assert_error(await admin.post(path, json=batch(site, too_many)), 422, "batch_too_large")

    duplicate_host = await admin.post(
        path, json=batch(site, [("c1", "10.0.0.1"), ("c2", "10.0.0.2"), ("c1", "10.0.0.3")])
    )
    assert_error(duplicate_host, 422, "duplicate_hostname")
    assert field_errors(duplicate_host) == {"nodes[2].hostname": "duplicate_hostname"}

    duplicate_ip = await admin.post(
        path, json=batch(site, [("c1", "2001:db8::1"), ("c2", "2001:DB8:0::1")])
    )
    assert_error(duplicate_ip, 422, "duplicate_ipmi_ip")
    assert field_errors(duplicate_ip) == {"nodes[1].ipmi_ip": "duplicate_ipmi_ip"}

    mixed = await admin.post(
        path,
        json=batch(
            site,
            [("c1", "10.0.0.1"), ("C2", "10.0.0.2"), ("c3", "10.0.0.300"), ("c4", "10.0.0.4")],
            sku_id="nope",
        ),
    )
    assert_error(mixed, 422, "validation_failed")
    assert field_errors(mixed) == {
        "nodes[1].hostname": "invalid_hostname",
        "nodes[2].ipmi_ip": "invalid_ipmi_ip",
        "sku_id": "unknown_sku",
    }
    assert await rows(db_sessions) == []


async def test_batch_with_a_live_hostname_inserts_nothing(
    admin: Any, sku: str, db_sessions: Any
) -> None:
    site = await make_site(admin)
    live = (await admin.post(ONBOARDINGS, json=single(site, "c07u44"))).json()
    await create_node(db_sessions, hostname="c07u45", sku=SKU, region=REGION)
    nodes = [("c07u43", "10.176.16.128"), ("c07u44", "10.176.16.129"), ("c07u45", "10.176.16.130")]
    response = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, nodes))
    body = assert_error(response, 409, "batch_conflict")
    assert body["error"]["details"]["hostnames"] == ["c07u44", "c07u45"]
    assert body["error"]["details"]["conflicts"][0] == {
        "hostname": "c07u44",
        "code": "onboarding_in_progress",
        "onboarding_id": live["onboarding_id"],
    }
    assert body["error"]["details"]["conflicts"][1]["code"] == "node_exists"
    assert [r.hostname for r in await rows(db_sessions)] == ["c07u44"]

    only_live = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, nodes[:2]))
    assert_error(only_live, 409, "onboarding_in_progress")


# --- Temporal down -------------------------------------------------------------------------------


async def test_temporal_down_is_503_and_leaves_nothing(
    api: Any, make_token: Any, unreachable_settings: Any, admin: Any, sku: str, db_sessions: Any
) -> None:
    site = await make_site(admin)
    down = await api(
        token=await make_token("admin"),
        settings=unreachable_settings(temporal=True),
        temporal_client=None,
    )
    for headers in ({}, {"X-Idempotency-Key": f"k-{uuid.uuid4().hex}"}):
        response = await down.post(ONBOARDINGS, json=single(site), headers=headers)
        assert_error(response, 503, "temporal_unavailable")
        assert response.headers["retry-after"]
        response = await down.post(
            f"{ONBOARDINGS}/batch",
            json=batch(site, [("c1", "10.0.0.1"), ("c2", "10.0.0.2")]),
            headers=headers,
        )
        assert_error(response, 503, "temporal_unavailable")
    assert await rows(db_sessions) == []
    assert await audits(db_sessions, "onboarding.create") == []
    assert await audits(db_sessions, "onboarding.batch_create") == []

    # Reads need no Temporal; a retry once Temporal is back goes through.
    assert (await down.get(ONBOARDINGS)).status_code == 200
    assert (await admin.post(ONBOARDINGS, json=single(site))).status_code == 201


# --- lists ---------------------------------------------------------------------------------------


async def test_list_filters_pages_and_batch_summary(admin: Any, sku: str, db_sessions: Any) -> None:
    site, other_site = await make_site(admin), await make_site(admin)
    made = await admin.post(
        f"{ONBOARDINGS}/batch",
        json=batch(site, [(f"b{i}", f"10.0.1.{i}") for i in range(1, 6)]),
    )
    batch_id = made.json()["batch_id"]
    ids = {o["hostname"]: o["onboarding_id"] for o in made.json()["onboardings"]}
    await set_status(db_sessions, ids["b1"], "completed")
    await set_status(db_sessions, ids["b2"], "failed_manual_intervention")
    await set_status(db_sessions, ids["b3"], "running")
    lone = (await admin.post(ONBOARDINGS, json=single(other_site, "solo"))).json()

    everything = (await admin.get(ONBOARDINGS)).json()
    assert len(everything["items"]) == 6
    assert everything["summary"] is None
    assert everything["items"][0]["onboarding_id"] == lone["onboarding_id"]  # newest first

    in_batch = (await admin.get(ONBOARDINGS, params={"batch_id": batch_id})).json()
    assert sorted(i["hostname"] for i in in_batch["items"]) == ["b1", "b2", "b3", "b4", "b5"]
    assert in_batch["total"] == 5
    assert in_batch["summary"] == {
        "pending": 2,
        "running": 1,
        "completed": 1,
        "failed_retryable": 0,
        "failed_manual_intervention": 1,
        "cancelled": 0,
        "compensating": 0,
        "reconciled": 0,
    }

    failed = (await admin.get(ONBOARDINGS, params={"status": "failed_manual_intervention"})).json()
    assert [i["hostname"] for i in failed["items"]] == ["b2"]
    by_site = (await admin.get(ONBOARDINGS, params={"site_id": other_site["id"]})).json()
    assert [i["hostname"] for i in by_site["items"]] == ["solo"]
    by_host = (await admin.get(ONBOARDINGS, params={"hostname": "b4"})).json()
    assert [i["onboarding_id"] for i in by_host["items"]] == [ids["b4"]]
    both = await admin.get(ONBOARDINGS, params={"batch_id": batch_id, "status": "pending"})
    assert sorted(i["hostname"] for i in both.json()["items"]) == ["b4", "b5"]

    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await admin.get(ONBOARDINGS, params=params)).json()
        seen += [i["onboarding_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [i["onboarding_id"] for i in everything["items"]]

    bad = await admin.get(ONBOARDINGS, params={"status": "failed"})
    assert_error(bad, 422, "unknown_status")
    assert field_errors(bad) == {"status": "unknown_status"}
    assert_error(await admin.get(ONBOARDINGS, params={"cursor": "zzz"}), 400, "invalid_request")
    assert_error(await admin.get(ONBOARDINGS, params={"batch_id": "x"}), 400, "invalid_request")


# --- site profiles and policy knobs --------------------------------------------------------------


async def test_site_profiles(admin: Any, db_sessions: Any) -> None:
    site = await make_site(admin, distro_series="ubuntu/jammy")
    base = f"/api/v1/admin/maas-sites/{site['id']}/profiles"
    assert site["profile_ids"] == [site["default_profile_id"]]
    (default,) = (await admin.get(base)).json()["items"]
    assert default["name"] == "default"
    assert (default["distro_series"], default["architecture"]) == (None, None)
    assert (default["status"], default["is_default"]) == ("active", True)
    effective = default["effective"]
    assert {k: effective[k] for k in ("distro_series", "architecture", "node_pxe_iface")} == {
        "distro_series": "ubuntu/jammy",
        "architecture": "amd64/generic",
        "node_pxe_iface": "eno8303",
    }
    assert effective["enable_phase2_roce"] is True

    created = await admin.post(
        base,
        json={
            "name": "gpu-noble",
            "distro_series": "ubuntu/noble",
            "enable_phase2_roce": False,
            "reason": "new image",
        },
    )
    assert created.status_code == 201, created.text
    profile = created.json()
    assert profile["effective"]["distro_series"] == "ubuntu/noble"
    assert profile["effective"]["enable_phase2_roce"] is False
    assert profile["effective"]["architecture"] == "amd64/generic"
    assert_error(await admin.post(base, json={"name": "gpu-noble"}), 409, "profile_exists")
    assert_error(await admin.post(base, json={"name": "default"}), 409, "profile_exists")

    listed = (await admin.get(base)).json()["items"]
    assert [p["name"] for p in listed] == ["default", "gpu-noble"]
    fetched = (await admin.get(f"/api/v1/admin/maas-sites/{site['id']}")).json()
    assert set(fetched["profile_ids"]) == {site["default_profile_id"], profile["id"]}
    assert fetched["default_profile_id"] == site["default_profile_id"]

    patched = await admin.patch(
        f"{base}/{profile['id']}",
        json={"distro_series": None, "architecture": "arm64/generic", "reason": "arm racks"},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["distro_series"] is None
    assert patched.json()["effective"]["distro_series"] == "ubuntu/jammy"
    assert patched.json()["architecture"] == "arm64/generic"
    assert patched.json()["enable_phase2_roce"] is False  # absent: unchanged
    renamed = await admin.patch(f"{base}/{profile['id']}", json={"name": "arm"})
    assert renamed.json()["name"] == "arm"
    assert_error(
        await admin.patch(f"{base}/{site['default_profile_id']}", json={"name": "main"}),
        409,
        "default_profile_rename",
    )
    assert_error(
        await admin.patch(f"{base}/{profile['id']}", json={"bogus": 1}), 400, "invalid_request"
    )

    other = await make_site(admin)
    assert_error(await admin.get(f"{base}/{other['default_profile_id']}"), 404, "not_found")
    assert_error(await admin.get(f"/api/v1/admin/maas-sites/{NIL}/profiles"), 404, "not_found")

    async with db_sessions() as session:
        actions = list(
            await session.scalars(
                select(AuditEntry.action)
                .where(AuditEntry.target_id == profile["id"])
                .order_by(AuditEntry.id)
            )
        )
    assert actions == [
        "maas_site.profile_create",
        "maas_site.profile_update",
        "maas_site.profile_update",
    ]


async def test_profile_policy_knobs_default_and_disable(admin: Any, db_sessions: Any) -> None:
    """docs/maas-sites.md#site-profiles: every knob a run uses per profile (null: the site's value),
    a description and status, the site's default profile; a disabled profile starts nothing."""
    site = await make_site(admin, policy={"max_deploy_retry_attempts": 2})
    base = f"/api/v1/admin/maas-sites/{site['id']}/profiles"
    created = await admin.post(
        base,
        json={
            "name": "strict-recovery",
            "description": "reimage and recovery: no redeploy, no erase fallback",
            "enable_deploy_retry_on_datasource_failure": False,
            "max_deploy_retry_attempts": 0,
            "release_fallback_no_erase": False,
            "pxe_vlan_vid": 47,
            "deploy_timeout_seconds": 600,
        },
    )
    assert created.status_code == 201, created.text
    profile = created.json()
    assert profile["description"].startswith("reimage and recovery")
    assert (profile["status"], profile["is_default"]) == ("active", False)
    assert profile["max_deploy_retry_attempts"] == 0
    assert profile["strict_pxe_preflight"] is None  # not overridden
    effective = profile["effective"]
    assert effective["max_deploy_retry_attempts"] == 0
    assert effective["enable_deploy_retry_on_datasource_failure"] is False
    assert effective["release_fallback_no_erase"] is False
    assert effective["hardware_sync_interval"] == "15m"  # site-only: always the site's
    assert "hardware_sync_interval" not in profile  # no override a profile could hold
    assert (effective["pxe_vlan_vid"], effective["deploy_timeout_seconds"]) == (47, 600)
    assert effective["strict_pxe_preflight"] is True  # the site's
    default = (await admin.get(f"{base}/{site['default_profile_id']}")).json()
    assert default["effective"]["max_deploy_retry_attempts"] == 2  # the site policy's
    bad = await admin.post(base, json={"name": "x", "max_deploy_retry_attempts": 11})
    assert_error(bad, 400, "invalid_request")

    # hardware_sync_interval is site-only (MAAS has one global value): a profile setting it is
    # 422 site_only_setting and nothing is written; `null` (no override) is accepted.
    refused = await admin.post(base, json={"name": "fast-sync", "hardware_sync_interval": "5m"})
    assert_error(refused, 422, "site_only_setting")
    assert field_errors(refused) == {"hardware_sync_interval": "site_only_setting"}
    names = [p["name"] for p in (await admin.get(base)).json()["items"]]
    assert "fast-sync" not in names
    patched = await admin.patch(
        f"{base}/{profile['id']}",
        json={"hardware_sync_interval": "5m", "max_deploy_retry_attempts": 3},
    )
    assert_error(patched, 422, "site_only_setting")
    unchanged = (await admin.get(f"{base}/{profile['id']}")).json()
    assert unchanged["max_deploy_retry_attempts"] == 0
    assert unchanged["effective"]["hardware_sync_interval"] == "15m"
    kept = await admin.patch(f"{base}/{profile['id']}", json={"hardware_sync_interval": None})
    assert kept.status_code == 200, kept.text

    # Clearing an override falls back to the site.
    cleared = await admin.patch(f"{base}/{profile['id']}", json={"max_deploy_retry_attempts": None})
    assert cleared.json()["effective"]["max_deploy_retry_attempts"] == 2

    # The default cannot be disabled; another active profile can become the default.
    assert_error(
        await admin.delete(f"{base}/{site['default_profile_id']}"), 409, "default_profile_disable"
    )
    site_url = f"/api/v1/admin/maas-sites/{site['id']}"
    moved = await admin.patch(site_url, json={"default_profile_id": profile["id"]})
    assert moved.status_code == 200, moved.text
    assert moved.json()["default_profile_id"] == profile["id"]
    assert (await admin.get(f"{base}/{profile['id']}")).json()["is_default"] is True
    old_default = await admin.delete(f"{base}/{site['default_profile_id']}")
    assert old_default.status_code == 200, old_default.text
    assert old_default.json()["status"] == "disabled"
    assert_error(
        await admin.patch(site_url, json={"default_profile_id": site["default_profile_id"]}),
        422,
        "profile_disabled",
    )
    other = await make_site(admin)
    assert_error(
        await admin.patch(site_url, json={"default_profile_id": other["default_profile_id"]}),
        422,
        "unknown_profile",
    )

    async with db_sessions() as session:
        audited = list(
            await session.execute(
                select(AuditEntry.action, AuditEntry.prior_state, AuditEntry.expected_state)
                .where(AuditEntry.target_id == site["default_profile_id"])
                .order_by(AuditEntry.id)
            )
        )
    assert [tuple(row) for row in audited] == [("maas_site.profile_disable", "active", "disabled")]


async def test_disabled_or_foreign_profile_starts_no_onboarding(
    admin: Any, sku: str, db_sessions: Any
) -> None:
    site = await make_site(admin)
    other = await make_site(admin)
    base = f"/api/v1/admin/maas-sites/{site['id']}/profiles"
    spare = (await admin.post(base, json={"name": "spare"})).json()
    assert (await admin.delete(f"{base}/{spare['id']}")).status_code == 200

    disabled = await admin.post(ONBOARDINGS, json=single(site, profile_id=spare["id"]))
    assert_error(disabled, 422, "profile_disabled")
    assert field_errors(disabled) == {"profile_id": "profile_disabled"}
    foreign = await admin.post(
        f"{ONBOARDINGS}/batch",
        json=batch(site, [("b1", "10.176.16.1")], profile_id=other["default_profile_id"]),
    )
    assert_error(foreign, 422, "unknown_profile")
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(NodeOnboarding)) == 0


async def test_policy_onboarding_knobs(admin: Any, db_sessions: Any) -> None:
    site = await make_site(
        admin, policy={"maas_poll_interval_ms": 250, "deploy_timeout_seconds": 120}
    )
    policy = site["policy"]
    assert policy["maas_poll_interval_ms"] == 250
    assert policy["deploy_timeout_seconds"] == 120
    assert policy["discovery_timeout_seconds"] == 900
    assert policy["commission_timeout_seconds"] == 3600
    assert policy["hw_sync_seed_timeout_seconds"] == 900
    assert policy["hw_sync_health_timeout_seconds"] == 1800
    assert policy["enrollment_timeout_seconds"] == 1800
    assert (policy["roce_failures_stop_job"], policy["reconcile_max_missing_share"]) == (False, 0.1)

    path = f"/api/v1/admin/maas-sites/{site['id']}"
    patched = await admin.patch(
        path,
        json={"policy": {"enrollment_timeout_seconds": 600, "maas_poll_interval_ms": 10,
                         "roce_failures_stop_job": True, "reconcile_max_missing_share": 0.25}},
    )  # fmt: skip
    assert patched.status_code == 200, patched.text
    assert patched.json()["policy"]["enrollment_timeout_seconds"] == 600
    assert patched.json()["policy"]["maas_poll_interval_ms"] == 10
    assert patched.json()["policy"]["roce_failures_stop_job"] is True
    assert patched.json()["policy"]["reconcile_max_missing_share"] == 0.25
    for bad in (
        {"reconcile_max_missing_share": 1.5},
        {"maas_poll_interval_ms": 5},
        {"maas_poll_interval_ms": 600_001},
        {"deploy_timeout_seconds": 0},
        {"commission_timeout_seconds": -1},
        {"hw_sync_health_timeout_seconds": 8 * 24 * 3600},
    ):
        assert_error(await admin.patch(path, json={"policy": bad}), 400, "invalid_request")


async def test_action_on_a_batch_node_not_started_yet(
    admin: Any, sku: str, db_sessions: Any
) -> None:
    site = await make_site(admin)
    made = await admin.post(f"{ONBOARDINGS}/batch", json=batch(site, [("c1", "10.0.0.1")]))
    (item,) = made.json()["onboardings"]
    response = await admin.post(
        f"{ONBOARDINGS}/{item['onboarding_id']}/cancel", json={"reason": "wrong rack"}
    )
    assert_error(response, 409, "onboarding_not_started")


async def test_actions_503_when_temporal_is_down(
    api: Any, make_token: Any, unreachable_settings: Any, admin: Any, sku: str, db_sessions: Any
) -> None:
    site = await make_site(admin)
    created = (await admin.post(ONBOARDINGS, json=single(site))).json()
    down = await api(
        token=await make_token("admin"),
        settings=unreachable_settings(temporal=True),
        temporal_client=None,
    )
    response = await down.post(
        f"{ONBOARDINGS}/{created['onboarding_id']}/cancel", json={"reason": "x"}
    )
    assert_error(response, 503, "temporal_unavailable")
    assert await audits(db_sessions, "onboarding.cancel") == []


# --- end to end with the real MaasNodeOnboardWorkflow (tests/onboarding_fixtures.py) ------------

E2E = sim_scenario(
    sim_machine("api-ready", "10.176.16.60"),
    # Deploys, then hardware sync never turns healthy: the job waits there, running.
    sim_machine("api-stuck", "10.176.16.61", faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("api-noboss", "10.176.16.62", boss=False),
)


async def submit_through_api(rig: Any, admin: Any, hostname: str, ipmi_ip: str) -> Job:
    response = await admin.post(
        ONBOARDINGS,
        json={
            "site_id": str(rig.site_id),
            "profile_id": str(rig.profile_id),
            "sku_id": ONBOARD_SKU,
            "hostname": hostname,
            "ipmi_ip": ipmi_ip,
        },
    )
    assert response.status_code == 201, response.text
    job = Job(response.json()["onboarding_id"], response.json()["node_id"], hostname)
    rig.jobs.append(job)  # the rig ends what is still open when the test ends
    return job


async def wait_shown(
    admin: Any, job: Job, *statuses: str, stage: str | None = None, timeout: float = 60
) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        shown = (await admin.get(f"{ONBOARDINGS}/{job.onboarding_id}")).json()
        if shown["status"] in statuses and stage in (None, shown["current_stage"]):
            return shown
        assert asyncio.get_running_loop().time() < deadline, (
            f"still {shown['status']} at {shown['current_stage']} ({shown['error_code']}: "
            f"{shown['error_message']}); wanted {statuses}"
        )
        await asyncio.sleep(0.1)


@pytest.mark.maas_scenario(E2E)
async def test_e2e_onboard_through_the_api(
    onboarding: Any, api: Any, make_token: Any, db_sessions: Any
) -> None:
    admin = await api(token=await make_token("admin"), settings=onboarding.settings)
    job = await submit_through_api(onboarding, admin, "api-ready", "10.176.16.60")
    shown = await wait_shown(admin, job, "completed")
    assert shown["node_id"] == job.node_id
    assert shown["maas_system_id"]
    assert shown["last_maas_status"] == "Deployed"
    assert shown["events"]
    times = [e["occurred_at"] for e in shown["events"]]
    assert times == sorted(times, reverse=True)
    assert {e["stage"] for e in shown["events"]} >= {"load_site_config", "deploy_via_maas"}

    listed = (await admin.get(ONBOARDINGS, params={"status": "completed"})).json()
    assert [i["onboarding_id"] for i in listed["items"]] == [job.onboarding_id]
    # A completed onboarding's workflow has ended: no more actions.
    ended = await admin.post(
        f"{ONBOARDINGS}/{job.onboarding_id}/rerun", json={"reason": "once more"}
    )
    assert_error(ended, 409, "onboarding_closed")


@pytest.mark.maas_scenario(E2E)
async def test_e2e_retry_refused_while_running_and_cancel_accepted(
    onboarding: Any, api: Any, make_token: Any, db_sessions: Any
) -> None:
    admin = await api(token=await make_token("admin"), settings=onboarding.settings)
    await onboarding.set_policy(hw_sync_health_timeout_seconds=300)
    job = await submit_through_api(onboarding, admin, "api-stuck", "10.176.16.61")
    path = f"{ONBOARDINGS}/{job.onboarding_id}"
    await wait_shown(admin, job, "running", stage="wait_for_hardware_sync_healthy")

    refused = await admin.post(f"{path}/retry", json={"reason": "impatient"})
    body = assert_error(refused, 409, "action_not_allowed")
    assert "running" in body["error"]["message"]

    cancelled = await admin.post(f"{path}/cancel", json={"reason": "wrong rack"})
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["accepted"] is True
    assert cancelled.json()["prior_status"] == "running"
    assert cancelled.json()["expected_status"] == "cancelled"
    await wait_shown(admin, job, "cancelled")
    closed = await admin.post(f"{path}/cancel", json={"reason": "again"})
    assert_error(closed, 409, "onboarding_closed")

    # Every operator action is audited, the refused ones too, each saying whether it was taken.
    entry, refused_again = await audits(db_sessions, "onboarding.cancel")
    assert (entry.prior_state, entry.expected_state) == ("running", "cancelled")
    assert entry.reason == "wrong rack"
    assert entry.details["accepted"] is True
    assert (refused_again.reason, refused_again.details["accepted"]) == ("again", False)
    (refused_retry,) = await audits(db_sessions, "onboarding.retry_stage")
    assert (refused_retry.reason, refused_retry.details["accepted"]) == ("impatient", False)
    assert refused_retry.expected_state == "running"  # refused: nothing was to change


async def _storage_attempts(db_sessions: Any, job: Job) -> int:
    async with db_sessions() as session:
        events = await session.scalars(
            select(NodeOnboardingEvent).where(
                NodeOnboardingEvent.onboarding_id == uuid.UUID(job.onboarding_id),
                NodeOnboardingEvent.stage == "configure_storage",
                NodeOnboardingEvent.status == "started",
            )
        )
        return len(list(events))


@pytest.mark.maas_scenario(E2E)
async def test_e2e_operator_actions_map_the_workflow_answers(
    onboarding: Any, api: Any, make_token: Any, db_sessions: Any
) -> None:
    """The action routes against the real workflow: a repeated request with the same key is
    applied once and answered the same, bad input never reaches Temporal, every request is
    audited with the fields of docs/lifecycles/onboarding.md#monitoring, and a closed job takes no
    more actions."""
    admin = await api(token=await make_token("admin"), settings=onboarding.settings)
    job = await submit_through_api(onboarding, admin, "api-noboss", "10.176.16.62")
    path = f"{ONBOARDINGS}/{job.onboarding_id}"
    await wait_shown(admin, job, "failed_manual_intervention")
    before = await _storage_attempts(db_sessions, job)

    key = {"X-Idempotency-Key": f"act-{uuid.uuid4().hex}"}
    first = await admin.post(f"{path}/retry", json={"reason": "reseated the BOSS"}, headers=key)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "onboarding_id": job.onboarding_id,
        "action": "retry_stage",
        "accepted": True,
        "prior_status": "failed_manual_intervention",
        "prior_stage": "configure_storage",
        "expected_status": "completed",
        "message": "retry_stage accepted",
    }
    again = await admin.post(f"{path}/retry", json={"reason": "reseated the BOSS"}, headers=key)
    assert again.json() == first.json()
    # Applied once: the stage ran once more (and failed again: the disk is still missing).
    deadline = asyncio.get_running_loop().time() + 30
    while await _storage_attempts(db_sessions, job) < before + 1:
        assert asyncio.get_running_loop().time() < deadline, "the retry never ran"
        await asyncio.sleep(0.1)
    await wait_shown(admin, job, "failed_manual_intervention")
    await asyncio.sleep(0.5)
    assert await _storage_attempts(db_sessions, job) == before + 1

    assert_error(await admin.post(f"{path}/rerun", json={}), 400, "invalid_request")
    assert_error(await admin.post(f"{path}/rerun", json={"reason": "  "}), 400, "invalid_request")
    assert_error(await admin.post(f"{path}/reboot", json={"reason": "x"}), 404, "not_found")
    assert_error(
        await admin.post(f"{ONBOARDINGS}/{NIL}/rerun", json={"reason": "x"}), 404, "not_found"
    )

    cancelled = await admin.post(f"{path}/cancel", json={"reason": "wrong rack"})
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["expected_status"] == "cancelled"
    await wait_shown(admin, job, "cancelled")
    closed = await admin.post(f"{path}/mark-manual-intervention", json={"reason": "late"})
    assert_error(closed, 409, "onboarding_closed")

    (cancel,) = await audits(db_sessions, "onboarding.cancel")
    assert cancel.target_type == "onboarding"
    assert cancel.target_id == job.onboarding_id
    assert cancel.reason == "wrong rack"
    assert (cancel.prior_state, cancel.expected_state) == (
        "failed_manual_intervention",
        "cancelled",
    )
    assert cancel.workflow_ids == [job.workflow_id]
    assert cancel.details["workflow_id"] == job.workflow_id
    assert cancel.details["actor_role"] == "admin"
    assert cancel.details["prior_stage"] == "configure_storage"
    retries = await audits(db_sessions, "onboarding.retry_stage")
    assert len(retries) == 2  # every request is audited; the workflow applied it once
    assert {r.details["update_id"] for r in retries} == {f"retry_stage:{key['X-Idempotency-Key']}"}
