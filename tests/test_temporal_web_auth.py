"""Temporal Web for operators only (issue 36, item 7), with the real `temporalio/ui-server` started
as bin/stack starts it (devstack.temporal_cluster.temporal_web_child) and the real gateway under
uvicorn in front of it (gateway/console/temporal_web.py):

- without the console's sign-in, its pages send the browser to the sign-in form and its API
  answers 401: no workflow can be listed, cancelled, reset or terminated through it; a tenant's
  token (or an admin's bearer token, which is no session) opens nothing, and a tenant cannot
  sign in;
- an admin signed in to the console lists workflows through it, and its pages carry a
  Content-Security-Policy again;
- write actions are off: terminate, cancel, reset, signal and batch operations through the
  proxied API are refused by the ui-server's `disableWriteActions` (405), and the workflow runs
  on, while the same request to a ui-server with writes on does terminate (the requests are
  well-formed: the refusal is the setting's);
- the ui-server listens on loopback only; docker-compose.temporal.yml says the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from temporalio.client import Client, WorkflowExecutionStatus

from core.config import Settings
from devstack.processes import Child, free_port, http_ok, tail
from devstack.temporal_cluster import (
    TEMPORAL_WEB_PUBLIC_PATH,
    temporal_web_child,
    ui_server_argv,
    ui_server_config,
)
from devstack.up import StackOptions
from gateway import codec_session
from gateway.app import create_app
from gateway.console.temporal_web import PUBLIC_PATH, content_security_policy
from tests.gateway_fixtures import bearer, served_over_http
from tests.lifecycle_support import eventually

REPO_ROOT = Path(__file__).resolve().parent.parent
API = f"{PUBLIC_PATH}/api/v1/namespaces/default"
CSRF = "temporal-web-test-csrf"  # the ui-server's double-submit token: cookie and header alike


async def _until_healthy(url: str, child: Child) -> None:
    for _ in range(150):
        assert child.running, f"{child.name} exited:\n{tail(child.log_path)}"
        if await http_ok(url):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{child.name} never answered:\n{tail(child.log_path)}")


@contextlib.asynccontextmanager
async def running_web(
    root: Path, temporal_client: Client, *, writes: bool = False
) -> AsyncIterator[str]:
    """The ui-server as bin/stack runs it (or, `writes=True`, the same with write actions on,
    for the control); yields its private base URL."""
    port = free_port()
    frontend = temporal_client.service_client.config.target_host
    codec = "http://localhost:8000/api/v1/admin/codec"
    if writes:
        config = {
            **ui_server_config(frontend, port, namespace="default", codec_endpoint=codec),
            "disableWriteActions": False,
        }
        web = Child("temporal-web-writable", ui_server_argv(root, config), root / "web.log",
                    dict(os.environ), root)  # fmt: skip
    else:
        web = temporal_web_child(
            root, root / "web.log", frontend, port, namespace="default", codec_endpoint=codec
        )
    await web.start()
    upstream = f"http://127.0.0.1:{port}"
    try:
        await _until_healthy(f"{upstream}{TEMPORAL_WEB_PUBLIC_PATH}/healthz", web)
        yield upstream
    finally:
        await web.stop()


@contextlib.asynccontextmanager
async def gateway(settings: Settings, temporal_client: Client, upstream: str) -> AsyncIterator[str]:
    app = create_app(
        dataclasses.replace(settings, temporal_web_upstream=upstream),
        temporal_client=temporal_client,
    )
    async with served_over_http(app) as base:
        yield base


async def probe_workflow(temporal_client: Client) -> str:
    """A workflow that only waits (no worker polls its queue): something to list and to try to
    terminate."""
    workflow_id = f"temporal-web-probe-{uuid.uuid4()}"
    await temporal_client.start_workflow(
        "TemporalWebProbe", id=workflow_id, task_queue=f"no-worker-{uuid.uuid4()}"
    )
    return workflow_id


def listing(workflow_id: str) -> str:
    query = quote('WorkflowId="' + workflow_id + '"')
    return f"{API}/workflows?query={query}"


async def sign_in(base: str, token: str, next_path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        return await client.post(
            "/console/sign-in",
            data={"token": token, "next": next_path},
            follow_redirects=False,
        )


def write_requests(workflow_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The UI's write calls (Temporal's HTTP API, as the ui-server exposes it)."""
    wf = f"{API}/workflows/{quote(workflow_id, safe='')}"
    return [
        (f"{wf}/terminate", {"reason": "bypassing the console"}),
        (f"{wf}/cancel", {"reason": "bypassing the console"}),
        (f"{wf}/reset", {"reason": "bypassing the console", "workflowTaskFinishEventId": "3"}),
        (f"{wf}/signal/anything", {}),
        (
            f"{API}/batch-operations/{uuid.uuid4()}",
            {
                "visibilityQuery": "ExecutionStatus='Running'",
                "reason": "x",
                "terminationOperation": {},
            },
        ),
    ]


