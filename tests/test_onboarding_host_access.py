"""The real host-access implementations against honest stand-ins of what they talk to.

SshHostSeeder talks to a real SSH server (asyncssh, in process, on 127.0.0.1, with a host key made
here) that runs each command with bash, the way sshd runs it with the user's shell, in a sandbox:
PATH holds only the few tools the commands may use plus fake `sudo` and `systemctl` scripts that
record their argv (sudo also checks the password it reads from stdin, as `sudo -S` does), and the
seeder's paths point under a temporary root. IpmitoolBmc runs a fake `ipmitool` script that
records its argv and its IPMI_PASSWORD.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from activities.onboarding.host_access import BmcLogin, SshLogin
from activities.onboarding.ipmi import IpmitoolBmc
from activities.onboarding.ssh_seeder import SshHostSeeder
from contracts.node_files import HwSyncConfig, render_hw_sync_service, render_hw_sync_timer
from core.failures import ClassifiedError, FailureClass
from devstack.processes import free_port

USER = "gpuadmin"
PASSWORD = "Sup3r-s3cret_deploy.pw"
CREDS = (
    "reporting:\n  maas:\n    consumer_key: ck\n    token_key: tk\n    token_secret: ts\n"
    "    endpoint: http://maas.example:5240/MAAS/metadata/status/abc123\n"
)
AGENT_TOML = (
    'api_url = "http://api.example"\nenrollment_token = "gpe_fresh_token"\n'
    'state_dir = "/var/lib/gpucloud-agent"\n'
)
TOOLS = ("sh", "cat", "dirname", "mkdir", "chmod", "chown", "mv", "true", "sleep")

FAKE_SUDO = r"""#!/bin/bash
# sudo -k -S -p '' -- CMD...: the password from one stdin line, as real sudo -S reads it
# (byte by byte, so the rest of stdin reaches CMD); three tries, like sudo.
printf '%s\n' "$*" >> "$SANDBOX/sudo.argv"
while [ $# -gt 0 ]; do
  case "$1" in
    -k|-S) shift ;;
    -p) shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ -e "$SANDBOX/nopasswd" ] && exec "$@"
expected="$(cat "$SANDBOX/sudo.password")"
for try in 1 2 3; do
  IFS= read -r given || { echo "sudo: no password was provided" >&2; exit 1; }
  [ "$given" = "$expected" ] && exec "$@"
  echo "Sorry, try again." >&2
done
echo "sudo: 3 incorrect password attempts" >&2
exit 1
"""

FAKE_SYSTEMCTL = r"""#!/bin/bash
printf '%s\n' "$*" >> "$SANDBOX/systemctl.argv"
case "$1" in
  cat) [ -e "$SANDBOX/installed/$2" ] || { echo "No files found for $2." >&2; exit 1; } ;;
  restart)
    if [ -e "$SANDBOX/hang" ]; then sleep 30; fi
    if [ -e "$SANDBOX/fail/$2" ]; then
      echo "Job for $2 failed because the control process exited with error code." >&2
      exit 1
    fi ;;
