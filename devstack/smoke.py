"""The README's tenant flow, scripted over HTTP against a running stack.

`gpucloud-stack --check` runs it after bringing the stack up; against a stack that is already
running (bin/stack in another terminal):

    .venv/bin/python -m devstack.smoke                 # .state/tokens.json, $GPUCLOUD_API
    .venv/bin/python -m devstack.smoke --gateway http://127.0.0.1:8000 --tokens path/to/tokens.json

Steps: register an SSH key, POST /api/v1/allocations (h100.slice, 2 GPUs, us-east-1) with an
X-Idempotency-Key, repeat it (same allocation), poll until active, read the timeline, release,
poll until released, and list release_failed allocations as an admin. With an admin token, on
the demo MAAS site: onboard its Ready machines c07u43 (bare metal) and c07u46 (GPU slices; its
first deployment fails and is redeployed); on each node an allocation served by the real agent
its first boot started (a slice VM on libvirt's test driver; a tenant account); then soft_reset,
reimage and full_decommission with erase on c07u43, and full_decommission on c07u46, whose
failing erase takes the site's no-erase fallback. Exit status 0 or 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DEFAULT_TOKENS = Path(__file__).resolve().parent.parent / ".state" / "tokens.json"
TERMINAL_FAILURES = {"failed", "release_failed", "rejected"}


class SmokeFailed(RuntimeError):
    pass


def new_public_key(comment: str) -> str:
    public = Ed25519PrivateKey.generate().public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return f"{line.decode()} {comment}"


def _expect(response: httpx.Response, *codes: int) -> Any:
    if response.status_code not in codes:
        raise SmokeFailed(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code}, expected {'/'.join(map(str, codes))}: {response.text[:500]}"
        )
    return response.json() if response.content else None


def _poll_status(
    http: httpx.Client, path: str, want: str, timeout: float, say: Callable[[str], None]
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        body: dict[str, Any] = _expect(http.get(path), 200)
        status = body["status"]
        if status != last:
            say(f"    status: {status}")
            last = status
        if status == want:
            return body
        if status in TERMINAL_FAILURES:
            raise SmokeFailed(
                f"allocation ended in {status}: {body.get('failure_reason')} "
                f"{body.get('failure_message') or ''}".strip()
            )
        if time.monotonic() > deadline:
            raise SmokeFailed(f"allocation still {status} after {timeout:.0f}s (wanted {want})")
        time.sleep(0.5)


DEMO_SITE = "demo-maas"
# The demo MAAS scenario's Ready machines (sim/maas/scenarios/demo.toml) and the demo catalog's
# SKUs (sim/demo_fleet.py). c07u43 is healthy and becomes a bare-metal node; c07u46 is the
# troubled one: its first deployment fails like a cloud-init datasource failure (the site's
# bounded redeploy recovers), its machine token shows up late, and erasing its disks fails once
# (the site's no-erase fallback releases it). It becomes a GPU-slice node.
DEMO_BAREMETAL = {"hostname": "c07u43", "ipmi_ip": "10.176.16.128", "sku_id": "h100.8x.baremetal"}
DEMO_SLICE = {"hostname": "c07u46", "ipmi_ip": "10.176.16.131", "sku_id": "h100.slice"}
ONBOARD_SETTLED_OK = ("completed", "reconciled")
ONBOARD_FAILED = ("failed_retryable", "failed_manual_intervention", "cancelled")
# At most this many allocations are placed elsewhere before one lands on the node under test.
MAX_MISPLACED = 8


def _start_onboarding(
    http: httpx.Client,
    admin: dict[str, str],
    site: dict[str, Any],
    machine: dict[str, str],
    step: Callable[[str], None],
) -> str | None:
    """POST /api/v1/admin/onboardings for one of the demo site's Ready machines; the job's path,
    or None when a node of that hostname exists already (an earlier run stopped before its
    decommission)."""
    body = {"site_id": site["id"], "profile_id": site["default_profile_id"], **machine}
    step(f"POST /api/v1/admin/onboardings ({machine['hostname']} as {machine['sku_id']})")
    # A fresh key per run: the node is decommissioned at the end of each run (the machine goes
    # back to Ready), so the next run onboards it again.
    headers = {**admin, "X-Idempotency-Key": f"smoke-onboard-{uuid.uuid4()}"}
    response = http.post("/api/v1/admin/onboardings", json=body, headers=headers)
    if response.status_code == 409 and response.json()["error"]["code"] == "node_exists":
        step(f"    {machine['hostname']} already onboarded by an earlier run")
        return None
    onboarding = _expect(response, 200, 201)
    return f"/api/v1/admin/onboardings/{onboarding['onboarding_id']}"


def _poll_job(
    http: httpx.Client,
    admin: dict[str, str],
    path: str,
    what: str,
    step: Callable[[str], None],
    timeout: float,
) -> dict[str, Any]:
    """A lifecycle job (onboarding, decommission) until it settles; SmokeFailed if it fails."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        job: dict[str, Any] = _expect(http.get(path, headers=admin), 200)
        where = f"{job['status']} at {job['current_stage']}"
        if where != last:
            step(f"    {what}: {where}")
            last = where
        if job["status"] in ONBOARD_SETTLED_OK:
            return job
        if job["status"] in ONBOARD_FAILED:
            raise SmokeFailed(
                f"{what} ended {job['status']}: {job.get('error_code')} {job.get('error_message')}"
            )
        if time.monotonic() > deadline:
            raise SmokeFailed(f"{what} still {where} after {timeout:.0f}s")
        time.sleep(1.0)


