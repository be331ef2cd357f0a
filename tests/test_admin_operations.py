"""The gateway's admin mutations run in the worker, through AdminOperationWorkflow (issue 24):
what an API client and an operator can observe of that, over the real gateway, Temporal,
PostgreSQL, the Vault-compatible server and the MAAS simulator.

- a manual credit retried with the same key, even by requests racing each other, posts once;
- a MAAS or Vault failure during a site-credential change leaves the previous credentials in
  place and answers as before;
- each operation is a workflow in Temporal (visible, its audit row naming it), whose payloads
  carry secrets only encrypted;
- every path through the workflow (each operation's success and each refusal) is recorded under
  tests/histories/admin_operation/ for tests/test_replay.py (GPUCLOUD_RECORD_HISTORIES=1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from sqlalchemy import func, select, update
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from contracts.admin_operation import (
    BILLING_CREDIT,
    DRIFT_RESOLVE,
    GPU_SLOT_RETURN,
    NOT_FOUND,
    POWER_OVERRIDE_CREATE,
    POWER_OVERRIDE_DELETE,
    POWER_OVERRIDE_UPDATE,
    ROCE_DELETE,
    ROCE_UPSERT,
    SITE_CREDENTIALS_WRITE,
    SITE_PROBE,
    UNKNOWN_OPERATION,
    WORKFLOW_NAME,
    Actor,
    AdminOperationInput,
    CreditInput,
    PowerOverrideCreateInput,
    PowerOverrideDeleteInput,
    PowerOverrideUpdateInput,
    RoceItem,
    RoceUpsertInput,
    SiteCredentialsInput,
    SiteProbeInput,
    admin_operation_workflow_id,
    credit_key,
)
from contracts.states import SlotStatus
from core.codec import ENCODING, AesGcmPayloadCodec
from core.secrets import SecretStore, SecretStoreUnavailable
from schema.models import AuditEntry, GpuSlot, LedgerEntry, MaasSite, NodeMaasState
from tests.admin_operation_support import admin_operations_worker, nth_run, record
from tests.conftest import TEST_CODEC_KEY
from tests.factories import create_node, create_sku
from tests.test_maas_sites import create_site

BMC_PASSWORD = "bmc-" + uuid.uuid4().hex
DEPLOY_PASSWORD = "deploy-" + uuid.uuid4().hex
ACTOR = Actor(name="ops-test", token_id=None, role="admin", reason="test")


@pytest.fixture
def vault_settings(settings: Any, vault_server: Any) -> Any:
    return dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )


@pytest.fixture
async def plane(temporal_client: Client, vault_settings: Any, db_engine: Any) -> AsyncIterator[Any]:
    """The control-plane worker as worker.py builds it (so its registration is what runs)."""
    from worker import build_worker

    async with build_worker(temporal_client, vault_settings, db_engine):
        yield vault_settings


@pytest.fixture
async def admin(api: Any, make_token: Any, plane: Any) -> Any:
    return await api(token=await make_token("admin"), settings=plane)


async def run_directly(client: Client, settings: Any, operation: str, request: Any) -> Any:
    """Start the workflow as the gateway does, with a request the gateway would not send (its
    own checks answer first): how the worker's refusal looks when the row went away between."""
    handle = await client.start_workflow(
        WORKFLOW_NAME,
        AdminOperationInput(operation=operation, request=request),
        id=admin_operation_workflow_id(operation, f"direct-{uuid.uuid4()}"),
        task_queue=settings.control_plane_task_queue,
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    return handle, failed.value.cause


def error_code(response: Any) -> str:
    code: str = response.json()["error"]["code"]
    return code


async def audits(db_sessions: Any, action: str) -> list[AuditEntry]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(AuditEntry).where(AuditEntry.action == action).order_by(AuditEntry.id)
        )
        return list(rows)


# --- billing ------------------------------------------------------------------------------------


