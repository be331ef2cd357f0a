"""MAAS site admin routes end to end: the gateway over real PostgreSQL, the Vault-compatible
server (hvac over HTTP) and the MAAS simulator (a separate process over HTTP)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select

from activities.power_credentials import PowerCredentialsMissing, resolve_power_credentials
from devstack.processes import free_port
from schema.models import AuditEntry, MaasSite
from tests.admin_operation_support import admin_operations_worker

POWER_PASSWORD = "bmc-pa55-" + uuid.uuid4().hex
DEPLOY_PASSWORD = "deploy-pa55-" + uuid.uuid4().hex


@pytest.fixture
def vault_settings(settings: Any, vault_server: Any) -> Any:
    return dataclasses.replace(
        settings, vault_addr=vault_server.addr, vault_token=vault_server.token
    )


@pytest.fixture
async def start_admin_worker(
    temporal_client: Any, db_engine: Any
) -> AsyncIterator[Callable[[Any], Awaitable[None]]]:
    """The worker that runs what calls MAAS or Vault (AdminOperationWorkflow), reading Vault as
    the given settings say."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(settings: Any) -> None:
            worker = admin_operations_worker(temporal_client, settings, db_engine)
            await stack.enter_async_context(worker)

        yield start


@pytest.fixture
async def admin(api: Any, make_token: Any, vault_settings: Any, start_admin_worker: Any) -> Any:
    await start_admin_worker(vault_settings)
    return await api(token=await make_token("admin"), settings=vault_settings)


def site_body(maas_url: str, name: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": name or f"dc-{uuid.uuid4().hex[:6]}",
        "region_code": "us-east-1",
        "api_base_url": maas_url,
        "pxe_iface": "ens19",
        "pxe_vlan_vid": 46,
        "node_pxe_iface": "eno8303",
        **extra,
    }


async def create_site(admin: Any, maas_url: str, **extra: Any) -> dict[str, Any]:
    response = await admin.post("/api/v1/admin/maas-sites", json=site_body(maas_url, **extra))
    assert response.status_code == 201, response.text
    site: dict[str, Any] = response.json()
    return site


async def audit_actions(db_sessions: Any, target_id: str) -> list[str]:
    async with db_sessions() as session:
        rows = await session.scalars(
            select(AuditEntry.action)
            .where(AuditEntry.target_id == target_id)
            .order_by(AuditEntry.id)
        )
        return list(rows)


