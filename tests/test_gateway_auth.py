"""Authentication and authorisation: 401 without a valid token, 403 for the wrong role, 404 across
projects (exactly like a nonexistent id), immediate revocation, and an audit row per admin
mutation."""

from __future__ import annotations

import uuid

import pytest

from contracts.allocation import allocation_workflow_id
from contracts.states import AllocationStatus
from schema.models import ApiToken, AuditEntry, Project
from tests.factories import REGION, SLICE_SKU, create_node, create_sku
from tests.gateway_fixtures import bearer, ed25519_public_key

NIL = "00000000-0000-4000-8000-000000000000"

TENANT_ROUTES = [
    ("GET", "/api/v1/ssh-keys"),
    ("POST", "/api/v1/ssh-keys"),
    ("GET", f"/api/v1/ssh-keys/{NIL}"),
    ("DELETE", f"/api/v1/ssh-keys/{NIL}"),
    ("GET", "/api/v1/allocations"),
    ("POST", "/api/v1/allocations"),
    ("GET", f"/api/v1/allocations/{NIL}"),
    ("GET", f"/api/v1/allocations/{NIL}/timeline"),
    ("POST", f"/api/v1/allocations/{NIL}/release"),
]
ADMIN_ROUTES = [
    ("GET", "/api/v1/admin/projects"),
    ("POST", "/api/v1/admin/projects"),
    ("GET", f"/api/v1/admin/projects/{NIL}"),
    ("GET", "/api/v1/admin/tokens"),
    ("POST", "/api/v1/admin/tokens"),
    ("POST", f"/api/v1/admin/tokens/{NIL}/revoke"),
    ("GET", "/api/v1/admin/audit"),
    ("GET", "/api/v1/admin/allocations"),
    ("GET", f"/api/v1/admin/allocations/{NIL}"),
    ("GET", f"/api/v1/admin/allocations/{NIL}/timeline"),
    ("POST", f"/api/v1/admin/allocations/{NIL}/force-release"),
    ("POST", "/api/v1/admin/codec/session"),
    ("POST", "/api/v1/admin/codec/decode"),
    ("POST", "/api/v1/admin/codec/encode"),
]


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str)
    assert isinstance(body["error"]["details"], dict)
    return body


@pytest.mark.parametrize(("method", "path"), TENANT_ROUTES + ADMIN_ROUTES)
async def test_no_token_is_401_everywhere(api, method, path):
    client = await api()
    response = await client.request(method, path, json={})
    assert_error(response, 401, "unauthenticated")
    assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer not-a-token",
        "Bearer gpc_" + "A" * 43,  # well-formed, never issued
        "gpc_" + "A" * 43,  # no scheme
    ],
)
async def test_invalid_tokens_are_401(api, header):
    client = await api()
    response = await client.get("/api/v1/ssh-keys", headers={"Authorization": header})
    assert_error(response, 401, "unauthenticated")


async def test_revoked_token_is_401(api, make_token):
    token = await make_token("tenant", revoked=True)
    client = await api(token=token)
    assert_error(await client.get("/api/v1/ssh-keys"), 401, "unauthenticated")


async def test_revocation_is_immediate(api, make_token, make_project):
    project = await make_project()
    admin = await make_token("admin")
    client = await api()
    issued = await client.post(
        "/api/v1/admin/tokens",
        json={"name": "ci", "role": "tenant", "project_id": str(project.id)},
        headers=bearer(admin),
    )
    assert issued.status_code == 201, issued.text
    tenant = issued.json()["token"]
    assert (await client.get("/api/v1/ssh-keys", headers=bearer(tenant))).status_code == 200

    revoked = await client.post(
        f"/api/v1/admin/tokens/{issued.json()['id']}/revoke",
        json={"reason": "leaked in a CI log"},
        headers=bearer(admin),
    )
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked_at"] is not None
    assert_error(
        await client.get("/api/v1/ssh-keys", headers=bearer(tenant)), 401, "unauthenticated"
    )


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
async def test_tenant_token_on_admin_routes_is_403(api, make_token, method, path):
    client = await api(token=await make_token("tenant"))
    assert_error(await client.request(method, path, json={}), 403, "forbidden")


@pytest.mark.parametrize(("method", "path"), TENANT_ROUTES)
async def test_admin_token_on_tenant_routes_is_403_tenant_only(api, make_token, method, path):
    client = await api(token=await make_token("admin"))
    assert_error(await client.request(method, path, json={}), 403, "tenant_only")


