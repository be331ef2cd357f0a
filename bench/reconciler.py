"""One MAAS site reconcile pass at scale: a simulated site of N Deployed machines (default 2,000)
bound to N nodes, the `maas.reconcile_site` activity called directly against a private
PostgreSQL and the MAAS simulator (a subprocess, over HTTP). Prints wall time and database round
trips (a before_cursor_execute listener on the engine) for a clean pass, for a pass after
10 % of the machines drifted out of band (half released, half with a new IP), and for a pass
over a truncated list (the simulator's truncate_list fault drops a fifth of the machines): that
one is refused as reconcile_suspect and changes no node. Each pass must stay under 5 s; the
script exits 1 if one does not, or if the truncated pass changed anything.

    .venv/bin/python -m bench.reconciler [--machines 2000]

The API token comes from an in-memory secret store: Vault is not what is measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from activities.maas_reconcile import MaasReconcileActivities
from bench.stack import private_postgres
from contracts.maas_reconciler import ReconcileInput
from devstack.processes import free_port
from schema.db import create_engine, session_factory
from schema.migrate import upgrade
from schema.models import MaasSite, Node, NodeDriftEvent, NodeMaasState

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 5.0
SUBNET = {
    "name": "pxe",
    "cidr": "10.176.32.0/19",
    "vid": 46,
    "gateway_ip": "10.176.32.1",
    "dns_servers": ["10.176.32.1"],
    "dynamic_range": ["10.176.60.1", "10.176.63.250"],
}


class MemorySecretStore:
    def __init__(self) -> None:
        self.data: dict[str, dict[str, str]] = {}

    async def read(self, path: str) -> dict[str, str] | None:
        return self.data.get(path)

    async def write(self, path: str, data: Mapping[str, str]) -> int:
        self.data[path] = dict(data)
        return 1

    async def delete(self, path: str) -> None:
        self.data.pop(path, None)


def scenario(n: int) -> dict[str, Any]:
    machines = []
    for i in range(n):
        b = (i >> 8) & 0xFF, i & 0xFF
        bmc = f"10.177.{b[0]}.{b[1]}"
        mac = f"{0:02x}:{b[0]:02x}:{b[1]:02x}"
        machines.append(
            {
                "hostname": f"bench-{i:05d}",
                "enlisted": True,
                "status": "Deployed",
                "bmc": {"address": bmc, "user": "root", "password": "calvin"},
                "interfaces": [
                    {"name": "eno8303", "mac": f"02:00:{mac}:01", "subnet": "pxe", "pxe": True},
                    {"name": "ens1f0np0", "mac": f"02:01:{mac}:02", "speed": 400000},
                ],
                "block_devices": [
                    {"name": "sda", "model": "BOSS-N1", "serial": f"B{i}", "size": 480103981056},
                    {"name": "nvme0n1", "model": "NVMe", "serial": f"N{i}", "size": 3840755982336},
                ],
            }
        )
    return {
        "seed": 1,
        "time_scale": 0.001,
        "site": {"custom_images": ["gpuaas-noble-2025.06"]},
        "subnets": [SUBNET],
        "machines": machines,
        "faults": [],
    }


@contextlib.contextmanager
def maas_simulator(workdir: Path, n: int) -> Iterator[tuple[str, str, str]]:
    port = free_port()
    api_key = f"{secrets.token_hex(9)}:{secrets.token_hex(9)}:{secrets.token_hex(16)}"
    control = secrets.token_hex(16)
    (workdir / "scenario.json").write_text(json.dumps(scenario(n)))
    (workdir / "api.key").write_text(api_key + "\n")
    (workdir / "control.token").write_text(control + "\n")
    argv = [
        sys.executable, "-m", "sim.maas", "--host", "127.0.0.1", "--port", str(port),
        "--scenario", str(workdir / "scenario.json"),
        "--api-key-file", str(workdir / "api.key"),
        "--control-token-file", str(workdir / "control.token"),
        "--log-level", "warning",
    ]  # fmt: skip
    with (workdir / "maas-sim.log").open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/MAAS"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/api/2.0/version/", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((workdir / "maas-sim.log").read_text())
            time.sleep(0.1)
        yield base, api_key, control
    finally:
        process.terminate()
        process.wait(timeout=10)


class RoundTrips:
    def __init__(self, engine: AsyncEngine) -> None:
        self.count = 0

        def count(*_: Any) -> None:
            self.count += 1

        event.listen(engine.sync_engine, "before_cursor_execute", count)


async def seed(engine: AsyncEngine, base_url: str, api_key: str, control: str) -> uuid.UUID:
    async with httpx.AsyncClient(
        base_url=base_url.removesuffix("/MAAS"), headers={"Authorization": f"Bearer {control}"}
    ) as http:
        machines = (await http.get("/_sim/state")).json()["machines"]
    site_id = uuid.uuid4()
    sessions = session_factory(engine)
    async with sessions() as session, session.begin():
        session.add(
            MaasSite(
                id=site_id,
                name="bench",
                region_code="bench-1",
                api_base_url=base_url,
                api_token_vault_path=f"kv/maas-sites/{site_id}/api-token",
                default_power_creds_vault_path=f"kv/maas-sites/{site_id}/power/default",
                deploy_password_vault_path=f"kv/maas-sites/{site_id}/deploy-password",
                pxe_iface="ens19",
                pxe_vlan_vid=46,
                node_pxe_iface="eno8303",
            )
        )
        await session.flush()
        nodes, states = [], []
        for m in machines:
            node_id = uuid.uuid4()
            nodes.append(
                {
                    "id": node_id,
                    "hostname": m["hostname"],
                    "region": "bench-1",
                    "sku": "h100-8x",
                    "status": "active",
                    "gpu_count": 8,
                    "host_address": m["ip_addresses"][0],
                }
            )
            states.append(
                {"node_id": node_id, "site_id": site_id, "maas_system_id": m["system_id"]}
            )
        await session.execute(insert(Node), nodes)
        await session.execute(insert(NodeMaasState), states)
    return site_id


async def drift(base_url: str, control: str, n: int) -> None:
    async with httpx.AsyncClient(
        base_url=base_url.removesuffix("/MAAS"),
        headers={"Authorization": f"Bearer {control}"},
        timeout=30,
    ) as http:
        for i in range(0, n, 10):
            action = "release" if i % 20 == 0 else "change-ip"
            r = await http.post(f"/_sim/machines/bench-{i:05d}/{action}", json={})
            r.raise_for_status()


async def truncate(base_url: str, control: str, keep: int) -> None:
    """The next machines list answers only its first `keep` machines."""
    async with httpx.AsyncClient(
        base_url=base_url.removesuffix("/MAAS"), headers={"Authorization": f"Bearer {control}"}
    ) as http:
        fault = {"kind": "truncate_list", "op": "machines.read", "keep": keep, "times": 1}
        (await http.post("/_sim/faults", json=fault)).raise_for_status()


async def fingerprint(engine: AsyncEngine) -> tuple[Any, ...]:
    """What a reconcile pass writes: node statuses and hosts, reconcile stamps, drift events."""
    sessions = session_factory(engine)
    async with sessions() as session:
        nodes = await session.scalar(
            text(
                "SELECT md5(string_agg(status || ':' || coalesce(host_address, ''), ','"
                " ORDER BY id)) FROM nodes"
            )
        )
        stamps = await session.scalar(select(func.max(NodeMaasState.last_reconciled_at)))
        events = await session.scalar(select(func.count()).select_from(NodeDriftEvent))
    return nodes, stamps, events


async def main_async(n: int) -> int:
    with private_postgres() as cluster, tempfile.TemporaryDirectory() as sim_dir:
        cluster.create_database("bench", recreate=True)
        url = cluster.url("bench")
        await asyncio.to_thread(upgrade, url)
        t0 = time.perf_counter()
        with maas_simulator(Path(sim_dir), n) as (base_url, api_key, control):
            print(f"simulator with {n} Deployed machines up in {time.perf_counter() - t0:.1f} s")
            engine = create_engine(url)
            site_id = await seed(engine, base_url, api_key, control)
            store = MemorySecretStore()
            await store.write(f"kv/maas-sites/{site_id}/api-token", {"token": api_key})
            activities = MaasReconcileActivities(session_factory(engine), store)
            trips = RoundTrips(engine)
            failed = 0
            for label in ("clean pass", "after drift", "truncated list"):
                if label == "after drift":
                    await drift(base_url, control, n)
                if label == "truncated list":
                    await truncate(base_url, control, keep=n - n // 5)
                    before = await fingerprint(engine)
                trips.count = 0
                start = time.perf_counter()
                result = await activities.reconcile(ReconcileInput(str(site_id)))
                wall = time.perf_counter() - start
                within = wall < TARGET_SECONDS
                failed += not within
                print(
                    f"{label}: {wall:.2f} s wall ({'under' if within else 'OVER'} "
                    f"{TARGET_SECONDS:.0f} s), {trips.count} database round trips; "
                    f"machines {result.machines_seen}, nodes {result.nodes_checked}, "
                    f"drift detected {result.drift_detected}, actions {len(result.actions)}"
                    + (f" {result.actions}" if label == "truncated list" else "")
                )
                if label == "truncated list":
                    unchanged = await fingerprint(engine) == before
                    failed += not unchanged or result.actions != ["suspect:missing_share"]
                    print(f"  refused as reconcile_suspect, nothing changed: {unchanged}")
            await engine.dispose()
            return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2000)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main_async(args.machines)))


if __name__ == "__main__":
    main()