async def test_site_crud_policy_defaults_disable_and_audit(
    admin: Any, maas_sim: Any, db_sessions: Any, api: Any, make_token: Any, vault_settings: Any
) -> None:
    site = await create_site(admin, maas_sim.base_url, policy={"batch_max_parallel": 4})
    site_id = site["id"]
    assert site["status"] == "active"
    assert site["policy"]["batch_max_parallel"] == 4
    assert site["policy"]["strict_pxe_preflight"] is True
    assert site["policy"]["auto_claim_single_new_machine"] is False
    assert site["policy"]["hardware_sync_interval"] == "15m"
    assert site["policy"]["enrollment_token_ttl_seconds"] == 7200
    assert site["api_token_vault_path"] == f"kv/maas-sites/{site_id}/api-token"
    assert site["default_power_creds_vault_path"] == f"kv/maas-sites/{site_id}/power/default"
    assert site["credentials_updated_at"] is None

    duplicate = await admin.post(
        "/api/v1/admin/maas-sites", json=site_body(maas_sim.base_url, name=site["name"])
    )
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["code"] == "site_exists"

    patched = await admin.patch(
        f"/api/v1/admin/maas-sites/{site_id}",
        json={"pxe_vlan_vid": 47, "policy": {"max_deploy_retry_attempts": 2}, "reason": "rack 7"},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["pxe_vlan_vid"] == 47
    assert patched.json()["policy"]["max_deploy_retry_attempts"] == 2

    bad = await admin.patch(f"/api/v1/admin/maas-sites/{site_id}", json={"pxe_vlan_vid": 5000})
    assert bad.status_code == 400

    disabled = await admin.delete(f"/api/v1/admin/maas-sites/{site_id}")
    assert disabled.status_code == 200
    assert disabled.json()["status"] == "disabled"
    enabled = await admin.patch(f"/api/v1/admin/maas-sites/{site_id}", json={"status": "active"})
    assert enabled.json()["status"] == "active"
    listed = (await admin.get("/api/v1/admin/maas-sites")).json()["items"]
    assert [s["id"] for s in listed] == [site_id]

    assert await audit_actions(db_sessions, site_id) == [
        "maas_site.create",
        "maas_site.update",
        "maas_site.disable",
        "maas_site.update",
    ]
    async with db_sessions() as session:
        disable = await session.scalar(
            select(AuditEntry).where(AuditEntry.action == "maas_site.disable")
        )
    assert disable is not None
    assert (disable.prior_state, disable.expected_state) == ("active", "disabled")

    tenant = await api(token=await make_token("tenant"), settings=vault_settings)
    assert (await tenant.get("/api/v1/admin/maas-sites")).status_code == 403
    anonymous = await api(settings=vault_settings)
    assert (await anonymous.get("/api/v1/admin/maas-sites")).status_code == 401


async def test_credentials_are_validated_against_maas_before_anything_is_written(
    admin: Any, maas_sim: Any, db_sessions: Any, secret_store: Any, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    site = await create_site(admin, maas_sim.base_url)
    site_id = site["id"]
    token_path = site["api_token_vault_path"]
    consumer, token_key, _ = maas_sim.api_key.split(":")
    wrong_key = f"{consumer}:{token_key}:not-the-secret"

    rejected = await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials", json={"maas_api_key": wrong_key}
    )
    assert rejected.status_code == 422
    assert rejected.json()["error"]["code"] == "maas_token_rejected"
    malformed = await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials", json={"maas_api_key": "just-one-part"}
    )
    assert malformed.status_code == 422
    assert malformed.json()["error"]["code"] == "maas_api_key_malformed"

    unreachable_site = await create_site(admin, f"http://127.0.0.1:{free_port()}/MAAS")
    unreachable = await admin.post(
        f"/api/v1/admin/maas-sites/{unreachable_site['id']}/credentials",
        json={"maas_api_key": maas_sim.api_key},
    )
    assert unreachable.status_code == 422
    assert unreachable.json()["error"]["code"] == "maas_unreachable"
    assert await secret_store.read(token_path) is None
    assert await secret_store.read(unreachable_site["api_token_vault_path"]) is None
    assert "maas_site.credentials_write" not in await audit_actions(db_sessions, site_id)

    written = await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials",
        json={
            "maas_api_key": maas_sim.api_key,
            "power": {"user": "root", "password": POWER_PASSWORD},
            "deploy_password": DEPLOY_PASSWORD,
            "reason": "initial seed",
        },
    )
    assert written.status_code == 200, written.text
    assert written.json()["written_paths"] == [
        token_path,
        site["default_power_creds_vault_path"],
        site["deploy_password_vault_path"],
    ]
    assert (await secret_store.read(token_path)) == {"token": maas_sim.api_key}
    assert (await secret_store.read(site["default_power_creds_vault_path"])) == {
        "user": "root",
        "pass": POWER_PASSWORD,
    }
    fetched = (await admin.get(f"/api/v1/admin/maas-sites/{site_id}")).json()
    assert fetched["credentials_updated_at"] is not None
    assert fetched["maas_version"]

    # No secret in any response, audit row or log line.
    async with db_sessions() as session:
        audits = (await session.scalars(select(AuditEntry))).all()
        sites = (await session.scalars(select(MaasSite))).all()
    seen = json.dumps(
        [written.json(), fetched, rejected.json(), unreachable.json()]
        + [dict(a.details or {}) for a in audits]
        + [{c.name: str(getattr(s, c.name)) for c in MaasSite.__table__.columns} for s in sites]
    )
    assert caplog.records  # the log check reads what was logged
    for secret in (maas_sim.api_key.split(":")[2], POWER_PASSWORD, DEPLOY_PASSWORD):
        assert secret not in seen
        assert secret not in caplog.text


