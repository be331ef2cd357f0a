"""sim/first_boot.py against the real MAAS simulator (a subprocess), the real gateway (served by
uvicorn on a free port, over PostgreSQL) and the real node agent: a machine deployed through the
MAAS API with our rendered cloud-init gets a disk under `machines_dir/<system_id>/root` with the
cloud-config's files on it, and the simulator starts the unit's ExecStart as a `gpucloud-agent`
subprocess, which enrolls itself over HTTP with the token in its agent.toml (setting
nodes.enrolled_at) and writes its identity on that disk. Each test has its own machines dir
(tmp_path) and its own gateway; the agent's output is `machines_dir/<system_id>/agent.log`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import logging
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import text
from temporalio.client import Client

import sim.first_boot
from activities.cloud_init import (
    AgentBootstrap,
    CloudInitInput,
    DeployUser,
    MaasMachineCredentials,
    NodeFacts,
    SiteFacts,
    hash_deploy_password,
    render_agent_toml,
    render_agent_unit,
    render_cloud_init,
)
from activities.onboarding.host_access import BmcLogin, SshLogin
from agent.main import AGENT_VERSION
from core.codec import node_payload_key
from core.config import Settings
from core.failures import ClassifiedError, FailureClass
from devstack.processes import free_port
from gateway.app import create_app
from gateway.config import GatewayConfig
from sim.first_boot import (
    AGENT_CONFIG_PATH,
    AGENT_UNIT_PATH,
    IDENTITY_PATH,
    RESTART_MARKER,
    BootRecord,
    FirstBootSimulator,
    MalformedUserData,
    SimulatedBmc,
    SimulatedHostSeeder,
    agent_config_from_user_data,
    parse_unit,
    write_files,
)
from tests.factories import create_node, create_sku
from tests.gateway_fixtures import bearer
from tests.lifecycle_support import eventually, server_started
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario

API_URL = "http://testserver.local"  # only for the parsing tests: nothing listens there
# Where enrollment leaves the node's own payload key (no key comes with cloud-init).
PAYLOAD_KEY_PATH = "/var/lib/gpucloud-agent/payload.key"
FORGED_TOKEN = "gpe_" + "A" * 43
# The agent is a real process (imports, enrollment, Temporal): generous, on a shared machine.
ENROLL_TIMEOUT_S = 60.0
THREE_READY = sim_scenario(
    sim_machine("node-a", "10.176.16.10"),
    sim_machine("node-b", "10.176.16.11"),
    sim_machine("node-d", "10.176.16.13"),
    sim_machine("node-c", "10.176.16.12", enlisted=False),
)


@dataclass
class Gateway:
    url: str
    admin: httpx.AsyncClient
    settings: Settings

    async def issue(self, node_id: Any) -> str:
        response = await self.admin.post(
            f"/api/v1/admin/nodes/{node_id}/enrollment-tokens", json={}
        )
        assert response.status_code == 201, response.text
        return str(response.json()["enrollment_token"])

    def agent_toml(self, token: str) -> str:
        return render_agent_toml(self.bootstrap(token))

    def bootstrap(self, token: str) -> AgentBootstrap:
        return AgentBootstrap(api_url=self.url, enrollment_token=token)


@pytest.fixture
async def gateway(
    settings: Settings, temporal_client: Client, make_token: Any, control_plane: None
) -> AsyncIterator[Gateway]:
    """The gateway app on a real port (and the worker that writes what it is asked: tokens,
    enrollments): the agents are processes, they enroll over HTTP."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = dataclasses.replace(settings, public_api_url=url)
    app = create_app(settings, temporal_client=temporal_client, config=GatewayConfig())
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await server_started(server, serving)
    try:
        async with httpx.AsyncClient(
            base_url=url, headers=bearer(await make_token("admin")), timeout=30
        ) as admin:
            yield Gateway(url, admin, settings)
    finally:
        server.should_exit = True
        await serving


@pytest.fixture
def machines_dir(tmp_path: Path) -> Path:
    return tmp_path / "machines"


@pytest.fixture
def first_boot(maas_sim: MaasSim, machines_dir: Path) -> Callable[..., FirstBootSimulator]:
    def make(**options: Any) -> FirstBootSimulator:
        return FirstBootSimulator(
            maas_sim.base_url,
            maas_sim.control_token,
            machines_dir=machines_dir,
            poll_interval=0.05,
            agent_env={"GPUCLOUD_AGENT_HEARTBEAT_S": "2"},
            max_restart_delay_s=0.5,
            **options,
        )

    return make


