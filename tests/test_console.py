"""The operator console over HTTP (gateway/console/): sign-in trades an admin token for a signed
session cookie that opens the console and the codec endpoint; tenants open nothing; forms need
the session's form token and the console's own origin. What the pages show, and the actions
they send, are driven in a real browser by tests/test_console_browser.py."""

from __future__ import annotations

import datetime as dt
import re
import uuid

from core.codec import AesGcmPayloadCodec
from gateway import codec_session
from schema.models import MaasSite, NodeDriftEvent, NodeMaasState
from tests.factories import REGION, create_node, create_sku
from tests.gateway_fixtures import TEMPORAL_UI_ORIGIN, bearer
from tests.test_gateway_codec import DECODE, from_json, plain, to_json

PAGES = [
    "/console/",
    "/console/inventory",
    "/console/jobs",
    "/console/allocations",
    "/console/drift",
    f"/console/nodes/{uuid.uuid4()}",
    f"/console/onboardings/{uuid.uuid4()}",
    f"/console/decommissions/{uuid.uuid4()}",
    f"/console/batches/{uuid.uuid4()}",
    f"/console/allocations/{uuid.uuid4()}",
]


async def sign_in(client, token: str):
    return await client.post(
        "/console/sign-in",
        data={"token": token, "next": "/console/drift"},
        follow_redirects=False,
    )


def error_code(page: str) -> str:
    match = re.search(r'data-testid="error-code">([a-z_]+)<', page)
    assert match, page
    return match.group(1)


async def test_admin_sign_in_opens_the_console_and_the_codec(api, make_token, settings, token_row):
    admin_token = await make_token("admin", name="ops-alice")
    client = await api()
    signed_in = await sign_in(client, admin_token)
    assert signed_in.status_code == 303, signed_in.text
    assert signed_in.headers["location"] == "/console/drift"
    set_cookie = signed_in.headers["set-cookie"].lower()
    assert set_cookie.startswith(f"{codec_session.CONSOLE_COOKIE_NAME}=")
    assert "httponly" in set_cookie
    assert "samesite=lax" in set_cookie
    assert "path=/;" in set_cookie
    assert "secure" not in set_cookie  # plain http here; https requests get Secure
    value = client.cookies[codec_session.CONSOLE_COOKIE_NAME]
    assert admin_token not in value
    assert admin_token[4:] not in value
    assert str((await token_row(admin_token)).id) in value  # an id, signed, never the token

    for path in ("/console/inventory", "/console/jobs", "/console/allocations", "/console/drift"):
        page = await client.get(path)
        assert page.status_code == 200, (path, page.text)
        assert "ops-alice" in page.text
        assert admin_token not in page.text

    # Temporal Web (another origin) decodes with the console's cookie and no bearer token.
    payloads = await AesGcmPayloadCodec(settings.codec_key).encode([plain(b'"from-console"')])
    decoded = await client.post(
        DECODE, json=to_json(payloads), headers={"Origin": TEMPORAL_UI_ORIGIN}
    )
    assert decoded.status_code == 200, decoded.text
    assert from_json(decoded.json()) == [plain(b'"from-console"')]
    assert decoded.headers["access-control-allow-credentials"] == "true"

    # The session is audited; the cookie is no API credential.
    admin = await api(token=admin_token)
    audit = await admin.get("/api/v1/admin/audit", params={"action": "console.session_create"})
    (entry,) = audit.json()["items"]
    assert entry["actor"] == "ops-alice"
    assert admin_token not in audit.text
    assert (await client.get("/api/v1/admin/projects")).status_code == 401

    # Signing out drops the cookie: pages ask for a sign-in again, the codec refuses.
    await client.post("/console/sign-out")
    assert codec_session.CONSOLE_COOKIE_NAME not in client.cookies
    again = await client.get("/console/inventory", follow_redirects=False)
    assert again.status_code == 303
    assert (await client.post(DECODE, json=to_json(payloads))).status_code == 401


async def test_a_tenant_token_opens_no_console_page(api, make_token):
    tenant_token = await make_token("tenant")
    client = await api()
    refused = await sign_in(client, tenant_token)
    assert refused.status_code == 403
    assert error_code(refused.text) == "forbidden"
    assert codec_session.CONSOLE_COOKIE_NAME not in client.cookies
    # A bad token is 401, with the API's code.
    bad = await sign_in(client, "gpc_" + "x" * 40)
    assert bad.status_code == 401
    assert error_code(bad.text) == "unauthenticated"

    # A bearer header is no console session: every page sends the browser to the sign-in form.
    for path in PAGES:
        for headers in ({}, bearer(tenant_token)):
            page = await client.get(path, headers=headers, follow_redirects=False)
            assert page.status_code == 303, (path, page.status_code)
            assert page.headers["location"].startswith("/console/sign-in?next=")
    posted = await client.post(
        f"/console/drift/{uuid.uuid4()}/resolve",
        data={"reason": "x", "csrf_token": "x"},
        headers=bearer(tenant_token),
    )
    assert posted.status_code == 401