async def test_a_credit_retried_with_the_same_key_posts_once_even_when_requests_race(
    admin: Any, plane: Any, make_project: Any, make_token: Any, api: Any, db_sessions: Any,
    temporal_client: Client,
) -> None:  # fmt: skip
    project = await make_project(credit_minor=0)
    url = f"/api/v1/admin/billing/accounts/{project.id}/credits"
    body = {"amount_minor": 1500, "idempotency_key": "topup-7", "reason": "goodwill, INC-12"}

    racing = await asyncio.gather(*(admin.post(url, json=body) for _ in range(6)))
    assert [r.status_code for r in racing] == [201] * 6, [r.text for r in racing]
    answers = {(r.json()["entry_id"], r.json()["balance_minor"]) for r in racing}
    assert len(answers) == 1, answers
    (entry_id, balance), = answers  # fmt: skip
    assert balance == 1500
    workflow_id = admin_operation_workflow_id(
        BILLING_CREDIT, credit_key(str(project.id), "topup-7")
    )
    first = temporal_client.get_workflow_handle(workflow_id)
    await record(first, "billing_credit")

    retried = await admin.post(url, json=body)
    assert retried.status_code == 201
    assert retried.json() == {"entry_id": entry_id, "created": False, "balance_minor": 1500}
    await record(temporal_client.get_workflow_handle(workflow_id), "billing_credit_retried")
    other = await admin.post(url, json={**body, "idempotency_key": "topup-8"})
    assert other.json()["created"] is True
    assert other.json()["balance_minor"] == 3000

    async with db_sessions() as session:
        posted = await session.scalar(
            select(func.count()).where(LedgerEntry.idempotency_key == f"admin:{project.id}:topup-7")
        )
    assert posted == 1
    (credit, _) = await audits(db_sessions, "billing.credit")
    assert (credit.target_id, credit.reason) == (str(project.id), "goodwill, INC-12")
    assert credit.details == {"amount_minor": 1500, "entry_id": entry_id}
    assert credit.workflow_ids == [workflow_id]

    # An operator sees it in Temporal: which workflow, on which queue, done.
    described = await first.describe()
    assert described.workflow_type == WORKFLOW_NAME
    assert described.task_queue == plane.control_plane_task_queue
    assert described.status == WorkflowExecutionStatus.COMPLETED
    tenant = await api(token=await make_token("tenant", project), settings=plane)
    assert (await tenant.get("/api/v1/billing/balance")).json()["balance_minor"] == 3000

    # The gateway's own check answers a missing project; the worker's, a project gone between.
    missing = await admin.post(f"/api/v1/admin/billing/accounts/{uuid.uuid4()}/credits", json=body)
    assert (missing.status_code, error_code(missing)) == (404, "not_found")
    handle, cause = await run_directly(
        temporal_client,
        plane,
        BILLING_CREDIT,
        CreditInput(ACTOR, project_id=str(uuid.uuid4()), amount_minor=1, idempotency_key="k"),
    )
    assert isinstance(cause, ApplicationError)
    assert (cause.type, cause.message) == (NOT_FOUND, "project not found")
    await record(handle, "billing_credit_not_found")


async def test_an_unknown_operation_is_refused(temporal_client: Client, plane: Any) -> None:
    handle, cause = await run_directly(temporal_client, plane, "admin.no_such_thing", {})
    assert isinstance(cause, ApplicationError)
    assert cause.type == UNKNOWN_OPERATION
    await record(handle, "unknown_operation")


# --- GPU slots and drift -----------------------------------------------------------------------


