"""The simulated deployed OS: what happens on a node after MAAS deploys it, for the embedded
default and the tests. The MAAS simulator (sim/maas) stops at "Deployed" with the user data it
was given; real hardware would then boot, run cloud-init and start our node agent, which enrolls
with the gateway (seed 003 §4.3 WaitForAgentEnrollment, §9). This module plays that part, and
answers the calls onboarding makes outside MAAS's API (activities/onboarding/host_access.py):

- `FirstBootSimulator` polls the MAAS simulator's control API (GET /_sim/state). Each machine
  that is Deployed with user data it has not booted yet (key: system_id and the sha256 of the
  user data) "boots": the #cloud-config is parsed, /etc/gpucloud/agent.toml taken from its
  write_files (as `agent.enrollment.AgentConfig.load` reads it), and the enrollment is POSTed
  to the config's api_url, exactly as the agent does (`agent.enrollment.ENROLL_PATH`). A
  machine that leaves Deployed is forgotten, so every deployment boots afresh.
  `hold(hostname)` makes a machine's agent unable to reach the API (it never enrolls);
  `release(hostname)` lets it enroll on the next poll (a late enrollment). Malformed user data
  is recorded and logged, never fatal; an API that does not answer (or answers 5xx) is retried
  on every poll, since the gateway may start after this simulator.
- `SimulatedBmc` power-cycles through POST /_sim/bmc/{address}/power-cycle: an unknown machine
  PXE-boots and enlists as New, as with `ipmitool chassis power cycle`. The BMC login is not
  checked (the simulator's BMCs accept any).
- `SimulatedHostSeeder` stands for SSH to the deployed host: seeds are recorded, an address can
  be made unreachable (`fail_ssh`), and a pushed agent config makes the "restarted agent"
  enroll with its token (through the linked `FirstBootSimulator` when there is one, so a held
  machine stays unenrolled).

Only the JSON-bodied #cloud-config that activities/cloud_init.py renders is understood (JSON is
YAML 1.2, which real cloud-init reads); anything else counts as malformed here.

Nothing here logs or records a token or user-data content: records carry hostnames, statuses
and error kinds only.

    python -m sim.first_boot --maas-url http://127.0.0.1:5240/MAAS \\
        --control-token-file .state/maas-control-token [--poll-interval 0.5]

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
import signal
import sys
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from activities.onboarding.host_access import BmcLogin, SshLogin
from agent.enrollment import DEFAULT_CONFIG_PATH, ENROLL_PATH
from core.failures import ClassifiedError, FailureClass

logger = logging.getLogger("sim.first_boot")

AGENT_CONFIG_PATH = str(DEFAULT_CONFIG_PATH)
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


def agent_config_from_user_data(user_data: str) -> AgentToml:
    """The agent config cloud-init would write, from a #cloud-config with a JSON body."""
    header, _, body = user_data.partition("\n")
    if header.strip() != "#cloud-config":
        raise MalformedUserData("not a #cloud-config document")
    try:
        doc = json.loads(body)
    except ValueError:
        raise MalformedUserData("the #cloud-config body is not JSON") from None
    files = doc.get("write_files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        raise MalformedUserData("no write_files")
    for entry in files:
        if isinstance(entry, dict) and entry.get("path") == AGENT_CONFIG_PATH:
            content = entry.get("content")
            if not isinstance(content, str):
                raise MalformedUserData(f"{AGENT_CONFIG_PATH} has no content")
            if entry.get("encoding") in ("b64", "base64"):
                try:
                    content = base64.b64decode(content).decode()
                except ValueError:
                    raise MalformedUserData(f"{AGENT_CONFIG_PATH} is not valid base64") from None
            return parse_agent_toml(content)
    raise MalformedUserData(f"write_files has no {AGENT_CONFIG_PATH}")


@dataclass
class BootRecord:
    """One boot of one deployment. `error` says why it has not enrolled (a kind, never a
    secret); `gave_up`: it will not try again (malformed user data, enrollment refused)."""

    hostname: str
    system_id: str
    user_data_sha256: str
    scenario_hostname: str | None = None
    api_url: str | None = None
    enrolled: bool = False
    http_status: int | None = None
    attempts: int = 0
    held: bool = False
    gave_up: bool = False
    error: str | None = None
    config_pushes: int = 0
    enrolled_at: float | None = None  # time.monotonic()
    _token: str | None = field(default=None, repr=False)


async def post_enrollment(
    http: httpx.AsyncClient, api_url: str, token: str, agent_version: str
) -> httpx.Response:
    """What `agent.enrollment.ensure_enrolled` sends. Raises httpx.HTTPError."""
    return await http.post(
        f"{api_url}{ENROLL_PATH}",
        json={"enrollment_token": token, "agent_version": agent_version},
        timeout=HTTP_TIMEOUT_S,
    )


def _error_code(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(response.json()["error"]["code"])
    return "unknown"


class FirstBootSimulator:
    """See the module docstring. `http`: the client enrollments go through (absolute URLs, so
    any base_url is ignored; tests pass one on an ASGI transport); by default one is made and
    closed here. `control_http`: the same for the MAAS simulator's control API."""

    def __init__(
        self,
        maas_base_url: str,
        control_token: str,
        *,
        poll_interval: float = 0.1,
        agent_version: str = "sim-first-boot",
        http: httpx.AsyncClient | None = None,
        control_http: httpx.AsyncClient | None = None,
    ) -> None:
        self.maas_base_url = maas_base_url
        self.poll_interval = poll_interval
        self.agent_version = agent_version
        self.booted: dict[str, BootRecord] = {}  # hostname -> its latest boot
        self.polls = 0
        self._control_token = control_token
        self._http = http
        self._own_http = http is None
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
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)
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
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None
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
        """The agent on `hostname` cannot reach the API: it never enrolls (until released)."""
        self._held.add(hostname)

    def release(self, hostname: str) -> None:
        """Undo `hold`: the agent enrolls on the next poll (a late enrollment)."""
        self._held.discard(hostname)

    def is_held(self, hostname: str) -> bool:
        return hostname in self._held

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
        """Read the simulator's state once and boot / enroll what is due. Raises httpx errors
        of the state read (the loop logs them)."""
        assert self._control is not None, "start() first"
        response = await self._control.get("/_sim/state")
        response.raise_for_status()
        machines = response.json().get("machines", [])
        async with self._lock:
            self._machines = [m for m in machines if isinstance(m, dict)]
            self.polls += 1
            for machine in self._machines:
                await self._observe(machine)

    def machine_at(self, address: str) -> dict[str, Any] | None:
        """The snapshot (last poll) of the machine with this deployed IP address or hostname."""
        for machine in self._machines:
            if address in (machine.get("ip_addresses") or []) or address == machine.get("hostname"):
                return machine
        return None

    async def _observe(self, machine: Mapping[str, Any]) -> None:
        system_id = str(machine.get("system_id"))
        if machine.get("status_name") != DEPLOYED:
            self._boots.pop(system_id, None)  # the next deployment boots afresh
            return
        record = self._record_for(machine)
        if not (record.enrolled or record.gave_up):
            await self._try_enroll(record)

    def _record_for(self, machine: Mapping[str, Any]) -> BootRecord:
        """The current boot of a Deployed machine, booting it if its user data is new. A
        machine deployed without user data boots with no agent config (nothing to enroll with
        until one is pushed)."""
        system_id = str(machine.get("system_id"))
        user_data = machine.get("user_data_text")
        record = self._boots.get(system_id)
        if not isinstance(user_data, str):
            if record is None:
                record = BootRecord(
                    hostname=str(machine.get("hostname")),
                    system_id=system_id,
                    user_data_sha256="",
                    scenario_hostname=machine.get("scenario_hostname"),
                    error="no user data: no agent config",
                )
                self._boots[system_id] = record
                self.booted[record.hostname] = record
            return record
        digest = hashlib.sha256(user_data.encode()).hexdigest()
        if record is not None and record.user_data_sha256 == digest:
            return record
        hostname = str(machine.get("hostname"))
        record = BootRecord(
            hostname=hostname,
            system_id=system_id,
            user_data_sha256=digest,
            scenario_hostname=machine.get("scenario_hostname"),
        )
        try:
            config = agent_config_from_user_data(user_data)
        except MalformedUserData as err:
            record.gave_up = True
            record.error = f"malformed user data: {err}"
            logger.warning("%s (%s) booted with malformed user data: %s", hostname, system_id, err)
        else:
            record.api_url, record._token = config.api_url, config.enrollment_token
            logger.info("%s (%s) booted; its agent enrolls at %s", hostname, system_id,
                        config.api_url)  # fmt: skip
        self._boots[system_id] = record
        self.booted[hostname] = record
        return record

    def _held_record(self, record: BootRecord) -> bool:
        return record.hostname in self._held or (
            record.scenario_hostname is not None and record.scenario_hostname in self._held
        )

    async def _try_enroll(self, record: BootRecord) -> None:
        if record._token is None or record.api_url is None:
            return
        if self._held_record(record):
            if not record.held:
                logger.info("%s is held: its agent cannot reach the API", record.hostname)
            record.held = True
            record.error = "held: the agent cannot reach the API"
            return
        record.held = False
        record.attempts += 1
        assert self._http is not None, "start() first"
        try:
            response = await post_enrollment(
                self._http, record.api_url, record._token, self.agent_version
            )
        except httpx.HTTPError as err:
            if record.error != f"API unreachable ({type(err).__name__})":
                logger.info("%s: the API at %s is not reachable (%s); retrying",
                            record.hostname, record.api_url, type(err).__name__)  # fmt: skip
            record.error = f"API unreachable ({type(err).__name__})"
            return
        record.http_status = response.status_code
        if response.status_code == 200:
            record.enrolled, record.error = True, None
            record.enrolled_at = time.monotonic()
            record._token = None  # single-use, and nothing keeps it after enrollment
            logger.info("%s enrolled", record.hostname)
        elif response.status_code >= 500 or response.status_code == 429:
            record.error = f"API answered {response.status_code}"
        else:
            record.gave_up = True
            record.error = f"enrollment refused ({response.status_code} {_error_code(response)})"
            logger.warning("%s: %s", record.hostname, record.error)

    async def agent_config_pushed(self, address: str, agent_toml: str) -> BootRecord:
        """A new agent.toml was written on the host at `address` and the agent restarted
        (`SimulatedHostSeeder.push_agent_config`): unless the machine is held, it enrolls now
        with that token; an agent that already enrolled keeps its identity and does nothing.
        Raises ClassifiedError (post_deploy_connectivity_failure) when no deployed host is at
        `address`, MalformedUserData for a bad config."""
        config = parse_agent_toml(agent_toml)
        machine = await self._deployed_machine_at(address)
        async with self._lock:
            record = self._record_for(machine)
            record.config_pushes += 1
            if record.enrolled:
                return record
            record.api_url, record._token = config.api_url, config.enrollment_token
            record.gave_up, record.error = False, None
            await self._try_enroll(record)
            return record

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


# ---------------------------------------------------------------------- BMC and SSH stand-ins


class SimulatedBmc:
    """`BmcPowerControl` against the MAAS simulator's BMCs (POST /_sim/bmc/{address}/power-cycle).
    No BMC at the address: bmc_power_failure, like an IPMI session that cannot be opened."""

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

    async def power_cycle(self, login: BmcLogin) -> None:
        path = f"/_sim/bmc/{quote(login.address, safe='')}/power-cycle"
        try:
            async with httpx.AsyncClient(
                base_url=self._base_url,
                headers={"Authorization": f"Bearer {self._control_token}"},
                timeout=HTTP_TIMEOUT_S,
                transport=self._transport,
            ) as client:
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
                f"BMC {login.address}: power cycle failed (HTTP {response.status_code})",
                failure_class=FailureClass.BMC_POWER_FAILURE,
            )
        result = str(response.json().get("result", ""))
        self.cycles.append((login.address, result))
        logger.info("BMC %s power-cycled (%s)", login.address, result)


