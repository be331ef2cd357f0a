"""`gpucloud-admin`: bootstrap and break-glass identity operations straight against the database.

    gpucloud-admin bootstrap-admin --name ops-alice      # prints a new admin token
    gpucloud-admin create-project acme                   # prints the project id
    gpucloud-admin issue-token --project acme --name ci  # prints a new tenant token

Tokens go to stdout alone (pipe them into a secret store); everything else goes to stderr. Every
change is audited with actor "cli". Settings come from the GPUCLOUD_* environment.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

from sqlalchemy import select

from contracts.states import TokenRole
from core.config import Settings
from gateway import identity
from gateway.audit import CLI_ACTOR
from gateway.errors import ApiError, is_database_unavailable
from gateway.schemas import NAME_MAX_CHARS, NAME_PATTERN
from schema.db import create_engine, session_factory
from schema.models import Project

_NAME = re.compile(NAME_PATTERN)


class CliError(Exception):
    pass


def _name(value: str) -> str:
    if not (1 <= len(value) <= NAME_MAX_CHARS and _NAME.match(value)):
        raise argparse.ArgumentTypeError(
            f"names are 1-{NAME_MAX_CHARS} characters: letters, digits, space, '.', '_', '-'"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpucloud-admin", description="Identity operations for the gpucloud control plane."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bootstrap = commands.add_parser("bootstrap-admin", help="issue an admin token")
    bootstrap.add_argument("--name", required=True, type=_name, help="who holds the token")
    bootstrap.add_argument("--reason", default="bootstrap", help="recorded in the audit log")
    project = commands.add_parser("create-project", help="create a project")
    project.add_argument("name", type=_name)
    project.add_argument("--reason", default=None)
    token = commands.add_parser("issue-token", help="issue a tenant token for a project")
    token.add_argument("--project", required=True, help="project name")
    token.add_argument("--name", required=True, type=_name, help="what the token is for")
    token.add_argument("--reason", default=None)
    return parser


async def _run(args: argparse.Namespace, settings: Settings) -> str:
    engine = create_engine(
        settings.database_url, connect_timeout_seconds=settings.database_connect_timeout_seconds
    )
    sessions = session_factory(engine)
    reason: str | None = args.reason
    try:
        async with sessions() as session:
            if args.command == "bootstrap-admin":
                _, secret = await identity.issue_token(
                    session,
                    name=args.name,
                    role=TokenRole.ADMIN,
                    project_id=None,
                    actor=CLI_ACTOR,
                    actor_token_id=None,
                    actor_role=TokenRole.ADMIN.value,
                    reason=reason,
                )
                output = secret
            elif args.command == "create-project":
                created = await identity.create_project(
                    session,
                    args.name,
                    actor=CLI_ACTOR,
                    actor_token_id=None,
                    role=TokenRole.ADMIN.value,
                    reason=reason,
                )
                output = str(created.id)
            else:
                project_id = await session.scalar(
                    select(Project.id).where(Project.name == args.project)
                )
                if project_id is None:
                    raise CliError(f"no project named {args.project!r}")
                _, secret = await identity.issue_token(
                    session,
                    name=args.name,
                    role=TokenRole.TENANT,
                    project_id=project_id,
                    actor=CLI_ACTOR,
                    actor_token_id=None,
                    actor_role=TokenRole.ADMIN.value,
                    reason=reason,
                )
                output = secret
            await session.commit()
            return output
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        output = asyncio.run(_run(args, Settings.from_env()))
    except (CliError, ApiError) as err:
        print(f"gpucloud-admin: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        if is_database_unavailable(err):
            print("gpucloud-admin: the database is not reachable", file=sys.stderr)
            return 2
        raise
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