async def test_slot_return_and_drift_resolve_paths(
    admin: Any, plane: Any, maas_sim: Any, db_sessions: Any, temporal_client: Client
) -> None:
    await create_sku(db_sessions)
    node = await create_node(db_sessions)
    async with db_sessions() as session, session.begin():
        slot_id = await session.scalar(
            update(GpuSlot)
            .where(GpuSlot.node_id == node.id, GpuSlot.gpu_index == 3)
            .values(status=SlotStatus.DISABLED, quarantine_reason="Xid 79",
                    quarantined_at=func.now())
            .returning(GpuSlot.id)
        )  # fmt: skip
    slot_url = f"/api/v1/admin/nodes/{node.id}/gpu-slots/{slot_id}/return-to-service"
    slot_run = admin_operation_workflow_id(GPU_SLOT_RETURN, f"{node.id}-{slot_id}")

    returned = await admin.post(slot_url, json={"reason": "reseated"})
    assert returned.status_code == 200, returned.text
    assert (returned.json()["status"], returned.json()["quarantine_reason"]) == ("free", None)
    await record(temporal_client.get_workflow_handle(slot_run), "gpu_slot_return")
    again = await admin.post(slot_url, json={"reason": "twice"})
    assert (again.status_code, error_code(again)) == (409, "slot_not_quarantined")
    await record(temporal_client.get_workflow_handle(slot_run), "gpu_slot_return_not_quarantined")
    other = uuid.uuid4()
    missing = await admin.post(
        f"/api/v1/admin/nodes/{node.id}/gpu-slots/{other}/return-to-service",
        json={"reason": "no such slot"},
    )
    assert (missing.status_code, error_code(missing)) == (404, "not_found")
    assert missing.json()["error"]["message"] == "GPU slot not found"
    missing_run = admin_operation_workflow_id(GPU_SLOT_RETURN, f"{node.id}-{other}")
    await record(temporal_client.get_workflow_handle(missing_run), "gpu_slot_return_not_found")

    site = await create_site(admin, maas_sim.base_url)
    async with db_sessions() as session, session.begin():
        session.add(
            NodeMaasState(node_id=node.id, site_id=uuid.UUID(site["id"]), maas_system_id="abc123",
                          drift_detected=True, drift_rule="released_outside_workflow")
        )  # fmt: skip
    drift_url = f"/api/v1/admin/reconciliation/drift/{node.id}/resolve"
    drift_run = admin_operation_workflow_id(DRIFT_RESOLVE, str(node.id))
    resolved = await admin.post(drift_url, json={"reason": "redeployed"})
    assert resolved.status_code == 200, resolved.text
    assert resolved.json()["hostname"] == node.hostname
    assert resolved.json()["rule"] == "released_outside_workflow"
    await record(temporal_client.get_workflow_handle(drift_run), "drift_resolve")
    again = await admin.post(drift_url, json={"reason": "twice"})
    assert (again.status_code, error_code(again)) == (409, "no_drift")
    await record(temporal_client.get_workflow_handle(drift_run), "drift_resolve_no_drift")
    unbound = uuid.uuid4()
    missing = await admin.post(
        f"/api/v1/admin/reconciliation/drift/{unbound}/resolve", json={"reason": "x"}
    )
    assert (missing.status_code, error_code(missing)) == (404, "not_found")
    missing_run = admin_operation_workflow_id(DRIFT_RESOLVE, str(unbound))
    await record(temporal_client.get_workflow_handle(missing_run), "drift_resolve_not_found")
    (audit,) = await audits(db_sessions, "reconciliation.resolve_drift")
    assert audit.workflow_ids == [drift_run]


# --- MAAS site credentials ---------------------------------------------------------------------


class RefusingVault:
    """The Vault-compatible server, reached through a store that gets Vault's "unavailable" for
    writes to some paths: a Vault that fails in the middle of a credentials change."""

    def __init__(self, store: SecretStore) -> None:
        self._store = store
        self.refuse: set[str] = set()

    async def read(self, path: str) -> dict[str, str] | None:
        return await self._store.read(path)

    async def write(self, path: str, data: Mapping[str, str]) -> int:
        if path in self.refuse:
            raise SecretStoreUnavailable(f"Vault answered 503 on {path!r}", path=path)
        return await self._store.write(path, data)

    async def delete(self, path: str) -> None:
        await self._store.delete(path)


async def site_row(db_sessions: Any, site_id: str) -> MaasSite:
    async with db_sessions() as session:
        site = await session.get(MaasSite, uuid.UUID(site_id))
        assert site is not None
        return site