def _start_decommission(
    http: httpx.Client,
    admin: dict[str, str],
    node_id: str,
    body: dict[str, Any],
    step: Callable[[str], None],
) -> str:
    step(f"POST /api/v1/admin/nodes/{node_id}/decommission ({body['mode']})")
    job = _expect(
        http.post(f"/api/v1/admin/nodes/{node_id}/decommission", json=body, headers=admin),
        200,
        201,
        202,
    )
    return f"/api/v1/admin/decommissions/{job['decommission_id']}"


def _allocate_on(
    http: httpx.Client,
    body: dict[str, Any],
    node_id: str,
    step: Callable[[str], None],
) -> tuple[str, list[str]]:
    """POST the allocation until placement puts one on `node_id`: (that one, the ones placed
    elsewhere). Tenants cannot pick a node, and the demo fleet sells the same SKUs, so each
    allocation placed elsewhere is kept until ours lands (it takes that node's capacity: ask
    for whole nodes, so every miss rules one node out), then released by the caller."""
    misplaced: list[str] = []
    try:
        for _ in range(MAX_MISPLACED + 1):
            idem = {"X-Idempotency-Key": f"smoke-{uuid.uuid4()}"}
            created = _expect(http.post("/api/v1/allocations", json=body, headers=idem), 201)
            if created["node_id"] == node_id:
                step(f"    allocation {created['allocation_id']} on node {node_id}")
                return str(created["allocation_id"]), misplaced
            step(f"    placed on demo node {created['node_id']}; kept while placing again")
            misplaced.append(str(created["allocation_id"]))
        raise SmokeFailed(f"{len(misplaced)} allocations placed, none on node {node_id}")
    except BaseException:
        for other in misplaced:  # give the demo capacity back
            with contextlib.suppress(httpx.HTTPError):
                http.post(f"/api/v1/allocations/{other}/release")
        raise