async def assert_running(temporal_client: Client, workflow_id: str) -> None:
    description = await temporal_client.get_workflow_handle(workflow_id).describe()
    assert description.status == WorkflowExecutionStatus.RUNNING


# --- configuration -----------------------------------------------------------------------------


def test_every_temporal_web_is_read_only_and_private() -> None:
    """bin/stack's ui-server and the compose file's: loopback only, write actions off, under
    the path the gateway guards."""
    assert PUBLIC_PATH == TEMPORAL_WEB_PUBLIC_PATH
    stack = ui_server_config("127.0.0.1:7233", 8233, namespace="default", codec_endpoint="x")
    assert stack["host"] == "127.0.0.1"
    assert stack["disableWriteActions"] is True
    assert stack["publicPath"] == PUBLIC_PATH
    assert "auth" not in stack  # the gateway's console sign-in is the only one

    compose = yaml.safe_load((REPO_ROOT / "docker-compose.temporal.yml").read_text())
    ui = compose["services"]["temporal-ui"]
    assert ui["environment"]["TEMPORAL_DISABLE_WRITE_ACTIONS"] == "true"
    assert ui["environment"]["TEMPORAL_UI_PUBLIC_PATH"] == PUBLIC_PATH
    for service in ("temporal-ui", "temporal"):
        for published in compose["services"][service].get("ports", []):
            assert published.startswith("127.0.0.1:"), (service, published)


def test_the_stack_prints_the_guarded_url(tmp_path: Path) -> None:
    options = StackOptions(
        state_dir=tmp_path, pg_port=1, temporal_port=2, ui_port=8233, gateway_host="127.0.0.1",
        gateway_port=8123, phase_delay=0, jitter=0, agents=False, check=False, reset=False,
    )  # fmt: skip
    assert options.ui_url == f"http://localhost:8123{PUBLIC_PATH}/"
    assert options.ui_upstream == "http://127.0.0.1:8233"


def test_the_page_policy_hashes_inline_scripts_only() -> None:
    page = b'<script>boot()</script><script src="/temporal/_app/x.js"></script>'
    policy = content_security_policy(page)
    assert policy.startswith("script-src 'strict-dynamic' 'sha256-")
    assert policy.count("'sha256-") == 1
    assert "object-src 'none'" in policy


# --- the real ui-server behind the real gateway -------------------------------------------------


async def test_without_sign_in_nothing_is_listed_or_changed(
    settings: Settings, temporal_client: Client, make_token: Any, tmp_path: Path
) -> None:
    workflow_id = await probe_workflow(temporal_client)
    tenant_token = await make_token("tenant")
    admin_token = await make_token("admin")
    async with (
        running_web(tmp_path / "web", temporal_client) as upstream,
        gateway(settings, temporal_client, upstream) as base,
    ):
        # The ui-server itself lists it (the listing below is refused by the gateway, not
        # empty): bin/stack's ui-server behind the gateway sees the workflow.
        async with httpx.AsyncClient(base_url=upstream, timeout=30) as direct:

            async def seen_upstream() -> bool:
                return workflow_id in (await direct.get(listing(workflow_id))).text

            await eventually(seen_upstream, timeout=5, interval=0.1)

        async with httpx.AsyncClient(base_url=base, timeout=30) as anonymous:
            page = await anonymous.get(f"{PUBLIC_PATH}/namespaces/default/workflows")
            assert page.status_code == 303
            assert page.headers["location"] == (
                f"/console/sign-in?next={quote(f'{PUBLIC_PATH}/namespaces/default/workflows')}"
            )
            for headers in (
                {},
                bearer(tenant_token),
                bearer(admin_token),  # a token is no console session
                {"cookie": f"{codec_session.CONSOLE_COOKIE_NAME}=v1.forged.9999999999.x"},
            ):
                listed = await anonymous.get(listing(workflow_id), headers=headers)
                assert listed.status_code == 401, listed.text
                assert workflow_id not in listed.text
                assert listed.json()["error"]["code"] == "unauthenticated"
                for path, body in write_requests(workflow_id):
                    refused = await anonymous.post(
                        path,
                        json=body,
                        headers={
                            **headers,
                            "x-csrf-token": CSRF,
                            "cookie": f"_csrf={CSRF}",
                        },
                    )
                    assert refused.status_code == 401, (path, refused.text)

        # A tenant cannot get a console session at all.
        tenant = await sign_in(base, tenant_token, f"{PUBLIC_PATH}/")
        assert tenant.status_code == 403
        assert codec_session.CONSOLE_COOKIE_NAME not in tenant.cookies
    await assert_running(temporal_client, workflow_id)