esac
exit 0
"""


@dataclass
class Host:
    """A freshly deployed host as the seeder sees it."""

    port: int
    root: Path  # stands for "/"
    sandbox: Path  # the fakes' records and switches
    commands: list[str] = field(default_factory=list)  # every command line the server ran

    def login(self, password: str = PASSWORD, port: int | None = None) -> SshLogin:
        return SshLogin(address="127.0.0.1", user=USER, password=password, port=port or self.port)

    def seeder(self, **kwargs: Any) -> SshHostSeeder:
        r = str(self.root)
        hw_sync = HwSyncConfig(
            service_unit=f"{r}/etc/systemd/system/maas_hardware_sync.service",
            timer_unit=f"{r}/etc/systemd/system/maas_hardware_sync.timer",
            credentials=f"{r}/etc/maas/maas-machine-creds.yml",
        )
        kwargs.setdefault("connect_timeout_s", 5.0)
        return SshHostSeeder(
            hw_sync=hw_sync, agent_config_path=f"{r}/etc/gpucloud/agent.toml", **kwargs
        )

    def file(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def record(self, name: str) -> str:
        path = self.sandbox / name
        return path.read_text() if path.exists() else ""

    def systemctl_calls(self) -> list[str]:
        return self.record("systemctl.argv").splitlines()

    def everything_recorded(self) -> str:
        return "\n".join([*self.commands, self.record("sudo.argv"), self.record("systemctl.argv")])


class _Server(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return True

    def validate_password(self, username: str, password: str) -> bool:
        return username == USER and password == PASSWORD


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[Host]:
    root, sandbox, bin_dir = tmp_path / "root", tmp_path / "sandbox", tmp_path / "bin"
    for d in (root / "etc/systemd/system", sandbox / "installed", sandbox / "fail", bin_dir):
        d.mkdir(parents=True)
    (sandbox / "sudo.password").write_text(PASSWORD + "\n")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    if os.geteuid() != 0:  # chown root:root needs root; record it instead
        (bin_dir / "chown").unlink()
        (bin_dir / "chown").write_text('#!/bin/bash\nprintf "%s\\n" "$*" >> "$SANDBOX/chown"\n')
    for name, text in (("sudo", FAKE_SUDO), ("systemctl", FAKE_SYSTEMCTL)):
        (bin_dir / name).write_text(text)
    for script in bin_dir.iterdir():
        if not script.is_symlink():
            script.chmod(0o755)
    env = {"PATH": str(bin_dir), "SANDBOX": str(sandbox), "HOME": str(tmp_path), "LANG": "C"}
    bash = shutil.which("bash")
    assert bash is not None
    state = Host(port=0, root=root, sandbox=sandbox)
    children: list[asyncio.subprocess.Process] = []

    async def run(process: asyncssh.SSHServerProcess[str]) -> None:
        command = process.command or ""
        state.commands.append(command)
        data = await process.stdin.read()
        child = await asyncio.create_subprocess_exec(
            bash, "-c", command, env=env, cwd=str(tmp_path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        children.append(child)
        out, err = await child.communicate(data.encode())
        process.stdout.write(out.decode())
        process.stderr.write(err.decode())
        process.exit(child.returncode or 0)

    server = await asyncssh.create_server(
        _Server, "127.0.0.1", 0,
        server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")],
        process_factory=run,
    )  # fmt: skip
    state.port = server.get_port()
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()
        for child in children:  # a command the seeder gave up on (the timeout test)
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                await child.wait()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------- SshHostSeeder


async def test_seed_writes_credentials_and_units_and_restarts_them(host: Host) -> None:
    seeder = host.seeder()
    await seeder.seed_hardware_sync(host.login(), creds_yaml=CREDS, interval_minutes=15)

    service = host.file("/etc/systemd/system/maas_hardware_sync.service")
    timer = host.file("/etc/systemd/system/maas_hardware_sync.timer")
    creds = host.file("/etc/maas/maas-machine-creds.yml")
    cfg = HwSyncConfig(service_unit=str(service), timer_unit=str(timer), credentials=str(creds))
    assert creds.read_text() == CREDS  # exactly: no password line, no marker
    assert mode(creds) == 0o600
    assert service.read_text() == render_hw_sync_service(cfg)
    assert timer.read_text() == render_hw_sync_timer(cfg, 15)
    assert "OnUnitActiveSec=15min" in timer.read_text()
    assert mode(service) == mode(timer) == 0o644
    if os.geteuid() == 0:
        assert (creds.stat().st_uid, creds.stat().st_gid) == (0, 0)
    assert not list(creds.parent.glob("*.gpucloud-new"))

    assert host.systemctl_calls() == [
        "daemon-reload",
        "enable --now maas_hardware_sync.timer",
        "restart maas_hardware_sync.service",
        "cat maas-agent.service",  # not installed here: left alone
    ]
    # Every root action went through sudo with the password on stdin only.
    assert all(c.startswith("sudo -k -S -p '' -- ") for c in host.commands)
    assert PASSWORD not in host.everything_recorded()
    assert "consumer_key" not in host.everything_recorded()  # contents never on a command line


async def test_seed_restarts_maas_agent_where_installed_and_rewrites_on_reseed(host: Host) -> None:
    (host.sandbox / "installed/maas-agent.service").touch()
    seeder = host.seeder()
    await seeder.seed_hardware_sync(host.login(), creds_yaml=CREDS, interval_minutes=15)
    await seeder.seed_hardware_sync(host.login(), creds_yaml="rotated: true\n", interval_minutes=5)
    assert host.file("/etc/maas/maas-machine-creds.yml").read_text() == "rotated: true\n"
    timer = host.file("/etc/systemd/system/maas_hardware_sync.timer").read_text()
    assert "OnUnitActiveSec=5min" in timer
    calls = host.systemctl_calls()
    assert calls.count("enable maas-agent.service") == 2
    assert calls.count("restart maas-agent.service") == 2


async def test_push_agent_config_writes_it_private_and_restarts_the_agent(host: Host) -> None:
    await host.seeder().push_agent_config(host.login(), agent_toml=AGENT_TOML)
    config = host.file("/etc/gpucloud/agent.toml")
    assert config.read_text() == AGENT_TOML
    assert mode(config) == 0o600
    assert mode(config.parent) == 0o755
    assert host.systemctl_calls() == [
        "reset-failed gpucloud-agent.service",
        "restart gpucloud-agent.service",
    ]
    assert "gpe_fresh_token" not in host.everything_recorded()
    assert PASSWORD not in host.everything_recorded()


async def test_nopasswd_sudo_leaves_the_password_out_of_the_file(host: Host) -> None:
    # With NOPASSWD sudo reads nothing: the password line reaches the root script, which must
    # drop it (it reads up to the marker).
    (host.sandbox / "nopasswd").touch()
    await host.seeder().push_agent_config(host.login(), agent_toml=AGENT_TOML)
    assert host.file("/etc/gpucloud/agent.toml").read_text() == AGENT_TOML


async def test_wrong_ssh_password_is_a_connectivity_failure(host: Host) -> None:
    with pytest.raises(ClassifiedError) as err:
        await host.seeder().seed_hardware_sync(
            host.login(password="wrong-" + PASSWORD), creds_yaml=CREDS, interval_minutes=15
        )
    assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
    assert "refused" in str(err.value)
    assert PASSWORD not in str(err.value)
    assert host.commands == []


async def test_unreachable_port_is_a_connectivity_failure(host: Host) -> None:
    with pytest.raises(ClassifiedError) as err:
        await host.seeder().push_agent_config(host.login(port=free_port()), agent_toml=AGENT_TOML)
    assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
    assert PASSWORD not in str(err.value)


async def test_sudo_refusing_the_password_sends_no_content(host: Host) -> None:
    (host.sandbox / "sudo.password").write_text("another-password\n")
    with pytest.raises(ClassifiedError) as err:
        await host.seeder().seed_hardware_sync(host.login(), creds_yaml=CREDS, interval_minutes=15)
    assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
    assert "sudo refused" in str(err.value)
    assert len(host.commands) == 1  # the check only: nothing was written
    assert not host.file("/etc/maas/maas-machine-creds.yml").exists()


async def test_failing_unit_restart_is_a_hardware_sync_failure(host: Host) -> None:
    (host.sandbox / "fail/maas_hardware_sync.service").touch()
    with pytest.raises(ClassifiedError) as err:
        await host.seeder().seed_hardware_sync(host.login(), creds_yaml=CREDS, interval_minutes=15)
    assert err.value.failure_class is FailureClass.HARDWARE_SYNC_FAILURE
    assert "maas_hardware_sync.service failed" in str(err.value)
    assert "consumer_key" not in str(err.value)
    assert PASSWORD not in str(err.value)


async def test_missing_sudo_is_a_missing_site_capability(host: Host) -> None:
    (host.root.parent / "bin/sudo").unlink()
    with pytest.raises(ClassifiedError) as err:
        await host.seeder().push_agent_config(host.login(), agent_toml=AGENT_TOML)
    assert err.value.failure_class is FailureClass.SITE_CAPABILITY_MISSING


async def test_a_hanging_command_is_bounded(host: Host) -> None:
    (host.sandbox / "hang").touch()
    with pytest.raises(ClassifiedError) as err:
        await host.seeder(command_timeout_s=0.5).push_agent_config(
            host.login(), agent_toml=AGENT_TOML
        )
    assert err.value.failure_class is FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE
    assert "no answer within 0.5s" in str(err.value)


async def test_invalid_input_is_refused_before_connecting(host: Host) -> None:
    seeder = host.seeder()
    for interval in (0, 1441):
        with pytest.raises(ClassifiedError) as err:
            await seeder.seed_hardware_sync(host.login(), creds_yaml=CREDS,
                                            interval_minutes=interval)  # fmt: skip
        assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
    with pytest.raises(ClassifiedError) as err:
        await seeder.push_agent_config(host.login(), agent_toml='enrollment_token = "unclosed')
    assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
    assert "unclosed" not in str(err.value)
    with pytest.raises(ClassifiedError) as err:
        await seeder.push_agent_config(host.login(password="two\nlines"), agent_toml=AGENT_TOML)
    assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
    assert "two" not in str(err.value)
    assert host.commands == []


# --------------------------------------------------------------------------- IpmitoolBmc

FAKE_IPMITOOL = r"""#!/bin/bash
# Records argv and the password it got from the environment; answers like ipmitool.
printf '%s\n' "$(printf '%s\x1f' "$@")" >> "$IPMI_RECORD/argv"
printf '%s\n' "${IPMI_PASSWORD-<unset>}" >> "$IPMI_RECORD/password"
mode="$(cat "$IPMI_RECORD/mode")"
case "$*" in
  *"chassis power status")
    [ "$mode" = hang ] && sleep 30
    [ "$mode" = fail ] && {
      echo "Error: Unable to establish IPMI v2 / RMCP+ session (password=$IPMI_PASSWORD)" >&2
      exit 1; }
    [ "$mode" = off ] && echo "Chassis Power is off" || echo "Chassis Power is on" ;;
  *"chassis power cycle")
    [ "$mode" = present_state ] && {
      echo "Set Chassis Power Control to Cycle failed: Command not supported in present state" >&2
      exit 1; }
    echo "Chassis Power Control: Cycle" ;;
  *"chassis power on") echo "Chassis Power Control: Up/On" ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""
