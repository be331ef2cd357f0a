"""Machines in the simulated region: listing and filters, creation (IPMI-only and with MACs),
update, delete, accept, commissioning over time (Commissioning -> Testing -> Ready), abort,
allocation, power operations and power parameters."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.lifecycle_support import eventually
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario


async def _system_id(sim: MaasSim, ref: str) -> str:
    return str((await sim.machine(ref))["system_id"])


async def _status_changes(sim: MaasSim, system_id: str) -> list[str]:
    async with sim.client() as maas:
        response = await maas.get(
            "events/", params={"op": "query", "id": system_id, "level": "DEBUG", "limit": 1000}
        )
    events = response.json()["events"]
    return [e["description"] for e in reversed(events) if e["type"] == "Node changed status"]


async def test_list_and_filters(maas_sim: MaasSim) -> None:
    node_a = await maas_sim.machine("node-a")
    async with maas_sim.client() as maas:
        everything = (await maas.get("machines/")).json()
        assert sorted(m["hostname"] for m in everything) == ["node-a", "node-b"]  # node-c unknown
        by_host = (await maas.get("machines/", params={"hostname": "node-a"})).json()
        assert [m["system_id"] for m in by_host] == [node_a["system_id"]]
        mac = by_host[0]["boot_interface"]["mac_address"]
        by_mac = (await maas.get("machines/", params={"mac_address": mac.upper()})).json()
        assert [m["hostname"] for m in by_mac] == ["node-a"]
        by_id = (await maas.get("machines/", params={"id": node_a["system_id"]})).json()
        assert len(by_id) == 1
        by_status = (await maas.get("machines/", params={"status": "new"})).json()
        assert [m["hostname"] for m in by_status] == ["node-b"]
        assert (await maas.get("machines/", params={"hostname": "nope"})).json() == []
        bad_mac = await maas.get("machines/", params={"mac_address": "zz"})
        assert bad_mac.status_code == 400
        assert bad_mac.json() == {"mac_address": ["'zz' is not a valid MAC address."]}


async def test_read_shows_the_documented_fields(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        machine = (await maas.get(f"machines/{system_id}/")).json()
    assert machine["status"] == 4
    assert machine["status_name"] == "Ready"
    assert machine["power_type"] == "ipmi"
    assert machine["power_state"] == "off"
    assert machine["fqdn"] == "node-a.maas"
    assert machine["boot_interface"]["name"] == "eno8303"
    assert machine["boot_disk"]["name"] == "sda"
    assert machine["enable_hw_sync"] is False
    assert machine["last_sync"] is None
    assert machine["next_sync"] is None
    assert machine["sync_interval"] is None
    assert "is_sync_healthy" not in machine
    assert "power_parameters" not in machine
    link = machine["boot_interface"]["links"][0]
    assert link["mode"] == "auto"
    assert link["subnet"]["cidr"] == "10.176.46.0/24"
    assert "ip_address" not in link  # an AUTO link has no address until deployment
    assert machine["resource_uri"] == f"/MAAS/api/2.0/machines/{system_id}/"
    assert len(system_id) == 6
    assert set(system_id) <= set("34678abcdefghkmnpqrstwxy")


async def test_ipmi_only_creation_gives_a_new_machine_without_interfaces(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={
                "hostname": "c07u45",
                "power_type": "ipmi",
                "power_parameters_power_address": "10.176.16.12",
                "power_parameters_power_user": "root",
                "power_parameters_power_pass": "calvin",
                "mac_addresses": "02:00:b0:10:0c:01",  # ignored without an architecture
            },
        )
        assert created.status_code == 200, created.text
        machine = created.json()
        assert (machine["status_name"], machine["interface_set"]) == ("New", [])
        system_id = machine["system_id"]
        params = await maas.get(f"machines/{system_id}/", params={"op": "power_parameters"})
        assert params.json()["power_address"] == "10.176.16.12"
        everyone = (await maas.get("machines/", params={"op": "power_parameters"})).json()
        assert everyone[system_id]["power_user"] == "root"
        # No interfaces: the Commission action is not available ...
        refused = await maas.post(f"machines/{system_id}/", params={"op": "commission"})
        assert refused.status_code == 400
        assert refused.json() == {
            "__all__": ["Commission is not available because of the current state of the node."]
        }
        # ... but accept commissions it, and commissioning finds the hardware behind the BMC.
        accepted = await maas.post("machines/", params={"op": "accept"},
                                   data={"machines": system_id})  # fmt: skip
        assert [m["status_name"] for m in accepted.json()] == ["Commissioning"]
    ready = await maas_sim.wait_for_status(system_id, "Ready")
    assert [i["name"] for i in ready["interface_set"]] == ["eno8303", "ens1f0np0"]
    assert {d["name"] for d in ready["blockdevice_set"]} == {"sda", "nvme0n1"}


async def test_creation_with_macs_commissions_and_refuses_bad_input(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={
                "architecture": "amd64",
                "mac_addresses": ["52:54:00:00:00:01"],
                "hostname": "vm-1",
            },
        )
        assert created.status_code == 200, created.text
        assert created.json()["status_name"] == "Commissioning"
        assert created.json()["architecture"] == "amd64/generic"
        cases: list[tuple[dict[str, Any], dict[str, list[str]]]] = [
            ({"hostname": "x"}, {"architecture": ["This field is required."],
                                 "mac_addresses": ["This field is required."]}),
            ({"power_type": "ipmi", "power_parameters_power_address": "10.0.0.1",
              "power_parameters_colour": "blue"},
             {"power_parameters": ["Unknown parameter(s): colour."]}),
            ({"power_type": "ipmi", "hostname": "node-a",
              "power_parameters_power_address": "10.0.0.1"},
             {"hostname": ["Node with this Hostname already exists."]}),
        ]  # fmt: skip
        for data, errors in cases:
            response = await maas.post("machines/", data=data)
            assert response.status_code == 400, data
            assert response.json() == errors


async def test_update_and_delete(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-b")
    async with maas_sim.client() as maas:
        updated = await maas.put(
            f"machines/{system_id}/",
            data={
                "hostname": "c07u44",
                "description": "rack 7",
                "power_parameters_power_user": "maas-admin",
            },
        )
        assert updated.status_code == 200, updated.text
        assert (updated.json()["hostname"], updated.json()["description"]) == ("c07u44", "rack 7")
        params = await maas.get(f"machines/{system_id}/op-power_parameters")
        assert params.json()["power_user"] == "maas-admin"
        clash = await maas.put(f"machines/{system_id}/", data={"hostname": "node-a"})
        assert clash.status_code == 400
        deleted = await maas.delete(f"machines/{system_id}/")
        assert deleted.status_code == 204
        gone = await maas.get(f"machines/{system_id}/")
        assert (gone.status_code, gone.text) == (404, "No Machine matches the given query.")


async def test_accept_rules(maas_sim: MaasSim) -> None:
    new, ready = await _system_id(maas_sim, "node-b"), await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        unknown = await maas.post("machines/?op=accept", data={"machines": [new, "zzzzzz"]})
        assert (unknown.status_code, unknown.text) == (400, "Unknown machine(s): zzzzzz.")
        both = await maas.post("machines/?op=accept", data={"machines": [new, ready]})
        assert [m["system_id"] for m in both.json()] == [new]  # Ready is skipped
        again = await maas.post("machines/?op=accept", data={"machines": [new]})
        assert again.json() == []  # Commissioning is skipped too
    await maas_sim.wait_for_status(new, "Ready")
    await maas_sim.set_status(new, "Deployed")
    async with maas_sim.client() as maas:
        refused = await maas.post("machines/?op=accept", data={"machines": [new]})
    assert refused.status_code == 409
    assert refused.text == f"Cannot accept node enlistment: node {new} is in state Deployed."


async def test_commissioning_runs_testing_then_ready(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        started = await maas.post(
            f"machines/{system_id}/", params={"op": "commission"},
            data={"enable_ssh": "1", "skip_bmc_config": "1"},
        )  # fmt: skip
        assert started.status_code == 200, started.text
        assert (started.json()["status_name"], started.json()["power_state"]) == (
            "Commissioning",
            "on",
        )
    ready = await maas_sim.wait_for_status(system_id, "Ready")
    assert ready["power_state"] == "on"  # enable_ssh keeps it up
    assert ready["commissioning_status_name"] == "Passed"
    assert ready["testing_status_name"] == "Passed"
    assert await _status_changes(maas_sim, system_id) == [
        "From 'Ready' to 'Commissioning'",
        "From 'Commissioning' to 'Testing'",
        "From 'Testing' to 'Ready'",
    ]


async def test_commission_is_refused_outside_its_statuses(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    await maas_sim.set_status(system_id, "Deployed")
    async with maas_sim.client() as maas:
        refused = await maas.post(f"machines/{system_id}/?op=commission")
    assert refused.status_code == 400
    assert refused.json() == {
        "__all__": ["Commission is not available because of the current state of the node."]
    }


@pytest.mark.maas_scenario(
    sim_scenario(sim_machine("slow", "10.176.16.20", timings={"commissioning": 60000}))
)
async def test_abort_commissioning_returns_to_the_previous_status(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "slow")
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=commission")
        aborted = await maas.post(f"machines/{system_id}/?op=abort")
        assert aborted.status_code == 200, aborted.text
        assert (aborted.json()["status_name"], aborted.json()["power_state"]) == ("Ready", "off")
        refused = await maas.post(f"machines/{system_id}/?op=abort")
    assert refused.status_code == 409
    assert refused.text == f"Cannot abort in current state: node {system_id} is in state Ready."


async def test_allocate_power_and_power_state(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        unowned = await maas.post(f"machines/{system_id}/?op=power_on")
        assert (unowned.status_code, unowned.text) == (
            409,
            "Can't start node: it hasn't been allocated.",
        )
        allocated = await maas.post("machines/?op=allocate", data={"system_id": system_id})
        assert (allocated.json()["status_name"], allocated.json()["owner"]) == (
            "Allocated",
            "admin",
        )
        none_left = await maas.post("machines/?op=allocate", data={"system_id": system_id})
        assert none_left.status_code == 409
        await maas_sim.set_status(system_id, "Deployed")  # power_on on Allocated would deploy
        on = await maas.post(f"machines/{system_id}/?op=power_on")
        assert on.json()["power_state"] == "on"
        state = await maas.get(f"machines/{system_id}/?op=query_power_state")
        assert state.json() == {"state": "on"}
        off = await maas.post(f"machines/{system_id}/?op=power_off", data={"stop_mode": "hard"})
        assert off.json()["power_state"] == "off"
        state = await maas.get(f"machines/{system_id}/", params={"op": "query_power_state"})
        assert state.json() == {"state": "off"}


async def test_a_machine_whose_bmc_does_not_answer(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={"power_type": "ipmi", "power_parameters_power_address": "10.99.99.99"},
        )
        system_id = created.json()["system_id"]
        assert created.json()["power_state"] == "unknown"
        query = await maas.get(f"machines/{system_id}/?op=query_power_state")
        assert query.status_code == 503
        assert "Failed talking to node's BMC" in query.text
        await maas.post("machines/?op=accept", data={"machines": system_id})
    failed = await maas_sim.wait_for_status(system_id, "Failed commissioning")
    assert failed["power_state"] == "error"
    assert failed["error_description"] == (
        "Node operation 'Commissioning' timed out after 30 minutes."
    )


async def test_anonymous_enlistment_and_accept_all(maas_sim: MaasSim) -> None:
    async with httpx.AsyncClient(base_url=maas_sim.api_url) as anonymous:
        enlisted = await anonymous.post(
            "machines/",
            data={"architecture": "amd64/generic", "mac_addresses": "52:54:00:aa:bb:cc"},
        )
        assert enlisted.status_code == 200, enlisted.text
        assert enlisted.json()["status_name"] == "New"
        known = await anonymous.get(
            "machines/", params={"op": "is_registered", "mac_address": "52:54:00:aa:bb:cc"}
        )
        assert known.json() is True
    async with maas_sim.client() as maas:
        accepted = (await maas.post("machines/", params={"op": "accept_all"})).json()
        assert sorted(m["hostname"] for m in accepted) == sorted(
            ["node-b", enlisted.json()["hostname"]]
        )
        assert {m["status_name"] for m in accepted} == {"Commissioning"}


async def test_power_off_answers_null_when_maas_cannot_control_power(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={"architecture": "amd64", "mac_addresses": "52:54:00:00:00:09",
                  "power_type": "manual", "commission": "false"},
        )  # fmt: skip
        assert created.json()["status_name"] == "New"
        off = await maas.post(f"machines/{created.json()['system_id']}/?op=power_off")
        assert (off.status_code, off.json()) == (200, None)


def _nat_machine() -> dict[str, Any]:
    machine = sim_machine("c07u47", "10.176.16.47", enlisted=False)
    machine["bmc"]["detected_address"] = "10.176.99.47"
    return machine


@pytest.mark.maas_scenario(sim_scenario(_nat_machine()))
async def test_enlistment_matches_records_by_the_detected_bmc_address(maas_sim: MaasSim) -> None:
    """A BMC whose detection reports another address than the one operators use: the IPMI-only
    record made with the operator's address is not the one the machine enlists into; another
    New machine (petname, detected address) appears, and only `status=new`/filters find it
    without reading the whole list (counted apart as machines.read_unfiltered)."""
    async with maas_sim.client() as maas:
        created = await maas.post(
            "machines/",
            data={"hostname": "c07u47", "power_type": "ipmi",
                  "power_parameters_power_address": "10.176.16.47"},
        )  # fmt: skip
        assert created.status_code == 200, created.text
        ours = created.json()["system_id"]
        assert await maas_sim.power_cycle_bmc("10.176.16.47") == "enlisting"
        await maas_sim.reset_counters()

        async def enlisted() -> list[dict[str, Any]]:
            new = (await maas.get("machines/", params={"status": "new"})).json()
            return [m for m in new if m["system_id"] != ours]

        (other,) = await eventually(enlisted, timeout=5)
        assert other["hostname"] != "c07u47"  # a petname
        assert other["interface_set"]
        params = await maas.get(
            f"machines/{other['system_id']}/", params={"op": "power_parameters"}
        )
        assert params.json()["power_address"] == "10.176.99.47"
        assert (await maas.get(f"machines/{ours}/")).json()["interface_set"] == []
        # Our record still holds the hostname: renaming the enlisted one collides.
        renamed = await maas.put(f"machines/{other['system_id']}/", data={"hostname": "c07u47"})
        assert renamed.status_code == 400
        assert renamed.json() == {"hostname": ["Node with this Hostname already exists."]}
        counters = await maas_sim.counters()
        assert counters["ops"].get("machines.read_unfiltered", 0) == 0
        await maas.get("machines/")
        counters = await maas_sim.counters()
        assert counters["ops"]["machines.read_unfiltered"] == 1