async def test_a_failed_credentials_change_leaves_the_previous_credentials(
    admin: Any, plane: Any, maas_sim: Any, db_sessions: Any, secret_store: Any, api: Any,
    make_token: Any, temporal_client: Client, db_engine: Any, vault_server: Any,
) -> None:  # fmt: skip
    site = await create_site(admin, maas_sim.base_url)
    url = f"/api/v1/admin/maas-sites/{site['id']}/credentials"
    token_path, power_path = site["api_token_vault_path"], site["default_power_creds_vault_path"]
    deploy_path = site["deploy_password_vault_path"]
    first = {"maas_api_key": maas_sim.api_key, "power": {"user": "root", "password": BMC_PASSWORD},
             "deploy_password": DEPLOY_PASSWORD}  # fmt: skip
    written = await admin.post(url, json=first)
    assert written.status_code == 200, written.text
    assert written.json()["written_paths"] == [token_path, power_path, deploy_path]
    await record(await nth_run(temporal_client, plane, SITE_CREDENTIALS_WRITE, 0),
                 "site_credentials_write")  # fmt: skip
    before = await site_row(db_sessions, site["id"])
    previous = {p: await secret_store.read(p) for p in (token_path, power_path, deploy_path)}
    assert previous[token_path] == {"token": maas_sim.api_key}

    consumer, token_key, _ = maas_sim.api_key.split(":")
    rejected = await admin.post(
        url, json={**first, "maas_api_key": f"{consumer}:{token_key}:wrong",
                   "power": {"user": "root", "password": "new-" + BMC_PASSWORD}},
    )  # fmt: skip
    assert (rejected.status_code, error_code(rejected)) == (422, "maas_token_rejected")
    assert rejected.json()["error"]["details"] == {"failure_class": "site_capability_missing"}
    await record(await nth_run(temporal_client, plane, SITE_CREDENTIALS_WRITE, 1),
                 "site_credentials_maas_token_rejected")  # fmt: skip
    malformed = await admin.post(url, json={"maas_api_key": "one-part"})
    assert (malformed.status_code, error_code(malformed)) == (422, "maas_api_key_malformed")
    await record(await nth_run(temporal_client, plane, SITE_CREDENTIALS_WRITE, 2),
                 "site_credentials_malformed_key")  # fmt: skip
    elsewhere = await admin.patch(
        f"/api/v1/admin/maas-sites/{site['id']}", json={"api_base_url": "http://127.0.0.1:9/MAAS"}
    )
    assert elsewhere.status_code == 200
    unreachable = await admin.post(url, json=first)
    assert (unreachable.status_code, error_code(unreachable)) == (422, "maas_unreachable")
    await record(await nth_run(temporal_client, plane, SITE_CREDENTIALS_WRITE, 3),
                 "site_credentials_maas_unreachable")  # fmt: skip
    back = await admin.patch(
        f"/api/v1/admin/maas-sites/{site['id']}", json={"api_base_url": maas_sim.base_url}
    )
    assert back.status_code == 200
    for path, value in previous.items():
        assert await secret_store.read(path) == value, path

    # Vault fails at the second of three writes: the first is put back, nothing commits.
    refusing = RefusingVault(secret_store)
    refusing.refuse = {power_path}
    broken = dataclasses.replace(plane, control_plane_task_queue=f"control-plane-{uuid.uuid4()}")
    async with admin_operations_worker(temporal_client, broken, db_engine, refusing):
        client = await api(token=await make_token("admin"), settings=broken)
        failed = await client.post(
            url, json={**first, "power": {"user": "root2", "password": "other"}}
        )
        assert (failed.status_code, error_code(failed)) == (503, "secret_store_unavailable")
        assert failed.headers["Retry-After"] == "2"
        await record(await nth_run(temporal_client, broken, SITE_CREDENTIALS_WRITE, 0),
                     "site_credentials_vault_failed")  # fmt: skip
    for path, value in previous.items():
        assert await secret_store.read(path) == value, path
    # The token was written (version 2) before Vault failed, then put back (version 3).
    metadata = vault_server.client().secrets.kv.v2.read_secret_metadata(
        path=token_path.removeprefix("kv/"), mount_point="kv"
    )
    assert metadata["data"]["current_version"] == 3
    after = await site_row(db_sessions, site["id"])
    assert after.credentials_updated_at == before.credentials_updated_at
    assert len(await audits(db_sessions, "maas_site.credentials_write")) == 1