BMC_PASSWORD = "calvin-Secret.42"


@dataclass
class FakeIpmi:
    record: Path
    env: dict[str, str]

    def bmc(self, **kwargs: Any) -> IpmitoolBmc:
        return IpmitoolBmc(env=self.env, **kwargs)

    def set_mode(self, mode: str) -> None:
        (self.record / "mode").write_text(mode)

    def calls(self) -> list[list[str]]:
        lines = (self.record / "argv").read_text().splitlines()
        return [line.rstrip("\x1f").split("\x1f") for line in lines]

    def passwords(self) -> list[str]:
        return (self.record / "password").read_text().splitlines()


@pytest.fixture
def ipmi(tmp_path: Path) -> FakeIpmi:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    script = bin_dir / "ipmitool"
    script.write_text(FAKE_IPMITOOL)
    script.chmod(0o755)
    fake = FakeIpmi(record, {"PATH": f"{bin_dir}:/usr/bin:/bin", "IPMI_RECORD": str(record)})
    fake.set_mode("on")
    return fake


LOGIN = BmcLogin(address="10.176.16.12", user="root", password=BMC_PASSWORD)
BASE = ["-I", "lanplus", "-H", "10.176.16.12", "-U", "root", "-E", "chassis", "power"]


async def test_ipmitool_cycles_a_running_chassis_with_the_password_in_env_only(
    ipmi: FakeIpmi,
) -> None:
    await ipmi.bmc().power_cycle(LOGIN)
    assert ipmi.calls() == [[*BASE, "status"], [*BASE, "cycle"]]
    assert ipmi.passwords() == [BMC_PASSWORD, BMC_PASSWORD]
    assert BMC_PASSWORD not in json.dumps(ipmi.calls())
    assert BMC_PASSWORD not in repr(LOGIN)


