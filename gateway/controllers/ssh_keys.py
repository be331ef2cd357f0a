"""Tenant SSH public keys. Responses carry name, type and fingerprint, never the key."""

from __future__ import annotations

import uuid
from typing import Annotated

import sqlalchemy.exc
from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody, QueryParameter
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway import audit
from gateway.auth import Principal, tenant_guard
from gateway.errors import Conflict, NotFound, Unprocessable
from gateway.openapi import errors
from gateway.schemas import SshKeyCreate, SshKeyList, SshKeyView
from gateway.sshkeys import SshKeyInvalid, parse_public_key
from schema.models import SshKey


def _view(key: SshKey) -> SshKeyView:
    return SshKeyView(
        id=key.id,
        name=key.name,
        key_type=key.key_type,
        fingerprint=key.fingerprint,
        created_at=key.created_at,
    )


def _exists(field: str) -> Conflict:
    return Conflict(
        f"this project already has an SSH key with this {field}",
        code="ssh_key_exists",
        details={"field": field},
    )


class SshKeysController(Controller):
    path = "/api/v1/ssh-keys"
    guards = [tenant_guard]
    tags = ["ssh-keys"]

    @post(
        "/",
        status_code=201,
        summary="Add an SSH public key to the caller's project",
        responses=errors(400, 403, 409, 413, 422),
    )
    async def create_key(
        self,
        data: JSONBody[SshKeyCreate],
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
    ) -> SshKeyView:
        try:
            parsed = parse_public_key(data.public_key)
        except SshKeyInvalid as err:
            raise Unprocessable(str(err), code="ssh_key_invalid") from None
        project_id = principal.project
        clash = await db.scalar(
            select(SshKey).where(
                SshKey.project_id == project_id,
                or_(SshKey.name == data.name, SshKey.fingerprint == parsed.fingerprint),
            )
        )
        if clash is not None:
            raise _exists("fingerprint" if clash.fingerprint == parsed.fingerprint else "name")
        key = SshKey(
            id=uuid.uuid4(),
            project_id=project_id,
            name=data.name,
            key_type=parsed.key_type,
            public_key=parsed.openssh,
            fingerprint=parsed.fingerprint,
        )
        db.add(key)
        try:
            await db.flush()
        except sqlalchemy.exc.IntegrityError:  # a concurrent insert won
            raise _exists("name or fingerprint") from None
        audit.record_by(
            db,
            principal,
            action="ssh_key.create",
            target_type="ssh_key",
            target_id=str(key.id),
            expected_state="exists",
            details={
                "name": data.name,
                "key_type": parsed.key_type,
                "fingerprint": parsed.fingerprint,
                "project_id": str(project_id),
            },
        )
        await db.commit()
        await db.refresh(key)
        return _view(key)

    @get("/", summary="The project's SSH keys", responses=errors(403))
    async def list_keys(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 200,
    ) -> SshKeyList:
        rows = await db.scalars(
            select(SshKey)
            .where(SshKey.project_id == principal.project)
            .order_by(SshKey.created_at, SshKey.id)
            .limit(limit)
        )
        return SshKeyList(items=[_view(k) for k in rows])

    async def _owned(
        self, db: AsyncSession, principal: Principal, key_id: FromPath[uuid.UUID]
    ) -> SshKey:
        key = await db.scalar(
            select(SshKey).where(SshKey.id == key_id, SshKey.project_id == principal.project)
        )
        if key is None:
            raise NotFound("SSH key not found")
        return key

    @get("/{key_id:uuid}", summary="One SSH key", responses=errors(403, 404))
    async def get_key(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        key_id: FromPath[uuid.UUID],
    ) -> SshKeyView:
        return _view(await self._owned(db, principal, key_id))

    @delete(
        "/{key_id:uuid}", status_code=204, summary="Remove an SSH key", responses=errors(403, 404)
    )
    async def delete_key(
        self,
        db: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
        key_id: FromPath[uuid.UUID],
    ) -> None:
        key = await self._owned(db, principal, key_id)
        audit.record_by(
            db,
            principal,
            action="ssh_key.delete",
            target_type="ssh_key",
            target_id=str(key.id),
            prior_state="exists",
            expected_state="deleted",
            details={"name": key.name, "fingerprint": key.fingerprint},
        )
        await db.delete(key)
        await db.commit()
