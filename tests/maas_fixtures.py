"""MAAS simulator fixtures: `python -m sim.maas` as a real subprocess, the MAAS peer over HTTP.

    async def test_x(maas_sim):                       # reset to DEFAULT_SCENARIO for this test
        async with maas_sim.client() as maas:          # httpx client, signs every request
            machines = (await maas.get("machines/", params={"hostname": "node-a"})).json()
        await maas_sim.power_cycle_bmc("10.176.16.12")   # discovery: node-c enlists as New
        assert (await maas_sim.counters())["ops"].get("machine.deploy", 0) <= 2

    @pytest.mark.maas_scenario(sim_scenario(sim_machine("n1", "10.0.0.1", faults=[
        {"kind": "deploy_fails_datasource"}])))       # this test's scenario instead
    async def test_y(maas_sim): ...

`maas_sim_process` (session): the subprocess on a free port, with a random API key and control
token, started with DEFAULT_SCENARIO and polled until GET /MAAS/api/2.0/version/ answers. Its
output goes to `<tmp>/maas-sim.log` (`log_path`).

`maas_sim` (per test): resets the simulator (machines, faults, counters, nonces) to the test's
`maas_scenario` marker (a scenario dict or TOML text; `time_scale=` keyword) or DEFAULT_SCENARIO,
and yields a `MaasSim` handle:

    base_url            "http://127.0.0.1:PORT/MAAS" (what a MAAS site's api_base_url holds)
    api_url             base_url + "/api/2.0/"
    api_key             "consumer_key:token_key:token_secret"
    control_token       bearer token of the /_sim/ control API
    control             httpx.AsyncClient for /_sim/ with the token set (raw calls, error cases)
    auth_header()       a fresh OAuth PLAINTEXT Authorization header for api_key
    client(**kw)        httpx.AsyncClient on api_url that signs each request (caller closes it)
    await reset(scenario=None, time_scale=None)     -> simulator state
    await state() / machine(ref)                    -> snapshots (status, power, user data, ...)
    await counters() / reset_counters()             -> {"ops", "machines", "answers"}
    await release(ref, erase=False, comment="")     behind the product's back, as in the UI
    await mark_broken(ref, comment="")
    await delete(ref)
    await change_ip(ref, ip=None, interface=None)   -> the new address
    await set_planned_ip(ref, ip, interface=None)   the address its next deployment gets
    await add_user(username, is_superuser=False)    -> a fresh API key of a new MAAS user
    await set_power(ref, "on" | "off")              at the BMC
    await set_status(ref, "Deploying")              forced, no transition
    await power_cycle_bmc(address)                  -> "enlisting" | "booted"
    await bmc_log() / erasures()                    every BMC request / disk erase MAAS ran
    await set_fault(ref, kind, **params)            a machine fault (sim.maas.faults)
    await clear_faults(ref)
    await add_request_fault(kind, **params)         site-wide http_error / slow / truncate_list
    await clear_request_faults()
    await set_time_scale(scale)
    await wait_for_status(system_id, *names, timeout=10.0) -> the machine once its status_name
                                                      is one of names (polls the MAAS API)

A `ref` is a system_id, a MAAS hostname, a scenario hostname or a BMC address.

Scenario builders: `sim_machine(hostname, bmc_address, ...)` and `sim_scenario(*machines, ...)`
build scenario dicts with short test timings (TEST_TIMINGS at TEST_TIME_SCALE: each transition
takes 0.04-0.2 s) on one PXE subnet, "pxe" (10.176.46.0/24).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.processes import free_port
from sim.maas.auth import oauth_header

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_TIME_SCALE = 0.001  # real seconds per simulated second
TEST_TIMINGS: dict[str, float] = {
    "commissioning": 100,
    "testing": 40,
    "deploying": 200,
    "disk_erasing": 100,
    "releasing": 40,
    "enlistment": 100,
}
PXE_SUBNET: dict[str, Any] = {
    "name": "pxe",
    "cidr": "10.176.46.0/24",
    "vid": 46,
    "gateway_ip": "10.176.46.1",
    "dns_servers": ["10.176.46.1"],
    "dynamic_range": ["10.176.46.200", "10.176.46.250"],
}
BOSS_MODEL = "Dell BOSS-N1"
DISK_SIZE_BOSS = 480103981056
DISK_SIZE_NVME = 3840755982336


def _macs_for(bmc_address: str) -> tuple[str, str]:
    """Two stable MACs per machine, derived from its BMC address."""
    octets = ipaddress.ip_address(bmc_address).packed[-3:]
    base = ":".join(f"{b:02x}" for b in octets)
    return f"02:00:{base}:01", f"02:01:{base}:02"


def sim_machine(
    hostname: str,
    bmc_address: str,
    *,
    status: str = "Ready",
    enlisted: bool = True,
    boss: bool = True,
    faults: Sequence[Mapping[str, Any]] = (),
    timings: Mapping[str, float] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A GPU node: a PXE NIC on "pxe", a RoCE NIC, a BOSS disk `sda` (unless boss=False) and
    an NVMe disk. `extra` adds MachineSpec fields (owner, enable_hw_sync, boot_disk, ...)."""
    pxe_mac, roce_mac = _macs_for(bmc_address)
    disks = [{"name": "nvme0n1", "model": "Dell Ent NVMe CM6 RI 3.84TB",
              "serial": f"NV-{hostname}", "size": DISK_SIZE_NVME}]  # fmt: skip
    if boss:
        boss_id = f"/dev/disk/by-id/ata-DELL_BOSS-N1_BOSS-{hostname}"
        disks.insert(0, {"name": "sda", "model": BOSS_MODEL, "serial": f"BOSS-{hostname}",
                         "size": DISK_SIZE_BOSS, "id_path": boss_id})  # fmt: skip
    machine: dict[str, Any] = {
        "hostname": hostname,
        "enlisted": enlisted,
        "status": status,
        "bmc": {"address": bmc_address, "user": "root", "password": "calvin"},
        "interfaces": [
            {"name": "eno8303", "mac": pxe_mac, "subnet": "pxe", "pxe": True},
            {"name": "ens1f0np0", "mac": roce_mac, "speed": 400000},
        ],
        "block_devices": disks,
        "faults": [dict(f) for f in faults],
        **extra,
    }
    if timings:
        machine["timings"] = dict(timings)
    return machine


