"""`IpmitoolBmc`: power-cycles a machine through its BMC with `ipmitool` (IPMI 2.0, lanplus), so
it PXE-boots and MAAS discovers or enlists it (docs/lifecycles/onboarding.md#stages
CreateOrFindInMaas: MAAS never talks to a BMC it does not know, so discovery starts with an
out-of-band power cycle).

Why ipmitool and not a Python IPMI library: it is what every site already has and trusts for its
BMCs (cipher suites, vendor quirks), and its failure output is what operators know.

Rules:

- The password travels only in the child's environment (`IPMI_PASSWORD`, read by `-E`), never in
  argv: argv is world-readable in /proc and shows up in `ps` and process accounting.
- Every call is bounded (`timeout_s`); a call that overruns is killed and reported.
- `chassis power status` first: a chassis that is off gets `power on` (most BMCs refuse `power
  cycle` on an off chassis), one that is on gets `power cycle`. If the state changes between the
  two calls and the BMC answers "not supported in present state", `power on` is tried once.
- Failures are `ClassifiedError`s: no ipmitool on this worker is `site_capability_missing` (an
  operator installs it, nothing to retry); a non-zero exit or a timeout is `bmc_power_failure`
  (bounded retry, then manual intervention) with ipmitool's stderr sanitised and truncated. An
  address or user that cannot be a BMC login is `input_config_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
from collections.abc import Mapping

from activities.onboarding.host_access import BmcLogin
from core.failures import ClassifiedError, FailureClass
from core.redaction import redact

logger = logging.getLogger("activities.onboarding.ipmi")

DEFAULT_TIMEOUT_S = 30.0
MAX_STDERR_CHARS = 200
_ADDRESS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:%-]{0,252}$")  # IPv4, IPv6 or a DNS name
_USER = re.compile(r"^[\x21-\x7e]{1,64}$")
_NOT_IN_PRESENT_STATE = "not supported in present state"


class IpmitoolBmc:
    """`BmcPowerControl` through the `ipmitool` binary.

    `executable`: the name (looked up on PATH) or the path of ipmitool. `env`: the environment
    the child starts from (default: this process's, read at call time); `IPMI_PASSWORD` is added
    per call and nothing else from the login is put anywhere else."""

    def __init__(
        self,
        *,
        executable: str = "ipmitool",
        interface: str = "lanplus",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._executable = executable
        self._interface = interface
        self._timeout_s = timeout_s
        self._env = env

    async def power_status(self, login: BmcLogin) -> str:
        """`chassis power status`: "on", "off", or "unknown" for an answer that says neither."""
        _check_login(login)
        status = await self._run(login, "chassis", "power", "status")
        found = re.search(r"\bis (on|off)\b", status, re.IGNORECASE)
        return found.group(1).lower() if found else "unknown"

    async def power_cycle(self, login: BmcLogin) -> None:
        if await self.power_status(login) == "off":
            logger.info("BMC %s: chassis is off, powering on", login.address)
            await self._run(login, "chassis", "power", "on")
            return
        try:
            await self._run(login, "chassis", "power", "cycle")
        except _IpmitoolFailed as err:
            if _NOT_IN_PRESENT_STATE not in err.stderr.lower():
                raise
            logger.info("BMC %s refused a cycle in its present state, powering on", login.address)
            await self._run(login, "chassis", "power", "on")
        logger.info("BMC %s: power cycle sent", login.address)

    async def _run(self, login: BmcLogin, *command: str) -> str:
        """Run one ipmitool command; its stdout. Raises ClassifiedError."""
        base_env = dict(os.environ if self._env is None else self._env)
        program = shutil.which(self._executable, path=base_env.get("PATH"))
        if program is None:
            raise ClassifiedError(
                f"ipmitool ({self._executable}) is not installed on this worker",
                failure_class=FailureClass.SITE_CAPABILITY_MISSING,
            )
        argv = [
            program,
            "-I", self._interface,
            "-H", login.address,
            "-U", login.user,
            "-E",  # the password from IPMI_PASSWORD, never from argv
            *command,
        ]  # fmt: skip
        what = " ".join(command)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**base_env, "IPMI_PASSWORD": login.password},
                start_new_session=True,  # its own process group: a kill reaches any helper too
            )
        except FileNotFoundError:
            raise ClassifiedError(
                f"ipmitool ({self._executable}) is not installed on this worker",
                failure_class=FailureClass.SITE_CAPABILITY_MISSING,
            ) from None
        except OSError as err:
            raise ClassifiedError(
                f"ipmitool could not be started ({type(err).__name__})",
                failure_class=FailureClass.SITE_CAPABILITY_MISSING,
            ) from None
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), self._timeout_s)
        except TimeoutError:
            raise ClassifiedError(
                f"BMC {login.address}: `{what}` did not answer within {self._timeout_s:g}s",
                failure_class=FailureClass.BMC_POWER_FAILURE,
            ) from None
        finally:
            if process.returncode is None:  # timed out or cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await process.wait()
        if process.returncode != 0:
            detail = _safe(stderr.decode(errors="replace"), login)
            raise _IpmitoolFailed(
                f"BMC {login.address}: `{what}` failed (exit {process.returncode})"
                + (f": {detail}" if detail else ""),
                stderr=detail,
            )
        return stdout.decode(errors="replace")


class _IpmitoolFailed(ClassifiedError):
    failure_class = FailureClass.BMC_POWER_FAILURE

    def __init__(self, message: str, *, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


def _check_login(login: BmcLogin) -> None:
    # Values are never echoed: the address is not secret but a bad one may be anything.
    if not _ADDRESS.fullmatch(login.address):
        raise ClassifiedError(
            "the BMC address is not an IP address or host name",
            failure_class=FailureClass.INPUT_CONFIG_ERROR,
        )
    if not _USER.fullmatch(login.user):
        raise ClassifiedError(
            "the BMC user must be 1..64 printable characters without spaces",
            failure_class=FailureClass.INPUT_CONFIG_ERROR,
        )
    if not login.password or "\x00" in login.password:
        raise ClassifiedError(
            "the BMC password is empty or malformed",
            failure_class=FailureClass.INPUT_CONFIG_ERROR,
        )


def _safe(text: str, login: BmcLogin) -> str:
    """ipmitool's stderr, fit for Temporal history: the password removed even if a BMC echoed
    it, secret-looking text redacted, one line, truncated."""
    text = text.replace(login.password, "[redacted]")
    return redact(" ".join(text.split()), limit=MAX_STDERR_CHARS)