async def test_probe_reads_the_token_at_call_time(
    admin: Any, maas_sim: Any, secret_store: Any
) -> None:
    site = await create_site(admin, maas_sim.base_url)
    site_id = site["id"]
    missing = await admin.post(f"/api/v1/admin/maas-sites/{site_id}/probe")
    assert missing.status_code == 409
    assert missing.json()["error"]["code"] == "credentials_missing"

    await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials", json={"maas_api_key": maas_sim.api_key}
    )
    probe = await admin.post(f"/api/v1/admin/maas-sites/{site_id}/probe")
    assert probe.status_code == 200, probe.text
    body = probe.json()
    assert body["reachable"] is True
    assert body["maas_version"]
    assert body["rack_controllers"], "the simulator has a rack controller"

    # Rotate behind the gateway's back (as an operator rotating in Vault would): used at once.
    consumer, token_key, _ = maas_sim.api_key.split(":")
    await secret_store.write(site["api_token_vault_path"], {"token": f"{consumer}:{token_key}:x"})
    rotated = await admin.post(f"/api/v1/admin/maas-sites/{site_id}/probe")
    assert rotated.status_code == 502
    assert rotated.json()["error"]["code"] == "maas_token_rejected"
    await secret_store.write(site["api_token_vault_path"], {"token": maas_sim.api_key})
    assert (await admin.post(f"/api/v1/admin/maas-sites/{site_id}/probe")).status_code == 200


async def test_a_non_admin_key_is_refused_and_nothing_is_written(
    admin: Any, maas_sim: Any, db_sessions: Any, secret_store: Any
) -> None:
    """A valid key of a user who is no MAAS administrator passes `version/` but would fail at
    onboarding's first accept or commission: the credentials write and the probe ask
    users/?op=whoami and refuse it (422 maas_token_not_admin), and no Vault path changes."""
    site = await create_site(admin, maas_sim.base_url)
    site_id = site["id"]
    first = await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials",
        json={
            "maas_api_key": maas_sim.api_key,
            "power": {"user": "root", "password": POWER_PASSWORD},
        },
    )
    assert first.status_code == 200, first.text
    viewer_key = await maas_sim.add_user("viewer")

    refused = await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials",
        json={
            "maas_api_key": viewer_key,
            "power": {"user": "other", "password": "other-" + POWER_PASSWORD},
            "deploy_password": DEPLOY_PASSWORD,
        },
    )
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "maas_token_not_admin"
    assert "viewer" in error["message"]
    assert error["details"]["failure_class"] == "site_capability_missing"
    assert (await secret_store.read(site["api_token_vault_path"])) == {"token": maas_sim.api_key}
    assert (await secret_store.read(site["default_power_creds_vault_path"])) == {
        "user": "root",
        "pass": POWER_PASSWORD,
    }
    assert await secret_store.read(site["deploy_password_vault_path"]) is None
    assert await audit_actions(db_sessions, site_id) == [
        "maas_site.create",
        "maas_site.credentials_write",
    ]
    whoami = (await maas_sim.counters())["ops"].get("users.whoami", 0)
    assert whoami == 2  # the admin's write and the refused one each asked

    # A key that stopped being an admin's (swapped in Vault behind the gateway's back).
    await secret_store.write(site["api_token_vault_path"], {"token": viewer_key})
    probe = await admin.post(f"/api/v1/admin/maas-sites/{site_id}/probe")
    assert probe.status_code == 422, probe.text
    assert probe.json()["error"]["code"] == "maas_token_not_admin"