async def test_a_signed_in_admin_lists_but_cannot_write(
    settings: Settings, temporal_client: Client, make_token: Any, tmp_path: Path
) -> None:
    workflow_id = await probe_workflow(temporal_client)
    admin_token = await make_token("admin")
    async with (
        running_web(tmp_path / "web", temporal_client) as upstream,
        gateway(settings, temporal_client, upstream) as base,
    ):
        target = f"{PUBLIC_PATH}/namespaces/default/workflows"
        signed = await sign_in(base, admin_token, target)
        assert signed.status_code == 303, signed.text
        assert signed.headers["location"] == target  # back to Temporal Web after sign-in
        # Never an open redirect, whatever `next` says.
        elsewhere = await sign_in(base, admin_token, "//evil.example/temporal/")
        assert elsewhere.headers["location"] == "/console/inventory"
        session = signed.cookies[codec_session.CONSOLE_COOKIE_NAME]
        cookie = f"{codec_session.CONSOLE_COOKIE_NAME}={session}"
        async with httpx.AsyncClient(
            base_url=base, timeout=30, headers={"cookie": cookie}
        ) as admin:
            page = await admin.get(target)
            assert page.status_code == 200, page.text
            assert f'base: "{PUBLIC_PATH}"' in page.text  # the UI's own routes stay under it
            assert page.headers["content-security-policy"].startswith(
                "script-src 'strict-dynamic' 'sha256-"
            )
            bare = await admin.get(PUBLIC_PATH, follow_redirects=False)
            assert bare.status_code == 308
            assert bare.headers["location"] == f"{PUBLIC_PATH}/"

            listed = await admin.get(listing(workflow_id))
            assert listed.status_code == 200, listed.text
            executions = listed.json()["executions"]
            assert [e["execution"]["workflowId"] for e in executions] == [workflow_id]
            settings_answer = (await admin.get(f"{PUBLIC_PATH}/api/v1/settings")).json()
            assert settings_answer["DisableWriteActions"] is True

            # Writes: refused by the ui-server's disableWriteActions (405), well-formed as they
            # are (the CSRF double-submit passes: the refusal is not the CSRF check's).
            write_headers = {"x-csrf-token": CSRF, "cookie": f"{cookie}; _csrf={CSRF}"}
            for path, body in write_requests(workflow_id):
                refused = await admin.post(path, json=body, headers=write_headers)
                assert refused.status_code == 405, (path, refused.status_code, refused.text)
                assert "Method Not Allowed" in refused.text
            for method in ("PUT", "PATCH", "DELETE"):
                other = await admin.request(
                    method, f"{API}/workflows/{workflow_id}", headers=write_headers
                )
                assert other.status_code == 405, (method, other.text)
    await assert_running(temporal_client, workflow_id)


async def test_the_same_terminate_goes_through_with_writes_on(
    temporal_client: Client, tmp_path: Path
) -> None:
    """The control for the 405s above: the very request a signed-in admin sent, to a ui-server
    configured the same but with write actions on, terminates the workflow. The refusal is the
    setting's, not a malformed request's."""
    workflow_id = await probe_workflow(temporal_client)
    async with (
        running_web(tmp_path / "writable", temporal_client, writes=True) as upstream,
        httpx.AsyncClient(base_url=upstream, timeout=30) as direct,
    ):
        path, body = write_requests(workflow_id)[0]
        done = await direct.post(
            path, json=body, headers={"x-csrf-token": CSRF, "cookie": f"_csrf={CSRF}"}
        )
        assert done.status_code == 200, done.text
    description = await temporal_client.get_workflow_handle(workflow_id).describe()
    assert description.status == WorkflowExecutionStatus.TERMINATED


def _listening_addresses(port: int) -> set[str]:
    """The local addresses that listen on `port` (Linux /proc/net/tcp{,6}, state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


async def test_the_ui_server_listens_on_loopback_only(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with running_web(tmp_path / "web", temporal_client) as upstream:
        port = int(upstream.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else


@pytest.mark.parametrize("upstream", [None])
async def test_no_upstream_answers_503_after_the_sign_in_check(
    settings: Settings, temporal_client: Client, make_token: Any, upstream: None
) -> None:
    app = create_app(
        dataclasses.replace(settings, temporal_web_upstream=upstream),
        temporal_client=temporal_client,
    )
    async with served_over_http(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as anonymous:
            assert (await anonymous.get(f"{API}/workflows")).status_code == 401
        signed = await sign_in(base, await make_token("admin"), "/console/inventory")
        session = signed.cookies[codec_session.CONSOLE_COOKIE_NAME]
        cookie = f"{codec_session.CONSOLE_COOKIE_NAME}={session}"
        async with httpx.AsyncClient(
            base_url=base, timeout=30, headers={"cookie": cookie}
        ) as admin:
            answer = await admin.get(f"{PUBLIC_PATH}/")
            assert answer.status_code == 503
            assert json.loads(answer.text)["error"]["code"] == "temporal_web_unavailable"
