"""The simulated deployed OS: what happens on a node after MAAS deploys it, for the embedded
default and the tests. The MAAS simulator (sim/maas) stops at "Deployed" with the user data it
was given; real hardware would then boot, run cloud-init and start our node agent, which enrolls
with the gateway (docs/lifecycles/onboarding.md#stages WaitForAgentEnrollment, §9). This module
plays that part, and answers the calls onboarding makes outside MAAS's API
(activities/onboarding/host_access.py):

- `FirstBootSimulator` polls the MAAS simulator's control API (GET /_sim/state). Each machine
  that is Deployed with user data it has not booted yet (key: system_id and the sha256 of the
  user data) boots on a fresh disk, `machines_dir/<system_id>/root` (sim/machine_image.py): the
  #cloud-config's write_files are written there with their permissions, and the rendered
  `gpucloud-agent.service` is read as systemd would: its ExecStart runs as a real
  `gpucloud-agent` process (GPUCLOUD_AGENT_ROOT = the disk; log in `<system_id>/agent.log`),
  restarted after RestartSec unless its exit status is in RestartPreventExitStatus. The agent
  enrolls itself with the token from its own config; the boot counts as enrolled once its
  identity file exists. A machine that leaves Deployed is powered off (its agent stopped) and
  forgotten, so every deployment boots afresh. `hold(hostname)` takes the machine's network
  away (its agent is not running); `release(hostname)` brings it back (a late enrollment);
  `stop_agent` is `systemctl stop`. Malformed user data is recorded and logged, never fatal.
- `SimulatedBmc` reads the chassis status through GET /_sim/bmc/{address} and power-cycles
  through POST /_sim/bmc/{address}/power-cycle: an unknown machine
  PXE-boots and enlists as New, as with `ipmitool chassis power cycle`. The BMC login is not
  checked (the simulator's BMCs accept any).
- `SimulatedHostSeeder` stands for SSH to the deployed host: seeds are recorded, an address can
  be made unreachable (`fail_ssh`), and a pushed agent config is written on the machine's disk
  and its agent restarted (through the linked `FirstBootSimulator`, or a restart marker in
  `machines_dir` that the simulator process picks up).
- systemd's part for the units the agent restarts (agent/host_processes.UnitRestartRequests: a
  request file per unit on the disk): a restart of the hardware-sync timer, with the MAAS
  credentials its service needs on the disk, makes the deployed OS post its hardware sync to the
  MAAS simulator again (POST /_sim/machines/{id}/hw-sync-timer); each restart is recorded in
  the boot record's `unit_restarts`.

Only the JSON-bodied #cloud-config that activities/cloud_init.py renders is understood (JSON is
YAML 1.2, which real cloud-init reads); anything else counts as malformed here.

Nothing here logs or records a token or user-data content: records carry hostnames, statuses
and error kinds only.

    python -m sim.first_boot --maas-url http://127.0.0.1:5240/MAAS \\
        --control-token-file .state/maas-control-token [--machines-dir .state/machines]

runs a `FirstBootSimulator` until SIGINT/SIGTERM (`--control-token T` or
GPUCLOUD_SIM_MAAS_CONTROL_TOKEN instead of the file).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from activities.onboarding.host_access import BmcLogin, SshLogin
from agent.config_file import ROOT_ENV
from contracts.node_files import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_STATE_DIR,
    UNIT_RESTART_REQUESTS_DIR,
    HwSyncConfig,
    render_hw_sync_service,
    render_hw_sync_timer,
)
from core.crash_traces import enable_crash_traces
from core.failures import ClassifiedError, FailureClass
from sim.machine_image import build_machine

logger = logging.getLogger("sim.first_boot")

AGENT_CONFIG_PATH = str(DEFAULT_CONFIG_PATH)
AGENT_UNIT_PATH = "/etc/systemd/system/gpucloud-agent.service"
AGENT_EXECUTABLE = "gpucloud-agent"
IDENTITY_PATH = str(DEFAULT_STATE_DIR / "identity.json")
# Left in a machine's directory by an SSH config push: the agent restarts at the next poll.
RESTART_MARKER = "restart-agent"
AGENT_STOP_TIMEOUT_S = 15.0
# With max_running_agents, an agent is stopped only this long after its node enrolled, so the
# onboarding that waited for the enrollment has finished with it.
SHED_AFTER_ENROLLED_S = 60.0
MAX_RUNNING_AGENTS_ENV = "GPUCLOUD_SIM_MAX_RUNNING_AGENTS"
DEFAULT_MACHINES_DIR = Path(".state/machines")
DEPLOYED = "Deployed"
HTTP_TIMEOUT_S = 10.0
INTERVAL_RANGE_MINUTES = (1, 1440)  # what the real seeder (and node.hw_sync_reseed) accepts


def control_base_url(maas_base_url: str) -> str:
    """The simulator's control API lives beside the MAAS API, at the root of the same server:
    http://HOST:PORT/MAAS -> http://HOST:PORT (then /_sim/...)."""
    return maas_base_url.rstrip("/").removesuffix("/MAAS")