async def test_other_projects_resources_are_404_like_nonexistent(
    api, make_project, make_token, make_ssh_key, make_allocation
):
    owner, intruder = await make_project(), await make_project()
    key = await make_ssh_key(owner)
    allocation = await make_allocation(owner, status=AllocationStatus.ACTIVE)
    client = await api(token=await make_token("tenant", intruder))

    missing = str(uuid.uuid4())
    for method, template in [
        ("GET", "/api/v1/ssh-keys/{}"),
        ("DELETE", "/api/v1/ssh-keys/{}"),
    ]:
        theirs = await client.request(method, template.format(key.id))
        nothing = await client.request(method, template.format(missing))
        assert_error(theirs, 404, "not_found")
        assert theirs.json() == nothing.json()
    for method, template in [
        ("GET", "/api/v1/allocations/{}"),
        ("GET", "/api/v1/allocations/{}/timeline"),
        ("POST", "/api/v1/allocations/{}/release"),
    ]:
        theirs = await client.request(method, template.format(allocation.id))
        nothing = await client.request(method, template.format(missing))
        assert_error(theirs, 404, "not_found")
        assert theirs.json() == nothing.json()

    # Lists show only the caller's project.
    assert (await client.get("/api/v1/ssh-keys")).json()["items"] == []
    assert (await client.get("/api/v1/allocations")).json()["items"] == []
    # Using another project's key in an allocation is refused, as if it did not exist.
    refused = await client.post(
        "/api/v1/allocations",
        json={"sku": "h100.slice", "gpus": 1, "region": "r", "ssh_key_ids": [str(key.id)]},
    )
    assert_error(refused, 422, "ssh_key_not_found")

    # The owner still sees both, untouched.
    owner_client = await api(token=await make_token("tenant", owner))
    assert (await owner_client.get(f"/api/v1/ssh-keys/{key.id}")).status_code == 200
    assert (await owner_client.get(f"/api/v1/allocations/{allocation.id}")).status_code == 200


async def test_admin_mutations_are_audited(api, make_token, token_row, count_rows):
    admin = await make_token("admin", name="ops-alice")
    admin_id = (await token_row(admin)).id
    client = await api(token=admin)

    project = await client.post(
        "/api/v1/admin/projects",
        json={"name": "acme"},
        headers={"X-Audit-Reason": "onboarding ticket 42"},
    )
    assert project.status_code == 201, project.text
    project_id = project.json()["id"]

    issued = await client.post(
        "/api/v1/admin/tokens",
        json={"name": "acme-ci", "role": "tenant", "project_id": project_id, "reason": "CI"},
    )
    assert issued.status_code == 201, issued.text
    token_id = issued.json()["id"]

    revoked = await client.post(
        f"/api/v1/admin/tokens/{token_id}/revoke", headers={"X-Audit-Reason": "rotation"}
    )
    assert revoked.status_code == 200, revoked.text

    audit = await client.get("/api/v1/admin/audit")
    assert audit.status_code == 200
    entries = {e["action"]: e for e in audit.json()["items"]}
    assert set(entries) >= {"project.create", "token.issue", "token.revoke"}
    for entry in entries.values():
        assert entry["actor"] == "ops-alice"
        assert entry["actor_token_id"] == str(admin_id)
        assert entry["role"] == "admin"
    assert entries["project.create"]["target_type"] == "project"
    assert entries["project.create"]["target_id"] == project_id
    assert entries["project.create"]["reason"] == "onboarding ticket 42"
    assert entries["token.issue"]["target_id"] == token_id
    assert entries["token.issue"]["reason"] == "CI"
    assert entries["token.revoke"]["reason"] == "rotation"
    assert entries["token.revoke"]["prior_state"] == "active"
    assert entries["token.revoke"]["expected_state"] == "revoked"
    # The audit never holds a token or its hash.
    plaintext = issued.json()["token"]
    row = await token_row(plaintext)
    assert plaintext not in audit.text
    assert row.token_sha256 not in audit.text

    # Filters.
    only = await client.get(
        "/api/v1/admin/audit", params={"target_type": "api_token", "target_id": token_id}
    )
    assert {e["action"] for e in only.json()["items"]} == {"token.issue", "token.revoke"}
    by_action = await client.get("/api/v1/admin/audit", params={"action": "project.create"})
    assert [e["target_id"] for e in by_action.json()["items"]] == [project_id]
    assert len((await client.get("/api/v1/admin/audit", params={"limit": 1})).json()["items"]) == 1
    assert await count_rows(AuditEntry) == 3