async def test_probe_paths(
    admin: Any, plane: Any, maas_sim: Any, secret_store: Any, temporal_client: Client
) -> None:
    site = await create_site(admin, maas_sim.base_url)
    url = f"/api/v1/admin/maas-sites/{site['id']}/probe"
    missing = await admin.post(url)
    assert (missing.status_code, error_code(missing)) == (409, "credentials_missing")
    await record(await nth_run(temporal_client, plane, SITE_PROBE, 0),
                 "site_probe_credentials_missing")  # fmt: skip
    await secret_store.write(site["api_token_vault_path"], {"token": maas_sim.api_key})
    probed = await admin.post(url)
    assert probed.status_code == 200, probed.text
    assert probed.json()["rack_controllers"]
    await record(await nth_run(temporal_client, plane, SITE_PROBE, 1), "site_probe")
    consumer, token_key, _ = maas_sim.api_key.split(":")
    await secret_store.write(site["api_token_vault_path"], {"token": f"{consumer}:{token_key}:x"})
    rejected = await admin.post(url)
    assert (rejected.status_code, error_code(rejected)) == (502, "maas_token_rejected")
    await record(await nth_run(temporal_client, plane, SITE_PROBE, 2),
                 "site_probe_maas_token_rejected")  # fmt: skip
    await secret_store.write(site["api_token_vault_path"], {"token": "not-a-key"})
    invalid = await admin.post(url)
    assert (invalid.status_code, error_code(invalid)) == (409, "credentials_invalid")
    await record(await nth_run(temporal_client, plane, SITE_PROBE, 3),
                 "site_probe_credentials_invalid")  # fmt: skip


# --- RoCE and BMC credential overrides ----------------------------------------------------------


async def test_roce_and_override_paths(
    admin: Any, plane: Any, maas_sim: Any, secret_store: Any, temporal_client: Client,
    db_sessions: Any,
) -> None:  # fmt: skip
    site = await create_site(admin, maas_sim.base_url)
    base = f"/api/v1/admin/maas-sites/{site['id']}"
    items = [{"hostname": "c07u31", "interface": "enp28s0np0", "ipv4_cidr": "172.30.9.61/31"}]
    upserted = await admin.post(f"{base}/roce-assignments", json={"items": items})
    assert upserted.json() == {"created": 1, "updated": 0, "unchanged": 0}
    await record(await nth_run(temporal_client, plane, ROCE_UPSERT, 0), "roce_upsert")
    (assignment,) = (await admin.get(f"{base}/roce-assignments")).json()["items"]
    roce_run = admin_operation_workflow_id(ROCE_DELETE, f"{site['id']}-{assignment['id']}")
    assert (await admin.delete(f"{base}/roce-assignments/{assignment['id']}")).status_code == 204
    await record(temporal_client.get_workflow_handle(roce_run), "roce_delete")
    gone = await admin.delete(f"{base}/roce-assignments/{assignment['id']}")
    assert (gone.status_code, error_code(gone)) == (404, "not_found")
    await record(temporal_client.get_workflow_handle(roce_run), "roce_delete_not_found")

    url = f"{base}/power-overrides"
    body = {"selector_type": "hostname", "selector_value": "C07U31", "user": "admin",
            "password": BMC_PASSWORD}  # fmt: skip
    created = await admin.post(url, json=body)
    assert created.status_code == 201, created.text
    override = created.json()
    assert override["selector_value"] == "c07u31"
    assert await secret_store.read(override["vault_path"]) == {
        "user": "admin",
        "pass": BMC_PASSWORD,
    }
    await record(await nth_run(temporal_client, plane, POWER_OVERRIDE_CREATE, 0),
                 "power_override_create")  # fmt: skip
    duplicate = await admin.post(url, json=body)
    assert (duplicate.status_code, error_code(duplicate)) == (409, "override_exists")
    await record(await nth_run(temporal_client, plane, POWER_OVERRIDE_CREATE, 1),
                 "power_override_create_exists")  # fmt: skip
    rotated = await admin.patch(
        f"{url}/{override['id']}", json={"user": "admin2", "password": "r-" + BMC_PASSWORD,
                                         "status": "disabled"},
    )  # fmt: skip
    assert rotated.status_code == 200, rotated.text
    assert rotated.json()["status"] == "disabled"
    assert await secret_store.read(override["vault_path"]) == {
        "user": "admin2",
        "pass": "r-" + BMC_PASSWORD,
    }
    await record(await nth_run(temporal_client, plane, POWER_OVERRIDE_UPDATE, 0),
                 "power_override_update")  # fmt: skip
    assert (await admin.delete(f"{url}/{override['id']}")).status_code == 204
    assert await secret_store.read(override["vault_path"]) is None
    delete_run = admin_operation_workflow_id(
        POWER_OVERRIDE_DELETE, f"{site['id']}-{override['id']}"
    )
    await record(temporal_client.get_workflow_handle(delete_run), "power_override_delete")
    assert (await admin.get(f"{url}/{override['id']}")).status_code == 404
    (audit,) = await audits(db_sessions, "maas_site.power_override_delete")
    assert audit.workflow_ids == [delete_run]