def sim_scenario(
    *machines: Mapping[str, Any],
    time_scale: float = TEST_TIME_SCALE,
    timings: Mapping[str, float] | None = None,
    subnets: Sequence[Mapping[str, Any]] = (PXE_SUBNET,),
    faults: Sequence[Mapping[str, Any]] = (),
    site: Mapping[str, Any] | None = None,
    seed: int = 1,
) -> dict[str, Any]:
    return {
        "seed": seed,
        "time_scale": time_scale,
        "site": {"custom_images": ["gpuaas-noble-2025.06"], **(site or {})},
        "timings": {**TEST_TIMINGS, **(timings or {})},
        "subnets": [dict(s) for s in subnets],
        "machines": [dict(m) for m in machines],
        "faults": [dict(f) for f in faults],
    }


DEFAULT_SCENARIO = sim_scenario(
    sim_machine("node-a", "10.176.16.10"),
    sim_machine("node-b", "10.176.16.11", status="New"),
    sim_machine("node-c", "10.176.16.12", enlisted=False),
)


class MaasOAuth(httpx.Auth):
    """Signs each request (retries included) with a fresh nonce and timestamp."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = oauth_header(self.api_key)
        yield request


@dataclass
class MaasSimProcess:
    base_url: str
    api_key: str
    control_token: str
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)


@dataclass
class MaasSim:
    base_url: str
    api_key: str
    control_token: str
    control: httpx.AsyncClient = field(repr=False)  # raw control client (bearer set)

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/api/2.0/"

    def auth_header(self) -> str:
        return oauth_header(self.api_key)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 10.0)
        return httpx.AsyncClient(base_url=self.api_url, auth=MaasOAuth(self.api_key), **kwargs)

    async def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        response = await self.control.request(method, path, json=body)
        if response.status_code >= 400:
            raise AssertionError(f"control {method} {path}: {response.status_code} {response.text}")
        return response.json()

    async def reset(
        self, scenario: Mapping[str, Any] | str | None = None, time_scale: float | None = None
    ) -> Any:
        body: dict[str, Any] = {}
        if isinstance(scenario, str):
            body["scenario_toml"] = scenario
        else:
            body["scenario"] = dict(scenario if scenario is not None else DEFAULT_SCENARIO)
        if time_scale is not None:
            body["time_scale"] = time_scale
        return await self._call("POST", "/_sim/reset", body)

    async def state(self) -> Any:
        return await self._call("GET", "/_sim/state")

    async def machine(self, ref: str) -> Any:
        return await self._call("GET", f"/_sim/machines/{ref}")

    async def counters(self) -> Any:
        return await self._call("GET", "/_sim/counters")

    async def reset_counters(self) -> Any:
        return await self._call("POST", "/_sim/counters/reset")

    async def bmc_log(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/_sim/bmc-log"))["requests"])

    async def erasures(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/_sim/erasures"))["erasures"])

    async def release(self, ref: str, *, erase: bool = False, comment: str = "") -> Any:
        return await self._call(
            "POST", f"/_sim/machines/{ref}/release", {"erase": erase, "comment": comment}
        )

    async def mark_broken(self, ref: str, comment: str = "") -> Any:
        return await self._call("POST", f"/_sim/machines/{ref}/mark-broken", {"comment": comment})

    async def delete(self, ref: str) -> Any:
        return await self._call("POST", f"/_sim/machines/{ref}/delete")

    async def change_ip(self, ref: str, ip: str | None = None, interface: str | None = None) -> str:
        body = {"ip": ip, "interface": interface}
        result = await self._call("POST", f"/_sim/machines/{ref}/change-ip", body)
        return str(result["new"])

    async def set_planned_ip(self, ref: str, ip: str, interface: str | None = None) -> Any:
        body = {"ip": ip, "interface": interface}
        return await self._call("POST", f"/_sim/machines/{ref}/planned-ip", body)

    async def add_user(self, username: str, *, is_superuser: bool = False) -> str:
        body = {"username": username, "is_superuser": is_superuser}
        return str((await self._call("POST", "/_sim/users", body))["api_key"])

    async def set_power(self, ref: str, state: str) -> Any:
        return await self._call("POST", f"/_sim/machines/{ref}/power", {"state": state})

    async def set_status(self, ref: str, status: str) -> Any:
        return await self._call("POST", f"/_sim/machines/{ref}/status", {"status": status})

    async def power_cycle_bmc(self, address: str) -> str:
        result = await self._call("POST", f"/_sim/bmc/{address}/power-cycle")
        return str(result["result"])

    async def set_fault(self, ref: str, kind: str, **params: Any) -> Any:
        return await self._call("POST", f"/_sim/machines/{ref}/faults", {"kind": kind, **params})

    async def clear_faults(self, ref: str) -> Any:
        return await self._call("DELETE", f"/_sim/machines/{ref}/faults")

    async def add_request_fault(self, kind: str, **params: Any) -> Any:
        return await self._call("POST", "/_sim/faults", {"kind": kind, **params})

    async def clear_request_faults(self) -> Any:
        return await self._call("DELETE", "/_sim/faults")

    async def set_time_scale(self, scale: float) -> Any:
        return await self._call("POST", "/_sim/time-scale", {"time_scale": scale})

    async def wait_for_status(
        self, system_id: str, *names: str, timeout: float = 10.0
    ) -> dict[str, Any]:
        """Poll GET machines/{id}/ until status_name is one of `names`."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        async with self.client() as maas:
            while time.monotonic() < deadline:
                response = await maas.get(f"machines/{system_id}/")
                response.raise_for_status()
                last = response.json()
                if last["status_name"] in names:
                    return last
                await asyncio.sleep(0.02)
        raise AssertionError(
            f"{system_id} did not reach {names} in {timeout}s; last {last.get('status_name')}"
        )


