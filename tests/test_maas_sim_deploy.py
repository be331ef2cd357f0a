"""Deployment and release in the simulated region: Ready/Allocated -> Deploying -> Deployed with
addresses, user data, hardware sync and a fresh machine token; every refusal of deploy; release
with erase (Disk erasing -> Releasing -> Ready) and without; broken and fixed; storage layout."""

from __future__ import annotations

import base64
import datetime as dt

import pytest

from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

CLOUD_CONFIG = "#cloud-config\nruncmd:\n  - [sh, -c, 'curl -fsS https://cp/enroll']\n"


async def _system_id(sim: MaasSim, ref: str) -> str:
    return str((await sim.machine(ref))["system_id"])


async def _events(sim: MaasSim, system_id: str, level: str = "DEBUG") -> list[dict[str, str]]:
    async with sim.client() as maas:
        response = await maas.get(
            "events/", params={"op": "query", "id": system_id, "level": level, "limit": 1000}
        )
    return list(reversed(response.json()["events"]))


def _parse(stamp: str) -> dt.datetime:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)


async def test_deploy_from_ready_reaches_deployed(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        before = (await maas.get(f"machines/{system_id}/?op=get_token")).json()
        deploying = await maas.post(
            f"machines/{system_id}/",
            params={"op": "deploy"},
            data={
                "distro_series": "custom/gpuaas-noble-2025.06",
                "user_data": base64.b64encode(CLOUD_CONFIG.encode()).decode(),
                "enable_hw_sync": "true",
            },
        )
        assert deploying.status_code == 200, deploying.text
        machine = deploying.json()
        assert (machine["status"], machine["status_name"]) == (9, "Deploying")
        assert (machine["owner"], machine["power_state"]) == ("admin", "on")
        assert (machine["osystem"], machine["distro_series"]) == ("custom", "gpuaas-noble-2025.06")
        assert machine["ip_addresses"] == ["10.176.46.10"]  # AUTO addresses are claimed now
        token = (await maas.get(f"machines/{system_id}/?op=get_token")).json()
        assert set(token) == {"token_key", "token_secret", "consumer_key"}
        assert before is None  # a Ready machine from the scenario has no node key yet
    deployed = await maas_sim.wait_for_status(system_id, "Deployed", "Failed deployment")
    assert deployed["status_name"] == "Deployed"
    assert deployed["enable_hw_sync"] is True
    assert deployed["sync_interval"] == 900
    last, following = _parse(deployed["last_sync"]), _parse(deployed["next_sync"])
    assert following - last == dt.timedelta(seconds=900)
    assert abs((dt.datetime.now(dt.UTC) - last).total_seconds()) < 30
    snapshot = await maas_sim.machine(system_id)
    assert snapshot["user_data_text"] == CLOUD_CONFIG
    changes = [e["description"] for e in await _events(maas_sim, system_id)
               if e["type"] == "Node changed status"]  # fmt: skip
    assert changes == [
        "From 'Ready' to 'Allocated'",
        "From 'Allocated' to 'Deploying'",
        "From 'Deploying' to 'Deployed'",
    ]
    assert deployed["status_message"] == "Deployed"


async def test_deploying_a_ready_machine_replaces_its_commissioning_token(
    maas_sim: MaasSim,
) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=commission")
        await maas_sim.wait_for_status(system_id, "Ready")
        after_commissioning = (await maas.get(f"machines/{system_id}/?op=get_token")).json()
        assert after_commissioning is not None
        await maas.post(f"machines/{system_id}/?op=deploy")
        after_deploy = (await maas.get(f"machines/{system_id}/?op=get_token")).json()
        assert after_deploy is not None
        assert after_deploy != after_commissioning
        await maas_sim.wait_for_status(system_id, "Deployed")
        await maas.post(f"machines/{system_id}/?op=release")
        await maas_sim.wait_for_status(system_id, "Ready")
        assert (await maas.get(f"machines/{system_id}/?op=get_token")).json() is None


async def test_deploy_an_allocated_machine_keeps_its_token(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        await maas.post("machines/?op=allocate", data={"system_id": system_id})
        assert (await maas.get(f"machines/{system_id}/?op=get_token")).json() is None
        await maas.post(f"machines/{system_id}/?op=deploy", data={"distro_series": "22.04"})
        token = (await maas.get(f"machines/{system_id}/?op=get_token")).json()
        deployed = await maas_sim.wait_for_status(system_id, "Deployed")
        assert deployed["distro_series"] == "jammy"
        assert (await maas.get(f"machines/{system_id}/?op=get_token")).json() == token


async def test_deploy_refusals(maas_sim: MaasSim) -> None:
    new, ready = await _system_id(maas_sim, "node-b"), await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        in_new = await maas.post(f"machines/{new}/?op=deploy")
        assert (in_new.status_code, in_new.text) == (
            409,
            "Can't deploy a machine that is in the 'New' state",
        )
        bad_series = await maas.post(
            f"machines/{ready}/?op=deploy", data={"distro_series": "gpuaas-x"}
        )
        assert bad_series.status_code == 400
        message = bad_series.json()["distro_series"][0]
        assert message.startswith("'gpuaas-x' is not a valid distro_series.  It should be one of:")
        kvm = await maas.post(f"machines/{ready}/?op=deploy", data={"install_kvm": "true"})
        assert kvm.status_code == 400
        # A refused deploy is one transaction: the machine is still Ready and unowned.
        machine = (await maas.get(f"machines/{ready}/")).json()
        assert (machine["status_name"], machine["owner"]) == ("Ready", None)
        await maas.post(
            f"machines/{ready}/?op=set_storage_layout", data={"storage_layout": "blank"}
        )
        no_root = await maas.post(f"machines/{ready}/?op=deploy")
        assert no_root.status_code == 400
        assert no_root.json() == {
            "storage": ["Mount the root '/' filesystem to be able to deploy this node."]
        }
        await maas_sim.set_status(ready, "Deployed")
        again = await maas.post(f"machines/{ready}/?op=deploy")
        assert again.status_code == 409


@pytest.mark.maas_scenario(
    sim_scenario(sim_machine("n1", "10.176.16.21", faults=[{"kind": "deploy_fails"}]))
)
async def test_failed_deployment_must_be_released_before_a_redeploy(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "n1")
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        await maas_sim.wait_for_status(system_id, "Failed deployment")
        refused = await maas.post(f"machines/{system_id}/?op=deploy")
        assert (refused.status_code, refused.text) == (
            409,
            "Can't deploy a machine that is in the 'Failed deployment' state",
        )
        released = await maas.post(f"machines/{system_id}/?op=release")
        assert released.json()["status_name"] in ("Releasing", "Ready")


async def test_release_with_erase_goes_through_disk_erasing(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy", data={"enable_hw_sync": "1"})
        await maas_sim.wait_for_status(system_id, "Deployed")
        erasing = await maas.post(
            f"machines/{system_id}/?op=release", data={"erase": "true", "quick_erase": "true"}
        )
        assert erasing.status_code == 200, erasing.text
        assert (erasing.json()["status"], erasing.json()["status_name"]) == (14, "Disk erasing")
        # Release clears the OS and the hardware sync fields at once.
        machine = erasing.json()
        assert (machine["osystem"], machine["distro_series"]) == ("", "")
        assert (machine["enable_hw_sync"], machine["last_sync"], machine["sync_interval"]) == (
            False,
            None,
            None,
        )
    ready = await maas_sim.wait_for_status(system_id, "Ready")
    assert (ready["owner"], ready["power_state"], ready["ip_addresses"]) == (None, "off", [])
    changes = [e["description"] for e in await _events(maas_sim, system_id)
               if e["type"] == "Node changed status"]  # fmt: skip
    assert changes[-3:] == [
        "From 'Deployed' to 'Disk erasing'",
        "From 'Disk erasing' to 'Releasing'",
        "From 'Releasing' to 'Ready'",
    ]


async def test_release_without_erase_and_its_refusals(maas_sim: MaasSim) -> None:
    ready, new = await _system_id(maas_sim, "node-a"), await _system_id(maas_sim, "node-b")
    async with maas_sim.client() as maas:
        noop = await maas.post(f"machines/{ready}/?op=release")
        assert (noop.status_code, noop.json()["status_name"]) == (200, "Ready")
        refused = await maas.post(f"machines/{new}/?op=release")
        assert (refused.status_code, refused.text) == (
            409,
            "Machine cannot be released in its current state ('New').",
        )
        await maas.post(f"machines/{ready}/?op=deploy")
        releasing = await maas.post(f"machines/{ready}/?op=release")  # mid-deployment
        assert releasing.json()["status_name"] == "Releasing"
    await maas_sim.wait_for_status(ready, "Ready")


async def test_abort_deploying_and_disk_erasing(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    await maas_sim.set_time_scale(1.0)  # long enough to abort mid-way
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{system_id}/?op=deploy")
        aborted = await maas.post(f"machines/{system_id}/?op=abort")
        assert aborted.json()["status_name"] == "Allocated"
        await maas_sim.set_status(system_id, "Deployed")
        await maas.post(f"machines/{system_id}/?op=release", data={"erase": "1"})
        aborted = await maas.post(f"machines/{system_id}/?op=abort")
        assert aborted.json()["status_name"] == "Failed disk erasing"


async def test_mark_broken_is_for_the_owner_and_mark_fixed_restores(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        not_owner = await maas.post(f"machines/{system_id}/?op=mark_broken")
        assert (not_owner.status_code, not_owner.text) == (403, "")
        await maas.post(f"machines/{system_id}/?op=deploy")
        await maas_sim.wait_for_status(system_id, "Deployed")
        broken = await maas.post(
            f"machines/{system_id}/?op=mark_broken", data={"comment": "GPU fell off the bus"}
        )
        assert broken.json()["status_name"] == "Broken"
        assert broken.json()["error_description"] == "GPU fell off the bus"
        fixed = await maas.post(f"machines/{system_id}/?op=mark_fixed")
        assert fixed.json()["status_name"] == "Deployed"  # it was Deployed before
        refused = await maas.post(f"machines/{system_id}/?op=mark_fixed")
        assert (refused.status_code, refused.text) == (
            409,
            "Can't mark a non-broken node as 'Ready'.",
        )


async def test_boot_disk_then_flat_layout(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        devices = (await maas.get(f"nodes/{system_id}/blockdevices/")).json()
        by_name = {d["name"]: d for d in devices}
        assert by_name["sda"]["model"] == "Dell BOSS-N1"
        assert by_name["sda"]["used_for"] == "GPT partitioned with 2 partitions"
        nvme = by_name["nvme0n1"]
        assert (nvme["used_for"], nvme["path"]) == ("Unused", "/dev/disk/by-dname/nvme0n1")
        chosen = await maas.post(f"nodes/{system_id}/blockdevices/{nvme['id']}/?op=set_boot_disk")
        assert (chosen.status_code, chosen.text) == (200, "OK")
        machine = (await maas.get(f"machines/{system_id}/")).json()
        assert machine["boot_disk"]["name"] == "nvme0n1"
        assert machine["boot_disk"]["partitions"] == []  # the old layout stays where it was
        flat = await maas.post(
            f"machines/{system_id}/?op=set_storage_layout",
            data={"storage_layout": "flat", "boot_device": "ignored"},
        )
        assert flat.status_code == 200, flat.text
        disks = {d["name"]: d for d in flat.json()["blockdevice_set"]}
        mounts = [p["filesystem"]["mount_point"] for p in disks["nvme0n1"]["partitions"]]
        assert mounts == ["/boot/efi", "/"]
        assert disks["sda"]["partitions"] == []
        unknown = await maas.post(f"nodes/{system_id}/blockdevices/9999/?op=set_boot_disk")
        assert (unknown.status_code, unknown.text) == (
            404,
            "No BlockDevice matches the given query.",
        )
        bad = await maas.post(
            f"machines/{system_id}/?op=set_storage_layout", data={"storage_layout": "zfs"}
        )
        assert bad.status_code == 400
        assert "storage_layout" in bad.json()
        await maas_sim.set_status(system_id, "Allocated")
        not_ready = await maas.post(
            f"machines/{system_id}/?op=set_storage_layout", data={"storage_layout": "flat"}
        )
        assert (not_ready.status_code, not_ready.text) == (
            409,
            "Cannot change the storage layout on a machine that is not Ready.",
        )
        no_boot = await maas.post(f"nodes/{system_id}/blockdevices/{nvme['id']}/?op=set_boot_disk")
        assert (no_boot.status_code, no_boot.text) == (
            409,
            "Cannot set as boot disk because the machine is not Ready.",
        )


async def test_power_on_an_allocated_machine_deploys_it(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "node-a")
    async with maas_sim.client() as maas:
        await maas.post("machines/?op=allocate", data={"name": "node-a.maas"})
        started = await maas.post(f"machines/{system_id}/?op=power_on")
        assert started.json()["status_name"] == "Deploying"
    await maas_sim.wait_for_status(system_id, "Deployed")


@pytest.mark.maas_scenario(
    sim_scenario(sim_machine("old", "10.176.16.22"), site={"maas_version": "3.5.4"})
)
async def test_releases_before_3_6_render_naive_datetimes(maas_sim: MaasSim) -> None:
    system_id = await _system_id(maas_sim, "old")
    async with maas_sim.client() as maas:
        assert (await maas.get("version/")).json()["version"] == "3.5.4"
        await maas.post(f"machines/{system_id}/?op=deploy", data={"enable_hw_sync": "true"})
    deployed = await maas_sim.wait_for_status(system_id, "Deployed")
    stamp = deployed["last_sync"]
    assert not stamp.endswith("Z")
    assert dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f")