async def test_ipmitool_powers_on_a_chassis_that_is_off(ipmi: FakeIpmi) -> None:
    ipmi.set_mode("off")
    await ipmi.bmc().power_cycle(LOGIN)
    assert ipmi.calls() == [[*BASE, "status"], [*BASE, "on"]]


async def test_ipmitool_powers_on_when_a_cycle_is_refused_in_present_state(ipmi: FakeIpmi) -> None:
    ipmi.set_mode("present_state")
    await ipmi.bmc().power_cycle(LOGIN)
    assert ipmi.calls() == [[*BASE, "status"], [*BASE, "cycle"], [*BASE, "on"]]


async def test_ipmitool_failure_is_a_bmc_power_failure_without_the_password(
    ipmi: FakeIpmi,
) -> None:
    ipmi.set_mode("fail")
    with pytest.raises(ClassifiedError) as err:
        await ipmi.bmc().power_cycle(LOGIN)
    assert err.value.failure_class is FailureClass.BMC_POWER_FAILURE
    assert "Unable to establish IPMI v2" in str(err.value)
    assert BMC_PASSWORD not in str(err.value)
    assert len(str(err.value)) < 320


async def test_ipmitool_that_hangs_is_killed_and_reported(ipmi: FakeIpmi) -> None:
    ipmi.set_mode("hang")
    with pytest.raises(ClassifiedError) as err:
        await ipmi.bmc(timeout_s=0.5).power_cycle(LOGIN)
    assert err.value.failure_class is FailureClass.BMC_POWER_FAILURE
    assert "did not answer within 0.5s" in str(err.value)