class SimulatedHostSeeder:
    """`HostSeeder` without SSH. With a `first_boot` simulator an address must belong to a
    Deployed machine (else post_deploy_connectivity_failure, as SSH to it would fail) and a
    pushed agent config goes through it (a held machine stays unenrolled); without one every
    address answers and a pushed config enrolls directly (`http`, or a client per call)."""

    def __init__(
        self,
        first_boot: FirstBootSimulator | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        agent_version: str = "sim-first-boot",
    ) -> None:
        self.first_boot = first_boot
        self.seeds: list[tuple[str, int]] = []  # (address, interval_minutes) per call
        self.agent_config_pushes = 0
        self._http = http
        self._agent_version = agent_version
        self._unreachable: set[str] = set()

    def fail_ssh(self, address: str) -> None:
        """SSH to `address` fails from now on (post_deploy_connectivity_failure)."""
        self._unreachable.add(address)

    def restore_ssh(self, address: str) -> None:
        self._unreachable.discard(address)

    def _connect(self, login: SshLogin) -> None:
        if login.address in self._unreachable:
            raise ClassifiedError(
                f"SSH to {login.user}@{login.address}:{login.port}: cannot connect "
                "(ConnectionRefusedError)",
                failure_class=FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
            )

    async def seed_hardware_sync(
        self, login: SshLogin, *, creds_yaml: str, interval_minutes: int
    ) -> None:
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
        self._connect(login)
        if self.first_boot is not None:
            await self.first_boot.host_at(login.address)
        self.seeds.append((login.address, interval_minutes))

    async def push_agent_config(self, login: SshLogin, *, agent_toml: str) -> None:
        try:
            config = parse_agent_toml(agent_toml)
        except MalformedUserData as err:
            raise ClassifiedError(
                f"the agent config is invalid: {err}",
                failure_class=FailureClass.INPUT_CONFIG_ERROR,
            ) from None
        self._connect(login)
        if self.first_boot is not None:
            await self.first_boot.agent_config_pushed(login.address, agent_toml)
            self.agent_config_pushes += 1
            return
        self.agent_config_pushes += 1
        # The restarted agent enrolls; whether it succeeds is for the workflow to observe
        # (nodes.enrolled_at), not an error of the push.
        http = self._http or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)
        try:
            response = await post_enrollment(
                http, config.api_url, config.enrollment_token, self._agent_version
            )
            if response.status_code == 200:
                logger.info("the agent at %s enrolled after the config push", login.address)
            else:
                logger.warning("the agent at %s was refused (%d %s)", login.address,
                               response.status_code, _error_code(response))  # fmt: skip
        except httpx.HTTPError as err:
            logger.warning("the agent at %s cannot reach the API (%s)", login.address,
                           type(err).__name__)  # fmt: skip
        finally:
            if self._http is None:
                await http.aclose()


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
    parser = argparse.ArgumentParser(
        prog="python -m sim.first_boot",
        description="Boot what the MAAS simulator deploys: each deployed node's agent enrolls.",
    )
    parser.add_argument("--maas-url", required=True, help="e.g. http://127.0.0.1:5240/MAAS")
    parser.add_argument("--control-token", help="the MAAS simulator's /_sim/ bearer token")
    parser.add_argument("--control-token-file", type=Path, help="the same, from a file")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds (%(default)s)")
    parser.add_argument("--agent-version", default="sim-first-boot")
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
        args.maas_url, token, poll_interval=args.poll_interval, agent_version=args.agent_version
    )
    print(f"sim.first_boot: booting what {args.maas_url} deploys (poll every "
          f"{args.poll_interval:g}s)", flush=True)  # fmt: skip
    asyncio.run(_serve(simulator))
    return 0


if __name__ == "__main__":
    sys.exit(main())
