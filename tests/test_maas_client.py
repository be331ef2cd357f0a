"""MaasClient against the MAAS simulator (`python -m sim.maas`, over real HTTP): the site check,
machines from creation with IPMI power to deploy and release, power, hardware sync and the
machine token. Errors, retries and secrets: test_maas_client_errors.py; storage, networking and
events: test_maas_client_network.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest

from activities.maas.client import MaasClient
from activities.maas.errors import (
    MaasAuthError,
    MaasBmcError,
    MaasStateConflict,
    MaasValidationError,
)
from activities.maas.types import (
    EraseMode,
    HardwareSync,
    IpmiPowerParameters,
    Machine,
    MachineState,
    MachineStatus,
    PowerState,
)
from core.failures import FailureClass
from tests.lifecycle_support import eventually
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

CLOUD_CONFIG = "#cloud-config\nruncmd:\n  - [sh, -c, 'echo enrolled']\n"


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests talk to the MAAS simulator only: no database to clean."""


def client(sim: MaasSim, *, timeout: float = 10.0, max_attempts: int = 3) -> MaasClient:
    """A client on the simulator with short retry backoffs."""
    return MaasClient(
        sim.base_url, sim.api_key, timeout=timeout, max_attempts=max_attempts, backoff_initial=0.01
    )


async def system_id_of(maas: MaasClient, hostname: str) -> str:
    [machine] = await maas.list_machines(hostnames=[hostname])
    return machine.system_id


async def wait_for(
    maas: MaasClient, system_id: str, *statuses: MachineStatus, timeout: float = 10.0
) -> Machine:
    deadline = time.monotonic() + timeout
    while True:
        machine = await maas.get_machine(system_id)
        if machine.status in statuses:
            return machine
        if time.monotonic() > deadline:
            raise AssertionError(f"{system_id} stayed {machine.status_name}, wanted {statuses}")
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- site