class MalformedUserData(ValueError):
    """The user data cannot be booted. The message names what is wrong, never a value."""


@dataclass(frozen=True)
class AgentToml:
    api_url: str
    enrollment_token: str = field(repr=False)


def parse_agent_toml(text: str) -> AgentToml:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise MalformedUserData("agent.toml is not valid TOML") from None
    api_url, token = data.get("api_url"), data.get("enrollment_token")
    if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
        raise MalformedUserData("agent.toml: api_url must be an http(s) URL")
    if not isinstance(token, str) or not token:
        raise MalformedUserData("agent.toml: enrollment_token is missing")
    return AgentToml(api_url=api_url.rstrip("/"), enrollment_token=token)


def parse_cloud_config(user_data: str) -> dict[str, Any]:
    """The #cloud-config document (a JSON body: JSON is YAML 1.2, which cloud-init reads)."""
    header, _, body = user_data.partition("\n")
    if header.strip() != "#cloud-config":
        raise MalformedUserData("not a #cloud-config document")
    try:
        doc = json.loads(body)
    except ValueError:
        raise MalformedUserData("the #cloud-config body is not JSON") from None
    if not isinstance(doc, dict):
        raise MalformedUserData("the #cloud-config body is not a mapping")
    return doc


def _file_content(entry: Mapping[str, Any], path: str) -> bytes:
    content = entry.get("content", "")
    if not isinstance(content, str):
        raise MalformedUserData(f"{path} has no content")
    if entry.get("encoding") in ("b64", "base64"):
        try:
            return base64.b64decode(content, validate=True)
        except ValueError:
            raise MalformedUserData(f"{path} is not valid base64") from None
    return content.encode()


def write_files(root: Path, doc: Mapping[str, Any]) -> list[str]:
    """cloud-init's write_files module on the disk at `root`: each file at its path, with its
    permissions. Answers the paths written."""
    files = doc.get("write_files")
    if not isinstance(files, list):
        raise MalformedUserData("no write_files")
    written = []
    for entry in files:
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
            raise MalformedUserData("a write_files entry has no absolute path")
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_file_content(entry, path))
        try:
            target.chmod(int(str(entry.get("permissions", "0644")), 8))
        except ValueError:
            raise MalformedUserData(f"{path}: permissions are not octal") from None
        written.append(path)
    return written


def agent_config_from_user_data(user_data: str) -> AgentToml:
    """The agent config cloud-init would write, from a #cloud-config with a JSON body."""
    files = parse_cloud_config(user_data).get("write_files")
    if not isinstance(files, list):
        raise MalformedUserData("no write_files")
    for entry in files:
        if isinstance(entry, dict) and entry.get("path") == AGENT_CONFIG_PATH:
            return parse_agent_toml(_file_content(entry, AGENT_CONFIG_PATH).decode())
    raise MalformedUserData(f"write_files has no {AGENT_CONFIG_PATH}")


def parse_unit(text: str) -> tuple[list[str], dict[str, str], float, frozenset[int]]:
    """ExecStart's argv, the Environment= settings, RestartSec and RestartPreventExitStatus of a
    systemd service unit."""
    argv: list[str] = []
    env: dict[str, str] = {}
    restart_s = 0.1
    no_restart: set[int] = set()
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        if section != "[Service]":
            continue
        if key == "ExecStart":
            argv = shlex.split(value)
        elif key == "Environment":
            for assignment in shlex.split(value):
                name, _, setting = assignment.partition("=")
                env[name] = setting
        elif key == "RestartSec":
            with contextlib.suppress(ValueError):
                restart_s = float(value.rstrip("s"))
        elif key == "RestartPreventExitStatus":
            no_restart.update(int(v) for v in value.split() if v.isdigit())
    if not argv:
        raise MalformedUserData("the agent unit has no ExecStart")
    return argv, env, restart_s, frozenset(no_restart)