def _serve_allocation(
    http: httpx.Client,
    body: dict[str, Any],
    node_id: str,
    expect_tasks: tuple[str, str],
    step: Callable[[str], None],
    timeout: float,
) -> None:
    """An allocation on the onboarded node: provisioned and released by the agent its first
    boot started (the timeline shows its host tasks). The ones placed elsewhere are released
    as soon as ours is placed (a release waits for their provisioning to settle)."""
    step(f"POST /api/v1/allocations ({body['sku']} x{body['gpus']} on node {node_id})")
    allocation_id, misplaced = _allocate_on(http, body, node_id, step)
    for other in misplaced:
        step(f"POST /api/v1/allocations/{other}/release (placed elsewhere)")
        _expect(http.post(f"/api/v1/allocations/{other}/release"), 200, 202)
    path = f"/api/v1/allocations/{allocation_id}"
    step(f"GET {path} until active")
    active = _poll_status(http, path, "active", timeout, step)
    step(f"    connect to {active['connect_host']}")
    step(f"POST {path}/release")
    _expect(http.post(f"{path}/release"), 200, 202)
    _poll_status(http, path, "released", timeout, step)
    timeline = _expect(http.get(f"{path}/timeline"), 200)
    tasks = {i["name"]: i for i in timeline.get("items") or [] if i["kind"] == "node_task"}
    for name in expect_tasks:
        task = tasks.get(name)
        if task is None or task["status"] != "succeeded":
            raise SmokeFailed(f"the timeline has no succeeded {name}: {sorted(tasks)}")
        phases = ", ".join(dict.fromkeys(p["phase"] for p in task.get("phases") or []))
        step(f"    {name:<28} {task['status']} [{phases}]")
    for other in misplaced:
        step(f"GET /api/v1/allocations/{other} until released")
        _poll_status(http, f"/api/v1/allocations/{other}", "released", timeout, step)


BAREMETAL_DECOMMISSIONS = (
    {"mode": "soft_reset", "reason": "stack check"},
    {"mode": "reimage", "reason": "stack check"},
    {"mode": "full_decommission", "erase": "quick", "reason": "stack check"},
)
SLICE_DECOMMISSION = {"mode": "full_decommission", "erase": "quick", "reason": "stack check"}


def _demo_maas_nodes(
    http: httpx.Client,
    admin: dict[str, str],
    site: dict[str, Any],
    step: Callable[[str], None],
    timeout: float,
) -> None:
    """Both demo machines onboarded through every stage (their first boots run the real agent,
    which enrolls and reports its GPUs: the nodes' slots), at once. On the bare-metal node a
    whole-node allocation, then soft_reset, reimage (the agent re-enrolls from a fresh
    cloud-init) and full_decommission with erase; on the slice node a slice VM on libvirt's test
    driver, then full_decommission whose erase fails once (the no-erase fallback). Every host
    task is served by the agent process of that machine; both machines end Ready."""
    jobs = {
        name: _start_onboarding(http, admin, site, machine, step)
        for name, machine in (("bare-metal", DEMO_BAREMETAL), ("slice", DEMO_SLICE))
    }
    nodes: dict[str, str] = {}  # onboarded and not yet given to a full_decommission
    in_flight: dict[str, str] = {}  # full_decommission jobs started, not yet settled
    try:
        for name, path in jobs.items():
            if path is not None:
                step(f"GET {path} until completed")
                job = _poll_job(http, admin, path, f"{name} onboarding", step, timeout)
                step(f"    node {job['node_id']}, {job['deploy_attempts']} deployment(s)")
                nodes[name] = str(job["node_id"])
        _serve_demo_maas_nodes(http, admin, site, nodes, in_flight, step, timeout)
    except BaseException:
        _clean_up(http, admin, nodes, in_flight, step, timeout)
        raise


