"""Agent enrollment end to end: an operator issues a single-use token, the agent redeems it
through the gateway (real PostgreSQL) and keeps its identity; expired, reused, forged tokens and
deleted nodes are refused with clear codes."""

from __future__ import annotations

import base64
import logging
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from agent.enrollment import AgentConfig, EnrollmentError, ensure_enrolled, load_identity
from core.codec import key_id, node_payload_key
from tests.factories import create_node, create_sku

# The worker writes what the gateway asks for: token issue and redemption.
pytestmark = pytest.mark.usefixtures("control_plane")


@pytest.fixture
async def node(db_sessions: Any) -> Any:
    await create_sku(db_sessions)
    return await create_node(db_sessions)


async def issue(admin: httpx.AsyncClient, node_id: Any, **body: Any) -> str:
    response = await admin.post(f"/api/v1/admin/nodes/{node_id}/enrollment-tokens", json=body)
    assert response.status_code == 201, response.text
    token: str = response.json()["enrollment_token"]
    return token


def config(tmp_path: Path, token: str, name: str = "state") -> AgentConfig:
    return AgentConfig(api_url="http://gateway.invalid", enrollment_token=token,
                       state_dir=tmp_path / name)  # fmt: skip


async def test_agent_enrolls_once_and_keeps_its_identity(
    api: Any, make_token: Any, node: Any, tmp_path: Path, db_sessions: Any, caplog: Any,
    settings: Any,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    admin = await api(token=await make_token("admin"))
    token = await issue(admin, node.id)
    anonymous = await api()
    identity = await ensure_enrolled(config(tmp_path, token), http=anonymous, agent_version="1.2")
    assert identity.node_id == str(node.id)
    assert identity.task_queue == f"node-{node.id}"
    assert identity.temporal_address == settings.temporal_address
    assert identity.control_plane_task_queue == settings.control_plane_task_queue
    stored = tmp_path / "state" / "identity.json"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert token not in stored.read_text()
    assert load_identity(tmp_path / "state") == identity
    # The node's own payload key (derived for it from the cluster key, never the cluster key),
    # 0600 in the state dir; the identity names its key id.
    key_file = tmp_path / "state" / "payload.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    node_key = base64.b64decode(key_file.read_text().strip())
    assert node_key == node_payload_key(settings.codec_key, node.id) != settings.codec_key
    assert identity.payload_key_id == key_id(node_key)

    async with db_sessions() as session:
        enrolled = (
            await session.execute(
                text("SELECT enrolled_at, agent_version, last_agent_contact_at FROM nodes "
                     "WHERE id = :id"), {"id": node.id},
            )
        ).one()  # fmt: skip
    assert enrolled.enrolled_at is not None
    assert enrolled.agent_version == "1.2"

    # A second start uses the stored identity: no call to the gateway at all.
    unreachable = httpx.AsyncClient(base_url="http://127.0.0.1:9")
    again = await ensure_enrolled(config(tmp_path, token), http=unreachable)
    assert again == identity

    # The token is single-use: another agent (fresh state) is refused.
    with pytest.raises(EnrollmentError) as reused:
        await ensure_enrolled(config(tmp_path, token, "other"), http=anonymous)
    assert reused.value.code == "enrollment_token_used"
    assert caplog.records  # the log check reads what was logged
    assert token not in caplog.text
    assert token not in str(reused.value)


async def test_reimaged_node_enrolls_again_as_the_same_node(
    api: Any, make_token: Any, node: Any, tmp_path: Path
) -> None:
    admin = await api(token=await make_token("admin"))
    anonymous = await api()
    first = await ensure_enrolled(config(tmp_path, await issue(admin, node.id), "before"),
                                  http=anonymous)  # fmt: skip
    # Reimage wipes the state dir; a fresh token comes with the new cloud-init.
    second = await ensure_enrolled(config(tmp_path, await issue(admin, node.id), "after"),
                                   http=anonymous)  # fmt: skip
    assert first.node_id == second.node_id == str(node.id)


async def test_expired_forged_and_deleted_are_refused(
    api: Any, make_token: Any, node: Any, tmp_path: Path, db_sessions: Any
) -> None:
    admin = await api(token=await make_token("admin"))
    anonymous = await api()

    expired = await issue(admin, node.id, ttl_seconds=60)
    async with db_sessions() as session, session.begin():
        await session.execute(text("UPDATE node_enrollment_tokens SET expires_at = now() - "
                                   "interval '1 second'"))  # fmt: skip
    with pytest.raises(EnrollmentError) as err:
        await ensure_enrolled(config(tmp_path, expired, "a"), http=anonymous)
    assert err.value.code == "enrollment_token_expired"

    for forged in ("gpe_" + "A" * 43, "not-a-token"):
        with pytest.raises(EnrollmentError) as err:
            await ensure_enrolled(config(tmp_path, forged, "b"), http=anonymous)
        assert err.value.code == "enrollment_token_invalid"

    live = await issue(admin, node.id)
    async with db_sessions() as session, session.begin():
        await session.execute(text("UPDATE nodes SET status = 'deleted' WHERE id = :id"),
                              {"id": node.id})  # fmt: skip
    response = await anonymous.post(
        "/api/v1/internal/agent/enroll", json={"enrollment_token": live}
    )
    assert response.status_code == 410
    assert response.json()["error"]["code"] == "node_deleted"
    refused = await admin.post(f"/api/v1/admin/nodes/{node.id}/enrollment-tokens", json={})
    assert refused.status_code == 410
    assert load_identity(tmp_path / "c") is None


async def test_only_admins_issue_enrollment_tokens(api: Any, make_token: Any, node: Any) -> None:
    tenant = await api(token=await make_token("tenant"))
    response = await tenant.post(f"/api/v1/admin/nodes/{node.id}/enrollment-tokens", json={})
    assert response.status_code == 403
    anonymous = await api()
    response = await anonymous.post(f"/api/v1/admin/nodes/{node.id}/enrollment-tokens", json={})
    assert response.status_code == 401


def test_agent_config_file_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('api_url = "https://api.example"\nenrollment_token = "gpe_x"\n'
                    f'state_dir = "{tmp_path}/state"\n')  # fmt: skip
    loaded = AgentConfig.load(path)
    assert loaded.api_url == "https://api.example"
    assert "gpe_x" not in repr(loaded)
    path.write_text('api_url = "ftp://nope"\n')
    with pytest.raises(EnrollmentError):
        AgentConfig.load(path)
