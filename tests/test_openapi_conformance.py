"""OpenAPI conformance: schemathesis, as its CLI in a process of its own, against the gateway
served over HTTP on a loopback port, with the whole control-plane worker, the Vault simulator
and stripe-mock behind it (the payments fixture), once with a tenant token over the tenant
routes and once with an admin token over the admin, internal and public ones. Every response
must be no 5xx and match the document: its status, content type and body schema.

Bounded: a few generated cases per operation (the deterministic coverage phase adds its edge
cases), a couple of minutes on a 2-core machine.

Destructive admin operations are exercised: the fuzzer knows no id of anything this test made
(it invents UUIDs), so revocations, releases, decommissions and detaches answer 404 or a
validation error and touch nothing. EXCLUDED are the two operations that would send traffic to
addresses the fuzzer invents (nothing but loopback may be a target here).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.gateway_fixtures import TEMPORAL_UI_ORIGIN, ed25519_public_key, served_over_http
from tests.stripe_fixtures import PaymentsFactory

EXCLUDED: dict[tuple[str, str], str] = {
    ("post", "/api/v1/admin/maas-sites"): (
        "creating a site validates its MAAS API key by calling the api_base_url in the body"
    ),
    ("put", "/api/v1/notifications/webhook"): (
        "the project's event notifications are then delivered to the url in the body"
    ),
}

MAX_EXAMPLES = 5
RUN_TIMEOUT_SECONDS = 240
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)
TENANT_PATHS = r"^/api/v1/(?!admin/|internal/|webhooks/)"
ADMIN_PATHS = r"^/(healthz|readyz|api/v1/(admin|internal|webhooks)/)"


async def _schemathesis(
    base_url: str, token: str, include_paths: str, excluded_ids: list[str], workdir: Path
) -> tuple[int, str]:
    argv = [
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/schema/openapi.json",
        "--url",
        base_url,
        "--header",
        f"Authorization: Bearer {token}",
        "--include-path-regex",
        include_paths,
        "--checks",
        CHECKS,
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "25",
        # One worker: with two threads, hypothesis' ast.parse of its lambdas trips CPython
        # 3.11's "AST constructor recursion depth mismatch" now and then (a Runtime Error).
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--no-shrink",
        "--output-sanitize",
        "true",
        "--warnings",
        "off",
    ]
    for operation_id in excluded_ids:
        argv += ["--exclude-operation-id", operation_id]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=workdir,  # its .hypothesis folder and reports stay out of the checkout
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_SECONDS)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, output.decode(errors="replace")


def _operation_ids(document: dict[str, Any], wanted: dict[tuple[str, str], str]) -> list[str]:
    ids = [
        document["paths"][path][method]["operationId"]
        for method, path in wanted
        if method in document["paths"].get(path, {})
    ]
    assert len(ids) == len(wanted), "an excluded operation is gone: update EXCLUDED"
    return ids


async def test_every_operation_answers_as_documented(
    payments: PaymentsFactory,
    make_project: Any,
    make_token: Any,
    temporal_client: Client,
    tmp_path: Path,
) -> None:
    project = await make_project()
    plane = await payments(project=project)
    tenant_token = await make_token("tenant", project)
    admin_token = await make_token("admin")
    app = create_app(
        plane.settings,
        temporal_client=temporal_client,
        config=GatewayConfig(temporal_ui_origin=TEMPORAL_UI_ORIGIN),
    )
    async with (
        served_over_http(app) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as http,
    ):
        # Something to list, so list bodies are checked with items in them.
        created = await http.post(
            "/api/v1/ssh-keys",
            json={"name": "conformance", "public_key": ed25519_public_key()},
            headers={"Authorization": f"Bearer {tenant_token}"},
        )
        assert created.status_code == 201, created.text
        document = (await http.get("/schema/openapi.json")).json()
        excluded = _operation_ids(document, EXCLUDED)

        failures = []
        for who, token, paths in [
            ("tenant", tenant_token, TENANT_PATHS),
            ("admin", admin_token, ADMIN_PATHS),
        ]:
            code, output = await _schemathesis(base_url, token, paths, excluded, tmp_path)
            assert token not in output
            if code != 0:
                failures.append(f"--- {who} run (exit {code}) ---\n{output[-12000:]}")
        assert not failures, "\n".join(failures)