def _serve_demo_maas_nodes(
    http: httpx.Client,
    admin: dict[str, str],
    site: dict[str, Any],
    nodes: dict[str, str],
    in_flight: dict[str, str],
    step: Callable[[str], None],
    timeout: float,
) -> None:
    """_demo_maas_nodes' allocations and decommissions; a node leaves `nodes` once its
    full_decommission is started (into `in_flight` until it settles)."""
    # The tenant's client (its token in the client's headers) allocates; admin calls add theirs.
    key = _expect(
        http.post(
            "/api/v1/ssh-keys",
            json={"name": f"smoke-maas-{uuid.uuid4().hex[:8]}", "public_key": new_public_key("m")},
        ),
        201,
    )

    def whole_node(sku: str) -> dict[str, Any]:
        return {"sku": sku, "gpus": 8, "region": site["region_code"], "ssh_key_ids": [key["id"]]}

    if "slice" in nodes:
        tasks = ("slice.vm_provision", "slice.vm_release")
        body = whole_node(DEMO_SLICE["sku_id"])
        _serve_allocation(http, body, nodes["slice"], tasks, step, timeout)
        in_flight["slice"] = _start_decommission(
            http, admin, nodes.pop("slice"), SLICE_DECOMMISSION, step
        )
    if "bare-metal" in nodes:
        tasks = ("allocation.provision_user", "allocation.deprovision_user")
        body = whole_node(DEMO_BAREMETAL["sku_id"])
        _serve_allocation(http, body, nodes["bare-metal"], tasks, step, timeout)
        for decommission in BAREMETAL_DECOMMISSIONS:
            node_id = nodes["bare-metal"]
            if decommission["mode"] == "full_decommission":
                nodes.pop("bare-metal")
            path = _start_decommission(http, admin, node_id, decommission, step)
            _poll_job(http, admin, path, f"bare-metal {decommission['mode']}", step, timeout)
    if "slice" in in_flight:
        path = in_flight["slice"]
        job = _poll_job(http, admin, path, "slice full_decommission", step, timeout)
        del in_flight["slice"]
        followups = [f.get("kind") for f in job.get("followups") or []]
        step(f"    follow-ups: {', '.join(map(str, followups)) or 'none'}")


CLEANUP_DECOMMISSION: dict[str, Any] = {
    "mode": "full_decommission",
    "force_release_allocations": True,
    "reason": "stack check cleanup after a failed step",
}


def _clean_up(
    http: httpx.Client,
    admin: dict[str, str],
    nodes: dict[str, str],
    in_flight: dict[str, str],
    step: Callable[[str], None],
    timeout: float,
) -> None:
    """After a failed step: the onboarded nodes are decommissioned all the same (best effort),
    so that the next run onboards the machines again instead of finding their nodes."""
    for name, node_id in nodes.items():
        with contextlib.suppress(SmokeFailed, httpx.HTTPError, KeyError):
            in_flight[name] = _start_decommission(http, admin, node_id, CLEANUP_DECOMMISSION, step)
    for name, path in in_flight.items():
        try:
            _poll_job(http, admin, path, f"{name} cleanup", step, timeout)
        except (SmokeFailed, httpx.HTTPError, KeyError) as err:
            step(f"    {name} node left behind: {err}")


