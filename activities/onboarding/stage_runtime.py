"""What every onboarding stage activity shares: its dependencies, the MAAS client for the site
(token read from Vault per call, so a rotated token is used by the next stage), the read-model
bookkeeping around the stage body, and the heartbeating poll loop that MAAS waits use (MAAS sends
no webhooks: docs/lifecycles/onboarding.md#stages WaitForMaasStatus).

    async def wait_for_ready(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.WAIT_FOR_READY) as run:
            ...
            run.result = StageResult(state=..., message=...)
        return run.result
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity

from activities.maas.client import MaasClient
from activities.maas.types import Machine
from activities.onboarding import read_model
from activities.onboarding.host_access import HostAccess
from activities.onboarding.stage_errors import StageError, as_application_error, error_code_of
from contracts.onboarding import (
    EventStatus,
    Observed,
    OnboardState,
    SiteConfig,
    Stage,
    StageInput,
    StageResult,
)
from contracts.onboarding_policy import TIMEOUTS
from core.failures import ClassifiedError, FailureClass
from core.secrets import SecretStore, SecretStoreError

T = TypeVar("T")
MAAS_TIMEOUT_SECONDS = 30.0


@dataclass
class OnboardingDeps:
    sessions: async_sessionmaker[AsyncSession]
    secrets: SecretStore
    host_access: HostAccess
    api_url: str  # what a node's agent calls to enroll (written into its cloud-init)
    # The shared directory storage provider's root, written into a node's agent config as its
    # `[storage] export_root` (the worker and every node see it at the same place).
    storage_export_root: str | None = None


@dataclass
class StageRun:
    input: StageInput
    stage: Stage
    result: StageResult | None = None

    @property
    def onboarding_id(self) -> uuid.UUID:
        return uuid.UUID(self.input.onboarding.onboarding_id)

    @property
    def site(self) -> SiteConfig:
        if self.input.site is None:
            raise StageError(
                FailureClass.INPUT_CONFIG_ERROR,
                "site_config_missing",
                "the stage ran before load_site_config",
                non_retryable=True,
            )
        return self.input.site

    @property
    def system_id(self) -> str:
        if self.input.state.system_id is None:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "system_id_unknown",
                "no MAAS machine is known for this onboarding yet",
                non_retryable=True,
            )
        return self.input.state.system_id

    def done(self, state: OnboardState, message: str, **details: Any) -> StageResult:
        self.result = StageResult(state=state, message=message, details=details)
        return self.result

    def skipped(self, state: OnboardState, message: str, **details: Any) -> StageResult:
        self.result = StageResult(state=state, message=message, details=details, skipped=True)
        return self.result


def observe(state: OnboardState, machine: Machine) -> OnboardState:
    """The state with MAAS's latest view of the machine recorded (§4.12)."""
    state.observed = Observed(
        maas_status=machine.status.label,
        power_state=str(machine.power_state),
        ip_addresses=list(machine.ip_addresses),
    )
    return state


def timeout_error(kind: str, message: str, **details: Any) -> StageError:
    rule = TIMEOUTS[kind]
    return StageError(
        rule.failure_class, rule.error_code, message, details=details, non_retryable=True
    )


class StageActivitiesBase:
    def __init__(self, deps: OnboardingDeps) -> None:
        self.deps = deps

    @contextlib.asynccontextmanager
    async def stage(self, input: StageInput, stage: Stage) -> AsyncIterator[StageRun]:
        run = StageRun(input=input, stage=stage)
        attempt = input.attempt
        async with self.deps.sessions() as session, session.begin():
            await read_model.stage_started(session, run.onboarding_id, stage.value, attempt)
        keepalive = asyncio.create_task(_keep_alive()) if activity.in_activity() else None
        try:
            yield run
        except ClassifiedError as err:
            await self._finish(run, attempt, EventStatus.FAILED, None, err.message, err)
            raise as_application_error(err) from err
        except SecretStoreError as err:
            wrapped = StageError(FailureClass.UPSTREAM_TRANSIENT, "vault_unavailable", str(err))
            await self._finish(run, attempt, EventStatus.FAILED, None, str(err), wrapped)
            raise as_application_error(wrapped) from err
        finally:
            if keepalive is not None:
                keepalive.cancel()
        if run.result is None:
            raise RuntimeError(f"stage {stage} finished without a result")
        status = EventStatus.SKIPPED if run.result.skipped else EventStatus.SUCCEEDED
        await self._finish(run, attempt, status, run.result.state, run.result.message, None)

    async def _finish(
        self,
        run: StageRun,
        attempt: int,
        status: EventStatus,
        state: OnboardState | None,
        message: str,
        error: ClassifiedError | None,
    ) -> None:
        details = dict(run.result.details) if run.result else {}
        if error is not None:
            details.update(failure_class=error.failure_class.value, error_code=error_code_of(error))
        with contextlib.suppress(Exception):  # bookkeeping must never mask the stage's outcome
            async with self.deps.sessions() as session, session.begin():
                await read_model.stage_finished(
                    session,
                    run.onboarding_id,
                    run.stage.value,
                    attempt,
                    status=status.value,
                    state=state,
                    message=message,
                    details=details,
                )

    @contextlib.asynccontextmanager
    async def maas(self, site: SiteConfig) -> AsyncIterator[MaasClient]:
        secret = await self.deps.secrets.read(site.api_token_vault_path)
        if not secret or not secret.get("token"):
            raise StageError(
                FailureClass.SITE_CAPABILITY_MISSING,
                "maas_token_missing",
                f"no MAAS API token at {site.api_token_vault_path}",
                non_retryable=True,
            )
        token = secret["token"]
        async with MaasClient(site.api_base_url, token, timeout=MAAS_TIMEOUT_SECONDS) as client:
            yield client

    async def read_secret(self, path: str, key: str, what: str) -> str:
        value = await self.deps.secrets.read(path)
        if not value or not value.get(key):
            raise StageError(
                FailureClass.SITE_CAPABILITY_MISSING,
                f"{what}_missing",
                f"no {what.replace('_', ' ')} at {path}",
                non_retryable=True,
            )
        return str(value[key])


KEEPALIVE_SECONDS = 2.0


async def _keep_alive() -> None:
    """Heartbeat while any stage runs, so a worker that dies mid-stage is noticed within the
    heartbeat timeout (seconds), not the stage's start-to-close timeout (up to hours)."""
    while True:
        await asyncio.sleep(KEEPALIVE_SECONDS)
        activity.heartbeat()


def poll_interval(site: SiteConfig) -> float:
    return site.policy.maas_poll_interval_ms / 1000.0


async def poll_until(
    site: SiteConfig,
    timeout_seconds: float,
    check: Callable[[], Awaitable[T | None]],
    *,
    progress: Callable[[], dict[str, Any]] | None = None,
) -> T | None:
    """Call `check` every poll interval until it answers something (returned) or the timeout
    passes (None). Heartbeats after each check so Temporal sees the wait is alive and operators
    see where it stands (heartbeat details)."""
    deadline = time.monotonic() + timeout_seconds
    started = time.monotonic()
    while True:
        found = await check()
        if found is not None:
            return found
        if activity.in_activity():
            beat = {"elapsed_s": round(time.monotonic() - started, 1)}
            if progress is not None:
                beat.update(progress())
            activity.heartbeat(beat)
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(poll_interval(site))


def utcnow_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()