def _wait_until_serving(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sim.maas exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"sim.maas did not answer {url} within 30 s:\n{log.read_text()}")


@pytest.fixture(scope="session")
def maas_sim_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MaasSimProcess]:
    workdir = tmp_path_factory.mktemp("maas-sim")
    port = free_port()
    api_key = f"{secrets.token_hex(9)}:{secrets.token_hex(9)}:{secrets.token_hex(16)}"
    control_token = secrets.token_hex(16)
    (workdir / "scenario.json").write_text(json.dumps(DEFAULT_SCENARIO))
    (workdir / "api.key").write_text(api_key + "\n")
    (workdir / "control.token").write_text(control_token + "\n")
    log_path = workdir / "maas-sim.log"
    argv = [
        sys.executable, "-m", "sim.maas", "--host", "127.0.0.1", "--port", str(port),
        "--scenario", str(workdir / "scenario.json"),
        "--api-key-file", str(workdir / "api.key"),
        "--control-token-file", str(workdir / "control.token"),
        "--log-level", "warning",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
    base_url = f"http://127.0.0.1:{port}/MAAS"
    try:
        _wait_until_serving(process, f"{base_url}/api/2.0/version/", log_path)
        yield MaasSimProcess(base_url, api_key, control_token, log_path, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "maas_scenario(scenario, time_scale=None): the scenario the maas_sim fixture resets to",
    )


@pytest.fixture
async def maas_sim(
    maas_sim_process: MaasSimProcess, request: pytest.FixtureRequest
) -> AsyncIterator[MaasSim]:
    marker = request.node.get_closest_marker("maas_scenario")
    scenario = marker.args[0] if marker is not None and marker.args else None
    time_scale = marker.kwargs.get("time_scale") if marker is not None else None
    control = httpx.AsyncClient(
        base_url=maas_sim_process.base_url.removesuffix("/MAAS"),
        headers={"Authorization": f"Bearer {maas_sim_process.control_token}"},
        timeout=10.0,
        # Drop an idle pooled connection well before the server may: never reuse one it closed.
        limits=httpx.Limits(keepalive_expiry=2.0),
    )
    sim = MaasSim(
        maas_sim_process.base_url, maas_sim_process.api_key, maas_sim_process.control_token, control
    )
    try:
        await sim.reset(scenario, time_scale=time_scale)
        yield sim
    finally:
        await control.aclose()
