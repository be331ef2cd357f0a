"""The operator console in a real browser: Debian's chromium driven by Playwright (never a
downloaded browser), against the gateway served over HTTP with the control-plane worker, the
MAAS simulator, real node agents and the tests' Temporal dev server. Each page is saved as a
screenshot under .artifacts/console/ (gitignored).

- a tenant token opens no page; an admin signs in once;
- inventory, node, lifecycle jobs, batch, allocations, allocation timeline and drift pages show
  the live data of a running batch onboarding and an active allocation;
- the batch page updates without a reload while the batch runs;
- actions sent from the console (freezing a batch node's onboarding, force-releasing the
  allocation) reach their workflows and are in the audit log with the typed reason;
- Temporal Web as bin/stack runs it (temporalio/ui-server on loopback, served by the gateway under
  /temporal/ to signed-in admins, codec calls with the browser's cookies, its codec endpoint the
  gateway) sends the browser to the sign-in first, then decodes a workflow's input, with nothing
  set in the browser by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.async_api import Browser, Page, async_playwright, expect

from core.config import Settings
from core.temporal import data_converter
from devstack.processes import Child, free_port, http_ok, tail
from devstack.temporal import dev_server_extra_args, temporal_cli_path
from devstack.temporal_cluster import temporal_web_child
from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.conftest import TEST_CODEC_KEY
from tests.factories import SLICE_SKU
from tests.lifecycle_support import Tenant, create_fleet, server_started, slice_request, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parent.parent / ".artifacts" / "console"
BATCH = [("console-a", "10.176.23.10"), ("console-b", "10.176.23.11")]
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is missing (bin/bootstrap installs it)"
)


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start.
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"]
        )
        try:
            yield browser
        finally:
            await browser.close()


async def snap(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


async def sign_in(page: Page, base: str, token: str) -> None:
    await page.goto(f"{base}/console/inventory")
    await expect(page).to_have_url(f"{base}/console/sign-in?next=/console/inventory")
    await page.get_by_test_id("token").fill(token)
    await page.get_by_test_id("sign-in").click()


async def act(page: Page, testid: str, reason: str) -> None:
    """Open an action's form, type the reason, send it."""
    action = page.get_by_test_id(testid)
    await action.locator("summary").click()
    await action.locator("textarea[name=reason]").fill(reason)
    await action.locator("button[type=submit]").click()


async def audit_entry(admin: Any, action: str, target_id: str) -> dict[str, Any] | None:
    listed = await admin.get("/api/v1/admin/audit", params={"action": action})
    return next((e for e in listed.json()["items"] if e["target_id"] == target_id), None)


