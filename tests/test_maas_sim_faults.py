"""Each fault a scenario can arm on a machine, and the request faults (5xx, slow answers)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import httpx
import pytest

from tests.lifecycle_support import eventually
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

BMC = "10.176.16.30"


def _one(faults: list[dict[str, Any]], status: str = "Ready", **scenario: Any) -> dict[str, Any]:
    return sim_scenario(sim_machine("n1", BMC, status=status, faults=faults), **scenario)


async def _system_id(sim: MaasSim) -> str:
    return str((await sim.machine("n1"))["system_id"])


async def _events(maas: httpx.AsyncClient, system_id: str, level: str = "INFO") -> list[Any]:
    response = await maas.get("events/", params={"op": "query", "id": system_id, "level": level})
    return [(e["level"], e["type"], e["description"]) for e in reversed(response.json()["events"])]


def _parse(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)


@pytest.mark.maas_scenario(_one([{"kind": "boss_disk_missing"}], status="New"))
async def test_boss_disk_missing(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post("machines/?op=accept", data={"machines": system_id})
        ready = await maas_sim.wait_for_status(system_id, "Ready")
        models = [d["model"] for d in ready["blockdevice_set"]]
    assert not any("BOSS" in m for m in models)
    assert ready["boot_disk"]["name"] == "nvme0n1"


@pytest.mark.maas_scenario(
    _one([{"kind": "commissioning_fails", "times": 1, "message": "lshw crashed"}])
)
async def test_commissioning_fails_once(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=commission")
        failed = await maas_sim.wait_for_status(system_id, "Failed commissioning", "Ready")
        assert failed["status_name"] == "Failed commissioning"
        assert (failed["status"], failed["error_description"]) == (2, "lshw crashed")
        assert failed["commissioning_status_name"] == "Failed"
        assert ("ERROR", "Marking node failed", "lshw crashed") in await _events(maas, system_id)
        again = await maas.post(f"machines/{system_id}/?op=commission")
        assert again.status_code == 200, again.text
    await maas_sim.wait_for_status(system_id, "Ready")


@pytest.mark.maas_scenario(_one([{"kind": "deploy_fails_datasource"}]))
async def test_datasource_failure_once_then_a_redeploy_succeeds(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        failed = await maas_sim.wait_for_status(system_id, "Failed deployment", "Deployed")
        assert failed["status_name"] == "Failed deployment"
        assert failed["error_description"] == (
            "Installation failed (refer to the installation log for more information)."
        )
        assert failed["status_message"] == (
            "Marking node failed - Installation failed (refer to the installation log for more "
            "information)."
        )
        events = await _events(maas, system_id)
        assert (
            "ERROR",
            "Node installation failure",
            "'cloudinit' running modules for final",
        ) in events
        debug = await _events(maas, system_id, "DEBUG")
        assert (
            "DEBUG",
            "Node installation",
            "'cloudinit' searching for network data from DataSourceMAAS",
        ) in debug
        await maas.post(f"machines/{system_id}/?op=release")
        await maas_sim.wait_for_status(system_id, "Ready")
        await maas.post(f"machines/{system_id}/?op=deploy")
    await maas_sim.wait_for_status(system_id, "Deployed")


@pytest.mark.maas_scenario(_one([{"kind": "deploy_fails_datasource", "variant": "timeout"}]))
async def test_datasource_failure_as_a_deployment_timeout(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        await maas_sim.wait_for_status(system_id, "Failed deployment")
        events = await _events(maas, system_id)
    assert events[-1] == (
        "ERROR",
        "Marking node failed",
        "Node operation 'Deploying' timed out after 30 minutes.",
    )


@pytest.mark.maas_scenario(_one([{"kind": "deploy_fails"}]))
async def test_generic_deploy_failure_every_time(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        for _ in range(2):
            await maas.post(f"machines/{system_id}/?op=deploy")
            await maas_sim.wait_for_status(system_id, "Failed deployment")
            events = await _events(maas, system_id)
            assert (
                "ERROR",
                "Node installation failure",
                "'curtin' curtin command install",
            ) in events
            await maas.post(f"machines/{system_id}/?op=release")
            await maas_sim.wait_for_status(system_id, "Ready")
    assert (await maas_sim.machine("n1"))["faults"][0]["fired"] == 2


@pytest.mark.maas_scenario(_one([{"kind": "erase_fails", "times": 1}], status="Deployed"))
async def test_erase_fails(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        erasing = await maas.post(f"machines/{system_id}/?op=release", data={"erase": "true"})
        assert erasing.json()["status_name"] == "Disk erasing"
        failed = await maas_sim.wait_for_status(system_id, "Failed disk erasing", "Ready")
        assert (failed["status"], failed["status_name"]) == (15, "Failed disk erasing")
        assert failed["error_description"] == "Failed to erase disks."
        # The fallback the product may take: release again without erasing.
        again = await maas.post(f"machines/{system_id}/?op=release")
        assert again.status_code == 200, again.text
    await maas_sim.wait_for_status(system_id, "Ready")


@pytest.mark.maas_scenario(_one([{"kind": "power_stuck_on", "times": 1}], status="Deployed"))
async def test_power_stuck_on_fails_the_release_once(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=power_on")
        await maas.post(f"machines/{system_id}/?op=release")
        failed = await maas_sim.wait_for_status(system_id, "Releasing failed", "Ready")
        assert failed["status_name"] == "Releasing failed"
        assert failed["error_description"] == "Failed to power off node."
        assert failed["power_state"] == "error"
        # The BMC behaves again (times=1): a second release converges.
        again = await maas.post(f"machines/{system_id}/?op=release")
        assert again.status_code == 200, again.text
    ready = await maas_sim.wait_for_status(system_id, "Ready")
    assert ready["power_state"] == "off"


@pytest.mark.maas_scenario(_one([{"kind": "vanishes", "when": "Deploying", "after": 50}]))
async def test_machine_vanishes_mid_deployment(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")

        async def vanished() -> bool:
            return (await maas.get(f"machines/{system_id}/")).status_code == 404

        await eventually(vanished, timeout=5)
        assert (await maas.get("machines/")).json() == []
    state = await maas_sim.state()
    assert state["hardware"][0]["in_maas"] == []


@pytest.mark.maas_scenario(
    _one(
        [{"kind": "hw_sync_never_healthy"}],
        site={"hardware_sync_interval": "1s"},
        timings={"hw_sync": 100},
    )
)
async def test_hardware_sync_never_healthy_goes_stale(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy", data={"enable_hw_sync": "true"})
        deployed = await maas_sim.wait_for_status(system_id, "Deployed")
        first = deployed["last_sync"]
        assert first is not None
        assert deployed["sync_interval"] == 1
        stale_after = _parse(first) + dt.timedelta(seconds=1.5 * deployed["sync_interval"])

        async def past_stale() -> Any:  # is_sync_healthy would be false from here on
            if dt.datetime.now(dt.UTC) <= stale_after:
                return None
            return (await maas.get(f"machines/{system_id}/")).json()

        later = await eventually(past_stale, timeout=10)
    assert later["last_sync"] == first  # never refreshed
    assert later["sync_interval"] == 1


@pytest.mark.maas_scenario(
    _one([], site={"hardware_sync_interval": "1s"}, timings={"hw_sync": 100})
)
async def test_hardware_sync_of_a_healthy_machine_keeps_ticking(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy", data={"enable_hw_sync": "true"})
        first = (await maas_sim.wait_for_status(system_id, "Deployed"))["last_sync"]

        async def synced_again() -> Any:
            machine = (await maas.get(f"machines/{system_id}/")).json()
            return machine if _parse(machine["last_sync"]) > _parse(first) else None

        # Within the 1.5 x interval that keeps it healthy.
        later = await eventually(synced_again, timeout=1.5)
    assert _parse(later["next_sync"]) - _parse(later["last_sync"]) == dt.timedelta(seconds=1)


@pytest.mark.maas_scenario(
    sim_scenario(sim_machine("n1", BMC, status="Deployed")), time_scale=0.001
)
async def test_enabling_hw_sync_after_deployment(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        updated = await maas.put(f"machines/{system_id}/", data={"enable_hw_sync": "true"})
        assert (updated.json()["enable_hw_sync"], updated.json()["sync_interval"]) == (True, 900)
        assert updated.json()["last_sync"] is None  # until the OS posts its first sync


@pytest.mark.maas_scenario(_one([{"kind": "token_delayed", "after": 400}]))
async def test_machine_token_delayed(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        assert (await maas.get(f"machines/{system_id}/?op=get_token")).json() is None

        async def token_issued() -> Any:
            return (await maas.get(f"machines/{system_id}/?op=get_token")).json()

        token = await eventually(token_issued, timeout=10)
    assert token["token_key"]


@pytest.mark.maas_scenario(_one([{"kind": "pxe_unlinked"}], status="New"))
async def test_pxe_interface_unlinked_after_commissioning(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim)
    async with maas_sim.client() as maas:
        await maas.post("machines/?op=accept", data={"machines": system_id})
        ready = await maas_sim.wait_for_status(system_id, "Ready")
        boot = ready["boot_interface"]
        assert [link["mode"] for link in boot["links"]] == ["link_up"]
        refused = await maas.post(f"machines/{system_id}/?op=deploy")
        assert refused.json() == {"network": ["Node must be configured to use a network"]}
        linked = await maas.post(
            f"nodes/{system_id}/interfaces/{boot['id']}/",
            params={"op": "link_subnet"},
            data={"mode": "AUTO", "subnet": "name:pxe"},
        )
        assert linked.status_code == 200, linked.text
        assert (await maas.post(f"machines/{system_id}/?op=deploy")).status_code == 200
    await maas_sim.wait_for_status(system_id, "Deployed")


@pytest.mark.maas_scenario(
    sim_scenario(
        sim_machine("n1", BMC),
        seed=7,
        faults=[{"kind": "http_error", "op": "machines.read", "times": 2}],
    )
)
async def test_http_errors_then_recovery(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        answers = [(await maas.get("machines/")).status_code for _ in range(3)]
        assert answers == [503, 503, 200]
        first = await maas.get("machines/")
        assert first.status_code == 200
    counters = await maas_sim.counters()
    assert counters["ops"]["machines.read"] == 4
    assert counters["answers"]["machines.read"] == {"503": 2, "200": 2}


async def test_http_error_rate(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("http_error", rate=0.5, status=500)
    async with maas_sim.client() as maas:
        answers = [(await maas.get("version/")).status_code for _ in range(60)]
    failures = answers.count(500)
    assert 10 <= failures <= 50, answers
    assert set(answers) == {200, 500}
    await maas_sim.clear_request_faults()


async def test_applied_http_error_loses_only_the_answer(maas_sim: MaasSim) -> None:
    await maas_sim.set_fault("node-a", "http_error", op="machine.deploy", times=1, applied=True)
    system_id = str((await maas_sim.machine("node-a"))["system_id"])
    async with maas_sim.client() as maas:
        lost = await maas.post(f"machines/{system_id}/?op=deploy")
        assert (lost.status_code, lost.text) == (503, "Service Unavailable")
        machine = (await maas.get(f"machines/{system_id}/")).json()
        assert machine["status_name"] in ("Deploying", "Deployed")  # it did happen
        other = await maas.get("machines/", params={"hostname": "node-b"})
        assert other.status_code == 200  # only this machine's deploy was hit


async def test_slow_answers(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("slow", delay=0.4, op="machines.read", times=2)
    async with maas_sim.client(timeout=0.15) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.get("machines/")
    async with maas_sim.client() as patient:
        started = time.monotonic()
        response = await patient.get("machines/")
        assert response.status_code == 200
        assert time.monotonic() - started >= 0.4
        started = time.monotonic()
        await patient.get("machines/")  # times=2: back to normal
        assert time.monotonic() - started < 0.3


async def test_a_slow_request_does_not_outlive_a_reset(maas_sim: Any) -> None:
    """A request still sleeping on a `slow` fault when the simulator is reset must not change the
    new scenario (it would leak one test's actions into the next)."""
    await maas_sim.add_request_fault("slow", delay=0.5, op="machine.commission", times=1)
    async with maas_sim.client() as maas:
        machines = (await maas.get("machines/", params={"hostname": "node-a"})).json()
        system_id = machines[0]["system_id"]
        pending = asyncio.create_task(
            maas.post(f"machines/{system_id}/", params={"op": "commission"})
        )

        async def sleeping_in_the_simulator() -> Any:  # counted on arrival, before the fault
            machines = (await maas_sim.counters())["machines"]
            return machines.get(system_id, {}).get("machine.commission")

        await eventually(sleeping_in_the_simulator, timeout=5, interval=0.01)
        await maas_sim.reset()
        answer = await pending
        assert answer.status_code == 503
        after = (await maas.get(f"machines/{system_id}/")).json()
    assert after["status_name"] == "Ready"


async def test_truncated_machine_lists(maas_sim: MaasSim) -> None:
    """truncate_list cuts a list answer (a region that lost machines, a cut body); answers that
    are not lists pass untouched and do not use up a strike."""
    await maas_sim.add_request_fault("truncate_list", keep=1, times=1)
    await maas_sim.add_request_fault("truncate_list", op="machines.read", times=1)
    async with maas_sim.client() as maas:
        assert (await maas.get("version/")).status_code == 200  # no list: no strike
        one = (await maas.get("machines/")).json()
        empty = (await maas.get("machines/")).json()
        whole = (await maas.get("machines/")).json()
    assert (len(one), len(empty), len(whole)) == (1, 0, 2)  # node-c is not enlisted
    assert one[0] == whole[0]
    spent = (await maas_sim.state())["request_faults"]
    assert [f["fired"] for f in spent] == [1, 1]
