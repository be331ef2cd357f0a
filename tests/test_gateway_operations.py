"""What the gateway hands to the worker instead of writing it (issue 24): every operation
AdminOperationWorkflow knows is registered by the worker as production builds it; an agent's
enrollment token reaches Temporal only as its SHA-256 (never the plaintext, not even inside
the encrypted payloads); the enrollment paths are recorded for tests/test_replay.py."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client

from contracts.admin_operation import (
    ENROLLMENT_ISSUE_TOKEN,
    ENROLLMENT_REDEEM_TOKEN,
    OPERATIONS,
)
from core.codec import AesGcmPayloadCodec
from core.enrollment_token import hash_enrollment_token
from core.secrets import VaultSecretStore
from schema.db import session_factory
from tests.admin_operation_support import nth_run, record
from tests.conftest import TEST_CODEC_KEY
from tests.factories import create_node, create_sku


def test_every_operation_is_registered_by_the_worker(
    settings: Any, db_engine: Any, temporal_client: Client
) -> None:
    from worker import operation_activities

    registered = operation_activities(
        session_factory(db_engine), VaultSecretStore.from_settings(settings), temporal_client
    )
    names = [activity._Definition.must_from_callable(fn).name for fn in registered]
    assert sorted(names) == sorted(OPERATIONS)


async def _plaintext_payloads(handle: Any) -> bytes:
    codec = AesGcmPayloadCodec(TEST_CODEC_KEY)
    history = await handle.fetch_history()
    decoded = b""
    for event in history.events:
        for field in ("workflow_execution_started_event_attributes",
                      "activity_task_scheduled_event_attributes",
                      "activity_task_completed_event_attributes",
                      "workflow_execution_completed_event_attributes"):  # fmt: skip
            if not event.HasField(field):
                continue
            attributes = getattr(event, field)
            payloads = attributes.input if hasattr(attributes, "input") else attributes.result
            for payload in payloads.payloads:
                decoded += codec.decode_one(payload).data
    return decoded


@pytest.mark.usefixtures("control_plane")
async def test_an_enrollment_token_reaches_temporal_only_as_its_hash(
    api: Any, make_token: Any, db_sessions: Any, settings: Any, temporal_client: Client
) -> None:
    await create_sku(db_sessions)
    node = await create_node(db_sessions)
    admin = await api(token=await make_token("admin"))
    issued = await admin.post(f"/api/v1/admin/nodes/{node.id}/enrollment-tokens", json={})
    assert issued.status_code == 201, issued.text
    token = issued.json()["enrollment_token"]
    anonymous = await api()
    enrolled = await anonymous.post(
        "/api/v1/internal/agent/enroll", json={"enrollment_token": token}
    )
    assert enrolled.status_code == 200, enrolled.text
    assert enrolled.json()["node_id"] == str(node.id)
    again = await anonymous.post("/api/v1/internal/agent/enroll", json={"enrollment_token": token})
    assert again.status_code == 401
    assert again.json()["error"]["code"] == "enrollment_token_used"

    runs = [
        (await nth_run(temporal_client, settings, ENROLLMENT_ISSUE_TOKEN, 0), "issue_token"),
        (await nth_run(temporal_client, settings, ENROLLMENT_REDEEM_TOKEN, 0), "redeem_token"),
        (await nth_run(temporal_client, settings, ENROLLMENT_REDEEM_TOKEN, 1), "redeem_token_used"),
    ]
    for handle, name in runs:
        raw = b"".join(e.SerializeToString() for e in (await handle.fetch_history()).events)
        plain = await _plaintext_payloads(handle)
        assert token.encode() not in raw + plain, name
        # The check reads what was sent: the token's hash is what crossed.
        assert hash_enrollment_token(token).encode() in plain, name
        await record(handle, name)


@pytest.mark.usefixtures("control_plane")
async def test_an_agent_whose_enrollment_answer_was_lost_gets_it_again(
    api: Any, make_token: Any, db_sessions: Any
) -> None:
    """The agent keeps one attempt id across its retries: a retry after the gateway used the
    token (its answer lost on the way) gets the same identity; anyone else with the token, used
    now, is refused."""
    await create_sku(db_sessions)
    node = await create_node(db_sessions)
    admin = await api(token=await make_token("admin"))
    issued = await admin.post(f"/api/v1/admin/nodes/{node.id}/enrollment-tokens", json={})
    token = issued.json()["enrollment_token"]
    anonymous = await api()
    attempt = {"enrollment_token": token, "attempt": "a1" * 16}
    first = await anonymous.post("/api/v1/internal/agent/enroll", json=attempt)
    assert first.status_code == 200, first.text
    again = await anonymous.post("/api/v1/internal/agent/enroll", json=attempt)
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    other = {"enrollment_token": token, "attempt": "b2" * 16}
    stranger = await anonymous.post("/api/v1/internal/agent/enroll", json=other)
    assert stranger.status_code == 401
    assert stranger.json()["error"]["code"] == "enrollment_token_used"
    bare = await anonymous.post("/api/v1/internal/agent/enroll", json={"enrollment_token": token})
    assert bare.json()["error"]["code"] == "enrollment_token_used"
