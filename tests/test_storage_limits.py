"""Storage limits per project (issue 37 item 3), through the API with the real worker: a
namespace beyond the project's limit on active namespaces or on their total quota is refused with
403 quota_exceeded before anything is created; the limits are admin-set (audited), with the
policy's defaults until then; a depleted project creates no namespace (402 balance_depleted)
until it is credited. The limits are checked in the transaction that creates the namespace,
under the project's lock: many creates at once at the limit make exactly what it allows."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gateway.controllers.storage import _derived_id
from schema.models import (
    DEFAULT_STORAGE_NAMESPACE_LIMIT,
    DEFAULT_STORAGE_QUOTA_LIMIT_BYTES,
    AuditEntry,
    StorageNamespace,
)

pytestmark = pytest.mark.usefixtures("control_plane")
MIB = 1 << 20


@pytest.fixture
async def tenant(api: Any, make_project: Any, make_token: Any) -> tuple[Any, Any]:
    project = await make_project()
    return project, await api(token=await make_token("tenant", project))


@pytest.fixture
async def admin(api: Any, make_token: Any) -> Any:
    return await api(token=await make_token("admin"))


async def create(client: Any, name: str, quota: int, key: str | None = None) -> Any:
    headers = {"X-Idempotency-Key": key} if key else {}
    return await client.post(
        "/api/v1/storage/namespaces", json={"name": name, "quota_bytes": quota}, headers=headers
    )


async def set_limits(admin: Any, project_id: Any, namespaces: int, quota: int) -> Any:
    return await admin.put(
        f"/api/v1/admin/billing/accounts/{project_id}/storage-limits",
        json={"namespace_limit": namespaces, "quota_limit_bytes": quota, "reason": "plan"},
    )


async def test_a_project_gets_the_policys_limits_until_an_admin_sets_its_own(
    tenant: tuple[Any, Any], admin: Any, db_sessions: Any
) -> None:
    project, client = tenant
    limits = (await client.get("/api/v1/billing/storage-limits")).json()
    assert limits == {
        "project_id": str(project.id),
        "namespace_limit": DEFAULT_STORAGE_NAMESPACE_LIMIT,
        "quota_limit_bytes": DEFAULT_STORAGE_QUOTA_LIMIT_BYTES,
        "namespaces": 0,
        "quota_bytes": 0,
    }
    over = await create(client, "huge", DEFAULT_STORAGE_QUOTA_LIMIT_BYTES + 1)
    assert over.status_code == 403, over.text
    assert over.json()["error"]["code"] == "quota_exceeded"

    answer = await set_limits(admin, project.id, 3, 5 * MIB)
    assert answer.status_code == 200, answer.text
    assert answer.json()["namespace_limit"] == 3
    async with db_sessions() as session:
        audit = (
            await session.scalars(
                select(AuditEntry).where(AuditEntry.action == "billing.storage_limits")
            )
        ).one()
    assert audit.target_id == str(project.id)
    assert audit.reason == "plan"
    assert audit.details["to"] == {"namespace_limit": 3, "quota_limit_bytes": 5 * MIB}
    # Tenants read their limits, never set them; an unknown project is 404.
    refused = await client.put(
        f"/api/v1/admin/billing/accounts/{project.id}/storage-limits",
        json={"namespace_limit": 99, "quota_limit_bytes": 1, "reason": "mine"},
    )
    assert refused.status_code == 403
    unknown = await set_limits(admin, "00000000-0000-4000-8000-000000000000", 1, 1)
    assert unknown.status_code == 404


async def test_namespaces_beyond_the_count_or_the_total_quota_are_refused(
    tenant: tuple[Any, Any], admin: Any, db_sessions: Any
) -> None:
    project, client = tenant
    assert (await set_limits(admin, project.id, 2, 3 * MIB)).status_code == 200

    first = await create(client, "one", 2 * MIB, key="k-one")
    assert first.status_code == 201, first.text
    too_big = await create(client, "two", 2 * MIB)
    assert too_big.status_code == 403, too_big.text
    error = too_big.json()["error"]
    assert error["code"] == "quota_exceeded"
    assert error["details"] == {
        "namespace_limit": 2,
        "namespaces": 1,
        "quota_limit_bytes": 3 * MIB,
        "quota_bytes": 2 * MIB,
        "requested_quota_bytes": 2 * MIB,
    }
    second = await create(client, "two", MIB)
    assert second.status_code == 201, second.text
    third = await create(client, "three", 1)
    assert third.status_code == 403
    assert third.json()["error"]["code"] == "quota_exceeded"
    # A retry of a namespace already made is answered, whatever the limits now.
    again = await create(client, "one", 2 * MIB, key="k-one")
    assert again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"]
    limits = (await client.get("/api/v1/billing/storage-limits")).json()
    assert (limits["namespaces"], limits["quota_bytes"]) == (2, 3 * MIB)

    # A namespace asked to be deleted no longer counts, from the request on.
    deleted = await client.delete(f"/api/v1/storage/namespaces/{first.json()['id']}")
    assert deleted.status_code == 202, deleted.text
    third = await create(client, "three", 2 * MIB)
    assert third.status_code == 201, third.text
    async with db_sessions() as session:
        names = set(
            await session.scalars(
                select(StorageNamespace.name).where(
                    StorageNamespace.project_id == project.id, StorageNamespace.status == "active"
                )
            )
        )
    assert names == {"two", "three"}


async def test_a_depleted_project_creates_no_namespace_until_credited(
    api: Any, make_project: Any, make_token: Any, admin: Any, db_sessions: Any
) -> None:
    project = await make_project(credit_minor=0)
    client = await api(token=await make_token("tenant", project))
    refused = await create(client, "data", MIB)
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["code"] == "balance_depleted"
    async with db_sessions() as session:
        assert list(await session.scalars(select(StorageNamespace.id))) == []

    credited = await admin.post(
        f"/api/v1/admin/billing/accounts/{project.id}/credits",
        json={"amount_minor": 5000, "idempotency_key": "top-up", "reason": "top-up"},
    )
    assert credited.status_code == 201, credited.text
    created = await create(client, "data", MIB)
    assert created.status_code == 201, created.text
    assert created.json()["quota_bytes"] == MIB


async def test_concurrent_creates_at_the_limits_make_exactly_what_they_allow(
    tenant: tuple[Any, Any], admin: Any, db_sessions: Any, storage_provider_root: Path
) -> None:
    project, client = tenant
    # The count: 3 namespaces, 12 asked for at once.
    assert (await set_limits(admin, project.id, 3, 100 * MIB)).status_code == 200
    answers = await asyncio.gather(
        *(create(client, f"count-{i}", MIB, key=f"count-{i}") for i in range(12))
    )
    assert Counter(a.status_code for a in answers) == {201: 3, 403: 9}, [a.text for a in answers]
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 403} == {
        "quota_exceeded"
    }
    created = {a.json()["id"] for a in answers if a.status_code == 201}
    assert await active_ids(db_sessions, project.id) == created
    # A refused create leaves no directory behind at the provider.
    for index, answer in enumerate(answers):
        namespace_id = _derived_id(project.id, f"count-{index}")
        exists = (storage_provider_root / "namespaces" / str(namespace_id)).is_dir()
        assert exists == (answer.status_code == 201)

    # The total quota: 3 + 5 MiB, twelve 1 MiB namespaces asked for at once (room for 5).
    assert (await set_limits(admin, project.id, 100, 8 * MIB)).status_code == 200
    answers = await asyncio.gather(*(create(client, f"quota-{i}", MIB) for i in range(12)))
    assert Counter(a.status_code for a in answers) == {201: 5, 403: 7}, [a.text for a in answers]
    limits = (await client.get("/api/v1/billing/storage-limits")).json()
    assert (limits["namespaces"], limits["quota_bytes"]) == (8, 8 * MIB)
    assert len(await active_ids(db_sessions, project.id)) == 8


async def active_ids(db_sessions: Any, project_id: uuid.UUID) -> set[str]:
    async with db_sessions() as session:
        return {
            str(i)
            for i in await session.scalars(
                select(StorageNamespace.id).where(
                    StorageNamespace.project_id == project_id, StorageNamespace.status == "active"
                )
            )
        }