async def test_version_is_the_credential_check(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        version = await maas.version()
    assert version.version == "3.6.0"
    assert version.subversion == ""
    assert version.has_capability("authenticate-api")
    # The API root itself is accepted as a base URL too.
    async with MaasClient(maas_sim.api_url, maas_sim.api_key) as maas:
        assert (await maas.version()).version == "3.6.0"


async def test_a_key_maas_does_not_know_is_refused_as_site_capability_missing(
    maas_sim: MaasSim,
) -> None:
    consumer, token, secret = maas_sim.api_key.split(":")
    wrong_keys = [
        f"nobody{consumer}:{token}:{secret}",  # Invalid API key.
        f"{consumer}:stolen{token}:{secret}",  # Invalid access token: <token>
        f"{consumer}:{token}:wrong{secret}",  # Invalid signature. Expected … &<real secret>
    ]
    for wrong in wrong_keys:
        async with MaasClient(maas_sim.base_url, wrong) as maas:
            with pytest.raises(MaasAuthError) as info:
                await maas.version()
        error = info.value
        assert error.status_code == 401
        assert error.failure_class == FailureClass.SITE_CAPABILITY_MISSING
        for part in {*wrong.split(":"), consumer, token, secret}:
            assert part not in str(error)
            assert part not in error.maas_text
    counters = await maas_sim.counters()
    assert counters["answers"]["version.read"] == {"401": 3}  # never retried


async def test_rack_controllers(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        racks = await maas.rack_controllers()
    assert racks
    assert all(rack.system_id and rack.hostname for rack in racks)


# ---------------------------------------------------------------------------- machines


async def test_list_and_get_machines_as_typed_values(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        machines = {m.hostname: m for m in await maas.list_machines()}
        assert set(machines) == {"node-a", "node-b"}  # node-c is not enlisted
        node_a = machines["node-a"]
        assert await maas.get_machine(node_a.system_id) == node_a
        assert (node_a.status, node_a.status_name) == (MachineStatus.READY, "Ready")
        assert machines["node-b"].status == MachineStatus.NEW
        assert node_a.power_state == PowerState.OFF
        assert node_a.power_type == "ipmi"
        assert node_a.owner is None
        assert node_a.fqdn == "node-a.maas"
        boot = node_a.interface_named("eno8303")
        assert boot is not None
        assert boot.id == node_a.boot_interface_id
        assert [b.name for b in node_a.block_devices if b.id == node_a.boot_disk_id] == ["sda"]
        assert not node_a.hardware_sync.enabled
        assert node_a.hardware_sync.available
        by_mac = await maas.list_machines(mac_addresses=[boot.mac_address.upper()])
        assert [m.hostname for m in by_mac] == ["node-a"]
        by_id = await maas.list_machines(system_ids=[node_a.system_id])
        assert [m.hostname for m in by_id] == ["node-a"]
        assert await maas.list_machines(hostnames=["nope"]) == []
        addresses = await maas.power_addresses()
    assert addresses[node_a.system_id] == "10.176.16.10"


async def test_ipmi_only_creation_then_accept_commissions_it(maas_sim: MaasSim) -> None:
    power = IpmiPowerParameters(
        power_address="10.176.16.12", power_user="root", power_pass="calvin"
    )
    assert "calvin" not in repr(power)
    async with client(maas_sim) as maas:
        created = await maas.create_machine(hostname="node-c", power=power)
        # With IPMI and no architecture MAAS ignores MACs: a New machine without interfaces ...
        assert (created.status, created.interfaces) == (MachineStatus.NEW, ())
        assert created.power_type == "ipmi"
        assert (await maas.power_addresses())[created.system_id] == "10.176.16.12"
        # ... which cannot be commissioned (400 __all__ "… current state …") ...
        with pytest.raises(MaasStateConflict) as refused:
            await maas.commission(created.system_id)
        assert refused.value.status_code == 400
        assert refused.value.failure_class == FailureClass.STATE_AMBIGUITY
        # ... but can be accepted, which commissions it.
        [accepted] = await maas.accept_machines(created.system_id)
        assert accepted.status == MachineStatus.COMMISSIONING
        ready = await wait_for(maas, created.system_id, MachineStatus.READY)
        assert [i.name for i in ready.interfaces] == ["eno8303", "ens1f0np0"]
        # Accepting a Ready machine again is skipped, not refused.
        assert await maas.accept_machines(created.system_id) == []


async def test_create_refusals_are_input_errors_with_field_details(maas_sim: MaasSim) -> None:
    power = IpmiPowerParameters(power_address="10.0.0.1", power_pass="s3cr3t-bmc-pass")
    async with client(maas_sim) as maas:
        with pytest.raises(MaasValidationError) as duplicate:
            await maas.create_machine(hostname="node-a", power=power)
    error = duplicate.value
    assert error.failure_class == FailureClass.INPUT_CONFIG_ERROR
    assert error.status_code == 400
    assert error.field_errors == {"hostname": ("Node with this Hostname already exists.",)}
    assert "s3cr3t-bmc-pass" not in str(error)
    counters = await maas_sim.counters()
    assert sum(counters["answers"]["machines.create"].values()) == 1


async def test_update_machine_sets_only_the_given_fields(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-b")
        renamed = await maas.update_machine(
            system_id,
            hostname="c07u99",
            power=IpmiPowerParameters(power_address="10.176.16.99", power_user="maas"),
        )
        assert renamed.hostname == "c07u99"
        assert renamed.status == MachineStatus.NEW
        assert (await maas.power_addresses())[system_id] == "10.176.16.99"


async def test_commission_then_deploy_replaces_the_machine_token(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        assert await maas.get_machine_token(system_id) is None
        started = await maas.commission(system_id, enable_ssh=True, skip_bmc_config=True)
        assert started.status == MachineStatus.COMMISSIONING
        await wait_for(maas, system_id, MachineStatus.READY)
        after_commissioning = await maas.get_machine_token(system_id)
        assert after_commissioning is not None
        assert after_commissioning.token_secret not in repr(after_commissioning)
        # Deploying a Ready machine allocates it: the owner changes, so does the token.
        await maas.deploy(system_id, distro_series="noble")
        after_deploy = await maas.get_machine_token(system_id)
        assert after_deploy is not None
        assert after_deploy != after_commissioning
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        await maas.release(system_id)
        await wait_for(maas, system_id, MachineStatus.READY)
        assert await maas.get_machine_token(system_id) is None


async def test_deploy_sends_base64_user_data_a_custom_image_and_hardware_sync(
    maas_sim: MaasSim,
) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        deploying = await maas.deploy(
            system_id,
            distro_series="gpuaas-noble-2025.06",  # sent as custom/gpuaas-noble-2025.06
            user_data=CLOUD_CONFIG,
            enable_hw_sync=True,
        )
        assert deploying.status == MachineStatus.DEPLOYING
        assert deploying.owner is not None
        assert (deploying.osystem, deploying.distro_series) == ("custom", "gpuaas-noble-2025.06")
        deployed = await wait_for(maas, system_id, MachineStatus.DEPLOYED)
    snapshot = await maas_sim.machine(system_id)
    assert snapshot["user_data_text"] == CLOUD_CONFIG
    sync = deployed.hardware_sync
    assert sync.enabled
    assert sync.sync_interval == dt.timedelta(seconds=900)
    assert sync.last_sync is not None
    assert sync.next_sync == sync.last_sync + sync.sync_interval
    assert sync.healthy(dt.datetime.now(dt.UTC))
    assert not sync.healthy(sync.last_sync + sync.sync_interval * 1.5 + dt.timedelta(seconds=1))
    assert deployed.ip_addresses


async def test_machine_states_are_the_whole_machines_status_part(maas_sim: MaasSim) -> None:
    """The reconciler's list (only a few keys of each entry decoded) reads what the whole list
    reads, for a Ready, a New and a deployed machine with hardware sync and addresses."""
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble", enable_hw_sync=True)
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        whole = await maas.list_machines()
        states = await maas.list_machine_states()
    assert [
        MachineState(
            m.system_id, m.hostname, m.status, m.power_state, m.ip_addresses, m.hardware_sync
        )
        for m in whole
    ] == states
    deployed = next(s for s in states if s.system_id == system_id)
    assert deployed.status_name == "Deployed"
    assert deployed.ip_addresses
    assert deployed.hardware_sync.enabled
    assert deployed.hardware_sync.last_sync is not None


@pytest.mark.maas_scenario(
    sim_scenario(
        sim_machine("n1", "10.176.16.30", faults=[{"kind": "hw_sync_never_healthy"}]),
        site={"hardware_sync_interval": "1s"},
        timings={"hw_sync": 100},
    )
)
async def test_hardware_sync_that_stops_posting_becomes_unhealthy(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "n1")
        await maas.deploy(system_id, distro_series="noble", enable_hw_sync=True)
        deployed = await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        assert deployed.hardware_sync.healthy(dt.datetime.now(dt.UTC))

        async def unhealthy() -> HardwareSync | None:  # past 1.5 x the 1 s interval
            sync = await maas.get_hardware_sync(system_id)
            return None if sync.healthy(dt.datetime.now(dt.UTC)) else sync

        later = await eventually(unhealthy, timeout=10)
    assert later.last_sync == deployed.hardware_sync.last_sync  # no fresh sync came


@pytest.mark.maas_scenario(
    sim_scenario(sim_machine("n1", "10.176.16.31", faults=[{"kind": "deploy_fails_datasource"}]))
)
async def test_a_failed_deployment_is_released_before_a_new_deploy(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "n1")
        await maas.deploy(system_id, distro_series="noble", user_data=CLOUD_CONFIG)
        failed = await wait_for(
            maas, system_id, MachineStatus.FAILED_DEPLOYMENT, MachineStatus.DEPLOYED
        )
        assert failed.status == MachineStatus.FAILED_DEPLOYMENT
        assert failed.status.is_failure
        assert failed.error_description
        with pytest.raises(MaasStateConflict) as refused:
            await maas.deploy(system_id, distro_series="noble", user_data=CLOUD_CONFIG)
        assert refused.value.status_code == 409
        assert refused.value.current_status == MachineStatus.FAILED_DEPLOYMENT
        assert refused.value.failure_class == FailureClass.STATE_AMBIGUITY
        released = await maas.release(system_id, comment="datasource retry")
        assert released.status in (MachineStatus.RELEASING, MachineStatus.READY)
        await wait_for(maas, system_id, MachineStatus.READY)
        await maas.deploy(system_id, distro_series="noble", user_data=CLOUD_CONFIG)
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)


@pytest.mark.parametrize("erase", [EraseMode.STANDARD, EraseMode.QUICK, EraseMode.SECURE])
async def test_release_with_each_erase_mode_goes_through_disk_erasing(
    maas_sim: MaasSim, erase: EraseMode
) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble", enable_hw_sync=True)
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        erasing = await maas.release(system_id, erase=erase)
        assert erasing.status == MachineStatus.DISK_ERASING
        # Release clears the OS and every hardware-sync field at once.
        assert (erasing.osystem, erasing.distro_series) == ("", "")
        assert not erasing.hardware_sync.enabled
        assert erasing.hardware_sync.last_sync is None
        ready = await wait_for(maas, system_id, MachineStatus.READY)
    assert ready.owner is None


async def test_release_without_erase_and_its_refusal(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        ready = await system_id_of(maas, "node-a")
        new = await system_id_of(maas, "node-b")
        assert (await maas.release(ready)).status == MachineStatus.READY  # a no-op
        with pytest.raises(MaasStateConflict) as refused:
            await maas.release(new)
    assert refused.value.current_status == MachineStatus.NEW


async def test_abort_a_deployment(maas_sim: MaasSim) -> None:
    await maas_sim.set_time_scale(1.0)  # slow enough to abort mid-way
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble")
        aborted = await maas.abort(system_id, comment="operator abort")
        assert aborted.status == MachineStatus.ALLOCATED
        with pytest.raises(MaasStateConflict):
            await maas.abort(system_id)


async def test_mark_fixed_after_broken(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas_sim.mark_broken(system_id, comment="GPU fell off the bus")
        broken = await maas.get_machine(system_id)
        assert broken.status == MachineStatus.BROKEN
        assert broken.status.is_failure
        fixed = await maas.mark_fixed(system_id, comment="reseated")
        assert fixed.status == MachineStatus.READY
        with pytest.raises(MaasStateConflict) as again:
            await maas.mark_fixed(system_id)
    assert again.value.status_code == 409


async def test_power_on_off_and_query_power_state(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        with pytest.raises(MaasStateConflict) as unowned:
            await maas.power_on(system_id)
        assert "hasn't been allocated" in str(unowned.value)
        await maas.deploy(system_id, distro_series="noble")
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        off = await maas.power_off(system_id, stop_mode="hard")
        assert off is not None
        assert off.power_state == PowerState.OFF
        assert await maas.query_power_state(system_id) == PowerState.OFF
        on = await maas.power_on(system_id, comment="back to work")
        assert on.power_state == PowerState.ON
        assert await maas.query_power_state(system_id) == PowerState.ON


async def test_a_bmc_that_does_not_answer_is_a_bmc_power_failure(maas_sim: MaasSim) -> None:
    power = IpmiPowerParameters(power_address="10.99.99.99", power_pass="calvin")
    async with client(maas_sim) as maas:
        created = await maas.create_machine(hostname="ghost", power=power)
        assert created.power_state == PowerState.UNKNOWN
        with pytest.raises(MaasBmcError) as info:
            await maas.query_power_state(created.system_id)
    assert info.value.failure_class == FailureClass.BMC_POWER_FAILURE
    assert info.value.status_code == 503
    counters = await maas_sim.counters()
    assert counters["ops"]["machine.query_power_state"] == 1  # MAAS answered: not retried
