"""Tenant SSH keys: every allowed type validates with an OpenSSH-compatible fingerprint, the key
material never comes back, duplicates are refused per project, delete removes."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from sqlalchemy import select

from gateway.sshkeys import parse_public_key
from schema.models import AuditEntry, SshKey
from tests.gateway_fixtures import (
    ecdsa_public_key,
    ed25519_public_key,
    rsa_public_key,
    sk_ecdsa_public_key,
    sk_ed25519_public_key,
)
from tests.test_gateway_auth import assert_error

VIEW_FIELDS = {"id", "name", "key_type", "fingerprint", "created_at"}


def expected_fingerprint(line: str) -> str:
    """What `ssh-keygen -lf` prints: SHA256 of the decoded blob, unpadded base64."""
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


KEYS = {
    "ssh-ed25519": ed25519_public_key,
    "ssh-rsa": lambda: rsa_public_key(2048),
    "ecdsa-sha2-nistp256": lambda: ecdsa_public_key(ec.SECP256R1()),
    "ecdsa-sha2-nistp384": lambda: ecdsa_public_key(ec.SECP384R1()),
    "ecdsa-sha2-nistp521": lambda: ecdsa_public_key(ec.SECP521R1()),
    "sk-ssh-ed25519@openssh.com": sk_ed25519_public_key,
    "sk-ecdsa-sha2-nistp256@openssh.com": sk_ecdsa_public_key,
}


@pytest.fixture
async def tenant(api, make_project, make_token):
    project = await make_project()
    client = await api(token=await make_token("tenant", project))
    client.project = project  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize("key_type", sorted(KEYS))
async def test_every_allowed_type_is_accepted(tenant, db_sessions, key_type):
    line = KEYS[key_type]()
    response = await tenant.post("/api/v1/ssh-keys", json={"name": "k1", "public_key": line})
    assert response.status_code == 201, response.text
    body = response.json()
    assert set(body) == VIEW_FIELDS
    assert body["key_type"] == key_type
    assert body["fingerprint"] == expected_fingerprint(line)
    assert line.split()[1] not in response.text
    async with db_sessions() as session:
        stored = await session.get(SshKey, body["id"])
    assert stored is not None
    assert stored.project_id == tenant.project.id
    assert stored.public_key.split()[:2] == line.split()[:2]


async def test_rsa_4096_and_comments(tenant):
    line = rsa_public_key(4096) + "  alice@workstation (2026)"
    response = await tenant.post("/api/v1/ssh-keys", json={"name": "big", "public_key": line})
    assert response.status_code == 201, response.text
    assert parse_public_key(line).comment == "alice@workstation (2026)"


async def test_key_material_is_never_returned(tenant, make_ssh_key):
    line = ed25519_public_key()
    created = await tenant.post("/api/v1/ssh-keys", json={"name": "mine", "public_key": line})
    key_id = created.json()["id"]
    await make_ssh_key(tenant.project)
    listing = await tenant.get("/api/v1/ssh-keys")
    one = await tenant.get(f"/api/v1/ssh-keys/{key_id}")
    assert listing.status_code == one.status_code == 200
    assert len(listing.json()["items"]) == 2
    for response in (created, listing, one):
        assert "public_key" not in response.text
        assert line.split()[1] not in response.text
    assert set(one.json()) == VIEW_FIELDS
    assert all(set(item) == VIEW_FIELDS for item in listing.json()["items"])


async def test_duplicates_in_a_project_are_409(tenant, api, make_token, make_project, count_rows):
    line = ed25519_public_key()
    first = await tenant.post("/api/v1/ssh-keys", json={"name": "laptop", "public_key": line})
    assert first.status_code == 201

    same_key = await tenant.post("/api/v1/ssh-keys", json={"name": "other", "public_key": line})
    error = assert_error(same_key, 409, "ssh_key_exists")["error"]
    assert error["details"] == {"field": "fingerprint"}

    # Same key with another comment is the same key.
    recommented = line.rsplit(" ", 1)[0] + " renamed@host"
    again = await tenant.post("/api/v1/ssh-keys", json={"name": "x", "public_key": recommented})
    assert_error(again, 409, "ssh_key_exists")

    same_name = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "laptop", "public_key": ed25519_public_key()}
    )
    error = assert_error(same_name, 409, "ssh_key_exists")["error"]
    assert error["details"] == {"field": "name"}
    assert await count_rows(SshKey) == 1

    # Another project may register the same key under the same name.
    neighbour = await api(token=await make_token("tenant", await make_project()))
    theirs = await neighbour.post("/api/v1/ssh-keys", json={"name": "laptop", "public_key": line})
    assert theirs.status_code == 201, theirs.text
    assert theirs.json()["fingerprint"] == first.json()["fingerprint"]


async def test_delete(tenant, count_rows, db_sessions):
    created = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "temp", "public_key": ed25519_public_key()}
    )
    key_id = created.json()["id"]
    deleted = await tenant.delete(f"/api/v1/ssh-keys/{key_id}")
    assert deleted.status_code == 204
    assert deleted.content == b""
    assert_error(await tenant.get(f"/api/v1/ssh-keys/{key_id}"), 404, "not_found")
    assert_error(await tenant.delete(f"/api/v1/ssh-keys/{key_id}"), 404, "not_found")
    assert await count_rows(SshKey) == 0
    # The name is free again.
    reused = await tenant.post(
        "/api/v1/ssh-keys", json={"name": "temp", "public_key": ed25519_public_key()}
    )
    assert reused.status_code == 201
    async with db_sessions() as session:
        actions = (
            await session.scalars(
                select(AuditEntry.action)
                .where(AuditEntry.target_id == key_id)
                .order_by(AuditEntry.id)
            )
        ).all()
    assert actions == ["ssh_key.create", "ssh_key.delete"]


def test_fingerprint_matches_openssh_reference():
    # A fixed vector: `ssh-keygen -lf` printed this fingerprint for this public key.
    line = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDHwjJ3pF7cZCtHN4G8a8XAIl10doSZNdTNiiw9EpLy7 test"
    parsed = parse_public_key(line)
    assert parsed.key_type == "ssh-ed25519"
    assert parsed.fingerprint == "SHA256:H8OhmudSvGtvgmT3wcYxPdXtaIQoj4jVAAKBYkPG6tc"
    assert parsed.comment == "test"


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen")
@pytest.mark.parametrize("key_type", sorted(KEYS))
def test_fingerprints_agree_with_ssh_keygen(tmp_path, key_type):
    line = KEYS[key_type]()
    path = tmp_path / "key.pub"
    path.write_text(line + "\n")
    printed = subprocess.run(
        ["ssh-keygen", "-lf", str(path)], check=True, capture_output=True, text=True
    ).stdout.split()
    assert parse_public_key(line).fingerprint == printed[1]
