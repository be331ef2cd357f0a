"""Hostile input (issue 38) through the HTTP API: every byte a tenant or an operator can send
gets a clear 4xx with a machine-readable code, one log line and no traceback, before anything is
stored or any workflow started; nothing it sends can wedge a lifecycle."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from schema.models import (
    Allocation,
    AllocationGroup,
    AuditEntry,
    LedgerEntry,
    StorageNamespace,
)
from tests.lifecycle_support import Tenant, create_fleet, eventually, slice_request, wait_status

GROUPS = "/api/v1/allocation-groups"
NAMESPACES = "/api/v1/storage/namespaces"
JSON = {"Content-Type": "application/json"}


def error_of(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    return error


def assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """A refusal is one line with its code: no traceback, no unhandled error."""
    assert "Traceback" not in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def deep(levels: int) -> bytes:
    return b'{"a":' * levels + b"1" + b"}" * levels


# --- strict decoding: no type coercion (no worker needed: nothing may start) ---


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"gpus": "1"}, "gpus"),
        ({"gpus": 1.0}, "gpus"),
        ({"sku": 1}, "sku"),
        ({"ssh_key_ids": [1]}, "ssh_key_ids"),
    ],
)
async def test_wrong_json_types_are_not_coerced(
    tenant: Tenant, count_rows: Any, change: dict[str, Any], key: str
) -> None:
    body = {**slice_request(1), **change}
    error = error_of(await tenant.client.post("/api/v1/allocations", json=body), 400,
                     "invalid_request")  # fmt: skip
    assert any(key in e.get("key", "") for e in error["details"]["errors"]), error
    group = await tenant.client.post(f"{GROUPS}/", json={"members": [body]})
    error_of(group, 400, "invalid_request")
    assert await count_rows(Allocation) == 0
    assert await count_rows(AllocationGroup) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"name": "ns", "quota_bytes": "1e3"},
        {"name": "ns", "quota_bytes": "1000"},
        {"name": "ns", "quota_bytes": 1000, "allow_multi_writer": "true"},
    ],
)
async def test_namespace_fields_are_not_coerced(
    tenant: Tenant, count_rows: Any, body: dict[str, Any]
) -> None:
    error_of(await tenant.client.post(NAMESPACES, json=body), 400, "invalid_request")
    assert await count_rows(StorageNamespace) == 0


async def test_credit_amount_is_not_coerced(tenant: Tenant, admin: Any, count_rows: Any) -> None:
    entries = await count_rows(LedgerEntry)
    response = await admin.post(
        f"/api/v1/admin/billing/accounts/{tenant.project_id}/credits",
        json={"amount_minor": "5000", "idempotency_key": "k1", "reason": "goodwill"},
    )
    error_of(response, 400, "invalid_request")
    assert await count_rows(LedgerEntry) == entries


# --- text PostgreSQL cannot store: refused at the edge as 422 invalid_text ---


@pytest.mark.parametrize("field", ["sku", "region"])
@pytest.mark.parametrize("bad", ["h100\x00", "a\x01b", "tab\there", "new\nline", "del\x7f"])
async def test_control_characters_in_tenant_text_are_422_invalid_text(
    tenant: Tenant, count_rows: Any, caplog: pytest.LogCaptureFixture, field: str, bad: str
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.errors")
    body = {**slice_request(1), field: bad}
    error = error_of(await tenant.client.post("/api/v1/allocations", json=body), 422,
                     "invalid_text")  # fmt: skip
    assert error["details"]["errors"][0]["key"] == field
    group = await tenant.client.post(f"{GROUPS}/", json={"members": [slice_request(1), body]})
    error = error_of(group, 422, "invalid_text")
    assert error["details"]["errors"][0]["key"] == f"members[1].{field}"
    assert await count_rows(Allocation) == 0
    assert await count_rows(AllocationGroup) == 0
    assert_quiet(caplog)
    refusals = [r.getMessage() for r in caplog.records if r.name == "gateway.errors"]
    assert refusals == ["POST /api/v1/allocations -> 422 invalid_text",
                        "POST /api/v1/allocation-groups -> 422 invalid_text"]  # fmt: skip


async def test_a_nul_anywhere_in_a_body_is_invalid_text(
    tenant: Tenant, admin: Any, count_rows: Any
) -> None:
    audited = await count_rows(AuditEntry)
    # A key, or a field whose own type would refuse it for another reason: still invalid_text.
    body = {**slice_request(1), "bad\x00key": 1}
    error_of(await tenant.client.post("/api/v1/allocations", json=body), 422, "invalid_text")
    ssh = await tenant.client.post("/api/v1/ssh-keys", json={"name": "k\x00", "public_key": "x"})
    error_of(ssh, 422, "invalid_text")
    # Admin free text: refused before the route looks anything up.
    for path in (
        f"/api/v1/admin/allocations/{uuid.uuid4()}/force-release",
        f"{'/api/v1/admin/allocation-groups'}/{uuid.uuid4()}/force-release",
    ):
        error = error_of(await admin.post(path, json={"reason": "oops\x00"}), 422, "invalid_text")
        assert error["details"]["errors"][0]["key"] == "reason"
    assert await count_rows(AuditEntry) == audited


# --- malformed bodies: 400 with a code, one log line, no traceback ---


TENANT_POSTS = [
    "/api/v1/allocations",
    f"{GROUPS}/",
    "/api/v1/ssh-keys",
    NAMESPACES,
    f"/api/v1/allocations/{uuid.uuid4()}/attachments",
]


# Fixed ids: the attachments path holds a fresh uuid, and pytest-xdist's workers must collect
# the same test names.
@pytest.mark.parametrize(
    "path", TENANT_POSTS, ids=["allocations", "groups", "ssh-keys", "namespaces", "attachments"]
)
@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (deep(1000), "json_too_deep"),
        (deep(10_000), "json_too_deep"),
        (b"[" * 5000 + b"]" * 5000, "json_too_deep"),
        (deep(40), "json_too_deep"),
        (b'{"sku": "\xff\xfe"}', "malformed_json"),
        (b'{"sku": "\xed\xa0\x80"}', "malformed_json"),  # a surrogate, UTF-8 encoded
        (b'{"sku": "\\ud800"}', "malformed_json"),  # a lone surrogate, escaped
        (b"\xff\xfe", "malformed_json"),
        (b"{", "malformed_json"),
    ],
)
async def test_malformed_bodies_are_400_without_traceback(
    tenant: Tenant, caplog: pytest.LogCaptureFixture, path: str, raw: bytes, code: str
) -> None:
    caplog.set_level(logging.INFO)
    error_of(await tenant.client.post(path, content=raw, headers=JSON), 400, code)
    assert_quiet(caplog)


@pytest.mark.parametrize("raw", [deep(1000), b'{"enrollment_token": "\xff"}', b"{"])
async def test_internal_enroll_refuses_malformed_bodies_without_credentials(
    api: Any, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    caplog.set_level(logging.INFO)
    client = await api()
    response = await client.post("/api/v1/internal/agent/enroll", content=raw, headers=JSON)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] in {"json_too_deep", "malformed_json"}
    assert_quiet(caplog)


async def test_nesting_within_the_limit_is_decoded(tenant: Tenant) -> None:
    # 32 levels is the declared limit: such a body reaches validation (an unknown field here).
    nested: Any = 1
    for _ in range(31):
        nested = {"a": nested}
    body = {**slice_request(1), "extra": nested}
    error_of(await tenant.client.post("/api/v1/allocations", json=body), 400, "invalid_request")


# --- consistent semantics across routes ---


@pytest.mark.usefixtures("control_plane")
async def test_group_member_with_a_gpu_count_its_sku_does_not_offer_is_refused_at_post(
    tenant: Tenant, db_sessions: Any, count_rows: Any
) -> None:
    await create_fleet(db_sessions, slice_nodes=0)  # the catalog: the slice SKU offers 1,2,4,8
    for bad in (slice_request(3), slice_request(1, sku="no-such-sku"),
                slice_request(1, region="nowhere")):  # fmt: skip
        response = await tenant.client.post(f"{GROUPS}/", json={"members": [slice_request(1), bad]})
        error = error_of(response, 409, "sku_unavailable")
        assert error["details"]["member"] == 1
        single = await tenant.client.post("/api/v1/allocations", json=bad)
        error_of(single, 409, "sku_unavailable")
    assert await count_rows(AllocationGroup) == 0


@pytest.mark.usefixtures("control_plane")
async def test_namespace_idempotency_key_compares_the_body(tenant: Tenant, count_rows: Any) -> None:
    headers = {"X-Idempotency-Key": "ns-once"}
    body = {"name": "data", "quota_bytes": 1 << 20}
    first = await tenant.client.post(NAMESPACES, json=body, headers=headers)
    assert first.status_code == 201, first.text
    again = await tenant.client.post(NAMESPACES, json=body, headers=headers)
    assert again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"]
    for other in (
        {**body, "quota_bytes": 1 << 21},
        {**body, "name": "other"},
        {**body, "allow_multi_writer": True},
    ):
        reused = await tenant.client.post(NAMESPACES, json=other, headers=headers)
        error_of(reused, 422, "idempotency_key_reused")
    assert await count_rows(StorageNamespace) == 1


async def test_attachments_of_an_unknown_allocation_are_404(tenant: Tenant) -> None:
    response = await tenant.client.get(f"/api/v1/allocations/{uuid.uuid4()}/attachments")
    error_of(response, 404, "not_found")


# --- nothing wedges: a NUL reason for a group's force-release ---


@pytest.mark.usefixtures("control_plane")
async def test_nul_force_release_reason_is_refused_and_the_group_still_releases(
    tenant: Tenant,
    admin: Any,
    api: Any,
    make_project: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.errors")
    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    created = await tenant.client.post(
        f"{GROUPS}/", json={"members": [slice_request(1, tenant.ssh_key_id)]}
    )
    assert created.status_code == 201, created.text
    group_id = created.json()["group_id"]
    member_id = created.json()["members"][0]["allocation_id"]

    async def status_is(wanted: str) -> dict[str, Any] | None:
        body: dict[str, Any] = (await tenant.client.get(f"{GROUPS}/{group_id}")).json()
        return body if body["status"] == wanted else None

    await eventually(lambda: status_is("active"), timeout=30, interval=0.1)

    forced = await admin.post(
        f"/api/v1/admin/allocation-groups/{group_id}/force-release",
        json={"reason": "maintenance\x00window"},
    )
    error = error_of(forced, 422, "invalid_text")
    assert error["details"]["errors"][0]["key"] == "reason"
    assert (await status_is("active")) is not None  # nothing moved, nothing asked

    # Another project's allocation is not visible through its attachments either.
    stranger = await api(token=await make_token("tenant", await make_project()))
    hidden = await stranger.get(f"/api/v1/allocations/{member_id}/attachments")
    error_of(hidden, 404, "not_found")
    assert (await tenant.client.get(f"/api/v1/allocations/{member_id}/attachments")).json()[
        "items"
    ] == []

    released = await tenant.client.post(f"{GROUPS}/{group_id}/release")
    assert released.status_code == 202, released.text
    await eventually(lambda: status_is("released"), timeout=30, interval=0.1)
    await wait_status(tenant.client, member_id, "released")
    assert_quiet(caplog)


# --- query, path and header parameters: the same text rules, no coercion, bounded ---

ALLOCATIONS = "/api/v1/allocations"


@pytest.mark.parametrize(
    ("query", "key"),
    [
        ("status=active%00", "status"),
        ("cursor=a%01b", "cursor"),
        ("cursor=%ff", "cursor"),  # invalid UTF-8, not silently U+FFFD
        ("cursor=%ed%a0%80", "cursor"),  # a UTF-8-encoded lone surrogate
    ],
)
async def test_control_characters_in_query_parameters_are_422_invalid_text(
    tenant: Tenant, caplog: pytest.LogCaptureFixture, query: str, key: str
) -> None:
    error = error_of(await tenant.client.get(f"{ALLOCATIONS}?{query}"), 422, "invalid_text")
    assert error["details"]["errors"] == [
        {"key": key, "source": "query", "code": "invalid_text", "message": error["message"]}
    ]
    assert_quiet(caplog)


async def test_control_characters_in_admin_query_and_path_parameters_are_422(
    admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    audit = await admin.get("/api/v1/admin/audit?target_id=x%00y")
    assert error_of(audit, 422, "invalid_text")["details"]["errors"][0]["key"] == "target_id"
    action = await admin.post(f"/api/v1/admin/decommissions/{uuid.uuid4()}/re%00try", json={})
    error = error_of(action, 422, "invalid_text")
    assert error["details"]["errors"][0]["key"] == "action"
    assert error["details"]["errors"][0]["source"] == "path"
    assert_quiet(caplog)


@pytest.mark.parametrize(
    ("path", "query", "key"),
    [
        (ALLOCATIONS, "limit=1e1", "limit"),  # lax conversion read 10
        (ALLOCATIONS, "limit=5.0", "limit"),  # lax conversion read 5
        (ALLOCATIONS, "limit=5&limit=6", "limit"),  # the last one won
        (ALLOCATIONS, "limit=99999999999999999999999999", "limit"),
        ("/api/v1/admin/nodes", "drift=1", "drift"),  # lax conversion read true
        ("/api/v1/admin/nodes", "drift=True", "drift"),
        (ALLOCATIONS, "cursor=" + "c" * 501, "cursor"),
    ],
)
async def test_query_parameters_are_not_coerced_and_are_bounded(
    tenant: Tenant, admin: Any, path: str, query: str, key: str
) -> None:
    client = admin if "/admin/" in path else tenant.client
    error = error_of(await client.get(f"{path}?{query}"), 400, "invalid_request")
    assert error["details"]["errors"][0]["key"] == key, error
    assert error["details"]["errors"][0]["source"] == "query", error


async def test_well_formed_parameters_still_pass(tenant: Tenant, admin: Any) -> None:
    assert (await tenant.client.get(f"{ALLOCATIONS}?limit=5&status=active")).status_code == 200
    assert (await admin.get("/api/v1/admin/nodes?drift=false&limit=1")).status_code == 200
    assert (await admin.get("/api/v1/admin/audit?target_id=caf%C3%A9")).status_code == 200


async def test_control_character_in_a_header_parameter_is_422_invalid_text(
    tenant: Tenant, count_rows: Any
) -> None:
    response = await tenant.client.post(
        ALLOCATIONS, json=slice_request(1), headers={"X-Idempotency-Key": b"bell\x07"}
    )
    error = error_of(response, 422, "invalid_text")
    assert error["details"]["errors"][0]["key"] == "X-Idempotency-Key"
    assert error["details"]["errors"][0]["source"] == "header"
    assert await count_rows(Allocation) == 0


async def test_checkout_session_without_idempotency_key_is_400_as_documented(
    tenant: Tenant, api: Any
) -> None:
    response = await tenant.client.post(
        "/api/v1/payments/checkout-session", json={"amount_minor": 1000, "currency": "usd"}
    )
    error_of(response, 400, "invalid_request")
    document = (await tenant.client.get("/schema/openapi.json")).json()
    operation = document["paths"]["/api/v1/payments/checkout-session"]["post"]
    (header,) = [p for p in operation["parameters"] if p["name"] == "X-Idempotency-Key"]
    assert header["required"] is True