def default_agent_command() -> list[str]:
    """What /usr/bin/gpucloud-agent is on a simulated machine: the agent installed in this
    Python environment (its console script, else the module)."""
    script = Path(sys.executable).with_name(AGENT_EXECUTABLE)
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "agent.main"]


@dataclass
class BootRecord:
    """One boot of one deployment. `error` says why its agent has not enrolled (a kind, never a
    secret); `gave_up`: it will not try again (malformed user data, an agent that cannot start)."""

    hostname: str
    system_id: str
    user_data_sha256: str
    scenario_hostname: str | None = None
    api_url: str | None = None
    enrolled: bool = False
    held: bool = False
    gave_up: bool = False
    error: str | None = None
    config_pushes: int = 0
    unit_restarts: list[str] = field(default_factory=list)  # units the agent restarted, in order
    enrolled_at: float | None = None  # time.monotonic()
    machine_dir: Path | None = None
    address: str | None = None
    unit_argv: tuple[str, ...] = ()
    unit_env: tuple[tuple[str, str], ...] = ()
    restart_delay_s: float = 0.0
    agent_starts: int = 0
    agent_exit_codes: list[int] = field(default_factory=list)
    stopped: bool = False  # systemctl stop: not restarted
    no_restart_codes: frozenset[int] = frozenset()  # the unit's RestartPreventExitStatus
    _process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    _next_start: float = 0.0

    @property
    def root(self) -> Path | None:
        return self.machine_dir / "root" if self.machine_dir is not None else None

    @property
    def agent_running(self) -> bool:
        return self._process is not None and self._process.returncode is None