async def test_refused_admin_mutations_change_nothing(api, make_token, make_project, count_rows):
    await make_project("taken")
    client = await api(token=await make_token("admin"))
    clash = await client.post("/api/v1/admin/projects", json={"name": "taken"})
    assert_error(clash, 409, "project_exists")
    orphan = await client.post(
        "/api/v1/admin/tokens",
        json={"name": "x", "role": "tenant", "project_id": str(uuid.uuid4())},
    )
    assert_error(orphan, 422, "project_not_found")
    unscoped = await client.post("/api/v1/admin/tokens", json={"name": "x", "role": "tenant"})
    assert_error(unscoped, 400, "invalid_request")
    scoped_admin = await client.post(
        "/api/v1/admin/tokens",
        json={"name": "x", "role": "admin", "project_id": str(uuid.uuid4())},
    )
    assert_error(scoped_admin, 400, "invalid_request")
    assert_error(await client.post(f"/api/v1/admin/tokens/{uuid.uuid4()}/revoke"), 404, "not_found")
    assert await count_rows(Project) == 1
    assert await count_rows(ApiToken) == 1  # the admin's own
    assert await count_rows(AuditEntry) == 0


async def test_token_listing_never_shows_secrets(api, make_token, token_row):
    admin = await make_token("admin")
    tenant = await make_token("tenant")
    client = await api(token=admin)
    listing = await client.get("/api/v1/admin/tokens")
    assert listing.status_code == 200
    assert len(listing.json()["items"]) == 2
    for secret in (admin, tenant):
        assert secret not in listing.text
        assert (await token_row(secret)).token_sha256 not in listing.text
    for item in listing.json()["items"]:
        assert set(item) == {
            "id",
            "name",
            "role",
            "project_id",
            "display_prefix",
            "created_at",
            "revoked_at",
        }
    prefixes = {i["display_prefix"] for i in listing.json()["items"]}
    assert tenant[4:12] in prefixes


async def test_issued_token_works_and_is_shown_once(api, make_token, make_project):
    project = await make_project()
    client = await api(token=await make_token("admin"))
    issued = await client.post(
        "/api/v1/admin/tokens",
        json={"name": "deploy", "role": "tenant", "project_id": str(project.id)},
    )
    body = issued.json()
    assert body["token"].startswith("gpc_")
    assert body["display_prefix"] == body["token"][4:12]
    tenant = await api(token=body["token"])
    created = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "laptop", "public_key": ed25519_public_key()}
    )
    assert created.status_code == 201, created.text
    listed = await client.get(f"/api/v1/admin/projects/{project.id}")
    assert listed.json()["name"] == project.name


async def test_force_release_is_audited(
    api, make_project, make_token, token_row, db_sessions, control_plane
):
    """Needs a live allocation workflow to accept the update, hence the control-plane worker;
    it checks only what the gateway records, not the lifecycle that follows."""
    await create_sku(db_sessions)
    await create_node(db_sessions)
    project = await make_project()
    tenant = await api(token=await make_token("tenant", project))
    created = await tenant.post(
        "/api/v1/allocations",
        json={"sku": SLICE_SKU, "gpus": 1, "region": REGION, "ssh_key_ids": []},
    )
    assert created.status_code == 201, created.text
    allocation_id = created.json()["allocation_id"]

    admin_token = await make_token("admin", name="ops-carol")
    admin = await api(token=admin_token)
    forced = await admin.post(
        f"/api/v1/admin/allocations/{allocation_id}/force-release",
        json={"reason": "customer escalation 991"},
    )
    assert forced.status_code == 202, forced.text
    answer = forced.json()
    assert answer["allocation_id"] == allocation_id

    (entry,) = (
        await admin.get(
            "/api/v1/admin/audit", params={"target_type": "allocation", "target_id": allocation_id}
        )
    ).json()["items"]
    assert entry["action"] == "allocation.force_release"
    assert entry["actor"] == "ops-carol"
    assert entry["actor_token_id"] == str((await token_row(admin_token)).id)
    assert entry["role"] == "admin"
    assert entry["reason"] == "customer escalation 991"
    assert entry["prior_state"] == answer["prior_status"]
    assert entry["expected_state"] == answer["expected_status"]
    assert entry["workflow_ids"] == [allocation_workflow_id(allocation_id)]
    assert entry["details"]["force"] is True
