"""Discovery after a BMC power cycle, the out-of-band controls drift tests use, request counters,
and the control API itself (token, resets from TOML, errors)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.lifecycle_support import eventually
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

UNKNOWN_BMC = "10.176.16.40"
DISCOVERY = sim_scenario(
    sim_machine("c07u45", UNKNOWN_BMC, enlisted=False),
    sim_machine("known", "10.176.16.41"),
    timings={"enlistment": 600},
)


async def _wait_for_machines(sim: MaasSim, count: int, timeout: float = 5.0) -> list[Any]:
    async with sim.client() as maas:

        async def listed() -> list[Any] | None:
            machines = list((await maas.get("machines/")).json())
            return machines if len(machines) == count else None

        return await eventually(listed, timeout=timeout)


@pytest.mark.maas_scenario(DISCOVERY)
async def test_an_unknown_machine_appears_as_new_only_after_a_bmc_power_cycle(
    maas_sim: MaasSim,
) -> None:
    async with maas_sim.client() as maas:
        assert [m["hostname"] for m in (await maas.get("machines/")).json()] == ["known"]
        # Nothing happens on its own: a bounded window, a third of the (scaled) enlistment.
        await asyncio.sleep(0.2)
        assert len((await maas.get("machines/")).json()) == 1
        assert await maas_sim.power_cycle_bmc(UNKNOWN_BMC) == "enlisting"
        assert len((await maas.get("machines/")).json()) == 1  # PXE boot + enlistment take time
    machines = await _wait_for_machines(maas_sim, 2)
    found = next(m for m in machines if m["hostname"] != "known")
    assert found["status_name"] == "New"
    assert found["hostname"].count("-") == 1  # a petname, not the scenario's c07u45
    assert [i["name"] for i in found["interface_set"]] == ["eno8303", "ens1f0np0"]
    assert found["power_state"] == "off"  # enlistment ends with a power off
    async with maas_sim.client() as maas:
        params = (await maas.get(f"machines/{found['system_id']}/?op=power_parameters")).json()
    assert (params["power_address"], params["power_user"]) == (UNKNOWN_BMC, "maas")


@pytest.mark.maas_scenario(DISCOVERY)
async def test_enlistment_completes_the_machine_the_product_created(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={"hostname": "c07u45", "power_type": "ipmi",
                  "power_parameters_power_address": UNKNOWN_BMC},
        )  # fmt: skip
        system_id = created.json()["system_id"]
        assert created.json()["interface_set"] == []
    await maas_sim.power_cycle_bmc(UNKNOWN_BMC)
    async with maas_sim.client() as maas:

        async def enlisted() -> Any:
            machine = (await maas.get(f"machines/{system_id}/")).json()
            return machine if machine["interface_set"] else None

        completed = await eventually(enlisted, timeout=5)
        assert len((await maas.get("machines/")).json()) == 2  # no duplicate
    assert (completed["hostname"], completed["status_name"]) == ("c07u45", "New")
    assert len(completed["interface_set"]) == 2


@pytest.mark.maas_scenario(DISCOVERY)
async def test_power_cycling_a_known_machine_only_reboots_it(maas_sim: MaasSim) -> None:
    assert await maas_sim.power_cycle_bmc("10.176.16.41") == "booted"
    assert (await maas_sim.machine("known"))["power_state"] == "on"
    response = await maas_sim.control.post("/_sim/bmc/10.9.9.9/power-cycle")
    assert response.status_code == 404


async def _deployed(sim: MaasSim, ref: str = "node-a") -> str:
    system_id = str((await sim.machine(ref))["system_id"])
    async with sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
    await sim.wait_for_status(system_id, "Deployed")
    return system_id


async def test_release_behind_the_products_back(maas_sim: MaasSim) -> None:
    system_id = await _deployed(maas_sim)
    await maas_sim.reset_counters()
    released = await maas_sim.release(system_id)
    assert released["status_name"] == "Releasing"
    ready = await maas_sim.wait_for_status(system_id, "Ready")
    assert ready["owner"] is None
    assert "machine.release" not in (await maas_sim.counters())["ops"]
    async with maas_sim.client() as maas:
        query = {"op": "query", "id": system_id, "level": "DEBUG", "owner": "ops-admin"}
        events = await maas.get("events/", params=query)
    assert [e["type"] for e in events.json()["events"]] == ["User releasing node"]


async def test_mark_broken_delete_and_drift_controls(maas_sim: MaasSim) -> None:
    system_id = await _deployed(maas_sim)
    old_ip = (await maas_sim.machine(system_id))["ip_addresses"][0]
    new_ip = await maas_sim.change_ip(system_id)
    assert new_ip != old_ip
    chosen = await maas_sim.change_ip("node-a", ip="10.176.46.99")
    assert chosen == "10.176.46.99"
    async with maas_sim.client() as maas:
        machine = (await maas.get(f"machines/{system_id}/")).json()
        assert machine["ip_addresses"] == ["10.176.46.99"]
        await maas_sim.set_power(system_id, "off")
        assert (await maas.get(f"machines/{system_id}/?op=query_power_state")).json() == {
            "state": "off"
        }
        broken = await maas_sim.mark_broken("10.176.16.10", comment="PSU failure")
        assert broken["status_name"] == "Broken"
        machine = (await maas.get(f"machines/{system_id}/")).json()
        assert (machine["status_name"], machine["error_description"]) == ("Broken", "PSU failure")
        forced = await maas_sim.set_status(system_id, "Commissioning")
        assert forced["status_name"] == "Commissioning"
        await maas_sim.delete(system_id)
        gone = await maas.get(f"machines/{system_id}/")
        assert (gone.status_code, gone.text) == (404, "No Machine matches the given query.")


async def test_counters_count_every_call_per_operation(maas_sim: MaasSim) -> None:
    system_id = str((await maas_sim.machine("node-a"))["system_id"])
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        await maas.post(f"machines/{system_id}/?op=deploy")  # 409: already Deploying
        await maas.get(f"machines/{system_id}/")
        await maas.get("machines/", params={"hostname": "node-a"})
        await maas.get("nowhere/")
    async with httpx.AsyncClient(base_url=maas_sim.api_url) as anonymous:
        await anonymous.get(f"machines/{system_id}/")  # 401, still counted
    counters = await maas_sim.counters()
    assert counters["ops"]["machine.deploy"] == 2
    assert counters["answers"]["machine.deploy"] == {"200": 1, "409": 1}
    assert counters["ops"]["machine.read"] == 2
    assert counters["answers"]["machine.read"] == {"200": 1, "401": 1}
    assert counters["ops"]["machines.read"] == 1
    assert counters["ops"]["unknown"] == 1
    assert counters["machines"][system_id]["machine.deploy"] == 2
    cleared = await maas_sim.reset_counters()
    assert cleared["ops"] == {}


async def test_control_api_needs_its_token_and_says_what_is_wrong(maas_sim: MaasSim) -> None:
    base = maas_sim.base_url.removesuffix("/MAAS")
    async with httpx.AsyncClient(base_url=base) as anonymous:
        assert (await anonymous.get("/_sim/health")).json() == {"ok": True}
        assert (await anonymous.get("/_sim/state")).status_code == 401
        wrong = await anonymous.get(
            "/_sim/state", headers={"Authorization": f"Bearer {maas_sim.api_key}"}
        )
        assert wrong.status_code == 401
    control = maas_sim.control
    bad_scenario = await control.post("/_sim/reset", json={"scenario": {"machines": [{}]}})
    assert bad_scenario.status_code == 400
    assert "scenario" in bad_scenario.json()["error"]
    bad_fault = await control.post("/_sim/machines/node-a/faults", json={"kind": "gremlins"})
    assert bad_fault.status_code == 400
    missing = await control.post("/_sim/machines/nobody/delete")
    assert missing.status_code == 404
    refused = await control.post("/_sim/machines/node-b/release", json={})
    assert refused.status_code == 409  # New is not releasable, as in MAAS


async def test_reset_from_toml_and_time_scale(maas_sim: MaasSim) -> None:
    state = await maas_sim.reset(
        """
        time_scale = 0.002
        [[subnets]]
        name = "pxe"
        cidr = "10.1.0.0/24"
        [[machines]]
        hostname = "toml-node"
        bmc = { address = "10.1.1.1" }
        interfaces = [{ name = "eth0", mac = "aa:bb:cc:00:00:01", subnet = "pxe", pxe = true }]
        block_devices = [{ name = "sda", size = 500000000000 }]
        """
    )
    assert state["time_scale"] == 0.002
    assert [m["hostname"] for m in state["machines"]] == ["toml-node"]
    assert (await maas_sim.set_time_scale(0.01))["time_scale"] == 0.01
    assert (await maas_sim.state())["time_scale"] == 0.01


@pytest.mark.maas_scenario(
    sim_scenario(
        sim_machine("n1", "10.176.16.42", status="Deployed", enable_hw_sync=True),
        site={"hardware_sync_interval": "1s"},
        timings={"hw_sync": 100},
    )
)
async def test_powering_a_deployed_machine_off_stops_its_hardware_sync(maas_sim: MaasSim) -> None:
    system_id = str((await maas_sim.machine("n1"))["system_id"])
    async with maas_sim.client() as maas:

        async def last_sync() -> str:
            return str((await maas.get(f"machines/{system_id}/")).json()["last_sync"])

        before = await last_sync()

        async def ticked(since: str) -> bool:  # a sync posted after `since` (it never goes back)
            return await last_sync() not in (since, "None")

        await eventually(lambda: ticked(before), timeout=5)  # its timer runs while it is on
        await maas_sim.set_power("n1", "off")
        frozen = await last_sync()
        # Must not move while off: a bounded window of three of the timer's 0.1 s periods.
        await asyncio.sleep(0.3)
        assert await last_sync() == frozen
        await maas_sim.set_power("n1", "on")
        await eventually(lambda: ticked(frozen), timeout=5)


@pytest.mark.maas_scenario(DISCOVERY)
async def test_a_scenario_machine_enlisting_itself_is_known_by_its_macs(maas_sim: MaasSim) -> None:
    hardware = next(h for h in (await maas_sim.state())["hardware"] if h["hostname"] == "c07u45")
    assert hardware["in_maas"] == []
    async with httpx.AsyncClient(base_url=maas_sim.api_url) as anonymous:
        enlisted = await anonymous.post(
            "machines/",
            data={"architecture": "amd64/generic", "mac_addresses": ["02:00:b0:10:28:01"]},
        )
        assert enlisted.status_code == 200, enlisted.text
        again = await anonymous.post(
            "machines/", data={"architecture": "amd64", "mac_addresses": "02:00:b0:10:29:01"}
        )
    assert enlisted.json()["status_name"] == "New"
    assert [i["name"] for i in enlisted.json()["interface_set"]] == ["eno8303", "ens1f0np0"]
    assert again.status_code == 400  # "known" is Ready: its MAC is in use
    assert again.json() == {
        "mac_addresses": ["MAC address 02:00:b0:10:29:01 already in use on known."]
    }


async def test_planned_ip_is_what_the_next_deployment_gets(maas_sim: MaasSim) -> None:
    """A machine's next deployment may come up on another address (MAAS hands AUTO addresses
    out again at every deploy): the control API says which one."""
    system_id = str((await maas_sim.machine("node-a"))["system_id"])
    planned = await maas_sim.set_planned_ip("node-a", "10.176.46.77")
    assert planned == {"interface": "eno8303", "planned_ip": "10.176.46.77"}
    async with maas_sim.client() as maas:
        deploying = await maas.post(
            f"machines/{system_id}/", params={"op": "deploy"}, data={"distro_series": "noble"}
        )
        assert deploying.status_code == 200, deploying.text
        assert deploying.json()["ip_addresses"] == ["10.176.46.77"]
    refused = await maas_sim.control.post(
        "/_sim/machines/node-a/planned-ip", json={"ip": "192.0.2.1"}
    )
    assert refused.status_code == 409
