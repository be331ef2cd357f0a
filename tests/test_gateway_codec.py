"""The remote codec endpoint for Temporal Web: protocol round trips with payloads produced by
core.codec and by the real Temporal client, admin-only (bearer or session cookie), CORS."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

import pytest
import uvicorn
from temporalio.api.common.v1 import Payload

from core.codec import ENCODING, AesGcmPayloadCodec
from devstack.processes import free_port
from devstack.temporal import temporal_cli_path
from gateway import codec_session
from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.gateway_fixtures import TEMPORAL_UI_ORIGIN, bearer
from tests.lifecycle_support import server_started
from tests.test_gateway_auth import assert_error

DECODE = "/api/v1/admin/codec/decode"
ENCODE = "/api/v1/admin/codec/encode"
SESSION = "/api/v1/admin/codec/session"


def to_json(payloads: list[Payload]) -> dict:
    return {
        "payloads": [
            {
                "metadata": {k: base64.b64encode(v).decode() for k, v in p.metadata.items()},
                "data": base64.b64encode(p.data).decode(),
            }
            for p in payloads
        ]
    }


def from_json(body: dict) -> list[Payload]:
    return [
        Payload(
            metadata={k: base64.b64decode(v) for k, v in p["metadata"].items()},
            data=base64.b64decode(p["data"]),
        )
        for p in body["payloads"]
    ]


def plain(data: bytes) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=data)


@pytest.fixture
async def admin(api, make_token):
    return await api(token=await make_token("admin"))


async def test_decode_round_trip_with_core_codec(admin, settings):
    codec = AesGcmPayloadCodec(settings.codec_key)
    originals = [plain(b'{"ssh_public_keys": ["ssh-ed25519 AAAA"]}'), plain(b'"hello"')]
    encrypted = await codec.encode(originals)
    assert all(p.metadata["encoding"] == ENCODING for p in encrypted)

    response = await admin.post(DECODE, json=to_json(encrypted), headers={"X-Namespace": "default"})
    assert response.status_code == 200, response.text
    assert from_json(response.json()) == originals


async def test_encode_then_decode_locally(admin, settings):
    originals = [plain(b'"secret-ish"'), Payload(metadata={}, data=b"")]
    response = await admin.post(ENCODE, json=to_json(originals))
    assert response.status_code == 200, response.text
    encrypted = from_json(response.json())
    assert all(p.metadata["encoding"] == ENCODING for p in encrypted)
    assert b"secret-ish" not in b"".join(p.data for p in encrypted)
    assert await AesGcmPayloadCodec(settings.codec_key).decode(encrypted) == originals


async def test_decodes_what_the_temporal_client_wrote(admin, temporal_client):
    """The payload exactly as Temporal history holds it (the client's converter with codec)."""
    value = {"allocation_id": str(uuid.uuid4()), "gpus": 2}
    encoded = await temporal_client.data_converter.encode([value])
    assert encoded[0].metadata["encoding"] == ENCODING
    response = await admin.post(DECODE, json=to_json(list(encoded)))
    assert response.status_code == 200
    decoded = from_json(response.json())
    assert decoded[0].metadata["encoding"] == b"json/plain"
    assert temporal_client.data_converter.payload_converter.from_payloads(decoded) == [value]


async def test_unencrypted_payloads_pass_through_and_empty_is_fine(admin):
    unencrypted = [plain(b"1")]
    response = await admin.post(DECODE, json=to_json(unencrypted))
    assert from_json(response.json()) == unencrypted
    empty = await admin.post(DECODE, json={"payloads": []})
    assert empty.json() == {"payloads": []}


async def test_foreign_key_and_bad_base64(admin):
    foreign = await AesGcmPayloadCodec(b"k" * 32).encode([plain(b'"x"')])
    assert_error(await admin.post(DECODE, json=to_json(foreign)), 422, "payload_undecodable")
    tampered = await AesGcmPayloadCodec(b"k" * 32).encode([plain(b'"x"')])
    bad_json = to_json(tampered)
    bad_json["payloads"][0]["data"] = "***"
    assert_error(await admin.post(DECODE, json=bad_json), 400, "invalid_request")
    assert_error(await admin.post(DECODE, json={"payloads": "x"}), 400, "invalid_request")


async def test_codec_is_admin_only(api, make_token):
    payload = to_json([plain(b"1")])
    tenant = await api(token=await make_token("tenant"))
    assert_error(await tenant.post(DECODE, json=payload), 403, "forbidden")
    assert_error(await tenant.post(ENCODE, json=payload), 403, "forbidden")
    assert_error(await tenant.post(SESSION), 403, "forbidden")
    anonymous = await api()
    assert_error(await anonymous.post(DECODE, json=payload), 401, "unauthenticated")
    revoked = await api(token=await make_token("admin", revoked=True))
    assert_error(await revoked.post(DECODE, json=payload), 401, "unauthenticated")


async def test_session_cookie_lets_the_browser_decode(api, make_token, settings, token_row):
    admin_token = await make_token("admin")
    client = await api()
    created = await client.post(SESSION, headers=bearer(admin_token))
    assert created.status_code == 200, created.text
    set_cookie = created.headers["set-cookie"]
    assert set_cookie.startswith(f"{codec_session.COOKIE_NAME}=")
    lowered = set_cookie.lower()
    assert "httponly" in lowered
    assert "samesite=lax" in lowered
    assert f"path={codec_session.COOKIE_PATH}".lower() in lowered
    assert "max-age=" in lowered
    value = client.cookies[codec_session.COOKIE_NAME]
    assert admin_token not in value
    assert admin_token[4:] not in value
    assert str((await token_row(admin_token)).id) in value  # an id, signed, never the token

    # The browser (Temporal Web's origin) calls with the cookie and no Authorization header.
    payloads = await AesGcmPayloadCodec(settings.codec_key).encode([plain(b'"from-ui"')])
    decoded = await client.post(
        DECODE,
        json=to_json(payloads),
        headers={"Origin": TEMPORAL_UI_ORIGIN, "X-Namespace": "default"},
    )
    assert decoded.status_code == 200, decoded.text
    assert from_json(decoded.json()) == [plain(b'"from-ui"')]
    assert decoded.headers["access-control-allow-origin"] == TEMPORAL_UI_ORIGIN
    assert decoded.headers["access-control-allow-credentials"] == "true"

    # The cookie is only a codec credential: it opens nothing else.
    assert_error(await client.get("/api/v1/admin/projects"), 401, "unauthenticated")
    assert_error(await client.post(SESSION), 401, "unauthenticated")

    # Dropping the session clears the cookie.
    dropped = await client.delete(SESSION)
    assert dropped.status_code == 204
    assert codec_session.COOKIE_NAME not in client.cookies
    assert_error(await client.post(DECODE, json=to_json(payloads)), 401, "unauthenticated")


async def test_session_audited(api, make_token):
    client = await api(token=await make_token("admin", name="ops-bob"))
    assert (await client.post(SESSION)).status_code == 200
    audit = await client.get("/api/v1/admin/audit", params={"action": "codec.session_create"})
    (entry,) = audit.json()["items"]
    assert entry["actor"] == "ops-bob"
    assert entry["target_type"] == "api_token"


async def test_bad_cookies_are_refused(api, make_token, settings, token_row, db_sessions):
    key = codec_session.signing_key(settings.codec_key)
    admin_id = (await token_row(await make_token("admin"))).id
    tenant_id = (await token_row(await make_token("tenant"))).id
    revoked_id = (await token_row(await make_token("admin", revoked=True))).id
    payload = to_json([plain(b"1")])

    good, _ = codec_session.issue(key, admin_id, 60)
    expired, _ = codec_session.issue(key, admin_id, 60, now=0)
    forged, _ = codec_session.issue(b"not-the-key" * 3, admin_id, 60)
    tampered = good.replace(str(admin_id), str(uuid.uuid4()))
    revoked, _ = codec_session.issue(key, revoked_id, 60)
    tenant, _ = codec_session.issue(key, tenant_id, 60)

    async def call(cookie: str):
        client = await api()
        return await client.post(
            DECODE, json=payload, headers={"Cookie": f"{codec_session.COOKIE_NAME}={cookie}"}
        )

    assert (await call(good)).status_code == 200
    for cookie in (expired, forged, tampered, revoked, "v1.x.y.z", ""):
        assert_error(await call(cookie), 401, "unauthenticated")
    assert_error(await call(tenant), 403, "forbidden")


async def test_cors_preflight(api):
    client = await api()
    allowed = await client.options(
        DECODE,
        headers={
            "Origin": TEMPORAL_UI_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-namespace",
        },
    )
    assert allowed.status_code == 204, allowed.text
    assert allowed.headers["access-control-allow-origin"] == TEMPORAL_UI_ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    allowed_headers = allowed.headers["access-control-allow-headers"].lower()
    assert "content-type" in allowed_headers
    assert "x-namespace" in allowed_headers

    other = await client.options(
        DECODE,
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers

    # A simple request from another origin gets no CORS grant either.
    plain_other = await client.post(DECODE, json={}, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in plain_other.headers


async def test_temporal_cli_decodes_history_through_the_endpoint(
    settings, temporal_client, make_token
):
    """Temporal's own client of the codec protocol (`temporal workflow show --codec-endpoint`)
    reads an encrypted history through the gateway, served over real HTTP."""
    marker = f"decoded-{uuid.uuid4()}"
    handle = await temporal_client.start_workflow(
        "NoSuchWorkflowType", {"marker": marker}, id=f"codec-{uuid.uuid4()}",
        task_queue=f"nobody-{uuid.uuid4()}",
    )  # fmt: skip
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, temporal_client=temporal_client, config=GatewayConfig()),
            host="127.0.0.1", port=port, log_level="warning", lifespan="on",
        )
    )  # fmt: skip
    serving = asyncio.create_task(server.serve())
    try:
        await server_started(server, serving, timeout=10)
        token = await make_token("admin")
        base = [
            str(temporal_cli_path(build=False)), "workflow", "show", "-w", handle.id,
            "--address", temporal_client.service_client.config.target_host, "-o", "json",
        ]  # fmt: skip
        codec = [
            "--codec-endpoint", f"http://127.0.0.1:{port}/api/v1/admin/codec",
            "--codec-auth", f"Bearer {token}",
        ]  # fmt: skip
        for args, readable in ((base, False), (base + codec, True)):
            process = await asyncio.create_subprocess_exec(
                *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await asyncio.wait_for(process.communicate(), timeout=30)
            assert process.returncode == 0, err.decode()
            started = json.loads(out)["events"][0]["workflowExecutionStartedEventAttributes"]
            (payload,) = started["input"]["payloads"]
            encoding = base64.b64decode(payload["metadata"]["encoding"])
            data = base64.b64decode(payload["data"])
            assert (encoding == b"json/plain") is readable
            assert (marker.encode() in data) is readable
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout=10)
        await handle.terminate("test over")