class FirstBootSimulator:
    """See the module docstring. `machines_dir`: where each machine's disk lives (one directory
    per system_id, sim/machine_image.py); `agent_command`: what /usr/bin/gpucloud-agent is on
    these machines (default: this environment's installed console script); `agent_env`: extra
    environment for every agent (e.g. GPUCLOUD_AGENT_HEARTBEAT_S); `max_restart_delay_s` caps
    the unit's RestartSec. `control_http`: the client for the MAAS simulator's control API (by
    default one is made and closed here). `max_running_agents`: at most this many agent
    processes at once (each is a Python process of about 60 MB): past it, the agents enrolled
    longest ago (and at least SHED_AFTER_ENROLLED_S ago) are stopped as `systemctl stop` would,
    so that one machine can play more deployed nodes than its memory holds agents (the
    500-node onboarding bench); their nodes then stop polling, as powered-down nodes do."""

    def __init__(
        self,
        maas_base_url: str,
        control_token: str,
        *,
        machines_dir: Path,
        poll_interval: float = 0.1,
        agent_command: Sequence[str] | None = None,
        agent_env: Mapping[str, str] | None = None,
        max_restart_delay_s: float = 2.0,
        control_http: httpx.AsyncClient | None = None,
        max_running_agents: int | None = None,
    ) -> None:
        self.maas_base_url = maas_base_url
        self.poll_interval = poll_interval
        self.machines_dir = Path(machines_dir).resolve()
        self.agent_command = tuple(agent_command or default_agent_command())
        self.agent_env = dict(agent_env or {})
        self.max_restart_delay_s = max_restart_delay_s
        self.max_running_agents = max_running_agents
        self.agents_shed = 0
        self.booted: dict[str, BootRecord] = {}  # hostname -> its latest boot
        self.polls = 0
        self._control_token = control_token
        self._control = control_http
        self._own_control = control_http is None
        self._boots: dict[str, BootRecord] = {}  # system_id -> the current deployment's boot
        self._held: set[str] = set()
        self._machines: list[dict[str, Any]] = []  # the last state poll
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._last_poll_error: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        self.machines_dir.mkdir(parents=True, exist_ok=True)
        if self._control is None:
            self._control = httpx.AsyncClient(
                base_url=control_base_url(self.maas_base_url),
                headers={"Authorization": f"Bearer {self._control_token}"},
                timeout=HTTP_TIMEOUT_S,
            )
        self._task = asyncio.create_task(self._run(), name="first-boot-simulator")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(self._stop_agent(r) for r in list(self._boots.values())))
        if self._own_control and self._control is not None:
            await self._control.aclose()
            self._control = None

    async def __aenter__(self) -> FirstBootSimulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
                self._last_poll_error = None
            except Exception as err:  # keep polling: MAAS may come (back) later
                kind = type(err).__name__
                if kind != self._last_poll_error:  # once per kind, not once per poll
                    logger.warning("cannot read the MAAS simulator's state (%s); retrying", kind)
                self._last_poll_error = kind
            await asyncio.sleep(self.poll_interval)

    # ------------------------------------------------------------------ control

    def hold(self, hostname: str) -> None:
        """The agent on `hostname` cannot reach the API: its network is down, so the agent is
        not running (until released)."""
        self._held.add(hostname)

    def release(self, hostname: str) -> None:
        """Undo `hold`: the agent starts on the next poll and enrolls (a late enrollment)."""
        self._held.discard(hostname)

    def is_held(self, hostname: str) -> bool:
        return hostname in self._held

    async def stop_agent(self, hostname: str) -> None:
        """`systemctl stop gpucloud-agent` on `hostname`: its agent stays stopped until
        `start_agent`, or until the machine is deployed afresh (a new OS starts its own)."""
        record = self.booted.get(hostname)
        if record is not None:
            record.stopped = True
            await self._stop_agent(record)

    def start_agent(self, hostname: str) -> None:
        record = self.booted.get(hostname)
        if record is not None:
            record.stopped = False

    async def wait_for(
        self, hostname: str, *, enrolled: bool = True, timeout: float = 10.0
    ) -> BootRecord:
        """The boot record of `hostname` once it exists (and, with enrolled=True, enrolled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.booted.get(hostname)
            if record is not None and (record.enrolled or not enrolled):
                return record
            await asyncio.sleep(0.02)
        raise TimeoutError(f"{hostname} did not {'enroll' if enrolled else 'boot'} in {timeout}s")

    # ------------------------------------------------------------------ the boot loop

    async def poll_once(self) -> None:
        """Read the simulator's state once and boot / supervise what is due. Raises httpx
        errors of the state read (the loop logs them)."""
        assert self._control is not None, "start() first"
        response = await self._control.get("/_sim/state")
        response.raise_for_status()
        machines = response.json().get("machines", [])
        async with self._lock:
            self._machines = [m for m in machines if isinstance(m, dict)]
            self.polls += 1
            deployed = set()
            for machine in self._machines:
                if machine.get("status_name") == DEPLOYED:
                    deployed.add(str(machine.get("system_id")))
                await self._observe(machine)
            for system_id in [s for s in self._boots if s not in deployed]:
                gone = self._boots.pop(system_id)  # powered off or released
                await self._stop_agent(gone)
                self._unlink_address(gone)
            await self._shed_agents()

    async def _shed_agents(self) -> None:
        """Past max_running_agents, stop the agents enrolled longest ago (class docstring)."""
        if self.max_running_agents is None:
            return
        running = [r for r in self._boots.values() if r.agent_running]
        excess = len(running) - self.max_running_agents
        if excess <= 0:
            return
        settled_before = time.monotonic() - SHED_AFTER_ENROLLED_S
        settled = sorted(
            (r for r in running if r.enrolled_at is not None and r.enrolled_at <= settled_before),
            key=lambda r: r.enrolled_at or 0.0,
        )
        for record in settled[:excess]:
            record.stopped = True  # not restarted, as after `systemctl stop`
            await self._stop_agent(record)
            self.agents_shed += 1
            logger.info("%s: agent stopped (more than %d running)", record.hostname,
                        self.max_running_agents)  # fmt: skip

    def machine_at(self, address: str) -> dict[str, Any] | None:
        """The snapshot (last poll) of the machine with this deployed IP address or hostname."""
        for machine in self._machines:
            if address in (machine.get("ip_addresses") or []) or address == machine.get("hostname"):
                return machine
        return None

    async def _observe(self, machine: Mapping[str, Any]) -> None:
        if machine.get("status_name") != DEPLOYED:
            return
        record = await self._record_for(machine)
        if record.gave_up:
            return
        try:
            await self._supervise(record)
        except (MalformedUserData, OSError) as err:  # this machine only; the loop goes on
            record.gave_up = True
            record.error = f"agent cannot start: {type(err).__name__}"
            logger.warning("%s: its agent cannot start (%s)", record.hostname, record.error)

    async def _record_for(self, machine: Mapping[str, Any]) -> BootRecord:
        """The current boot of a Deployed machine, booting it if its user data is new: a new
        deployment is a fresh disk, with the user data's files written on it."""
        system_id = str(machine.get("system_id"))
        user_data = machine.get("user_data_text")
        record = self._boots.get(system_id)
        digest = (
            hashlib.sha256(user_data.encode()).hexdigest() if isinstance(user_data, str) else ""
        )
        if record is not None and record.user_data_sha256 == digest:
            return record
        if record is not None:
            await self._stop_agent(record)
            self._unlink_address(record)
        hostname = str(machine.get("hostname"))
        addresses = [str(a) for a in machine.get("ip_addresses") or []]
        record = BootRecord(
            hostname=hostname,
            system_id=system_id,
            user_data_sha256=digest,
            scenario_hostname=machine.get("scenario_hostname"),
            machine_dir=self.machines_dir / system_id,
            address=addresses[0] if addresses else None,
        )
        self._boots[system_id] = record
        if not isinstance(user_data, str):
            record.error = "no user data: no agent config"
            self.booted[hostname] = record
            return record
        try:
            doc = parse_cloud_config(user_data)
            await asyncio.to_thread(self._install, record, doc)
        except (MalformedUserData, UnicodeDecodeError, OSError) as err:
            why = str(err) if isinstance(err, MalformedUserData) else type(err).__name__
            record.gave_up = True
            record.error = f"malformed user data: {why}"
            logger.warning("%s (%s) booted with malformed user data: %s", hostname, system_id, why)
        else:
            logger.info("%s (%s) booted from its user data", hostname, system_id)
        self.booted[hostname] = record
        return record

    def _install(self, record: BootRecord, doc: Mapping[str, Any]) -> None:
        """A fresh disk: the machine image, then cloud-init's write_files, then the agent unit
        read back as systemd would."""
        assert record.machine_dir is not None
        assert record.root is not None
        if record.machine_dir.exists():
            shutil.rmtree(record.machine_dir)
        build_machine(
            record.machine_dir,
            address=record.address or record.hostname,
            machine_key=record.system_id,
        )
        write_files(record.root, doc)
        agent_toml = record.root / AGENT_CONFIG_PATH.lstrip("/")
        config = parse_agent_toml(agent_toml.read_text()) if agent_toml.is_file() else None
        if config is None:
            raise MalformedUserData(f"write_files has no {AGENT_CONFIG_PATH}")
        record.api_url = config.api_url
        unit = record.root / AGENT_UNIT_PATH.lstrip("/")
        if not unit.is_file():
            raise MalformedUserData(f"write_files has no {AGENT_UNIT_PATH}")
        argv, env, restart_s, no_restart = parse_unit(unit.read_text())
        if PurePosixPath(argv[0]).name != AGENT_EXECUTABLE:
            raise MalformedUserData(f"the agent unit runs {argv[0]}, not {AGENT_EXECUTABLE}")
        record.unit_argv, record.unit_env = tuple(argv), tuple(env.items())
        record.no_restart_codes = no_restart
        record.restart_delay_s = min(restart_s, self.max_restart_delay_s)
        if self.machines_dir not in record.machine_dir.parents:
            raise MalformedUserData("machine directory escapes the machines directory")
        address_link = self.machines_dir / "by-address"
        address_link.mkdir(exist_ok=True)
        if record.address:
            link = address_link / record.address
            link.unlink(missing_ok=True)
            link.symlink_to(record.machine_dir)

    def _unlink_address(self, record: BootRecord) -> None:
        """SSH to a machine that is no longer deployed at its address finds nothing there."""
        if record.address is None or record.machine_dir is None:
            return
        link = self.machines_dir / "by-address" / record.address
        with contextlib.suppress(OSError):
            if link.is_symlink() and Path(os.readlink(link)) == record.machine_dir:
                link.unlink()

    def _held_record(self, record: BootRecord) -> bool:
        return record.hostname in self._held or (
            record.scenario_hostname is not None and record.scenario_hostname in self._held
        )

    def _agent_argv(self, record: BootRecord) -> list[str]:
        """The unit's ExecStart with this environment's agent as /usr/bin/gpucloud-agent (the
        unit was checked to run gpucloud-agent when the machine booted)."""
        return [*self.agent_command, *record.unit_argv[1:]]

    async def _take_restart(self, record: BootRecord) -> None:
        """`systemctl restart gpucloud-agent` that an SSH push asked for (the restart marker in
        the machine's directory): the agent stops now and starts again with the new config."""
        marker = record.machine_dir / RESTART_MARKER if record.machine_dir else None
        if marker is None or not marker.exists():
            return
        marker.unlink()
        record.config_pushes += 1
        await self._stop_agent(record)
        record._next_start = 0.0

    async def _take_unit_restarts(self, record: BootRecord) -> None:
        """The unit restarts the agent asked for, carried out as systemd would: the
        hardware-sync timer's restart makes its service post to MAAS (only with the credentials
        file in place: the service's ConditionPathExists). A request is removed once done."""
        assert record.root is not None
        requests = record.root / str(UNIT_RESTART_REQUESTS_DIR).lstrip("/")
        if not requests.is_dir():
            return
        hw_sync = HwSyncConfig()
        for request in sorted(p for p in requests.iterdir() if p.is_file()):
            unit = request.name
            creds = record.root / hw_sync.credentials.lstrip("/")
            if unit == PurePosixPath(hw_sync.timer_unit).name and creds.is_file():
                assert self._control is not None
                response = await self._control.post(
                    f"/_sim/machines/{quote(record.system_id)}/hw-sync-timer",
                    json={"running": True},
                )
                response.raise_for_status()
            request.unlink(missing_ok=True)
            record.unit_restarts.append(unit)
            logger.info("%s: restarted %s", record.hostname, unit)

    async def _supervise(self, record: BootRecord) -> None:
        """systemd's part: keep the unit's command running (Restart=always, RestartSec), pick
        up a restart an SSH push asked for, and notice enrollment (the identity file)."""
        if not record.unit_argv or record.root is None or record.stopped:
            return
        await self._take_restart(record)
        await self._take_unit_restarts(record)
        if self._held_record(record):
            if not record.held:
                logger.info("%s is held: its agent cannot reach the API", record.hostname)
                await self._stop_agent(record)
            record.held = True
            record.error = "held: the agent cannot reach the API"
            return
        if record.held:
            record.held, record.error = False, None
        process = record._process
        if process is not None and process.returncode is not None:
            record.agent_exit_codes.append(process.returncode)
            record._process = None
            record.error = f"agent exited {process.returncode}"
            record._next_start = time.monotonic() + record.restart_delay_s
            if process.returncode in record.no_restart_codes:
                record._next_start = float("inf")  # stays failed until a config push
                record.error += " (not restarted: RestartPreventExitStatus)"
            logger.info("%s: the agent exited %d", record.hostname, process.returncode)
        if record._process is None and time.monotonic() >= record._next_start:
            await self._start_agent(record)
        identity = record.root / IDENTITY_PATH.lstrip("/")
        if not record.enrolled and identity.is_file():
            record.enrolled, record.error = True, None
            record.enrolled_at = time.monotonic()
            logger.info("%s enrolled", record.hostname)

    async def _start_agent(self, record: BootRecord) -> None:
        assert record.root is not None
        assert record.machine_dir is not None
        env = {**os.environ, **dict(record.unit_env), **self.agent_env}
        env[ROOT_ENV] = str(record.root)
        # The machine's own environment, not the simulator's: no inherited overrides.
        for name in ("GPUCLOUD_CODEC_KEY", "GPUCLOUD_TEMPORAL_ADDRESS", "GPUCLOUD_AGENT_CONFIG"):
            if name not in dict(record.unit_env) and name not in self.agent_env:
                env.pop(name, None)
        log = (record.machine_dir / "agent.log").open("ab")
        try:
            record._process = await asyncio.create_subprocess_exec(
                *self._agent_argv(record),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        record.agent_starts += 1
        logger.info("%s: started its agent (pid %d)", record.hostname, record._process.pid)

    async def _stop_agent(self, record: BootRecord) -> None:
        process, record._process = record._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), AGENT_STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def restart_requested(self, address: str) -> None:
        """An SSH push left a restart marker on the machine at `address`: act on it now rather
        than at the next poll (the same marker `python -m sim.first_boot` picks up)."""
        async with self._lock:
            for record in self._boots.values():
                if record.address == address:
                    await self._supervise(record)

    async def _deployed_machine_at(self, address: str) -> dict[str, Any]:
        machine = self.machine_at(address)
        if machine is None or machine.get("status_name") != DEPLOYED:
            await self.poll_once()  # the last poll may predate the deployment
            machine = self.machine_at(address)
        if machine is None or machine.get("status_name") != DEPLOYED:
            raise ClassifiedError(
                f"SSH to {address}: no deployed host answers there",
                failure_class=FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
            )
        return machine

    async def host_at(self, address: str) -> dict[str, Any]:
        """The deployed machine at `address` (its last snapshot); ClassifiedError if none."""
        return await self._deployed_machine_at(address)