async def test_the_worker_answers_not_found_for_rows_gone_since_the_gateway_read_them(
    plane: Any, temporal_client: Client
) -> None:
    """The gateway reads the site or override first (404 at once); the worker checks again in its
    own transaction. Each operation's refusal, recorded."""
    site, row = str(uuid.uuid4()), str(uuid.uuid4())
    requests: dict[str, Any] = {
        SITE_CREDENTIALS_WRITE: SiteCredentialsInput(ACTOR, site_id=site, maas_api_key="a:b:c"),
        SITE_PROBE: SiteProbeInput(site_id=site),
        ROCE_UPSERT: RoceUpsertInput(ACTOR, site_id=site,
                                     items=[RoceItem("c07u31", "enp1", "172.30.9.61/31")]),
        POWER_OVERRIDE_CREATE: PowerOverrideCreateInput(
            ACTOR, site_id=site, override_id=row, selector_type="hostname",
            selector_value="c07u31", user="u", password="p"),
        POWER_OVERRIDE_UPDATE: PowerOverrideUpdateInput(ACTOR, site_id=site, override_id=row,
                                                        status="disabled"),
        POWER_OVERRIDE_DELETE: PowerOverrideDeleteInput(ACTOR, site_id=site, override_id=row),
    }  # fmt: skip
    for operation, request in requests.items():
        handle, cause = await run_directly(temporal_client, plane, operation, request)
        assert isinstance(cause, ApplicationError)
        assert cause.type == NOT_FOUND, (operation, cause)
        await record(handle, f"{operation.removeprefix('admin.')}_not_found")


# --- secrets in Temporal ------------------------------------------------------------------------


async def test_secrets_reach_temporal_history_only_encrypted(
    admin: Any, plane: Any, maas_sim: Any, temporal_client: Client
) -> None:
    site = await create_site(admin, maas_sim.base_url)
    written = await admin.post(
        f"/api/v1/admin/maas-sites/{site['id']}/credentials",
        json={"maas_api_key": maas_sim.api_key,
              "power": {"user": "root", "password": BMC_PASSWORD},
              "deploy_password": DEPLOY_PASSWORD},
    )  # fmt: skip
    assert written.status_code == 200, written.text
    created = await admin.post(
        f"/api/v1/admin/maas-sites/{site['id']}/power-overrides",
        json={"selector_type": "ipmi_ip", "selector_value": "10.0.0.9", "user": "u",
              "password": "o-" + BMC_PASSWORD},
    )  # fmt: skip
    assert created.status_code == 201, created.text
    secrets = [maas_sim.api_key.split(":")[2], BMC_PASSWORD, DEPLOY_PASSWORD]
    codec = AesGcmPayloadCodec(TEST_CODEC_KEY)
    for operation in (SITE_CREDENTIALS_WRITE, POWER_OVERRIDE_CREATE):
        handle = await nth_run(temporal_client, plane, operation, 0)
        assert not any(s in handle.id for s in secrets)
        history = await handle.fetch_history()
        raw = b"".join(event.SerializeToString() for event in history.events)
        for secret in secrets:
            assert secret.encode() not in raw, operation
        started = history.events[0].workflow_execution_started_event_attributes
        (payload,) = started.input.payloads
        assert payload.metadata["encoding"] == ENCODING
        # The check reads what was sent: decrypted, the input does hold a secret.
        plain = codec.decode_one(payload).data
        assert any(s.encode() in plain for s in secrets), operation