def run_smoke(
    gateway: str,
    tenant_token: str,
    admin_token: str | None = None,
    *,
    timeout: float = 180.0,
    say: Callable[[str], None] = print,
) -> bool:
    """The tenant flow end to end; True when every step behaved as the README says."""
    started = time.monotonic()

    def step(text: str) -> None:
        say(f"[{time.monotonic() - started:6.1f}s] {text}")

    headers = {"Authorization": f"Bearer {tenant_token}"}
    allocation_id: str | None = None
    released = False
    try:
        with httpx.Client(base_url=gateway, headers=headers, timeout=30.0) as http:
            step("GET /healthz")
            _expect(http.get("/healthz"), 200)

            step("POST /api/v1/ssh-keys")
            suffix = uuid.uuid4().hex[:8]
            key = _expect(
                http.post(
                    "/api/v1/ssh-keys",
                    json={
                        "name": f"smoke-{suffix}",
                        "public_key": new_public_key(f"smoke-{suffix}@gpucloud"),
                    },
                ),
                201,
            )
            step(f"    key {key['id']} {key['fingerprint']}")

            body = {
                "sku": "h100.slice",
                "gpus": 2,
                "region": "us-east-1",
                "ssh_key_ids": [key["id"]],
            }
            idem = {"X-Idempotency-Key": f"smoke-{uuid.uuid4()}"}
            step("POST /api/v1/allocations (h100.slice x2, us-east-1)")
            created = _expect(http.post("/api/v1/allocations", json=body, headers=idem), 201)
            allocation_id = created["allocation_id"]
            step(
                f"    allocation {allocation_id} on node {created['node_id']}: {created['status']}"
            )

            step("POST /api/v1/allocations again with the same X-Idempotency-Key")
            again = _expect(http.post("/api/v1/allocations", json=body, headers=idem), 200, 201)
            if again["allocation_id"] != allocation_id:
                raise SmokeFailed("the retried request created a second allocation")

            path = f"/api/v1/allocations/{allocation_id}"
            step(f"GET {path} until active")
            _poll_status(http, path, "active", timeout, step)

            step(f"GET {path}/timeline")
            timeline = _expect(http.get(f"{path}/timeline"), 200)
            items = timeline.get("items") or []
            tasks = [i for i in items if i.get("kind") == "node_task"]
            if not tasks:
                raise SmokeFailed("the timeline shows no node tasks")
            for item in items:
                phases = ", ".join(dict.fromkeys(p["phase"] for p in item.get("phases") or []))
                step(
                    f"    {item['kind']:<16} {item['name']:<28} {item['status']}"
                    + (f" [{phases}]" if phases else "")
                )

            step(f"POST {path}/release")
            answer = _expect(http.post(f"{path}/release"), 200, 202)
            step(f"    {answer.get('prior_status')} -> {answer.get('expected_status')}")
            released = True
            step(f"GET {path} until released")
            _poll_status(http, path, "released", timeout, step)

            step("POST /api/v1/payments/checkout-session (stripe-mock)")
            checkout = _expect(
                http.post(
                    "/api/v1/payments/checkout-session",
                    json={"amount_minor": 5000, "currency": "usd"},
                    headers={"X-Idempotency-Key": f"smoke-{uuid.uuid4()}"},
                ),
                201,
            )
            step(f"    {checkout['status']}: {checkout['checkout_url']}")
            balance = _expect(http.get("/api/v1/billing/balance"), 200)
            step(f"GET /api/v1/billing/balance: {balance['balance_minor']} ({balance['state']})")

            if admin_token:
                step("GET /api/v1/admin/allocations?status=release_failed (admin)")
                listing = _expect(
                    http.get(
                        "/api/v1/admin/allocations",
                        params={"status": "release_failed"},
                        headers={"Authorization": f"Bearer {admin_token}"},
                    ),
                    200,
                )
                step(f"    {len(listing.get('items', []))} allocation(s) in release_failed")
                admin = {"Authorization": f"Bearer {admin_token}"}
                sites = _expect(http.get("/api/v1/admin/maas-sites", headers=admin), 200)
                for site in sites.get("items", []):
                    step(f"POST /api/v1/admin/maas-sites/{site['id']}/probe ({site['name']})")
                    probe = _expect(
                        http.post(f"/api/v1/admin/maas-sites/{site['id']}/probe", headers=admin),
                        200,
                    )
                    racks = ", ".join(r["hostname"] for r in probe["rack_controllers"])
                    step(f"    MAAS {probe['maas_version']}, rack controllers: {racks}")
                    if site["name"] == DEMO_SITE:
                        _demo_maas_nodes(http, admin, site, step, timeout)
    except (SmokeFailed, httpx.HTTPError, KeyError, ValueError) as err:
        step(f"SMOKE CHECK FAILED: {type(err).__name__}: {err}")
        if allocation_id and not released:  # give the capacity back
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    f"{gateway}/api/v1/allocations/{allocation_id}/release",
                    headers=headers,
                    timeout=10.0,
                )
        return False
    step("smoke check passed")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.smoke", description=__doc__)
    parser.add_argument(
        "--gateway",
        default=os.environ.get("GPUCLOUD_API", "http://127.0.0.1:8000"),
        help="gateway base URL (default: $GPUCLOUD_API, else %(default)s)",
    )
    parser.add_argument("--tokens", type=Path, default=DEFAULT_TOKENS)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    tokens = json.loads(args.tokens.read_text())
    ok = run_smoke(
        args.gateway, tokens["tenant_token"], tokens.get("admin_token"), timeout=args.timeout
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
