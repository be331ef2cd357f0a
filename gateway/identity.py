"""Writes to the identity tables, shared by the admin API and the admin CLI. Each function adds
rows to the caller's session together with their audit row; the caller commits once."""

from __future__ import annotations

import uuid

import sqlalchemy.exc
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import TokenRole
from gateway import audit, tokens
from gateway.errors import Conflict
from schema.models import ApiToken, Project


class ProjectExists(Conflict):
    code = "project_exists"

    def __init__(self) -> None:
        super().__init__("a project with this name already exists")


async def create_project(
    session: AsyncSession,
    name: str,
    *,
    actor: str,
    actor_token_id: uuid.UUID | None,
    role: str,
    reason: str | None,
) -> Project:
    if await session.scalar(select(Project.id).where(Project.name == name)) is not None:
        raise ProjectExists()
    project = Project(id=uuid.uuid4(), name=name)
    session.add(project)
    try:
        await session.flush()
    except sqlalchemy.exc.IntegrityError as err:  # a concurrent create won the race
        raise ProjectExists() from err
    audit.record(
        session,
        actor=actor,
        actor_token_id=actor_token_id,
        role=role,
        reason=reason,
        action="project.create",
        target_type="project",
        target_id=str(project.id),
        expected_state="exists",
        details={"name": name},
    )
    return project


async def issue_token(
    session: AsyncSession,
    *,
    name: str,
    role: TokenRole,
    project_id: uuid.UUID | None,
    actor: str,
    actor_token_id: uuid.UUID | None,
    actor_role: str,
    reason: str | None,
) -> tuple[ApiToken, str]:
    row, token = await tokens.create_token(session, name=name, role=role, project_id=project_id)
    audit.record(
        session,
        actor=actor,
        actor_token_id=actor_token_id,
        role=actor_role,
        reason=reason,
        action="token.issue",
        target_type="api_token",
        target_id=str(row.id),
        expected_state="active",
        details={
            "name": name,
            "role": role.value,
            "project_id": str(project_id) if project_id else None,
            "display_prefix": row.display_prefix,
        },
    )
    return row, token
