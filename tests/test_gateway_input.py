"""Hostile and sloppy input: every refusal has the documented status and code, never a 500, never
echoes secrets, and leaves nothing behind in the database or in Temporal."""

from __future__ import annotations

import json
import uuid

import pytest
from temporalio.service import RPCError, RPCStatusCode

from contracts.allocation import allocation_workflow_id
from gateway.allocations import allocation_id_for
from schema.models import Allocation, AuditEntry, Project, SshKey
from tests.gateway_fixtures import bearer, ed25519_private_key, ed25519_public_key, rsa_public_key
from tests.test_gateway_auth import assert_error

VALID_ALLOCATION = {"sku": "h100.slice", "gpus": 1, "region": "test-region-1", "ssh_key_ids": []}


@pytest.fixture
async def tenant(api, make_project, make_token):
    project = await make_project()
    client = await api(token=await make_token("tenant", project))
    client.project = project  # type: ignore[attr-defined]
    return client


async def assert_nothing_created(count_rows) -> None:
    assert await count_rows(Allocation) == 0
    assert await count_rows(SshKey) == 0
    assert await count_rows(AuditEntry) == 0


@pytest.mark.parametrize("path", ["/api/v1/allocations", "/api/v1/ssh-keys"])
@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{", "malformed_json"),
        (b"not json", "malformed_json"),
        (b'{"sku": "a",}', "malformed_json"),
        (b"\xff\xfe", "malformed_json"),
        # JSON, but not the body the route takes:
        (b"[]", "invalid_request"),
        (b'"a string"', "invalid_request"),
        (b"null", "invalid_request"),
        (b"", "invalid_request"),
    ],
)
async def test_malformed_json_is_400(tenant, count_rows, path, raw, code):
    response = await tenant.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400, code)
    await assert_nothing_created(count_rows)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"gpus": "two"}, "gpus"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": 65}, "gpus"),
        ({"gpus": 1.5}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"sku": ""}, "sku"),
        ({"sku": 7}, "sku"),
        ({"region": "x" * 51}, "region"),
        ({"ssh_key_ids": ["not-a-uuid"]}, "ssh_key_ids"),
        ({"ssh_key_ids": "a"}, "ssh_key_ids"),
        ({"ssh_key_ids": [str(uuid.uuid4()) for _ in range(33)]}, "ssh_key_ids"),
        ({"surprise": 1}, "surprise"),
    ],
)
async def test_wrong_allocation_fields_are_400_with_details(tenant, count_rows, change, where):
    body = {**VALID_ALLOCATION, **change}
    response = await tenant.post("/api/v1/allocations", json=body)
    error = assert_error(response, 400, "invalid_request")["error"]
    assert error["details"]["errors"], error
    assert any(where in json.dumps(e) for e in error["details"]["errors"]), error
    await assert_nothing_created(count_rows)


async def test_missing_fields_are_400(tenant, count_rows):
    for field in VALID_ALLOCATION:
        body = {k: v for k, v in VALID_ALLOCATION.items() if k != field}
        response = await tenant.post("/api/v1/allocations", json=body)
        error = assert_error(response, 400, "invalid_request")["error"]
        assert field in json.dumps(error["details"]), error
    await assert_nothing_created(count_rows)


@pytest.mark.parametrize("path", ["/api/v1/allocations", "/api/v1/ssh-keys"])
async def test_oversized_body_is_413(tenant, settings, count_rows, path):
    padding = "x" * (settings.max_request_body_bytes + 1)
    response = await tenant.post(path, json={"name": "k", "public_key": padding})
    assert_error(response, 413, "payload_too_large")
    await assert_nothing_created(count_rows)


async def test_oversized_admin_body_is_413(api, make_token, settings, count_rows):
    client = await api(token=await make_token("admin"))
    response = await client.post(
        "/api/v1/admin/projects", content=b"{" + b" " * settings.max_request_body_bytes + b"}"
    )
    assert_error(response, 413, "payload_too_large")
    assert await count_rows(Project) == 0


@pytest.mark.parametrize(
    "key",
    [
        "",
        "x" * 201,
        "tab\there",
        b"caf\xc3\xa9",  # non-ASCII
        # A control character is 422 invalid_text, as in any parameter (test_hostile_input).
    ],
)
async def test_bad_idempotency_key_is_400_and_starts_nothing(
    tenant, count_rows, temporal_client, key
):
    response = await tenant.post(
        "/api/v1/allocations", json=VALID_ALLOCATION, headers={"X-Idempotency-Key": key}
    )
    error = assert_error(response, 400, "invalid_request")["error"]
    assert error["details"] == {"header": "X-Idempotency-Key"}
    await assert_nothing_created(count_rows)


