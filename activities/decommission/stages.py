"""The control-plane decommission stages (seed 003 §5.2-§5.5, §5.8): node inventory transitions
(through activities/node_lifecycle.py, the one place node status changes), allocation
force-release through each allocation's own workflow, MAAS release / power-off / delete, secrets
cleanup, and what the workflow needs for operator actions (observe, compensate) and its own
read-model writes. Host work (node.drain, node.storage_cleanup, ...) is dispatched by the
workflow itself on the node's queue; `record_node_task` mirrors it into node_tasks.

Every stage is status-aware, so a resumed or re-entered run converges instead of repeating a
side effect: a node already draining is adopted by disable_node, a machine already Ready is
not released again, one already off is not powered off again, a retired node is not retired
twice. Sessions stay short and never span a MAAS, Vault or Temporal call (load → call → apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities.decommission import read_model
from activities.maas.client import MaasClient
from activities.maas.errors import MaasError, MaasNotFound
from activities.maas.types import EraseMode, Machine, MachineStatus, PowerState
from activities.node_lifecycle import transition_node, transition_path
from activities.onboarding.host_access import HostAccess
from activities.onboarding.stage_errors import StageError, as_application_error, error_code_of
from contracts.allocation import (
    RELEASE_UPDATE,
    ReleaseAccepted,
    ReleaseRequest,
    allocation_workflow_id,
)
from contracts.decommission import (
    DISK_DISPOSITION_KIND,
    REDEPLOY_RELEASE_NOTE,
    DecommissionState,
    Erase,
    EventStatus,
    Mode,
    NodeTaskRecord,
    Observation,
    ProgressRecord,
    Stage,
    StageInput,
    StageResult,
    operator_disk_disposition,
)
from contracts.states import (
    LIVE_ALLOCATION_STATUSES,
    AllocationStatus,
    NodeStatus,
    NodeTaskStatus,
    ReleaseActor,
)
from core.failures import ClassifiedError, FailureClass
from core.secret_paths import node_secret_paths
from core.secrets import SecretStore, SecretStoreError
from schema.models import (
    Allocation,
    DomainEvent,
    GpuSlot,
    Node,
    NodeDriftEvent,
    NodeEnrollmentToken,
    NodeMaasState,
    NodeOnboarding,
    NodeTask,
)

S = MachineStatus
ACTOR = "decommission"
MAAS_TIMEOUT_SECONDS = 30.0
_ERASE = {
    Erase.NONE: EraseMode.NONE,
    Erase.QUICK: EraseMode.QUICK,
    Erase.SECURE: EraseMode.SECURE,
    Erase.STANDARD: EraseMode.STANDARD,
}
# MAAS will release these (maas-api-notes: op=release).
RELEASABLE = frozenset(
    {
        S.ALLOCATED,
        S.RESERVED,
        S.BROKEN,
        S.DEPLOYED,
        S.FAILED_DEPLOYMENT,
        S.FAILED_DISK_ERASING,
        S.FAILED_RELEASING,
    }
)
RELEASE_IN_PROGRESS = frozenset({S.RELEASING, S.DISK_ERASING})
# MAAS event types, as the region names them: a deployment (which puts an OS, and then tenant
# data, on the disks) begins with the first; an erase that completed logs the second.
# MAAS's event log (../shared/maas-api-notes.md "Events"): the deployment start, and the status
# change that leaves Disk erasing after a successful wipe ("Disk erasing → Releasing → Ready";
# a failed wipe goes to "Failed disk erasing" instead).
MAAS_DEPLOYMENT_EVENT = "User starting deployment"
MAAS_STATUS_CHANGE_EVENT = "Node changed status"
MAAS_ERASE_FINISHED = "From 'Disk erasing' to 'Releasing'"


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


async def disks_erased_since_deployment(maas: MaasClient, system_id: str) -> bool:
    """Whether MAAS's event log shows the machine's disks erased since it was last deployed:
    reading newest first, the status change out of Disk erasing into Releasing comes before the
    deployment start. A Ready machine does not say whether a release erased it; only its event
    log does (the status changes are DEBUG events). Not found in the last events: not seen, so
    not erased."""
    for event in await maas.query_events(system_id=system_id, level="DEBUG", limit=200):
        if event.type == MAAS_STATUS_CHANGE_EVENT and event.description == MAAS_ERASE_FINISHED:
            return True
        if event.type == MAAS_DEPLOYMENT_EVENT:
            return False
    return False


def record_disk_disposition(
    state: DecommissionState, disposition: str, **facts: Any
) -> dict[str, Any]:
    """The job's disk disposition (issue 35: where the disks went): `erased` (method, how it
    was observed) or `not_erased` (reason: operator_accepted_risk, erase_failed_fallback,
    machine_absent, machine_vanished). One per job, the last release's; kept in the job's
    followups so the API shows it, and returned for the stage event's details (the timeline)."""
    record = {
        "kind": DISK_DISPOSITION_KIND,
        "disposition": disposition,
        "system_id": state.system_id,
        **{k: v for k, v in facts.items() if v is not None},
    }
    state.followups = [f for f in state.followups if f.get("kind") != DISK_DISPOSITION_KIND]
    state.followups.append(record)
    return record