@pytest.fixture
async def node(db_sessions: Any) -> Any:
    await create_sku(db_sessions)
    return await create_node(db_sessions)


def cloud_init(agent: AgentBootstrap, hostname: str, system_id: str, maas_url: str) -> str:
    spec = CloudInitInput(
        site=SiteFacts(
            name="test-site",
            deploy_user=DeployUser("gpuadmin", hash_deploy_password("pw", salt="saltsalt")),
        ),
        node=NodeFacts(hostname=hostname, maas_system_id=system_id, maas_url=maas_url),
        agent=agent,
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


async def wait_until(
    check: Callable[[], bool], what: str, record: BootRecord, timeout: float = ENROLL_TIMEOUT_S
) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():  # noqa: ASYNC110 - a process's side effects, not signalled
                await asyncio.sleep(0.05)
    except TimeoutError:
        message = f"{record.hostname}: not {what}; {record!r}\n{agent_log(record)}"
        raise AssertionError(message) from None


async def enrolled(fb: FirstBootSimulator, hostname: str) -> BootRecord:
    """`hostname`'s record once its agent enrolled (its log in the failure message if not)."""
    record = await fb.wait_for(hostname, enrolled=False)
    await wait_until(lambda: fb.booted[hostname].enrolled, "enrolled", record)
    return fb.booted[hostname]


def on_disk(record: BootRecord, path: str) -> Path:
    assert record.root is not None
    return record.root / path.lstrip("/")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def agent_log(record: BootRecord) -> str:
    assert record.machine_dir is not None
    log = record.machine_dir / "agent.log"
    return log.read_text(errors="replace") if log.exists() else ""


def identity_node_id(record: BootRecord) -> str:
    return str(json.loads(on_disk(record, IDENTITY_PATH).read_text())["node_id"])


async def test_a_deployed_machine_boots_and_its_agent_enrolls(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    machines_dir: Path,
    node: Any,
    db_sessions: Any,
    caplog: Any,
) -> None:
    caplog.set_level(logging.DEBUG)
    token = await gateway.issue(node.id)
    system_id = await system_id_of(maas_sim, "node-a")
    user_data = cloud_init(gateway.bootstrap(token), "node-a", system_id, maas_sim.base_url)
    async with first_boot() as fb:
        await deploy(maas_sim, "node-a", user_data)
        record = await enrolled(fb, "node-a")
        # The enrolled agent goes on to serve its node's task queue on Temporal (with the
        # node's own payload key, from its enrollment).
        polling = f"polling node-{node.id}"
        await wait_until(lambda: polling in agent_log(record), "polling", record)
        await polls(fb, 3)  # later polls do not boot the same deployment again
        assert fb.booted["node-a"] is record
        assert record.agent_running
        starts = record.agent_starts
    assert not record.agent_running  # stopping the simulator stops its agents

    assert (record.system_id, record.api_url, record.gave_up) == (system_id, gateway.url, False)
    assert record.user_data_sha256 == hashlib.sha256(user_data.encode()).hexdigest()
    assert record.machine_dir == fb.machines_dir / system_id
    assert (starts, record.agent_exit_codes, record.error) == (1, [], None)
    assert record.unit_argv == ("/usr/bin/gpucloud-agent", "--config", AGENT_CONFIG_PATH)
    assert record.restart_delay_s == 0.5  # the unit's RestartSec=10, capped

    row = await enrollment(db_sessions, node.id)
    assert row.enrolled_at is not None
    assert row.agent_version == AGENT_VERSION

    # The cloud-config's files on the machine's disk, with their permissions.
    agent_toml = on_disk(record, AGENT_CONFIG_PATH)
    assert agent_toml.read_text() == gateway.agent_toml(token)
    assert mode(agent_toml) == 0o600
    # No key came with cloud-init; enrollment wrote the node's own (never the cluster key).
    assert "payload" not in user_data
    key = on_disk(record, PAYLOAD_KEY_PATH)
    node_key = node_payload_key(gateway.settings.codec_key, node.id)
    assert (key.read_text().strip(), mode(key)) == (base64.b64encode(node_key).decode(), 0o600)
    assert not on_disk(record, "/etc/gpucloud/payload.key").exists()
    unit = on_disk(record, AGENT_UNIT_PATH)
    assert (unit.read_text(), mode(unit)) == (render_agent_unit(ca_bundle=False), 0o644)
    assert mode(on_disk(record, "/etc/maas/maas-machine-creds.yml")) == 0o600
    # ... and the agent's own: the identity it got for this node.
    assert identity_node_id(record) == str(node.id)
    assert mode(on_disk(record, IDENTITY_PATH)) == 0o600
    assert (machines_dir / "by-address" / str(record.address)).resolve() == record.machine_dir

    assert token not in repr(record)
    assert caplog.records  # the log check reads what was logged
    assert token not in caplog.text
    log = agent_log(record)
    assert log  # the agent wrote its log there
    assert token not in log


async def test_a_held_machine_enrolls_only_once_released(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    node: Any,
    db_sessions: Any,
) -> None:
    token = await gateway.issue(node.id)
    system_id = await system_id_of(maas_sim, "node-a")
    user_data = cloud_init(gateway.bootstrap(token), "node-a", system_id, maas_sim.base_url)
    async with first_boot() as fb:
        fb.hold("node-a")
        await deploy(maas_sim, "node-a", user_data)
        record = await fb.wait_for("node-a", enrolled=False)
        await polls(fb, 10)
        # Booted (its disk is there) but its agent never ran: the network is down.
        assert on_disk(record, AGENT_CONFIG_PATH).is_file()
        assert record.held
        assert (record.enrolled, record.agent_running, record.agent_starts) == (False, False, 0)
        assert record.error == "held: the agent cannot reach the API"
        assert not on_disk(record, IDENTITY_PATH).exists()
        assert agent_log(record) == ""
        assert (await enrollment(db_sessions, node.id)).enrolled_at is None

        fb.release("node-a")
        assert await enrolled(fb, "node-a") is record
    assert not record.held
    assert record.agent_starts == 1
    assert identity_node_id(record) == str(node.id)
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None


@pytest.mark.maas_scenario(THREE_READY)
async def test_past_max_running_agents_the_longest_enrolled_agent_is_stopped(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[..., FirstBootSimulator],
    node: Any,
    db_sessions: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound the 500-node onboarding bench runs under: with max_running_agents 1, the
    second node's agent enrolls and runs, and the first one's is stopped (not restarted)."""
    monkeypatch.setattr(sim.first_boot, "SHED_AFTER_ENROLLED_S", 0.0)
    second = await create_node(db_sessions)
    async with first_boot(max_running_agents=1) as fb:
        records = []
        for hostname, node_id in (("node-a", node.id), ("node-b", second.id)):
            token = await gateway.issue(node_id)
            system_id = await system_id_of(maas_sim, hostname)
            user_data = cloud_init(gateway.bootstrap(token), hostname, system_id, maas_sim.base_url)
            await deploy(maas_sim, hostname, user_data)
            records.append(await enrolled(fb, hostname))
        first, last = records
        await wait_until(lambda: not first.agent_running, "stopped", first)
        await polls(fb, 5)
        assert (first.stopped, first.agent_running, first.agent_starts) == (True, False, 1)
        assert (last.stopped, last.agent_running) == (False, True)
        assert fb.agents_shed == 1
    for node_id in (node.id, second.id):
        assert (await enrollment(db_sessions, node_id)).enrolled_at is not None


@pytest.mark.maas_scenario(THREE_READY)
async def test_malformed_user_data_is_recorded_and_the_loop_goes_on(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    node: Any,
    db_sessions: Any,
) -> None:
    token = await gateway.issue(node.id)
    # A valid cloud-config whose write_files lack the agent unit: the disk is laid out, but
    # there is nothing to start.
    no_unit = json.loads(
        cloud_init(gateway.bootstrap(token), "node-b", "x", maas_sim.base_url).partition("\n")[2]
    )
    no_unit["write_files"] = [f for f in no_unit["write_files"] if f["path"] != AGENT_UNIT_PATH]
    async with first_boot() as fb:
        await deploy(maas_sim, "node-a", '#cloud-config\n{"write_files": [oops')
        await deploy(maas_sim, "node-b", "#cloud-config\n" + json.dumps(no_unit))
        bad = await fb.wait_for("node-a", enrolled=False)
        no_agent = await fb.wait_for("node-b", enrolled=False)
        system_id = await system_id_of(maas_sim, "node-d")
        await deploy(
            maas_sim,
            "node-d",
            cloud_init(gateway.bootstrap(token), "node-d", system_id, maas_sim.base_url),
        )
        good = await enrolled(fb, "node-d")
        await polls(fb, 3)
        assert fb.booted["node-a"] is bad  # a given-up boot is not retried
    assert bad.gave_up
    assert bad.error == "malformed user data: the #cloud-config body is not JSON"
    assert (bad.enrolled, bad.agent_starts, bad.unit_argv) == (False, 0, ())
    assert no_agent.gave_up
    assert no_agent.error == f"malformed user data: write_files has no {AGENT_UNIT_PATH}"
    assert (no_agent.enrolled, no_agent.agent_starts) == (False, 0)
    assert on_disk(no_agent, AGENT_CONFIG_PATH).is_file()  # cloud-init wrote what it had
    assert agent_log(no_agent) == ""
    for record in (bad, no_agent):
        assert token not in str(record.error)
        assert token not in repr(record)
    assert good.enrolled
    assert identity_node_id(good) == str(node.id)
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None


@pytest.mark.maas_scenario(THREE_READY)
async def test_a_unit_running_something_else_is_malformed_and_the_loop_goes_on(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    node: Any,
) -> None:
    token = await gateway.issue(node.id)
    doc = json.loads(
        cloud_init(gateway.bootstrap(token), "node-a", "x", maas_sim.base_url).partition("\n")[2]
    )
    for entry in doc["write_files"]:
        if entry["path"] == AGENT_UNIT_PATH:
            entry["content"] = entry["content"].replace("/usr/bin/gpucloud-agent", "/bin/true")
    async with first_boot() as fb:
        await deploy(maas_sim, "node-a", "#cloud-config\n" + json.dumps(doc))  # listed first
        system_id = await system_id_of(maas_sim, "node-d")
        await deploy(
            maas_sim,
            "node-d",
            cloud_init(gateway.bootstrap(token), "node-d", system_id, maas_sim.base_url),
        )
        other = await fb.wait_for("node-d", enrolled=False, timeout=5)
        bad = fb.booted["node-a"]
        await polls(fb, 3)
    assert other.agent_starts >= 1
    assert bad.gave_up
    assert bad.error == "malformed user data: the agent unit runs /bin/true, not gpucloud-agent"
    assert bad.agent_starts == 0


def test_user_data_parsing_names_the_problem_never_the_content() -> None:
    agent = AgentBootstrap(api_url=API_URL, enrollment_token="gpe_secret")
    toml = render_agent_toml(agent)
    ok = cloud_init(agent, "node-a", "abc123", "http://maas.example/MAAS")
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


def test_write_files_and_the_agent_unit_are_read_as_cloud_init_and_systemd_would(
    tmp_path: Path,
) -> None:
    secret = base64.b64encode(b"gpe_secret").decode()
    doc = {
        "write_files": [
            {"path": "/etc/a/plain", "content": "hello\n", "permissions": "0640"},
            {"path": "/etc/a/encoded", "content": secret, "encoding": "b64"},
        ]
    }
    assert write_files(tmp_path, doc) == ["/etc/a/plain", "/etc/a/encoded"]
    assert (tmp_path / "etc/a/plain").read_text() == "hello\n"
    assert mode(tmp_path / "etc/a/plain") == 0o640
    assert (tmp_path / "etc/a/encoded").read_bytes() == b"gpe_secret"
    assert mode(tmp_path / "etc/a/encoded") == 0o644
    cases: list[tuple[str, dict[str, Any]]] = [
        ("no write_files", {"runcmd": []}),
        (
            "a write_files entry has no absolute path",
            {"write_files": [{"path": "etc/relative", "content": "x"}]},
        ),
        (
            "a write_files entry has no absolute path",
            {"write_files": [{"path": "/etc/../../escape", "content": "x"}]},
        ),
        (
            "/etc/b is not valid base64",
            {"write_files": [{"path": "/etc/b", "content": "gpe_secret!", "encoding": "b64"}]},
        ),
        (
            "/etc/c: permissions are not octal",
            {"write_files": [{"path": "/etc/c", "content": "gpe_secret", "permissions": "rw"}]},
        ),
    ]
    for reason, bad in cases:
        with pytest.raises(MalformedUserData) as err:
            write_files(tmp_path / "other", bad)
        assert str(err.value) == reason
        assert "gpe_secret" not in str(err.value)
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path.parent / "escape").exists()

    argv, env, restart_s, no_restart = parse_unit(render_agent_unit(ca_bundle=True))
    assert no_restart == {78}  # a config the agent cannot start with stays failed
    assert argv == ["/usr/bin/gpucloud-agent", "--config", AGENT_CONFIG_PATH]
    assert env["GPUCLOUD_AGENT_CONFIG"] == AGENT_CONFIG_PATH
    assert "SSL_CERT_FILE" in env
    assert restart_s == 10.0
    with pytest.raises(MalformedUserData, match="no ExecStart"):
        parse_unit("[Unit]\nExecStart=/usr/bin/gpucloud-agent\n[Service]\nType=simple\n")


async def test_simulated_bmc_power_cycle_enlists_an_unknown_machine(maas_sim: MaasSim) -> None:
    bmc = SimulatedBmc(maas_sim.base_url, maas_sim.control_token)
    before = await maas_sim.state()
    assert not [m for m in before["machines"] if m["bmc_address"] == "10.176.16.12"]
    await bmc.power_cycle(BmcLogin(address="10.176.16.12", user="root", password="calvin"))
    assert bmc.cycles == [("10.176.16.12", "enlisting")]

    async def enlisted() -> list[dict[str, Any]]:
        machines = (await maas_sim.state())["machines"]
        return [m for m in machines if m["bmc_address"] == "10.176.16.12"]

    found = await eventually(enlisted, timeout=10)
    assert found[0]["status_name"] == "New"

    with pytest.raises(ClassifiedError) as err:
        await bmc.power_cycle(BmcLogin(address="10.9.9.9", user="root", password="calvin"))
    assert err.value.failure_class is FailureClass.BMC_POWER_FAILURE
    wrong = SimulatedBmc(maas_sim.base_url, "not-the-token")
    with pytest.raises(ClassifiedError) as err:
        await wrong.power_cycle(BmcLogin(address="10.176.16.12", user="root", password="calvin"))
    assert "not-the-token" not in str(err.value)


async def refused_boot(
    maas_sim: MaasSim, gateway: Gateway, fb: FirstBootSimulator, hostname: str
) -> tuple[BootRecord, SshLogin]:
    """`hostname` deployed with a token the gateway refuses: its agent keeps failing to enroll
    (exit 1, restarted as Restart=always says)."""
    system_id = await system_id_of(maas_sim, hostname)
    user_data = cloud_init(gateway.bootstrap(FORGED_TOKEN), hostname, system_id, maas_sim.base_url)
    await deploy(maas_sim, hostname, user_data)
    address = (await maas_sim.machine(hostname))["ip_addresses"][0]
    record = await fb.wait_for(hostname, enrolled=False)
    await wait_until(lambda: 1 in record.agent_exit_codes, "refused", record)
    assert not record.enrolled
    assert "enrollment failed (enrollment_token_invalid)" in agent_log(record)
    assert FORGED_TOKEN not in agent_log(record)
    assert record.address == address
    return record, SshLogin(address, "gpuadmin", "pw")


async def test_simulated_seeder_reaches_only_deployed_hosts_and_pushes_enroll(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    node: Any,
    db_sessions: Any,
) -> None:
    async with first_boot() as fb:
        seeder = SimulatedHostSeeder(first_boot=fb)
        assert seeder.machines_dir == fb.machines_dir
        # Not deployed yet: nothing answers SSH at its address.
        with pytest.raises(ClassifiedError) as err:
            await seeder.seed_hardware_sync(SshLogin("10.176.46.10", "gpuadmin", "pw"),
                                            creds_yaml="x: 1\n", interval_minutes=15)  # fmt: skip
        assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
        assert seeder.seeds == []

        # The cloud-init's token is refused: the agent fails to enroll ...
        refused, login = await refused_boot(maas_sim, gateway, fb, "node-a")
        await seeder.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15)
        assert seeder.seeds == [(login.address, 15)]
        # What the real seeder writes over SSH is on the machine's disk.
        creds = on_disk(refused, "/etc/maas/maas-machine-creds.yml")
        assert (creds.read_text(), mode(creds)) == ("x: 1\n", 0o600)
        timer = on_disk(refused, "/etc/systemd/system/maas_hardware_sync.timer")
        assert "OnUnitActiveSec=15min" in timer.read_text()

        # ... a held agent does not enroll with a pushed token either ...
        fresh = gateway.agent_toml(await gateway.issue(node.id))
        fb.hold("node-a")
        await seeder.push_agent_config(login, agent_toml=fresh)
        assert seeder.agent_config_pushes == 1
        assert refused.config_pushes == 1
        pushed = on_disk(refused, AGENT_CONFIG_PATH)
        assert (pushed.read_text(), mode(pushed)) == (fresh, 0o600)
        await polls(fb, 5)
        assert (refused.enrolled, refused.agent_running) == (False, False)
        assert (await enrollment(db_sessions, node.id)).enrolled_at is None
        # ... until it can reach the API: then it restarts, reads the pushed config, enrolls.
        fb.release("node-a")
        assert await enrolled(fb, "node-a") is refused
        assert identity_node_id(refused) == str(node.id)
        row = await enrollment(db_sessions, node.id)
        assert (row.enrolled_at is not None, row.agent_version) == (True, AGENT_VERSION)

        with pytest.raises(ClassifiedError) as err:
            await seeder.push_agent_config(login, agent_toml="x = [")
        assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
        seeder.fail_ssh(login.address)
        for call in (
            seeder.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15),
            seeder.push_agent_config(login, agent_toml=fresh),
        ):
            with pytest.raises(ClassifiedError) as err:
                await call
            assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
        assert seeder.agent_config_pushes == 1
        assert refused.config_pushes == 1
        assert pushed.read_text() == fresh


async def test_simulated_seeder_without_a_simulator_writes_the_machine_disk(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    machines_dir: Path,
    node: Any,
    db_sessions: Any,
) -> None:
    # The worker's seeder (another process than the simulator's): only the machines dir links
    # them.
    seeder = SimulatedHostSeeder(machines_dir=machines_dir)
    assert seeder.first_boot is None
    fresh = gateway.agent_toml(await gateway.issue(node.id))
    with pytest.raises(ClassifiedError) as err:  # no machine there
        await seeder.push_agent_config(SshLogin("10.0.0.5", "gpuadmin", "pw"), agent_toml=fresh)
    assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
    with pytest.raises(ClassifiedError) as err:
        await seeder.push_agent_config(SshLogin("10.0.0.5", "gpuadmin", "pw"), agent_toml="x = [")
    assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
    assert seeder.agent_config_pushes == 0

    async with first_boot() as fb:
        record, login = await refused_boot(maas_sim, gateway, fb, "node-a")
        await seeder.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=30)
        assert seeder.seeds == [(login.address, 30)]
        # Held while pushing, so that the marker is still there to look at.
        fb.hold("node-a")
        await polls(fb, 2)
        assert not record.agent_running
        await seeder.push_agent_config(login, agent_toml=fresh)
        assert seeder.agent_config_pushes == 1
        machine = machines_dir / "by-address" / login.address
        assert machine.resolve() == record.machine_dir
        pushed = machine / "root" / AGENT_CONFIG_PATH.lstrip("/")
        assert (pushed.read_text(), mode(pushed)) == (fresh, 0o600)
        assert (machine / RESTART_MARKER).is_file()
        assert (record.config_pushes, record.enrolled) == (0, False)

        # The simulator picks the marker up once the machine is reachable: restart, enroll.
        fb.release("node-a")
        assert await enrolled(fb, "node-a") is record
        assert not (machine / RESTART_MARKER).exists()
        assert record.config_pushes == 1
    assert identity_node_id(record) == str(node.id)
    assert on_disk(record, AGENT_CONFIG_PATH).read_text() == fresh
    assert (await enrollment(db_sessions, node.id)).enrolled_at is not None


async def test_the_seeder_without_a_simulator_does_not_reach_a_released_machine(
    maas_sim: MaasSim,
    gateway: Gateway,
    first_boot: Callable[[], FirstBootSimulator],
    machines_dir: Path,
    node: Any,
) -> None:
    system_id = await system_id_of(maas_sim, "node-a")
    user_data = cloud_init(
        gateway.bootstrap(await gateway.issue(node.id)), "node-a", system_id, maas_sim.base_url
    )
    async with first_boot() as fb:
        fb.hold("node-a")  # no agent needed: only the disk matters here
        await deploy(maas_sim, "node-a", user_data)
        record = await fb.wait_for("node-a", enrolled=False)
        await polls(fb, 2)  # the record is listed before its disk is laid out
        login = SshLogin(str(record.address), "gpuadmin", "pw")
        local, remote = (
            SimulatedHostSeeder(first_boot=fb),
            SimulatedHostSeeder(machines_dir=machines_dir),
        )
        await remote.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15)

        await maas_sim.release("node-a")
        await polls(fb, 3)  # the simulator has seen it leave Deployed
        with pytest.raises(ClassifiedError) as err:
            await local.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15)
        assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
        with pytest.raises(ClassifiedError) as err:  # the bug: this one still gets through
            await remote.seed_hardware_sync(login, creds_yaml="x: 1\n", interval_minutes=15)
        assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