async def test_foreign_ssh_key_is_422_and_starts_nothing(
    tenant, make_project, make_ssh_key, count_rows, temporal_client
):
    other = await make_project()
    foreign = await make_ssh_key(other)
    own = await make_ssh_key(tenant.project)
    key = "retry-me-" + uuid.uuid4().hex
    response = await tenant.post(
        "/api/v1/allocations",
        json={**VALID_ALLOCATION, "ssh_key_ids": [str(own.id), str(foreign.id), str(own.id)]},
        headers={"X-Idempotency-Key": key},
    )
    error = assert_error(response, 422, "ssh_key_not_found")["error"]
    assert error["details"] == {"ssh_key_ids": [str(foreign.id)]}
    assert await count_rows(Allocation) == 0
    workflow_id = allocation_workflow_id(str(allocation_id_for(tenant.project.id, key)))
    with pytest.raises(RPCError) as missing:
        await temporal_client.get_workflow_handle(workflow_id).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/api/v1/allocations", {"limit": "0"}),
        ("/api/v1/allocations", {"limit": "201"}),
        ("/api/v1/allocations", {"limit": "many"}),
        ("/api/v1/allocations", {"status": "sleeping"}),
        ("/api/v1/allocations", {"cursor": "garbage!"}),
        ("/api/v1/allocations", {"cursor": "eyJjIjoxfQ"}),  # valid base64, wrong content
        ("/api/v1/ssh-keys", {"limit": "-1"}),
    ],
)
async def test_bad_query_parameters_are_400(tenant, path, params):
    assert_error(await tenant.get(path, params=params), 400, "invalid_request")


async def test_unknown_routes_and_methods(tenant):
    assert_error(await tenant.get("/api/v1/nothing-here"), 404, "not_found")
    assert_error(await tenant.get("/api/v2/allocations"), 404, "not_found")
    assert_error(await tenant.put("/api/v1/allocations"), 405, "method_not_allowed")
    for path in ("/api/v1/allocations/not-a-uuid", "/api/v1/ssh-keys/1%27%20OR%201=1"):
        response = await tenant.get(path)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["code"] in ("invalid_request", "not_found")


_BAD_KEY_REASONS = {
    "private key",
    "garbage",
    "no data",
    "not base64",
    "unsupported type",
    "short RSA",
    "type mismatch",
    "options",
    "truncated",
    "two lines",
    "embedded type differs",
}


@pytest.mark.parametrize(
    ("public_key", "why"),
    [
        (ed25519_private_key(), "private key"),
        # A truncated fake, spelled in pieces so secret scanners do not mistake it for a key.
        (
            "-----BEGIN RSA " + "PRIVATE KEY-----\nMIIEow\n-----END RSA " + "PRIVATE KEY-----",
            "private key",
        ),
        ("garbage", "garbage"),
        ("ssh-ed25519", "no data"),
        ("ssh-ed25519 !!!notbase64!!!", "not base64"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "unsupported type"),
        (rsa_public_key(1024), "short RSA"),
        (ed25519_public_key().replace("ssh-ed25519", "ssh-rsa", 1), "type mismatch"),
        ('command="rm -rf /" ' + ed25519_public_key(), "options"),
        (ed25519_public_key(comment="")[:-8], "truncated"),
        (ed25519_public_key() + "\n" + ed25519_public_key(), "two lines"),
        ("ecdsa-sha2-nistp256 " + ed25519_public_key().split()[1], "embedded type differs"),
    ],
    # Named by the reason, never by the (freshly generated) key: pytest-xdist's workers must
    # collect the same test names.
    ids=lambda value: value if value in _BAD_KEY_REASONS else "",
)
async def test_bad_ssh_keys_are_422(tenant, count_rows, public_key, why):
    response = await tenant.post("/api/v1/ssh-keys", json={"name": "bad", "public_key": public_key})
    assert_error(response, 422, "ssh_key_invalid")
    # The refusal never quotes what was sent.
    for part in public_key.split():
        if len(part) > 24:
            assert part not in response.text, why
    await assert_nothing_created(count_rows)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "", "public_key": "x"},
        {"name": "has/slash", "public_key": "x"},
        {"name": "n" * 101, "public_key": "x"},
        {"name": "ok", "public_key": ""},
        {"name": "ok"},
        {"name": "ok", "public_key": 5},
    ],
)
async def test_bad_ssh_key_fields_are_400(tenant, count_rows, body):
    assert_error(await tenant.post("/api/v1/ssh-keys", json=body), 400, "invalid_request")
    await assert_nothing_created(count_rows)


async def test_bad_admin_input(api, make_token, count_rows):
    client = await api(token=await make_token("admin"))
    for body in (
        {"name": ""},
        {"name": "ok", "unknown": 1},
        {"name": "x" * 101},
        {"name": "ok", "reason": ""},
    ):
        assert_error(await client.post("/api/v1/admin/projects", json=body), 400, "invalid_request")
    for body in (
        {"name": "t", "role": "root"},
        {"name": "t", "role": "tenant", "project_id": "nope"},
    ):
        assert_error(await client.post("/api/v1/admin/tokens", json=body), 400, "invalid_request")
    alloc = f"/api/v1/admin/allocations/{uuid.uuid4()}/force-release"
    assert_error(await client.post(alloc, json={}), 400, "invalid_request")
    assert_error(await client.post(alloc, json={"reason": ""}), 400, "invalid_request")
    assert_error(await client.post(alloc, json={"reason": "r" * 501}), 400, "invalid_request")
    too_long = {"X-Audit-Reason": "r" * 501}
    assert_error(
        await client.post("/api/v1/admin/projects", json={"name": "ok"}, headers=too_long),
        400,
        "invalid_request",
    )
    assert_error(
        await client.get("/api/v1/admin/allocations", params={"project_id": "x"}),
        400,
        "invalid_request",
    )
    assert await count_rows(Project) == 0
    assert await count_rows(AuditEntry) == 0


async def test_errors_never_echo_bearer_tokens(api, make_token):
    token = await make_token("tenant", revoked=True)
    client = await api()
    response = await client.get("/api/v1/ssh-keys", headers=bearer(token))
    assert response.status_code == 401
    assert token not in response.text
    assert token[4:] not in response.text