# Deploys take 8 s here, so that the batch is still running while the test looks at it.
@pytest.mark.maas_scenario(
    sim_scenario(*(sim_machine(h, ip) for h, ip in BATCH), timings={"deploying": 8000})
)
async def test_console_pages_actions_and_live_batch(
    onboarding: OnboardingRig,
    tenant: Tenant,
    api: Any,
    make_token: Any,
    db_sessions: Any,
    start_node_agent: Any,
) -> None:
    base = onboarding.settings.public_api_url
    admin_token = await make_token("admin", name="ops-console")
    tenant_token = await make_token("tenant")
    admin = await api(token=admin_token)

    (node,) = await create_fleet(db_sessions, slice_nodes=1)
    await start_node_agent(node.id)
    created = (
        await tenant.client.post("/api/v1/allocations", json=slice_request(2, tenant.ssh_key_id))
    ).json()
    allocation_id = created["allocation_id"]
    await wait_status(tenant.client, allocation_id, "active")

    async with chromium() as browser:
        context = await browser.new_context()  # one browser profile: its pages share the cookie
        page = await context.new_page()

        # A tenant token opens nothing: refused at sign-in, and every page asks for a sign-in.
        await sign_in(page, base, tenant_token)
        await expect(page.get_by_test_id("error-code")).to_have_text("forbidden")
        await snap(page, "00-tenant-refused")
        for path in ("/console/inventory", f"/console/batches/{uuid.uuid4()}", "/console/drift"):
            await page.goto(f"{base}{path}")
            assert "/console/sign-in" in page.url, path

        await sign_in(page, base, admin_token)
        await expect(page.get_by_test_id("inventory")).to_contain_text(node.hostname)
        batch_id, jobs, _ = await onboarding.start_batch(BATCH)
        frozen = jobs[1]

        # The batch page, while the batch runs: it refreshes itself, no reload.
        await page.goto(f"{base}/console/batches/{batch_id}")
        table = page.get_by_test_id("batch-table")
        await expect(table).to_have_attribute("data-settled", "false")
        await page.evaluate("window.stillTheSamePage = true")
        await snap(page, "02-batch-running")

        # Freeze one node's onboarding from its lifecycle page (allowed while it runs).
        detail = await context.new_page()
        await detail.goto(f"{base}/console/onboardings/{frozen.onboarding_id}")
        await expect(detail.get_by_test_id("stages")).to_contain_text("load_site_config")
        freeze = detail.get_by_test_id("action-mark-manual-intervention")
        await expect(freeze).to_contain_text("failed_manual_intervention")  # expected state
        await expect(detail.get_by_test_id("action-retry")).to_have_count(0)  # not while running
        await act(detail, "action-mark-manual-intervention", "console test: BMC ticket OPS-7")
        await expect(detail.get_by_test_id("notice-expected")).to_have_text(
            "failed_manual_intervention"
        )
        await onboarding.wait_status(frozen, "failed_manual_intervention", timeout=90)
        entry = await audit_entry(
            admin, "onboarding.mark_manual_intervention_required", frozen.onboarding_id
        )
        assert entry is not None
        assert entry["actor"] == "ops-console"
        assert entry["reason"] == "console test: BMC ticket OPS-7"
        await detail.reload()
        await expect(detail.get_by_test_id("action-retry")).to_have_count(1)  # now allowed
        await snap(detail, "03-lifecycle-detail")

        # Back on the batch page: it settled by itself.
        await expect(table).to_have_attribute("data-settled", "true", timeout=120_000)
        await expect(page.locator(f'tr[data-hostname="{frozen.hostname}"]')).to_have_attribute(
            "data-status", "failed_manual_intervention"
        )
        await expect(page.locator('tr[data-hostname="console-a"]')).to_have_attribute(
            "data-status", "completed"
        )
        assert await page.evaluate("window.stillTheSamePage") is True
        await snap(page, "04-batch-settled")

        # The inventory now has the onboarded node, with its GPU slots; filters narrow it.
        await page.goto(f"{base}/console/inventory")
        inventory = page.get_by_test_id("inventory")
        await expect(inventory).to_contain_text("console-a")
        await snap(page, "01-inventory")
        await page.goto(f"{base}/console/inventory?status=active&sku={SLICE_SKU}")
        await expect(inventory).to_contain_text(node.hostname)
        await expect(inventory).not_to_contain_text("console-a")
        await page.get_by_role("link", name=node.hostname).click()
        await expect(page.locator("h1")).to_contain_text(node.hostname)
        await snap(page, "05-node")

        await page.goto(f"{base}/console/jobs")
        await expect(page.get_by_test_id("onboardings")).to_contain_text("console-b")
        await snap(page, "06-lifecycle-jobs")

        # The allocation: its timeline on a time axis, then a force-release from the console.
        await page.goto(f"{base}/console/allocations")
        await page.get_by_role("link", name=allocation_id).click()
        timeline = page.get_by_test_id("timeline")
        await expect(timeline).to_contain_text("provisioning_started")
        await expect(timeline).to_contain_text("slice.vm_provision")
        await expect(timeline.locator(".k-phase")).not_to_have_count(0)
        await snap(page, "07-allocation")
        await act(page, "action-force-release", "console test: tenant asked, OPS-8")
        await expect(page.get_by_test_id("notice")).to_contain_text("force_release")
        await wait_status(tenant.client, allocation_id, "released")
        entry = await audit_entry(admin, "allocation.force_release", allocation_id)
        assert entry is not None
        assert entry["reason"] == "console test: tenant asked, OPS-8"

        await page.goto(f"{base}/console/drift")
        await expect(page.get_by_test_id("reconciliation")).to_contain_text("nodes bound to MAAS")
        await snap(page, "08-drift")
        # Links into Temporal Web: the saved view without the schedules' runs.
        saved_view = await page.get_by_test_id("temporal-saved-view").get_attribute("href")
        assert saved_view is not None
        assert "TemporalScheduledById+IS+NULL" in saved_view


