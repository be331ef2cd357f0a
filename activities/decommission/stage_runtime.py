"""What every decommission stage runs on (docs/lifecycles/decommission.md): the dependencies, the
per-run record (`Run`), the started / succeeded|skipped|failed events around a stage body, the MAAS
client from the site's Vault token, polling with heartbeats, the protection re-check before a
destructive MAAS call, and the reads several stage groups share (the node's record and MAAS binding,
the live allocations on it).

Kept apart from the stages themselves so each stage group (node_inventory, draining,
maas_release, removal, operator_actions, bookkeeping) is a mixin on `StageRuntime` that depends
on this module only, never on another group. Sessions stay short and never span a MAAS, Vault
or Temporal call (load → call → apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client

from activities.decommission import read_model
from activities.maas.client import MaasClient
from activities.maas.errors import MaasNotFound
from activities.maas.types import Machine, MachineStatus
from activities.onboarding.host_access import HostAccess
from activities.onboarding.stage_errors import StageError, as_application_error, error_code_of
from contracts.decommission import DecommissionState, EventStatus, Stage, StageInput, StageResult
from contracts.states import LIVE_ALLOCATION_STATUSES
from core.failures import ClassifiedError, FailureClass
from core.secrets import SecretStore, SecretStoreError
from schema.models import Allocation, Node, NodeMaasState, NodeOnboarding

S = MachineStatus
ACTOR = "decommission"
MAAS_TIMEOUT_SECONDS = 30.0


@dataclass
class DecommissionDeps:
    sessions: async_sessionmaker[AsyncSession]
    secrets: SecretStore
    host_access: HostAccess
    api_url: str
    client: Client | None = None  # Temporal: allocation force-release goes through workflows


@dataclass
class Run:
    input: StageInput
    stage: Stage
    result: StageResult | None = None
    details: dict[str, Any] = field(default_factory=dict)
    maas_seen: tuple[str | None, str | None] | None = None

    @property
    def decommission_id(self) -> uuid.UUID:
        return uuid.UUID(self.input.decommission.decommission_id)

    @property
    def node_id(self) -> uuid.UUID:
        return uuid.UUID(self.input.decommission.node_id)

    @property
    def state(self) -> DecommissionState:
        return self.input.state

    def done(self, message: str, **details: Any) -> StageResult:
        self.result = StageResult(state=self.input.state, message=message, details=details)
        return self.result

    def skipped(self, message: str, **details: Any) -> StageResult:
        self.result = StageResult(
            state=self.input.state, message=message, details=details, skipped=True
        )
        return self.result


def ambiguity(code: str, message: str, **details: Any) -> StageError:
    return StageError(
        FailureClass.STATE_AMBIGUITY, code, message, details=details, non_retryable=True
    )


def observe_machine(state: DecommissionState, machine: Machine) -> None:
    state.maas_status = machine.status.label
    state.power_state = str(machine.power_state)


class StageRuntime:
    """The state and helpers the decommission stage mixins share; the activities are on the
    mixins, composed into DecommissionActivities (activities/decommission/control_plane.py)."""

    def __init__(self, deps: DecommissionDeps) -> None:
        self.deps = deps

    # ------------------------------------------------------------------ stage bookkeeping

    @contextlib.asynccontextmanager
    async def stage(self, input: StageInput, stage: Stage) -> AsyncIterator[Run]:
        """started / succeeded|skipped|failed events around a stage body; a classified failure
        leaves as the ApplicationError the workflow classifies (type = failure class)."""
        run = Run(input=input, stage=stage)
        attempt = activity.info().attempt if activity.in_activity() else input.attempt
        async with self.deps.sessions() as session, session.begin():
            await read_model.stage_started(session, run.decommission_id, stage.value, attempt)
        try:
            yield run
        except ClassifiedError as err:
            await self._finish(run, attempt, EventStatus.FAILED, err.message, err)
            raise as_application_error(err) from err
        except SecretStoreError as err:
            wrapped = StageError(FailureClass.UPSTREAM_TRANSIENT, "vault_unavailable", str(err))
            await self._finish(run, attempt, EventStatus.FAILED, str(err), wrapped)
            raise as_application_error(wrapped) from err
        if run.result is None:
            raise RuntimeError(f"stage {stage} finished without a result")
        status = EventStatus.SKIPPED if run.result.skipped else EventStatus.SUCCEEDED
        await self._finish(run, attempt, status, run.result.message, None)

    async def _finish(
        self,
        run: Run,
        attempt: int,
        status: EventStatus,
        message: str,
        error: ClassifiedError | None,
    ) -> None:
        details = dict(run.result.details if run.result else run.details)
        if error is not None:
            details.update(failure_class=error.failure_class.value, error_code=error_code_of(error))
        with contextlib.suppress(Exception):  # bookkeeping must never mask the stage's outcome
            async with self.deps.sessions() as session, session.begin():
                await read_model.stage_finished(
                    session,
                    run.decommission_id,
                    run.stage.value,
                    attempt,
                    status=status.value,
                    state=run.result.state if run.result else None,
                    message=message,
                    details=details,
                    maas=run.maas_seen,
                )

    @contextlib.asynccontextmanager
    async def maas(self, run: Run) -> AsyncIterator[MaasClient]:
        site = run.input.site
        if site is None:
            raise StageError(
                FailureClass.INPUT_CONFIG_ERROR,
                "site_config_missing",
                "a MAAS stage ran before load_site_config",
                non_retryable=True,
            )
        secret = await self.deps.secrets.read(site.api_token_vault_path)
        if not secret or not secret.get("token"):
            raise StageError(
                FailureClass.SITE_CAPABILITY_MISSING,
                "maas_token_missing",
                f"no MAAS API token at {site.api_token_vault_path}",
                non_retryable=True,
            )
        async with MaasClient(
            site.api_base_url, secret["token"], timeout=MAAS_TIMEOUT_SECONDS
        ) as client:
            yield client

    async def _machine(self, run: Run, maas: MaasClient) -> Machine:
        assert run.state.system_id is not None
        try:
            machine = await maas.get_machine(run.state.system_id)
        except MaasNotFound as err:
            raise ambiguity(
                "machine_deleted",
                f"machine {run.state.system_id} is no longer in MAAS (deleted out of band?)",
                system_id=run.state.system_id,
            ) from err
        observe_machine(run.state, machine)
        run.maas_seen = (run.state.maas_status, run.state.power_state)
        return machine

    async def _refuse_if_protected(self, run: Run, what: str) -> None:
        """Re-checked in the same run, right before a destructive MAAS call: a node an operator
        protected after the job started is not released, erased, powered off or deleted."""
        async with self.deps.sessions() as session:
            node = await session.get(Node, run.node_id)
        if node is not None and node.protected:
            raise StageError(
                FailureClass.NODE_PROTECTED,
                "node_protected",
                f"the node is protected ({node.protected_reason or 'no reason given'}): "
                f"{what} refused; unprotect it, then retry the stage (or cancel)",
                details={"protected_reason": node.protected_reason},
                non_retryable=True,
            )

    def _poll_seconds(self, run: Run) -> float:
        if run.input.site is not None:
            return run.input.site.policy.maas_poll_interval_ms / 1000.0
        return run.input.decommission.policy.poll_interval_ms / 1000.0

    async def _poll(self, run: Run, timeout: float, check: Any) -> Any:
        """Call `check` until it answers something or `timeout` passes (None); heartbeats."""
        deadline = time.monotonic() + timeout
        while True:
            found = await check()
            if found is not None:
                return found
            if activity.in_activity():
                activity.heartbeat({"stage": run.stage.value, "maas_status": run.state.maas_status})
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(self._poll_seconds(run))

    async def _load_node(self, run: Run) -> None:
        state = run.state
        async with self.deps.sessions() as session:
            node = await session.get(Node, run.node_id)
            if node is None:
                raise StageError(
                    FailureClass.INPUT_CONFIG_ERROR,
                    "node_not_found",
                    "the node does not exist",
                    non_retryable=True,
                )
            binding = await session.get(NodeMaasState, run.node_id)
            profile_id = await session.scalar(
                select(NodeOnboarding.profile_id)
                .where(NodeOnboarding.node_id == run.node_id)
                .order_by(NodeOnboarding.requested_at.desc())
                .limit(1)
            )
        state.hostname = node.hostname
        state.sku_id = node.sku
        if state.node_status_at_start is None:
            state.node_status_at_start = node.status
        if binding is not None:
            state.maas_managed = True
            state.site_id = str(binding.site_id)
            state.system_id = binding.maas_system_id
            state.maas_status = state.maas_status or binding.last_maas_status
            state.power_state = state.power_state or binding.last_maas_power_state
        # The request's profile (checked by the gateway), else the one it was onboarded with.
        chosen = run.input.decommission.profile_id or profile_id
        if chosen is not None:
            state.profile_id = str(chosen)

    async def _live_allocations(self, node_id: uuid.UUID) -> list[tuple[uuid.UUID, str]]:
        async with self.deps.sessions() as session:
            rows = await session.execute(
                select(Allocation.id, Allocation.status).where(
                    Allocation.node_id == node_id,
                    Allocation.status.in_([s.value for s in LIVE_ALLOCATION_STATUSES]),
                )
            )
            return [(i, s) for i, s in rows.all()]
