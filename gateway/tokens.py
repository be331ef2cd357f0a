"""API tokens: `gpc_` + 256 random bits, stored as SHA-256 hex with a short display prefix.

Shared by the gateway (POST /api/v1/admin/tokens) and the admin CLI (`gpucloud-admin`).
A fast hash is enough: the token is 256-bit random, so there is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid

from sqlalchemy.ext.asyncio import AsyncSession

from contracts.states import TokenRole
from schema.models import ApiToken

PREFIX = "gpc_"
DISPLAY_PREFIX_CHARS = 8
# secrets.token_urlsafe(32) gives 43 characters of the URL-safe alphabet.
_TOKEN_RE = re.compile(r"^gpc_[A-Za-z0-9_-]{43}$")


def generate_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def display_prefix(token: str) -> str:
    return token[len(PREFIX) : len(PREFIX) + DISPLAY_PREFIX_CHARS]


def looks_like_token(token: str) -> bool:
    """Cheap shape check so obvious garbage never reaches the database."""
    return bool(_TOKEN_RE.match(token))


async def create_token(
    session: AsyncSession, *, name: str, role: TokenRole, project_id: uuid.UUID | None
) -> tuple[ApiToken, str]:
    """Add a token row to the session (the caller commits) and return it with the plaintext,
    which is never stored and cannot be shown again."""
    if (role == TokenRole.ADMIN) != (project_id is None):
        raise ValueError("admin tokens have no project; tenant tokens need one")
    token = generate_token()
    row = ApiToken(
        id=uuid.uuid4(),
        token_sha256=hash_token(token),
        display_prefix=display_prefix(token),
        name=name,
        role=role.value,
        project_id=project_id,
    )
    session.add(row)
    await session.flush()
    return row, token