async def test_missing_ipmitool_is_a_missing_site_capability(tmp_path: Path) -> None:
    bmc = IpmitoolBmc(env={"PATH": str(tmp_path)})
    with pytest.raises(ClassifiedError) as err:
        await bmc.power_cycle(LOGIN)
    assert err.value.failure_class is FailureClass.SITE_CAPABILITY_MISSING


async def test_a_bmc_login_that_could_be_an_option_is_refused(ipmi: FakeIpmi) -> None:
    with pytest.raises(ClassifiedError) as err:
        await ipmi.bmc().power_cycle(BmcLogin(address="-oProxyCommand=x", user="root",
                                              password=BMC_PASSWORD))  # fmt: skip
    assert err.value.failure_class is FailureClass.INPUT_CONFIG_ERROR
    assert not (ipmi.record / "argv").exists()


# --------------------------------------------------------------------------- host_access_from_env


def test_host_access_from_env_picks_real_or_simulated() -> None:
    from activities.onboarding.host_access_config import (
        HostAccessConfigError,
        host_access_from_env,
    )
    from sim.first_boot import SimulatedHostSeeder

    real = host_access_from_env({})
    assert isinstance(real.bmc, IpmitoolBmc)
    assert isinstance(real.seeder, SshHostSeeder)
    assert isinstance(host_access_from_env({"GPUCLOUD_HOST_ACCESS": "real"}).bmc, IpmitoolBmc)

    simulated = host_access_from_env({
        "GPUCLOUD_HOST_ACCESS": "simulated",
        "GPUCLOUD_SIM_MAAS_URL": "http://127.0.0.1:5240/MAAS",
        "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": "control-token-value",
    })  # fmt: skip
    # The simulator's BMCs are reached through the real ipmitool path, its own binary.
    assert isinstance(simulated.bmc, IpmitoolBmc)
    assert isinstance(simulated.seeder, SimulatedHostSeeder)

    with pytest.raises(HostAccessConfigError) as err:
        host_access_from_env(
            {"GPUCLOUD_HOST_ACCESS": "simulated", "GPUCLOUD_SIM_MAAS_CONTROL_TOKEN": "ctl-value"}
        )
    assert "GPUCLOUD_SIM_MAAS_URL" in str(err.value)
    assert "ctl-value" not in str(err.value)
    with pytest.raises(HostAccessConfigError):
        host_access_from_env({"GPUCLOUD_HOST_ACCESS": "ssh"})