async def test_forged_or_foreign_requests_are_refused(api, make_token, settings):
    admin_token = await make_token("admin")
    client = await api()
    await sign_in(client, admin_token)
    node_id = uuid.uuid4()

    # Without the session's form token (a page of another origin cannot read it).
    forged = await client.post(
        f"/console/drift/{node_id}/resolve", data={"reason": "looks fine", "csrf_token": "nope"}
    )
    assert forged.status_code == 403
    assert error_code(forged.text) == "csrf_failed"

    # Temporal Web's origin may call the codec with credentials, but not the console.
    foreign = await client.get("/console/inventory", headers={"Origin": TEMPORAL_UI_ORIGIN})
    assert foreign.status_code == 403
    assert error_code(foreign.text) == "cross_origin_refused"

    # A tampered or expired cookie is no session.
    key = codec_session.console_signing_key(settings.codec_key)
    expired, _ = codec_session.issue(key, uuid.uuid4(), -10)
    codec_cookie, _ = codec_session.issue(
        codec_session.signing_key(settings.codec_key), node_id, 60
    )
    for cookie in (expired, codec_cookie, "v1.x.y.z"):
        fresh = await api()
        fresh.cookies.set(codec_session.CONSOLE_COOKIE_NAME, cookie)
        page = await fresh.get("/console/inventory", follow_redirects=False)
        assert page.status_code == 303, cookie


async def test_each_action_form_posts_to_its_kinds_actions(api, make_token, settings):
    """One form handler serves every job kind's actions, at the admin API's spellings, and one
    an allocation's: an unknown action or target is 404, and the form token is checked before
    anything is sent."""
    client = await api()
    await sign_in(client, await make_token("admin"))
    form_token = codec_session.csrf_token(
        codec_session.console_signing_key(settings.codec_key),
        client.cookies[codec_session.CONSOLE_COOKIE_NAME],
    )
    for kind, action, listed in [
        ("onboardings", "retry", "one of: retry, resume"),
        ("decommissions", "retry", "one of: retry, resume"),
        ("allocations", "force-release", "one of: force-release, detach"),
        ("allocations", "detach", "one of: force-release, detach"),
    ]:
        target = f"/console/{kind}/{uuid.uuid4()}"
        unknown = await client.post(
            f"{target}/reboot", data={"reason": "x", "csrf_token": form_token}
        )
        assert unknown.status_code == 404, (kind, unknown.text)
        assert listed in unknown.text
        forged = await client.post(f"{target}/{action}", data={"reason": "x", "csrf_token": "no"})
        assert forged.status_code == 403, kind
        assert error_code(forged.text) == "csrf_failed"
        missing = await client.post(
            f"{target}/{action}", data={"reason": "x", "csrf_token": form_token}
        )
        assert missing.status_code == 404, (kind, missing.text)
        assert error_code(missing.text) == "not_found"


async def test_the_drift_page_shows_each_open_drifts_severity_as_the_api(
    api, make_token, db_sessions
):
    """The severity of a node's open drift is its rule's latest event (the admin API's drift
    list), not whatever the node's latest drift event of another rule says."""
    await create_sku(db_sessions)
    node = await create_node(db_sessions)
    site_id = uuid.uuid4()
    now = dt.datetime.now(dt.UTC)
    async with db_sessions() as session, session.begin():
        session.add(
            MaasSite(
                id=site_id,
                name=f"console-{site_id.hex[:6]}",
                region_code=REGION,
                api_base_url="http://127.0.0.1:9/MAAS",
                api_token_vault_path=f"kv/maas-sites/{site_id}/api-token",
                default_power_creds_vault_path=f"kv/maas-sites/{site_id}/power/default",
                deploy_password_vault_path=f"kv/maas-sites/{site_id}/deploy-password",
                pxe_iface="ens19",
                pxe_vlan_vid=46,
                node_pxe_iface="eno8303",
            )
        )
        await session.flush()
        session.add(
            NodeMaasState(
                node_id=node.id,
                site_id=site_id,
                maas_system_id="abc123",
                drift_detected=True,
                drift_rule="released_outside_workflow",
            )
        )
        await session.flush()
        session.add_all(
            [
                NodeDriftEvent(
                    node_id=node.id,
                    site_id=site_id,
                    rule="released_outside_workflow",
                    severity="CRITICAL",
                    occurred_at=now - dt.timedelta(minutes=5),
                ),
                NodeDriftEvent(
                    node_id=node.id,
                    site_id=site_id,
                    rule="hw_sync_stale",
                    severity="INFO",
                    occurred_at=now,
                ),
            ]
        )
    admin_token = await make_token("admin")
    listed = await (await api(token=admin_token)).get("/api/v1/admin/reconciliation/drift")
    assert [d["severity"] for d in listed.json()["items"]] == ["CRITICAL"]

    client = await api()
    await sign_in(client, admin_token)
    page = await client.get("/console/drift")
    assert page.status_code == 200, page.text
    row = re.search(rf'<tr data-node="{node.hostname}">.*?</tr>', page.text, re.S)
    assert row, page.text
    assert '<span class="badge sev-critical">CRITICAL</span>' in row.group(0)
    # Both events are in the alerts, each with its own severity.
    alerts = re.search(r'data-testid="alerts">.*?</table>', page.text, re.S)
    assert alerts
    assert "hw_sync_stale" in alerts.group(0)
    assert '<span class="badge sev-info">INFO</span>' in alerts.group(0)