async def test_roce_bulk_upsert_is_idempotent(admin: Any, maas_sim: Any, db_sessions: Any) -> None:
    site_id = (await create_site(admin, maas_sim.base_url))["id"]
    url = f"/api/v1/admin/maas-sites/{site_id}/roce-assignments"
    items = [
        {"hostname": "c07u31", "interface": "enp28s0np0", "ipv4_cidr": "172.30.9.61/31"},
        {"hostname": "c07u31", "interface": "enp29s0np0", "ipv4_cidr": "172.29.1.219/31"},
        {"hostname": "c07u33", "interface": "enp28s0np0", "ipv4_cidr": "172.30.9.63/31"},
    ]
    first = await admin.post(url, json={"items": items})
    assert first.json() == {"created": 3, "updated": 0, "unchanged": 0}
    again = await admin.post(url, json={"items": items})
    assert again.json() == {"created": 0, "updated": 0, "unchanged": 3}
    items[0]["ipv4_cidr"] = "172.30.9.71/31"
    changed = await admin.post(url, json={"items": items})
    assert changed.json() == {"created": 0, "updated": 1, "unchanged": 2}
    listed = (await admin.get(url)).json()["items"]
    assert [(i["hostname"], i["interface"], i["ipv4_cidr"]) for i in listed] == [
        ("c07u31", "enp28s0np0", "172.30.9.71/31"),
        ("c07u31", "enp29s0np0", "172.29.1.219/31"),
        ("c07u33", "enp28s0np0", "172.30.9.63/31"),
    ]

    bad = await admin.post(
        url,
        json={"items": [{"hostname": "c08u01", "interface": "enp1", "ipv4_cidr": "300.1.1.1/31"}]},
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "invalid_cidr"
    repeated = await admin.post(url, json={"items": [items[1], items[1]]})
    assert repeated.status_code == 422
    assert len((await admin.get(url)).json()["items"]) == 3

    removed = await admin.delete(f"{url}/{listed[0]['id']}")
    assert removed.status_code == 204
    assert len((await admin.get(url)).json()["items"]) == 2
    assert (await admin.delete(f"{url}/{listed[0]['id']}")).status_code == 404
    assert "maas_site.roce_upsert" in await audit_actions(db_sessions, site_id)


async def test_power_credentials_resolve_in_override_order_and_rotate(
    admin: Any, maas_sim: Any, db_sessions: Any, secret_store: Any
) -> None:
    site = await create_site(admin, maas_sim.base_url)
    site_id = uuid.UUID(site["id"])
    url = f"/api/v1/admin/maas-sites/{site_id}/power-overrides"

    async def resolve(**machine: Any) -> tuple[str, str, str]:
        async with db_sessions() as session:
            creds = await resolve_power_credentials(session, secret_store, site_id, **machine)
        assert POWER_PASSWORD not in repr(creds)
        return creds.source, creds.user, creds.password

    with pytest.raises(PowerCredentialsMissing):
        await resolve(hostname="c07u31")
    await admin.post(
        f"/api/v1/admin/maas-sites/{site_id}/credentials",
        json={"maas_api_key": maas_sim.api_key, "power": {"user": "root", "password": "default"}},
    )
    machine = {"pxe_macs": ["AA:BB:CC:00:11:22"], "ipmi_ip": "10.0.0.31", "hostname": "C07U31"}
    assert await resolve(**machine) == ("site_default", "root", "default")

    created = {}
    for selector_type, value, user in (
        ("hostname", "c07u31", "by-host"),
        ("ipmi_ip", "10.0.0.31", "by-ipmi"),
        ("pxe_mac", "aa-bb-cc-00-11-22", "by-mac"),
    ):
        response = await admin.post(
            url,
            json={"selector_type": selector_type, "selector_value": value, "user": user,
                  "password": f"{user}-{POWER_PASSWORD}"},
        )  # fmt: skip
        assert response.status_code == 201, response.text
        assert POWER_PASSWORD not in response.text
        created[selector_type] = response.json()
    assert created["pxe_mac"]["selector_value"] == "aa:bb:cc:00:11:22"

    assert (await resolve(**machine))[:2] == ("override:pxe_mac", "by-mac")
    assert (await resolve(ipmi_ip="10.0.0.31", hostname="c07u31"))[:2] == (
        "override:ipmi_ip",
        "by-ipmi",
    )
    assert (await resolve(hostname="c07u31"))[:2] == ("override:hostname", "by-host")
    assert (await resolve(hostname="c07u32"))[0] == "site_default"

    # Rotation: the next resolution sees the new secret, no restart.
    mac_id = created["pxe_mac"]["id"]
    rotated = await admin.patch(f"{url}/{mac_id}", json={"user": "by-mac-2", "password": "new"})
    assert rotated.status_code == 200
    assert await resolve(**machine) == ("override:pxe_mac", "by-mac-2", "new")
    # A disabled override no longer matches.
    await admin.patch(f"{url}/{mac_id}", json={"status": "disabled"})
    assert (await resolve(**machine))[0] == "override:ipmi_ip"

    duplicate = await admin.post(
        url, json={"selector_type": "hostname", "selector_value": "C07U31", "user": "x",
                   "password": "y"},
    )  # fmt: skip
    assert duplicate.status_code == 409
    invalid = await admin.post(
        url, json={"selector_type": "pxe_mac", "selector_value": "nope", "user": "x",
                   "password": "y"},
    )  # fmt: skip
    assert invalid.status_code == 422

    host_id = created["hostname"]["id"]
    assert (await admin.delete(f"{url}/{host_id}")).status_code == 204
    assert await secret_store.read(created["hostname"]["vault_path"]) is None
    listed = (await admin.get(url)).json()["items"]
    assert sorted(o["selector_type"] for o in listed) == ["ipmi_ip", "pxe_mac"]


async def test_site_owns_its_reconciler_schedule(
    admin: Any, maas_sim: Any, temporal_client: Any
) -> None:
    from contracts.maas_reconciler import reconciler_schedule_id

    site = await create_site(admin, maas_sim.base_url)
    handle = temporal_client.get_schedule_handle(reconciler_schedule_id(site["id"]))

    async def state() -> tuple[bool, float]:
        described = await handle.describe()
        every = described.schedule.spec.intervals[0].every.total_seconds()
        return described.schedule.state.paused, every

    assert await state() == (False, 300.0)
    await admin.delete(f"/api/v1/admin/maas-sites/{site['id']}")
    assert await state() == (True, 300.0)
    await admin.patch(
        f"/api/v1/admin/maas-sites/{site['id']}",
        json={"status": "active", "policy": {"reconcile_interval_seconds": 60}},
    )
    assert await state() == (False, 60.0)
    await handle.delete()


async def test_vault_down_answers_503_and_writes_nothing(
    api: Any, make_token: Any, settings: Any, maas_sim: Any, db_sessions: Any,
    start_admin_worker: Any,
) -> None:  # fmt: skip
    down = dataclasses.replace(
        settings, vault_addr=f"http://127.0.0.1:{free_port()}", vault_token="t"
    )
    await start_admin_worker(down)  # the worker, which writes Vault, finds it down
    admin = await api(token=await make_token("admin"), settings=down)
    site = await create_site(admin, maas_sim.base_url)
    response = await admin.post(
        f"/api/v1/admin/maas-sites/{site['id']}/credentials",
        json={"maas_api_key": maas_sim.api_key},
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "secret_store_unavailable"
    assert maas_sim.api_key.split(":")[2] not in response.text
    assert "maas_site.credentials_write" not in await audit_actions(db_sessions, site["id"])
    probe = await admin.post(f"/api/v1/admin/maas-sites/{site['id']}/probe")
    assert probe.status_code == 503
