"""sim/first_boot.py against the real MAAS simulator (a subprocess) and the real gateway (over
PostgreSQL): a machine deployed through the MAAS API with our rendered cloud-init boots, and its
agent enrolls with the token the cloud-init carries, which sets nodes.enrolled_at. Enrollment goes
to the gateway app through httpx's ASGI transport (the `api` fixture's client): the api_url in
the cloud-init is that client's host, so the request is the one a real agent would send."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any

import pytest
from sqlalchemy import text

from activities.cloud_init import (
    AgentBootstrap,
    CloudInitInput,
    DeployUser,
    MaasMachineCredentials,
    NodeFacts,
    SiteFacts,
    hash_deploy_password,
    render_agent_toml,
    render_cloud_init,
)
from activities.onboarding.host_access import BmcLogin, SshLogin
from core.failures import ClassifiedError, FailureClass
from sim.first_boot import (
    FirstBootSimulator,
    MalformedUserData,
    SimulatedBmc,
    SimulatedHostSeeder,
    agent_config_from_user_data,
)
from tests.factories import create_node, create_sku
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

API_URL = "http://testserver.local"  # the host of the `api` fixture's clients
FORGED_TOKEN = "gpe_" + "A" * 43
TWO_READY = sim_scenario(
    sim_machine("node-a", "10.176.16.10"),
    sim_machine("node-d", "10.176.16.13"),
    sim_machine("node-c", "10.176.16.12", enlisted=False),
)


@pytest.fixture
async def node(db_sessions: Any) -> Any:
    await create_sku(db_sessions)
    return await create_node(db_sessions)


async def issue(admin: Any, node_id: Any) -> str:
    response = await admin.post(f"/api/v1/admin/nodes/{node_id}/enrollment-tokens", json={})
    assert response.status_code == 201, response.text
    return str(response.json()["enrollment_token"])


def cloud_init(token: str, hostname: str, system_id: str, maas_url: str) -> str:
    spec = CloudInitInput(
        site=SiteFacts(
            name="test-site",
            deploy_user=DeployUser("gpuadmin", hash_deploy_password("pw", salt="saltsalt")),
        ),
        node=NodeFacts(hostname=hostname, maas_system_id=system_id, maas_url=maas_url),
        agent=AgentBootstrap(api_url=API_URL, enrollment_token=token),
        maas_machine_token=MaasMachineCredentials("ck", "tk", "ts"),
    )
    return render_cloud_init(spec).content


async def system_id_of(sim: MaasSim, ref: str) -> str:
    return str((await sim.machine(ref))["system_id"])


async def deploy(sim: MaasSim, ref: str, user_data: str) -> str:
    system_id = await system_id_of(sim, ref)
    async with sim.client() as maas:
        response = await maas.post(
            f"machines/{system_id}/",
            params={"op": "deploy"},
            data={
                "distro_series": "custom/gpuaas-noble-2025.06",
                "user_data": base64.b64encode(user_data.encode()).decode(),
                "enable_hw_sync": "true",
            },
        )
    assert response.status_code == 200, response.text
    await sim.wait_for_status(system_id, "Deployed")
    return system_id


async def enrollment(db_sessions: Any, node_id: Any) -> Any:
    async with db_sessions() as session:
        return (
            await session.execute(
                text("SELECT enrolled_at, agent_version FROM nodes WHERE id = :id"),
                {"id": node_id},
            )
        ).one()


async def polls(fb: FirstBootSimulator, count: int) -> None:
    target = fb.polls + count
    async with asyncio.timeout(10):
        while fb.polls < target:  # noqa: ASYNC110 - polls are counted, not signalled
            await asyncio.sleep(0.01)


async def test_a_deployed_machine_boots_and_its_agent_enrolls(
    maas_sim: MaasSim, api: Any, make_token: Any, node: Any, db_sessions: Any, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    admin, anonymous = await api(token=await make_token("admin")), await api()
    token = await issue(admin, node.id)
    system_id = await system_id_of(maas_sim, "node-a")
    user_data = cloud_init(token, "node-a", system_id, maas_sim.base_url)
    async with FirstBootSimulator(
        maas_sim.base_url, maas_sim.control_token, poll_interval=0.02, http=anonymous
    ) as fb:
        await deploy(maas_sim, "node-a", user_data)
        record = await fb.wait_for("node-a")
        await polls(fb, 3)  # later polls do not boot the same deployment again
    assert record.enrolled
    assert (record.http_status, record.attempts, record.system_id) == (200, 1, system_id)
    row = await enrollment(db_sessions, node.id)
    assert row.enrolled_at is not None
    assert row.agent_version == "sim-first-boot"
    assert token not in repr(record)
    assert caplog.records  # the log check reads what was logged
    assert token not in caplog.text


async def test_a_held_machine_enrolls_only_once_released(
    maas_sim: MaasSim, api: Any, make_token: Any, node: Any, db_sessions: Any
) -> None:
    admin, anonymous = await api(token=await make_token("admin")), await api()
    token = await issue(admin, node.id)
    system_id = await system_id_of(maas_sim, "node-a")
    async with FirstBootSimulator(
        maas_sim.base_url, maas_sim.control_token, poll_interval=0.02, http=anonymous
    ) as fb:
        fb.hold("node-a")
        await deploy(maas_sim, "node-a", cloud_init(token, "node-a", system_id, maas_sim.base_url))
        record = await fb.wait_for("node-a", enrolled=False)
        await polls(fb, 10)
        assert record.held
        assert not record.enrolled
        assert record.attempts == 0
        assert (await enrollment(db_sessions, node.id)).enrolled_at is None

        fb.release("node-a")
        await fb.wait_for("node-a")
    assert not record.held
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None


@pytest.mark.maas_scenario(TWO_READY)
async def test_malformed_user_data_is_recorded_and_the_loop_goes_on(
    maas_sim: MaasSim, api: Any, make_token: Any, node: Any, db_sessions: Any
) -> None:
    admin, anonymous = await api(token=await make_token("admin")), await api()
    token = await issue(admin, node.id)
    async with FirstBootSimulator(
        maas_sim.base_url, maas_sim.control_token, poll_interval=0.02, http=anonymous
    ) as fb:
        await deploy(maas_sim, "node-a", '#cloud-config\n{"write_files": [oops')
        bad = await fb.wait_for("node-a", enrolled=False)
        system_id = await system_id_of(maas_sim, "node-d")
        await deploy(maas_sim, "node-d", cloud_init(token, "node-d", system_id, maas_sim.base_url))
        good = await fb.wait_for("node-d")
        await polls(fb, 3)
    assert bad.gave_up
    assert bad.error == "malformed user data: the #cloud-config body is not JSON"
    assert (bad.enrolled, bad.attempts) == (False, 0)
    assert good.enrolled
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None


def test_user_data_parsing_names_the_problem_never_the_content() -> None:
    toml = render_agent_toml(AgentBootstrap(api_url=API_URL, enrollment_token="gpe_secret"))
    ok = cloud_init("gpe_secret", "node-a", "abc123", "http://maas.example/MAAS")
    assert agent_config_from_user_data(ok).enrollment_token == "gpe_secret"
    encoded = ok.replace(
        '"content": ' + json.dumps(toml),
        f'"encoding": "b64", "content": "{base64.b64encode(toml.encode()).decode()}"',
    )
    assert encoded != ok
    assert agent_config_from_user_data(encoded).api_url == API_URL
    cases = {
        "#!/bin/sh\necho hi\n": "not a #cloud-config document",
        "#cloud-config\nruncmd: [ls]\n": "the #cloud-config body is not JSON",
        '#cloud-config\n{"runcmd": []}\n': "no write_files",
        '#cloud-config\n{"write_files": []}\n': "write_files has no /etc/gpucloud/agent.toml",
        ok.replace("enrollment_token", "token"): "agent.toml: enrollment_token is missing",
        ok.replace('api_url = \\"http', 'api_url = \\"ftp'): "agent.toml: api_url must be",
    }
    for user_data, reason in cases.items():
        with pytest.raises(MalformedUserData) as err:
            agent_config_from_user_data(user_data)
        assert str(err.value).startswith(reason), (reason, str(err.value))
        assert "gpe_secret" not in str(err.value)


async def test_simulated_bmc_power_cycle_enlists_an_unknown_machine(maas_sim: MaasSim) -> None:
    bmc = SimulatedBmc(maas_sim.base_url, maas_sim.control_token)
    before = await maas_sim.state()
    assert not [m for m in before["machines"] if m["bmc_address"] == "10.176.16.12"]
    await bmc.power_cycle(BmcLogin(address="10.176.16.12", user="root", password="calvin"))
    assert bmc.cycles == [("10.176.16.12", "enlisting")]
    async with asyncio.timeout(10):
        while True:
            found = [m for m in (await maas_sim.state())["machines"]
                     if m["bmc_address"] == "10.176.16.12"]  # fmt: skip
            if found:
                break
            await asyncio.sleep(0.02)
    assert found[0]["status_name"] == "New"

    with pytest.raises(ClassifiedError) as err:
        await bmc.power_cycle(BmcLogin(address="10.9.9.9", user="root", password="calvin"))
    assert err.value.failure_class is FailureClass.BMC_POWER_FAILURE
    wrong = SimulatedBmc(maas_sim.base_url, "not-the-token")
    with pytest.raises(ClassifiedError) as err:
        await wrong.power_cycle(BmcLogin(address="10.176.16.12", user="root", password="calvin"))
    assert "not-the-token" not in str(err.value)


async def test_simulated_seeder_reaches_only_deployed_hosts_and_pushes_enroll(
    maas_sim: MaasSim, api: Any, make_token: Any, node: Any, db_sessions: Any
) -> None:
    admin, anonymous = await api(token=await make_token("admin")), await api()
    system_id = await system_id_of(maas_sim, "node-a")
    async with FirstBootSimulator(
        maas_sim.base_url, maas_sim.control_token, poll_interval=0.02, http=anonymous
    ) as fb:
        seeder = SimulatedHostSeeder(first_boot=fb)
        # Not deployed yet: nothing answers SSH at its address.
        with pytest.raises(ClassifiedError) as err:
            await seeder.seed_hardware_sync(SshLogin("10.176.46.10", "gpuadmin", "pw"),
                                            creds_yaml="x: 1\n", interval_minutes=15)  # fmt: skip
        assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE

        # The cloud-init's token is refused (expired, say): the agent gives up ...
        await deploy(maas_sim, "node-a",
                     cloud_init(FORGED_TOKEN, "node-a", system_id, maas_sim.base_url))  # fmt: skip
        address = (await maas_sim.machine("node-a"))["ip_addresses"][0]
        login = SshLogin(address, "gpuadmin", "pw")
        refused = await fb.wait_for("node-a", enrolled=False)
        async with asyncio.timeout(10):
            while not refused.gave_up:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert (refused.http_status, refused.enrolled) == (401, False)

        await seeder.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15)
        assert seeder.seeds == [(address, 15)]

        # ... a held agent does not enroll with a pushed token either ...
        fresh = render_agent_toml(
            AgentBootstrap(api_url=API_URL, enrollment_token=await issue(admin, node.id))
        )
        fb.hold("node-a")
        await seeder.push_agent_config(login, agent_toml=fresh)
        assert seeder.agent_config_pushes == 1
        assert not refused.enrolled
        assert (await enrollment(db_sessions, node.id)).enrolled_at is None
        # ... until it can reach the API: then it enrolls with the pushed token.
        fb.release("node-a")
        await fb.wait_for("node-a")
        assert refused.config_pushes == 1
        assert (await enrollment(db_sessions, node.id)).enrolled_at is not None

        seeder.fail_ssh(address)
        for call in (
            seeder.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15),
            seeder.push_agent_config(login, agent_toml=fresh),
        ):
            with pytest.raises(ClassifiedError) as err:
                await call
            assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
        assert seeder.agent_config_pushes == 1


async def test_simulated_seeder_without_a_simulator_enrolls_directly(
    api: Any, make_token: Any, node: Any, db_sessions: Any
) -> None:
    admin, anonymous = await api(token=await make_token("admin")), await api()
    seeder = SimulatedHostSeeder(http=anonymous)
    toml = render_agent_toml(
        AgentBootstrap(api_url=API_URL, enrollment_token=await issue(admin, node.id))
    )
    await seeder.push_agent_config(SshLogin("10.0.0.5", "gpuadmin", "pw"), agent_toml=toml)
    assert seeder.agent_config_pushes == 1
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None
    with pytest.raises(ClassifiedError) as err:
        await seeder.push_agent_config(SshLogin("10.0.0.5", "gpuadmin", "pw"), agent_toml="x = [")
    assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