class DecommissionActivities:
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

    # ------------------------------------------------------------------ inventory

    @activity.defn(name="decommission.disable_node")
    async def disable_node(self, input: StageInput) -> StageResult:
        """§5.2 DisableNode: the node becomes unschedulable by entering `draining` (only active
        nodes are placed on), which also makes this workflow the owning lifecycle operation of
        the drain (seed 004 §3.3). Also loads what later stages need: hostname, MAAS binding,
        SKU and the profile (the request's, else the one the node was onboarded with)."""
        async with self.stage(input, Stage.DISABLE_NODE) as run:
            await self._load_node(run)
            sources = (NodeStatus.ACTIVE, NodeStatus.OFFLINE, NodeStatus.QUARANTINED)
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    sources,
                    NodeStatus.DRAINING,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied:
                run.done(f"{moved.prior} -> draining: no new allocations", prior=str(moved.prior))
            elif moved.current == NodeStatus.DRAINING:
                run.skipped("already draining: this decommission owns the drain")
            elif (
                moved.current in (NodeStatus.RETIRED, NodeStatus.REMOVING)
                and input.decommission.mode == Mode.FULL_DECOMMISSION
            ):
                run.skipped(f"already {moved.current}: past disable (resumed full decommission)")
            else:
                raise StageError(
                    FailureClass.INPUT_CONFIG_ERROR,
                    "node_not_decommissionable",
                    f"a node in {moved.current or 'no state (missing)'} cannot be disabled",
                    details={"node_status": str(moved.current)},
                    non_retryable=True,
                )
        assert run.result is not None
        return run.result

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

    @activity.defn(name="decommission.load_node")
    async def load_node(self, input: StageInput) -> StageResult:
        """What a storage_cleanup started before it disabled the node (the legacy two-stage
        run, workflows/decommission.py LEGACY_STORAGE_CLEANUP_STAGES) needs to know about it."""
        run = Run(input=input, stage=Stage.CLEANUP_STORAGE)
        await self._load_node(run)
        return StageResult(state=run.state, message="node loaded")

    @activity.defn(name="decommission.retire_gpuaas_node")
    async def retire_gpuaas_node(self, input: StageInput) -> StageResult:
        """§5.4 RetireGPUaaSNode: draining → retired (the drain lifecycle completed)."""
        async with self.stage(input, Stage.RETIRE_GPUAAS_NODE) as run:
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.DRAINING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied:
                run.done("draining -> retired")
            elif moved.current in (NodeStatus.RETIRED, NodeStatus.REMOVING):
                run.skipped(f"already {moved.current}")
            else:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}, not draining: something else moved it",
                    node_status=str(moved.current),
                )
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.enable_node")
    async def enable_node(self, input: StageInput) -> StageResult:
        """§5.2/§5.3 EnableNode: back to `active`, through the table's own path without ever
        passing `retired` (a soft reset or reimage retires nothing): draining → offline (the
        drain stops short of retirement, seed 004 §3.3) → active (the node was just validated
        clean: proven healthy); a node an operator released from quarantine (adopt after
        validation) goes quarantined → active."""
        async with self.stage(input, Stage.ENABLE_NODE) as run:
            async with self.deps.sessions() as session, session.begin():
                current = await session.scalar(select(Node.status).where(Node.id == run.node_id))
                if current == NodeStatus.QUARANTINED:
                    moved = await transition_node(
                        session,
                        run.node_id,
                        [NodeStatus.QUARANTINED],
                        NodeStatus.ACTIVE,
                        actor=ACTOR,
                        reason="operator adopted after validation",
                    )
                else:
                    moved = await transition_path(
                        session,
                        run.node_id,
                        [NodeStatus.DRAINING, NodeStatus.OFFLINE, NodeStatus.ACTIVE],
                        actor=ACTOR,
                        reason=input.decommission.reason,
                    )
            if moved.current != NodeStatus.ACTIVE:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}; it cannot be enabled from there",
                    node_status=str(moved.current),
                )
            if moved.applied:
                run.done(f"{moved.prior} -> active: available for allocations")
            else:
                run.skipped("already active")
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.quarantine_node")
    async def quarantine_node(self, input: StageInput) -> StageResult:
        """A failed validate_clean (§5.2): the node is quarantined (draining → offline →
        quarantined, or active/offline → quarantined) and an alert is raised: a CRITICAL drift
        row for MAAS nodes and a `node.decommission.validation_failed` domain event."""
        run = Run(input=input, stage=Stage.VALIDATE_CLEAN_NODE)
        reason = "decommission validation found tenant residue"
        async with self.deps.sessions() as session, session.begin():
            moved = await transition_path(
                session,
                run.node_id,
                [NodeStatus.DRAINING, NodeStatus.OFFLINE, NodeStatus.QUARANTINED],
                actor=ACTOR,
                reason=reason,
            )
            if moved.current == NodeStatus.ACTIVE:
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.ACTIVE],
                    NodeStatus.QUARANTINED,
                    actor=ACTOR,
                    reason=reason,
                )
            checks = input.state.followups[-1:] if input.state.followups else []
            session.add(
                DomainEvent(
                    type="node.decommission.validation_failed",
                    subject_type="node",
                    subject_id=str(run.node_id),
                    payload={
                        "decommission_id": input.decommission.decommission_id,
                        "severity": "CRITICAL",
                        "node_status": str(moved.current),
                        "checks": checks,
                    },
                )
            )
            if input.state.site_id is not None:
                await session.execute(
                    insert(NodeDriftEvent).values(
                        node_id=run.node_id,
                        site_id=uuid.UUID(input.state.site_id),
                        rule="decommission_validation_failed",
                        severity="CRITICAL",
                        details={
                            "decommission_id": input.decommission.decommission_id,
                            "node_status": str(moved.current),
                        },
                    )
                )
        input.state.quarantined = moved.current == NodeStatus.QUARANTINED
        return StageResult(state=input.state, message=f"node {moved.current}")

    # ------------------------------------------------------------------ allocations

    @activity.defn(name="decommission.force_release_allocations")
    async def force_release_allocations(self, input: StageInput) -> StageResult:
        """§5.4 ForceReleaseAllocations: each live allocation on the node is released by its own
        AllocationWorkflow (the `request_release` update, actor admin, force), never around it,
        so billing closes and the host is cleaned as for any release; then we wait until each
        is released. release_failed means allocations remain attached: manual intervention."""
        async with self.stage(input, Stage.FORCE_RELEASE_ALLOCATIONS) as run:
            live = await self._live_allocations(run.node_id)
            if not live:
                run.skipped("no live allocations on the node")
            else:
                force = (
                    input.decommission.force_release_allocations
                    or input.decommission.mode == Mode.FULL_DECOMMISSION
                )
                holding = [a for a, s in live if s != AllocationStatus.RELEASING]
                if holding and not force:
                    raise StageError(
                        FailureClass.STATE_AMBIGUITY,
                        "allocations_attached",
                        f"{len(holding)} live allocation(s) hold the node and force-release was "
                        "not requested",
                        details={"allocations": [str(a) for a in holding][:20]},
                        non_retryable=True,
                    )
                requested = await self._request_releases(run, holding)
                await self._wait_released(run, [a for a, _ in live])
                run.state.allocations_released = sorted(
                    {*run.state.allocations_released, *(str(a) for a, _ in live)}
                )
                run.done(
                    f"{len(live)} allocation(s) released through their workflows",
                    allocations=[str(a) for a, _ in live][:50],
                    requested=requested,
                )
        assert run.result is not None
        return run.result

    async def _live_allocations(self, node_id: uuid.UUID) -> list[tuple[uuid.UUID, str]]:
        async with self.deps.sessions() as session:
            rows = await session.execute(
                select(Allocation.id, Allocation.status).where(
                    Allocation.node_id == node_id,
                    Allocation.status.in_([s.value for s in LIVE_ALLOCATION_STATUSES]),
                )
            )
            return [(i, s) for i, s in rows.all()]

    async def _request_releases(self, run: Run, ids: list[uuid.UUID]) -> list[str]:
        if not ids:
            return []
        client = self.deps.client
        if client is None:
            raise RuntimeError("force_release_allocations needs a Temporal client")
        requested: list[str] = []
        reason = f"node decommission {run.input.decommission.decommission_id}: " + (
            run.input.decommission.reason or run.input.decommission.mode
        )
        for allocation_id in ids:
            handle = client.get_workflow_handle(allocation_workflow_id(str(allocation_id)))
            try:
                await handle.execute_update(
                    RELEASE_UPDATE,
                    ReleaseRequest(actor=ReleaseActor.ADMIN.value, reason=reason, force=True),
                    id=f"decommission-{run.input.decommission.decommission_id}-release",
                    result_type=ReleaseAccepted,
                )
                requested.append(str(allocation_id))
            except WorkflowUpdateFailedError:
                pass  # not releasable (failed meanwhile): the wait below reads where it stands
            except RPCError as err:
                raise StageError(
                    FailureClass.UPSTREAM_TRANSIENT,
                    "allocation_workflow_unreachable",
                    f"allocation {allocation_id}: {err.message}",
                ) from err
            if activity.in_activity():
                activity.heartbeat({"requested": len(requested)})
        return requested

    async def _wait_released(self, run: Run, ids: list[uuid.UUID]) -> None:
        failed: list[str] = []

        async def settled() -> bool | None:
            async with self.deps.sessions() as session:
                rows = (
                    await session.execute(
                        select(Allocation.id, Allocation.status).where(Allocation.id.in_(ids))
                    )
                ).all()
            failed[:] = [str(i) for i, s in rows if s == AllocationStatus.RELEASE_FAILED]
            if failed:
                return True
            done = all(s in (AllocationStatus.RELEASED, AllocationStatus.FAILED) for _, s in rows)
            return True if done else None

        timeout = run.input.decommission.policy.allocation_release_timeout_seconds
        if await self._poll(run, timeout, settled) is None:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "allocations_release_failed",
                "allocations did not finish releasing in time; they remain attached",
                details={"allocations": [str(i) for i in ids][:20]},
                non_retryable=True,
            )
        if failed:
            raise StageError(
                FailureClass.STATE_AMBIGUITY,
                "allocations_release_failed",
                f"{len(failed)} allocation(s) ended in release_failed; they remain attached",
                details={"allocations": failed[:20]},
                non_retryable=True,
            )

    @activity.defn(name="decommission.await_quiet_node")
    async def await_quiet_node(self, input: StageInput) -> StageResult:
        """Soft reset's DrainNode (§5.2), after the agent's node.drain: the allocations' own
        releases revoked their users (allocation.deprovision_user); this waits until no
        allocation and no host task is live on the node any more. The node returns to service
        at enable_node, which runs node.undrain first."""
        async with self.stage(input, Stage.DRAIN_NODE) as run:
            pending: list[str] = []

            async def quiet() -> bool | None:
                async with self.deps.sessions() as session:
                    tasks = (
                        await session.scalars(
                            select(NodeTask.kind).where(
                                NodeTask.node_id == run.node_id,
                                NodeTask.status.in_(
                                    [NodeTaskStatus.QUEUED.value, NodeTaskStatus.DISPATCHED.value]
                                ),
                                NodeTask.workflow_id != f"decommission-{run.decommission_id}",
                            )
                        )
                    ).all()
                allocations = await self._live_allocations(run.node_id)
                pending[:] = [*tasks, *(f"allocation {a} {s}" for a, s in allocations)]
                return None if pending else True

            policy = input.decommission.policy
            if await self._poll(run, policy.drain_wait_seconds, quiet) is None:
                raise StageError(
                    FailureClass.STATE_AMBIGUITY,
                    "drain_not_converging",
                    f"{len(pending)} host task(s) or allocation(s) are still live on the node",
                    details={"pending": pending[:20]},
                    non_retryable=True,
                )
            run.done("no live allocations or host tasks on the node")
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ MAAS

    @activity.defn(name="decommission.release_maas_node")
    async def release_maas_node(self, input: StageInput) -> StageResult:
        """§5.3/§5.4 ReleaseMaasNode: release with the requested erase mode and wait for Ready.
        An erase that fails (Failed disk erasing) is retried as a no-erase release only when
        the site policy allows it (release_fallback_no_erase); the fallback is recorded as a
        follow-up, since the disks were not wiped. Not converging is manual intervention."""
        async with self.stage(input, Stage.RELEASE_MAAS_NODE) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.state.released_in_maas = True
                # Where an operator recorded the disks went (record_disk_disposition) stands.
                disposition = operator_disk_disposition(
                    run.state.followups
                ) or record_disk_disposition(
                    run.state,
                    "not_erased",
                    reason="machine_absent",
                    detail="the machine is gone from MAAS (adopted): this job erased nothing",
                )
                run.skipped("the machine is gone from MAAS (adopted)", disk_disposition=disposition)
            else:
                await self._refuse_if_protected(run, "MAAS release (and erase)")
                async with self.maas(run) as maas:
                    await self._release(run, maas)
        assert run.result is not None
        return run.result

    async def _release(self, run: Run, maas: MaasClient) -> None:
        state, site = run.state, run.input.site
        assert site is not None
        assert state.system_id is not None
        erase = Erase(run.input.decommission.erase)
        # A reimage's redeploy after Failed deployment releases without an erase (the note).
        redeploy = run.input.note == REDEPLOY_RELEASE_NOTE
        if redeploy:
            erase = Erase.NONE
        machine = await self._machine(run, maas)
        if machine.status == S.READY and state.released_in_maas:
            run.skipped("already Ready")
            return
        if machine.status == S.READY:
            # Released by someone else while we drained (or by an attempt of ours whose answer
            # was lost): adopt, but say so, and only with the erase asked for seen done.
            if erase != Erase.NONE and not await disks_erased_since_deployment(
                maas, state.system_id
            ):
                raise ambiguity(
                    "erase_not_observed",
                    f"the machine is Ready but MAAS shows no disk erase since it was deployed; "
                    f"the requested {erase.value} erase was not seen done",
                    maas_status=machine.status.label,
                    erase=erase.value,
                )
            state.released_in_maas = True
            disposition = await self._disk_disposition(run, maas, erase, out_of_band=True)
            run.done(
                "the machine was already Ready (released out of band); adopted",
                disk_disposition=disposition,
            )
            return
        if machine.status == S.DEPLOYING:
            machine = await maas.abort(state.system_id, comment="gpucloud decommission")
        if machine.status in RELEASABLE:
            mode = erase
            if (
                machine.status == S.FAILED_DISK_ERASING
                and erase != Erase.NONE
                and site.policy.release_fallback_no_erase
            ):
                mode = Erase.NONE  # an earlier erase failed: the site allows the fallback
                self._note_fallback(state, erase)
            await maas.release(
                state.system_id,
                erase=_ERASE[mode],
                comment=f"gpucloud decommission {run.input.decommission.decommission_id}",
            )
            if not redeploy:  # erase_used stays what this job's release of the OS used
                state.erase_used = mode.value
        elif machine.status not in RELEASE_IN_PROGRESS:
            raise ambiguity(
                "maas_changed_out_of_band",
                f"the machine is {machine.status.label}; it cannot be released from there",
                maas_status=machine.status.label,
            )
        ready = await self._wait_ready(run, maas)
        if ready is None:
            current = state.maas_status
            if current == S.FAILED_DISK_ERASING.label:
                if not site.policy.release_fallback_no_erase:
                    raise StageError(
                        FailureClass.STATE_AMBIGUITY,
                        "erase_failed",
                        "disk erasing failed and the site does not allow a no-erase release",
                        details={"erase": erase.value, "maas_status": state.maas_status},
                        non_retryable=True,
                    )
                await maas.release(
                    state.system_id,
                    erase=EraseMode.NONE,
                    comment="gpucloud decommission: erase failed, releasing without erase",
                )
                state.erase_used = Erase.NONE.value
                self._note_fallback(state, erase)
                ready = await self._wait_ready(run, maas)
            if ready is None:
                code = "release_failed" if state.maas_status != S.RELEASING.label else ""
                raise StageError(
                    FailureClass.STATE_AMBIGUITY,
                    code or "release_timeout",
                    f"the machine did not reach Ready (it is {state.maas_status})",
                    details={"maas_status": state.maas_status},
                    non_retryable=True,
                )
        state.released_in_maas = True
        if redeploy:
            run.done("released back to Ready for a redeploy (no erase)", erase=Erase.NONE.value)
            return
        note = " (erase fell back to none)" if state.erase_fell_back else ""
        disposition = await self._disk_disposition(run, maas, erase)
        run.done(
            f"released to Ready, erase {state.erase_used}{note}; disks "
            f"{disposition['disposition'].replace('_', ' ')}",
            erase=state.erase_used,
            disk_disposition=disposition,
        )

    async def _disk_disposition(
        self, run: Run, maas: MaasClient, requested: Erase, *, out_of_band: bool = False
    ) -> dict[str, Any]:
        """Where this release left the disks, recorded on the job (followups, shown by the
        API) and in the stage's event (the timeline). `erased` only when MAAS's event log shows
        the erase finished since the machine's last deployment (observed now, never inferred
        from the request); otherwise `not_erased` with why: the erase failed and the site's
        policy allowed the no-erase release, or the request asked for none (the operator
        accepted the risk, named with the request's reason)."""
        state, request = run.state, run.input.decommission
        assert state.system_id is not None
        if state.erase_fell_back:
            return record_disk_disposition(
                state,
                "not_erased",
                reason="erase_failed_fallback",
                requested=requested.value,
                detail=f"the {requested.value} erase failed in MAAS (Failed disk erasing); "
                "released without erase as the site's release_fallback_no_erase allows",
            )
        if requested == Erase.NONE:
            return record_disk_disposition(
                state,
                "not_erased",
                reason="operator_accepted_risk",
                requested=Erase.NONE.value,
                accepted_by=request.requested_by or None,
                accepted_reason=request.reason or None,
                detail="the request asked for no erase: the disks keep their data",
            )
        if not await disks_erased_since_deployment(maas, state.system_id):
            raise ambiguity(
                "erase_not_observed",
                f"the machine is Ready but MAAS shows no disk erase since it was deployed; "
                f"the requested {requested.value} erase was not seen done",
                maas_status=state.maas_status,
                erase=requested.value,
            )
        return record_disk_disposition(
            state,
            "erased",
            # Released out of band: MAAS's log shows an erase, not which one.
            method="unknown" if out_of_band else (state.erase_used or requested.value),
            requested=requested.value,
            observed="MAAS event log: Disk erasing ended (Releasing) after the last deployment",
        )

    @staticmethod
    def _note_fallback(state: DecommissionState, erase: Erase) -> None:
        """The disks were not wiped: a follow-up for whoever handles the hardware next."""
        state.erase_fell_back = True
        if not any(f.get("kind") == "erase_fallback" for f in state.followups):
            state.followups.append(
                {
                    "kind": "erase_fallback",
                    "message": f"{erase.value} erase failed; released without erasing",
                }
            )

    async def _wait_ready(self, run: Run, maas: MaasClient) -> Machine | None:
        """Ready, or None when the release stopped in a failure state or timed out."""
        site = run.input.site
        assert site is not None
        stopped: list[bool] = [False]

        async def check() -> Machine | None:
            machine = await self._machine(run, maas)
            if machine.status == S.READY:
                return machine
            if machine.status in (S.FAILED_DISK_ERASING, S.FAILED_RELEASING, S.BROKEN):
                stopped[0] = True
                return machine
            if machine.status in RELEASE_IN_PROGRESS:
                return None
            raise ambiguity(
                "maas_changed_out_of_band",
                f"the machine went {machine.status.label} while releasing",
                maas_status=machine.status.label,
            )

        found: Machine | None = await self._poll(run, site.policy.deploy_timeout_seconds, check)
        if found is None or stopped[0]:
            return None
        return found

    @activity.defn(name="decommission.power_off_maas_node")
    async def power_off_maas_node(self, input: StageInput) -> StageResult:
        """§5.4 PowerOffMaasNode, and wait until MAAS reports it off. Not converging is manual
        intervention: full decommission is never reported complete with the machine on."""
        async with self.stage(input, Stage.POWER_OFF_MAAS_NODE) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.skipped("the machine is gone from MAAS (adopted)")
            else:
                await self._refuse_if_protected(run, "MAAS power-off")
                async with self.maas(run) as maas:
                    machine = await self._machine(run, maas)
                    if machine.power_state == PowerState.OFF:
                        run.state.powered_off = True
                        run.skipped("already off")
                    else:
                        answer = await maas.power_off(
                            machine.system_id, comment="gpucloud full decommission"
                        )
                        if answer is None:
                            raise StageError(
                                FailureClass.BMC_POWER_FAILURE,
                                "power_off_failed",
                                "MAAS cannot control this machine's power",
                                non_retryable=True,
                            )

                        async def off() -> bool | None:
                            current = await self._machine(run, maas)
                            return True if current.power_state == PowerState.OFF else None

                        timeout = input.decommission.policy.power_off_timeout_seconds
                        if await self._poll(run, timeout, off) is None:
                            raise StageError(
                                FailureClass.BMC_POWER_FAILURE,
                                "power_off_failed",
                                f"the machine is still {run.state.power_state} after power-off",
                                non_retryable=True,
                            )
                        run.state.powered_off = True
                        run.done("powered off")
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.remove_maas_record")
    async def remove_maas_record(self, input: StageInput) -> StageResult:
        """§5.4 RemoveMaasRecord, only when the request asks (default: the record is kept for
        MAAS-side audit). Best effort: a failed delete leaves the record and a follow-up."""
        async with self.stage(input, Stage.REMOVE_MAAS_RECORD) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.skipped("the machine is already gone from MAAS")
            elif not input.decommission.remove_maas_record:
                run.skipped("kept in MAAS (remove_maas_record is false)")
            else:
                assert run.state.system_id is not None
                await self._refuse_if_protected(run, "MAAS delete")
                try:
                    async with self.maas(run) as maas:
                        await maas.delete_machine(run.state.system_id)
                    run.state.maas_status = None
                    run.done(f"machine {run.state.system_id} deleted from MAAS")
                except MaasNotFound:
                    run.skipped("the machine is already gone from MAAS")
                except MaasError as err:
                    run.state.followups.append(
                        {"kind": "maas_record_retained", "message": err.message[:300]}
                    )
                    run.done("MAAS delete failed: the record stays (follow-up recorded)")
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ removal

    @activity.defn(name="decommission.begin_remove")
    async def begin_remove(self, input: StageInput) -> StageResult:
        """§5.4 RemoveGPUaaSNodeRecord, first half: retired → removing (the remove workflow
        owns it now). Answers skipped=True when the node is already deleted."""
        async with self.stage(input, Stage.REMOVE_GPUAAS_NODE_RECORD) as run:
            async with self.deps.sessions() as session, session.begin():
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.RETIRED],
                    NodeStatus.REMOVING,
                    actor=ACTOR,
                    reason=input.decommission.reason,
                )
            if moved.applied or moved.current == NodeStatus.REMOVING:
                run.done("retired -> removing" if moved.applied else "already removing")
            elif moved.current == NodeStatus.DELETED:
                run.skipped("already deleted")
            else:
                raise ambiguity(
                    "node_state_changed",
                    f"the node is {moved.current}, not retired",
                    node_status=str(moved.current),
                )
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.finish_remove")
    async def finish_remove(self, input: StageInput) -> StageResult:
        """Second half: removing → deleted once node.uninstall succeeded (or was not needed:
        MAAS released the machine, so the agent went with its OS), with the node's GPU slots
        disabled and its MAAS binding dropped; or, when uninstall failed (note
        "uninstall_failed"), back to retired (§5.8: the node must not be deleted prematurely)."""
        run = Run(input=input, stage=Stage.REMOVE_GPUAAS_NODE_RECORD)
        failed = input.note == "uninstall_failed"
        async with self.deps.sessions() as session, session.begin():
            if failed:
                moved = await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.REMOVING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason="node.uninstall failed",
                )
                return StageResult(state=input.state, message=f"node {moved.current}")
            moved = await transition_node(
                session,
                run.node_id,
                [NodeStatus.REMOVING],
                NodeStatus.DELETED,
                actor=ACTOR,
                reason=input.decommission.reason,
            )
            if moved.current != NodeStatus.DELETED:
                raise as_application_error(
                    ambiguity(
                        "node_state_changed",
                        f"the node is {moved.current}, not removing",
                        node_status=str(moved.current),
                    )
                )
            # The deleted identity no longer claims the machine: a re-onboarding of the same
            # hardware binds it to the new node record (the job row keeps the system id).
            await session.execute(delete(NodeMaasState).where(NodeMaasState.node_id == run.node_id))
            await session.execute(
                update(GpuSlot)
                .where(GpuSlot.node_id == run.node_id, GpuSlot.status != "reserved")
                .values(
                    status="disabled",
                    quarantine_reason="node deleted by full decommission",
                    quarantined_at=func.clock_timestamp(),
                    updated_at=func.clock_timestamp(),
                )
            )
        return StageResult(state=input.state, message="removing -> deleted")

    @activity.defn(name="decommission.cleanup_secrets")
    async def cleanup_secrets(self, input: StageInput) -> StageResult:
        """§5.4 CleanupSecrets: unused enrollment tokens are consumed (a deleted node can never
        enroll again anyway: redemption refuses it) and the node's own Vault paths deleted.
        A failure does not fail the job: it is recorded as a follow-up (§5.8)."""
        async with self.stage(input, Stage.CLEANUP_SECRETS) as run:
            async with self.deps.sessions() as session, session.begin():
                consumed = await session.scalars(
                    update(NodeEnrollmentToken)
                    .where(
                        NodeEnrollmentToken.node_id == run.node_id,
                        NodeEnrollmentToken.used_at.is_(None),
                    )
                    .values(
                        used_at=func.clock_timestamp(),
                        expires_at=func.least(
                            NodeEnrollmentToken.expires_at, func.clock_timestamp()
                        ),
                    )
                    .returning(NodeEnrollmentToken.id)
                )
                tokens = len(list(consumed))
            deleted, failed = [], []
            for path in node_secret_paths(run.node_id):
                try:
                    await self.deps.secrets.delete(path)
                    deleted.append(path)
                except SecretStoreError as err:
                    failed.append(path)
                    run.state.followups.append(
                        {"kind": "vault_cleanup", "path": path, "message": str(err)[:200]}
                    )
            message = f"{tokens} enrollment token(s) consumed, {len(deleted)} Vault path(s) deleted"
            if failed:
                message += f"; {len(failed)} Vault path(s) left as follow-up"
            run.done(message, tokens=tokens, vault_deleted=deleted, vault_failed=failed)
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ operator support

    @activity.defn(name="decommission.observe")
    async def observe(self, input: StageInput) -> Observation:
        """What adopt_observed_state decides from, seen now: the node record (its status and
        its MAAS binding, which a stage that failed may never have handed back), MAAS's machine,
        and the live allocations on the node. MAAS is asked through the loaded site only; when
        it cannot be asked (no site loaded, token missing, MAAS unreachable) the observation
        says so (`maas_observed` False, `maas_error` why) instead of reporting the machine
        absent."""
        run = Run(input=input, stage=Stage.DISABLE_NODE)
        state = input.state
        try:
            await self._load_node(run)
        except ClassifiedError as err:
            raise as_application_error(err) from err
        async with self.deps.sessions() as session:
            node_status = await session.scalar(select(Node.status).where(Node.id == run.node_id))
        machine_present = maas_observed = False
        maas_error = ""
        disks_erased: bool | None = None
        if state.maas_managed:
            if input.site is None:
                maas_error = "the site configuration is not loaded"
            elif not state.system_id:
                maas_error = "the node's MAAS binding names no machine"
            else:
                try:
                    async with asyncio.timeout(MAAS_TIMEOUT_SECONDS), self.maas(run) as maas:
                        try:
                            machine = await maas.get_machine(state.system_id)
                        except MaasNotFound:
                            state.maas_status = None
                            maas_observed = True
                        else:
                            observe_machine(state, machine)
                            machine_present = maas_observed = True
                            erase = Erase(input.decommission.erase)
                            if machine.status == S.READY and erase != Erase.NONE:
                                disks_erased = await disks_erased_since_deployment(
                                    maas, state.system_id
                                )
                except (ClassifiedError, SecretStoreError, TimeoutError) as err:
                    machine_present = maas_observed = False
                    disks_erased = None
                    maas_error = str(err)[:300] or f"MAAS did not answer ({type(err).__name__})"
        live = await self._live_allocations(run.node_id)
        return Observation(
            node_status=node_status,
            machine_present=machine_present,
            maas_status=state.maas_status,
            power_state=state.power_state,
            live_allocations=len(live),
            state=state,
            maas_observed=maas_observed,
            maas_error=maas_error,
            disks_erased=disks_erased,
        )

    @activity.defn(name="decommission.compensate")
    async def compensate(self, input: StageInput) -> StageResult:
        """Cancel (seed 004 §8: stop and compensate where possible). MAAS is never touched
        back. The node is not left in draining/removing without an owner: removing → retired;
        draining → offline ("operator recovery stops short of retirement", §3.3), from where
        the liveness loop returns it to active — unless the agent's node.drain ran (its marker
        refuses tenant work) or MAAS already changed the machine, in which case it goes on to
        quarantined for an operator. Whether MAAS changed it is what MAAS shows, not what the
        run last believed (a release whose stage failed may have gone through)."""
        run = Run(input=input, stage=Stage.DISABLE_NODE)
        notes: list[str] = []
        agent_drained = any(f.get("kind") == "agent_drained" for f in input.state.followups)
        maas_changed = input.state.released_in_maas or await self._maas_changed(run)
        async with self.deps.sessions() as session, session.begin():
            current = await session.scalar(select(Node.status).where(Node.id == run.node_id))
            if current == NodeStatus.REMOVING:
                await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.REMOVING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason="decommission cancelled",
                )
                notes.append("removing -> retired")
            elif current == NodeStatus.DRAINING:
                path = [NodeStatus.DRAINING, NodeStatus.OFFLINE]
                if agent_drained or maas_changed:
                    path.append(NodeStatus.QUARANTINED)
                moved = await transition_path(
                    session, run.node_id, path, actor=ACTOR, reason="decommission cancelled"
                )
                notes.append(f"draining -> {moved.current}")
            await read_model.add_event(
                session,
                run.decommission_id,
                stage="cancel",
                attempt=input.attempt,
                status=EventStatus.COMPENSATED.value,
                message="; ".join(notes) or "nothing to compensate",
            )
        return StageResult(state=input.state, message="; ".join(notes) or "nothing to compensate")

    async def _maas_changed(self, run: Run) -> bool:
        """Whether MAAS may hold the machine other than deployed because of this run. Without a
        loaded site no MAAS stage can have run (each needs it): unchanged, known. With one,
        MAAS is asked; a machine not Deployed, gone, or that cannot be seen counts as changed."""
        state = run.state
        if not state.maas_managed or run.input.site is None or not state.system_id:
            return False
        try:
            async with asyncio.timeout(MAAS_TIMEOUT_SECONDS), self.maas(run) as maas:
                machine = await maas.get_machine(state.system_id)
        except (ClassifiedError, SecretStoreError, TimeoutError):
            return True
        observe_machine(state, machine)
        return machine.status != S.DEPLOYED

    @activity.defn(name="decommission.node_status")
    async def node_status(self, node_id: str) -> str | None:
        async with self.deps.sessions() as session:
            status: str | None = await session.scalar(
                select(Node.status).where(Node.id == uuid.UUID(node_id))
            )
            return status

    @activity.defn(name="decommission.record_progress")
    async def record_progress(self, record: ProgressRecord) -> None:
        async with self.deps.sessions() as session, session.begin():
            await read_model.record_progress(session, record)

    @activity.defn(name="decommission.record_node_task")
    async def record_node_task(self, record: NodeTaskRecord) -> None:
        async with self.deps.sessions() as session, session.begin():
            await read_model.record_node_task(session, record)
