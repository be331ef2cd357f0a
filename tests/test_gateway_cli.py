"""`gpucloud-admin`, run as a real process against the test database."""

from __future__ import annotations

import asyncio
import os
import sys

from schema.models import AuditEntry
from tests.gateway_fixtures import bearer


async def admin_cli(settings, *args: str, database_url: str | None = None) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "GPUCLOUD_DATABASE_URL": database_url or settings.database_url,
        "GPUCLOUD_CODEC_KEY": settings.codec_key_b64,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.admin_cli", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_bootstrap_project_and_tenant_token(settings, api, db_sessions, count_rows):
    code, out, _ = await admin_cli(settings, "bootstrap-admin", "--name", "ops-alice")
    assert code == 0
    admin_token = out.strip()
    assert admin_token.startswith("gpc_")

    code, out, _ = await admin_cli(settings, "create-project", "acme")
    assert code == 0
    project_id = out.strip()

    code, out, err = await admin_cli(settings, "create-project", "acme")
    assert code == 1
    assert "already exists" in err
    assert out == ""

    code, out, _ = await admin_cli(settings, "issue-token", "--project", "acme", "--name", "ci")
    assert code == 0
    tenant_token = out.strip()

    code, _, err = await admin_cli(settings, "issue-token", "--project", "nope", "--name", "ci")
    assert code == 1
    assert "no project" in err

    client = await api()
    project = await client.get(f"/api/v1/admin/projects/{project_id}", headers=bearer(admin_token))
    assert project.json()["name"] == "acme"
    assert (await client.get("/api/v1/ssh-keys", headers=bearer(tenant_token))).status_code == 200

    audit = (await client.get("/api/v1/admin/audit", headers=bearer(admin_token))).json()["items"]
    assert [e["action"] for e in reversed(audit)] == [
        "token.issue",
        "project.create",
        "token.issue",
    ]
    assert {e["actor"] for e in audit} == {"cli"}
    assert all(e["actor_token_id"] is None for e in audit)
    assert admin_token not in str(audit)
    assert await count_rows(AuditEntry) == 3


async def test_cli_rejects_bad_names_and_reports_a_dead_database(settings):
    code, _, err = await admin_cli(settings, "create-project", "bad/name")
    assert code == 2  # argparse usage error
    assert "names are" in err
    code, _, err = await admin_cli(
        settings,
        "bootstrap-admin",
        "--name",
        "x",
        database_url="postgresql+asyncpg://gpucloud@127.0.0.1:9/gpucloud",
    )
    assert code == 2
    assert "not reachable" in err