@contextlib.asynccontextmanager
async def serve(settings: Settings, temporal_client: Any, config: GatewayConfig, port: int):
    app = create_app(settings, temporal_client=temporal_client, config=config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await server_started(server, serving)
    try:
        yield
    finally:
        server.should_exit = True
        await serving


async def test_temporal_web_decodes_after_console_sign_in(
    settings: Settings, temporal_client: Any, make_token: Any, tmp_path: Path
) -> None:
    """Temporal Web as bin/stack runs it: `temporalio/ui-server` (its configuration from
    devstack.temporal_cluster.ui_server_config, codec calls with the browser's cookies) on a
    headless dev server, served by this gateway under /temporal/, its codec endpoint this
    gateway. Opened without a session it asks for the console sign-in; after it, and with
    nothing set in the browser by hand, a workflow's input shows decoded, not as ciphertext."""
    from temporalio.testing import WorkflowEnvironment

    ui_port, gateway_port = free_port(), free_port()
    upstream, gateway = f"http://127.0.0.1:{ui_port}", f"http://localhost:{gateway_port}"
    codec_endpoint = f"{gateway}/api/v1/admin/codec"
    env = await WorkflowEnvironment.start_local(
        namespace="default",
        data_converter=data_converter(TEST_CODEC_KEY),
        dev_server_existing_path=str(temporal_cli_path()),
        dev_server_extra_args=dev_server_extra_args(),
        ui=False,
    )
    web = temporal_web_child(
        tmp_path / "temporal-web",
        tmp_path / "temporal-web.log",
        env.client.service_client.config.target_host,
        ui_port,
        namespace="default",
        codec_endpoint=codec_endpoint,
    )
    await web.start()
    marker = f"console-decoded-{uuid.uuid4().hex[:8]}"
    workflow_id = f"console-probe-{uuid.uuid4()}"
    try:
        # Never run (no worker polls this queue): its input is only stored, encrypted.
        await env.client.start_workflow(
            "ConsoleDecodeProbe", {"note": marker}, id=workflow_id, task_queue="no-worker"
        )
        history = await env.client.get_workflow_handle(workflow_id).fetch_history()
        assert marker not in json.dumps(history.to_json_dict())  # ciphertext at rest
        admin_token = await make_token("admin")
        gateway_config = GatewayConfig(temporal_ui_origin=gateway)
        served = dataclasses.replace(settings, temporal_web_upstream=upstream)
        async with (
            serve(served, temporal_client, gateway_config, gateway_port),
            chromium() as browser,
        ):
            await _until_answering(f"{upstream}/temporal/healthz", web)
            page = await browser.new_page()
            # Temporal Web first: the gateway asks for the console's sign-in, then comes back.
            await page.goto(f"{gateway}/temporal/namespaces/default/workflows/{workflow_id}")
            await page.get_by_test_id("token").fill(admin_token)
            await page.get_by_test_id("sign-in").click()
            await expect(page.get_by_text(marker).first).to_be_visible(timeout=30_000)
            await snap(page, "09-temporal-web-decoded")
            assert "Codec Server could not connect" not in await page.content()
    finally:
        await web.stop()
        await env.shutdown()


async def _until_answering(url: str, child: Child) -> None:
    """Until `url` answers 200; fails with the child's log if it exits first or never does."""
    for _ in range(150):
        assert child.running, f"{child.name} exited:\n{tail(child.log_path)}"
        if await http_ok(url):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{child.name} never answered:\n{tail(child.log_path)}")