def write_host_file(root: Path, path: str, content: str, mode: int) -> None:
    """What the SSH seeder's root script does on the machine's disk: write a temporary file
    with its mode, then rename it into place."""
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(content)
    tmp.chmod(mode)
    tmp.replace(target)


# ---------------------------------------------------------------------- BMC and SSH stand-ins


class SimulatedBmc:
    """`BmcPowerControl` against the MAAS simulator's BMCs (GET /_sim/bmc/{address} for the
    chassis status, POST /_sim/bmc/{address}/power-cycle). No BMC at the address:
    bmc_power_failure, like an IPMI session that cannot be opened."""

    def __init__(
        self,
        maas_base_url: str,
        control_token: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._base_url = control_base_url(maas_base_url)
        self._control_token = control_token
        self._transport = transport
        self.cycles: list[tuple[str, str]] = []  # (address, "enlisting" | "booted")

    async def power_status(self, login: BmcLogin) -> str:
        response = await self._call(login, "GET", f"/_sim/bmc/{quote(login.address, safe='')}")
        return str(response.json().get("power", "unknown"))

    async def power_cycle(self, login: BmcLogin) -> None:
        path = f"/_sim/bmc/{quote(login.address, safe='')}/power-cycle"
        response = await self._call(login, "POST", path)
        result = str(response.json().get("result", ""))
        self.cycles.append((login.address, result))
        logger.info("BMC %s power-cycled (%s)", login.address, result)

    async def _call(self, login: BmcLogin, method: str, path: str) -> httpx.Response:
        try:
            async with httpx.AsyncClient(
                base_url=self._base_url,
                headers={"Authorization": f"Bearer {self._control_token}"},
                timeout=HTTP_TIMEOUT_S,
                transport=self._transport,
            ) as client:
                if method == "GET":
                    response = await client.get(path)
                else:
                    response = await client.post(path, json={})
        except httpx.HTTPError as err:
            raise ClassifiedError(
                f"BMC {login.address}: the simulated BMC network is unreachable "
                f"({type(err).__name__})",
                failure_class=FailureClass.BMC_POWER_FAILURE,
            ) from None
        if response.status_code == 404:
            raise ClassifiedError(
                f"BMC {login.address}: no BMC answers at this address",
                failure_class=FailureClass.BMC_POWER_FAILURE,
            )
        if response.status_code == 401:
            raise ClassifiedError(
                "the MAAS simulator refused the control token (GPUCLOUD_SIM_MAAS_CONTROL_TOKEN)",
                failure_class=FailureClass.INPUT_CONFIG_ERROR,
            )
        if response.status_code != 200:
            raise ClassifiedError(
                f"BMC {login.address}: {method} {path} failed (HTTP {response.status_code})",
                failure_class=FailureClass.BMC_POWER_FAILURE,
            )
        return response


class SimulatedHostSeeder:
    """`HostSeeder` without SSH, writing on the simulated machines' disks instead. An address
    must belong to a deployed machine (else post_deploy_connectivity_failure, as SSH to it would
    fail): with a `first_boot` simulator in this process it asks it; otherwise it finds the
    machine's disk under `machines_dir/by-address/` (where `python -m sim.first_boot` keeps
    them). A pushed agent config is written there and the agent restarted, as
    `systemctl restart gpucloud-agent` over SSH would: the agent then enrolls itself."""

    def __init__(
        self,
        first_boot: FirstBootSimulator | None = None,
        *,
        machines_dir: Path | None = None,
    ) -> None:
        self.first_boot = first_boot
        self.machines_dir = (
            first_boot.machines_dir if first_boot is not None else machines_dir
        ) or DEFAULT_MACHINES_DIR
        self.seeds: list[tuple[str, int]] = []  # (address, interval_minutes) per call
        self.agent_config_pushes = 0
        self._unreachable: set[str] = set()

    def fail_ssh(self, address: str) -> None:
        """SSH to `address` fails from now on (post_deploy_connectivity_failure)."""
        self._unreachable.add(address)

    def restore_ssh(self, address: str) -> None:
        self._unreachable.discard(address)

    def _connect(self, login: SshLogin) -> Path:
        """The disk of the machine at the login's address."""
        if login.address in self._unreachable:
            raise ClassifiedError(
                f"SSH to {login.user}@{login.address}:{login.port}: cannot connect "
                "(ConnectionRefusedError)",
                failure_class=FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
            )
        machine = self.machines_dir / "by-address" / login.address
        if not (machine / "root").is_dir():
            raise ClassifiedError(
                f"SSH to {login.user}@{login.address}:{login.port}: no host answers there",
                failure_class=FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
            )
        return machine

    async def _machine(self, login: SshLogin) -> Path:
        """The disk of the deployed machine at the login's address (ClassifiedError else)."""
        self._connect(login)  # an address made unreachable fails first, as SSH would
        if self.first_boot is not None:
            await self.first_boot.host_at(login.address)
        return self._connect(login)

    async def seed_hardware_sync(
        self, login: SshLogin, *, creds_yaml: str, interval_minutes: int
    ) -> None:
        """The files the real seeder writes (activities/onboarding/ssh_seeder.py), on the disk;
        systemd's restart of the units has nothing to run here."""
        low, high = INTERVAL_RANGE_MINUTES
        if not low <= interval_minutes <= high:
            raise ClassifiedError(
                f"interval_minutes must be within {low}..{high}",
                failure_class=FailureClass.INPUT_CONFIG_ERROR,
            )
        if not creds_yaml.strip():
            raise ClassifiedError(
                "the MAAS machine credentials are empty",
                failure_class=FailureClass.INPUT_CONFIG_ERROR,
            )
        root = await self._machine(login) / "root"
        cfg = HwSyncConfig()
        write_host_file(root, cfg.credentials, creds_yaml, 0o600)
        write_host_file(root, cfg.service_unit, render_hw_sync_service(cfg), 0o644)
        write_host_file(root, cfg.timer_unit, render_hw_sync_timer(cfg, interval_minutes), 0o644)
        self.seeds.append((login.address, interval_minutes))

    async def push_agent_config(self, login: SshLogin, *, agent_toml: str) -> None:
        """agent.toml rewritten on the disk, then `systemctl restart gpucloud-agent`: a restart
        marker the simulator acts on (at once when it runs in this process)."""
        try:
            parse_agent_toml(agent_toml)
        except MalformedUserData as err:
            raise ClassifiedError(
                f"the agent config is invalid: {err}",
                failure_class=FailureClass.INPUT_CONFIG_ERROR,
            ) from None
        machine = await self._machine(login)
        write_host_file(machine / "root", AGENT_CONFIG_PATH, agent_toml, 0o600)
        (machine / RESTART_MARKER).touch()
        if self.first_boot is not None:
            await self.first_boot.restart_requested(login.address)
        self.agent_config_pushes += 1
        logger.info("agent config pushed to %s; its agent restarts", login.address)


# ---------------------------------------------------------------------- python -m sim.first_boot


def _read_token(args: argparse.Namespace) -> str | None:
    if args.control_token:
        return str(args.control_token)
    if args.control_token_file:
        return Path(args.control_token_file).read_text().strip() or None
    return os.environ.get("GPUCLOUD_SIM_MAAS_CONTROL_TOKEN") or None


async def _serve(simulator: FirstBootSimulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with simulator:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    enable_crash_traces()
    parser = argparse.ArgumentParser(
        prog="python -m sim.first_boot",
        description="Boot what the MAAS simulator deploys: each deployed node's agent enrolls.",
    )
    parser.add_argument("--maas-url", required=True, help="e.g. http://127.0.0.1:5240/MAAS")
    parser.add_argument("--control-token", help="the MAAS simulator's /_sim/ bearer token")
    parser.add_argument("--control-token-file", type=Path, help="the same, from a file")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds (%(default)s)")
    parser.add_argument(
        "--machines-dir",
        type=Path,
        default=DEFAULT_MACHINES_DIR,
        help="each machine's disk, one directory per system_id (default: %(default)s)",
    )
    parser.add_argument(
        "--max-running-agents",
        type=int,
        default=int(os.environ.get(MAX_RUNNING_AGENTS_ENV) or 0) or None,
        help=f"stop the longest-enrolled agents past this many (also {MAX_RUNNING_AGENTS_ENV})",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    if args.poll_interval <= 0:
        parser.error("--poll-interval must be positive")
    try:
        token = _read_token(args)
    except OSError as err:
        parser.error(f"cannot read --control-token-file: {type(err).__name__}")
    if token is None:
        parser.error(
            "the MAAS simulator's control token is required: --control-token, "
            "--control-token-file or GPUCLOUD_SIM_MAAS_CONTROL_TOKEN"
        )
    simulator = FirstBootSimulator(
        args.maas_url,
        token,
        machines_dir=args.machines_dir,
        poll_interval=args.poll_interval,
        max_running_agents=args.max_running_agents,
    )
    print(f"sim.first_boot: booting what {args.maas_url} deploys (poll every "
          f"{args.poll_interval:g}s)", flush=True)  # fmt: skip
    asyncio.run(_serve(simulator))
    return 0


if __name__ == "__main__":
    sys.exit(main())
