"""NodeDecommissionWorkflow `decommission-{id}`: the four decommission modes of
docs/lifecycles/decommission.md (soft_reset, reimage, full_decommission, storage_cleanup) with the
job-state model of docs/lifecycles/decommission.md#job-states and the failure and recovery model of
§5.8.

The mode's stages (contracts/decommission.py STAGES_BY_MODE) run in order. Control-plane
stages are activities on the control-plane queue (activities/decommission/); host work runs on
the node's own queue `node-{node_id}` as the agent's maintenance activities (node.drain,
node.storage_cleanup, node.gpu_scrub, node.validate_clean, node.uninstall) with a
schedule-to-start timeout, so an unreachable agent is detected instead of waited on; each host
call is mirrored as a node_tasks row (queued → completed/failed) for the timeline and for
resume's stale-task rule (docs/lifecycles/decommission.md#actions).

A stage failure its retries cannot cure is classified (workflows/decommission_policy.py) into
failed_retryable or failed_manual_intervention with a recommended action; the workflow then waits
for an operator action (the `operator_action` update) instead of closing:

    retry_stage   the failed stage again, then onwards
    resume        from the failed stage's checkpoint; a host task gets a fresh node_tasks row
                  (the stale one is closed as superseded). While the job runs, resume is an
                  idempotent no-op that names the live task: nothing is duplicated.
    adopt         accept what the node and MAAS show now (or the operator's word for host
                  work: "continue with explicit override", §5.8) and go on; ends `reconciled`.
                  Only what was seen: MAAS is asked first (loading the site if the job never
                  did), and a MAAS that cannot be asked refuses the adopt (`cannot_adopt`)
    cancel        stop (also while a stage runs) and compensate where possible: MAAS is never
                  rolled back; the node leaves draining/removing for offline/quarantined/retired
    mark_manual_intervention_required   freeze: stop the running stage, wait for a human
    record_disk_disposition   only while the job stands failed with host_not_wiped: the
                  operator's record of where the vanished machine's disks went (followups,
                  timeline), then the adopt it allows; ends `reconciled`

A failed validate_clean quarantines the node and raises an alert before the job fails; an
uninstall that fails after retirement sends the node back to retired (never deleted early).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from contracts.decommission import (
        DISK_DISPOSITION_KIND,
        HOST_NOT_WIPED,
        OPERATOR_RECORDED,
        REDEPLOY_RELEASE_NOTE,
        STAGES_BY_MODE,
        WORKFLOW_NAME,
        DecommissionInput,
        DecommissionResult,
        DecommissionState,
        DiskDisposition,
        Erase,
        EventStatus,
        Mode,
        NodeTaskRecord,
        NodeTaskRef,
        Observation,
        OperatorAction,
        Progress,
        ProgressRecord,
        Stage,
        StageInput,
        StageResult,
        StorageScope,
        operator_disk_disposition,
    )
    from contracts.host_task_errors import (
        AGENT_CAPABILITY_MISSING,
        agent_capability_missing,
        host_task_non_retryable,
    )
    from contracts.host_tasks import (
        NODE_DRAIN,
        NODE_GPU_SCRUB,
        NODE_STORAGE_CLEANUP,
        NODE_UNDRAIN,
        NODE_UNINSTALL,
        NODE_VALIDATE_CLEAN,
        NON_RETRYABLE_MAINTENANCE_ERRORS,
        STORAGE_SCOPE_LOCAL_SCRATCH,
        STORAGE_SCOPE_WEKA,
        DrainResult,
        GpuScrubResult,
        HostErrorType,
        NodeMaintenanceInput,
        StorageCleanupInput,
        StorageCleanupResult,
        UninstallResult,
        ValidateCleanResult,
    )
    from contracts.lifecycle import (
        ACTION_NOT_ALLOWED,
        STOP_BEFORE_NEXT_STAGE_PATCH,
        OperatorRequest,
    )
    from contracts.onboarding import JobStatus, SiteConfig
    from contracts.workflow_input import check_text
    from core import search_attributes as sa
    from core.failures import FailureClass
    from core.task_queues import node_task_queue
    from workflows.decommission_policy import (
        ADOPTABLE_NODE_STATUSES,
        ALLOWED_ACTIONS,
        DEFAULT_ATTEMPTS,
        REDEPLOY_FAILED,
        REDEPLOY_RETRIES_EXHAUSTED,
        STAGE_ATTEMPTS,
        checkpoint_for,
        outcome_for,
    )
    from workflows.lifecycle_job import (
        RUNNING_JOB_STATUSES,
        JobKind,
        OperatorControlledJob,
        StageFailure,
        StoppedBeforeNextStep,
        is_standing_action,
        stage_failure_from,
    )

QUICK = timedelta(minutes=2)
LOCAL = timedelta(seconds=30)
# Workflows that ran before these changes replay without them: a cancelled soft reset undrains
# the agent; an operator's interrupt wins over the failure its cancelled host task reports; an
# interrupt absorbed by a host task's result also stops a stage before its next host task (a
# second storage scope's wipe); and STOP_BEFORE_NEXT_STAGE_PATCH, shared with onboarding.
UNDRAIN_ON_CANCEL_PATCH = "undrain-agent-when-soft-reset-is-cancelled"
INTERRUPT_WINS_PATCH = "operator-interrupt-wins-over-stage-failure"
STOP_BEFORE_NEXT_HOST_TASK_PATCH = "operator-interrupt-stops-before-the-next-host-task"
# Adopt accepts only what it saw: a job that never loaded its site loads it (and asks MAAS)
# before adopting, MAAS that cannot be seen refuses the adopt instead of counting as "machine
# gone", and node and erase state are checked as well. Runs that adopted before go on as they did.
ADOPT_ONLY_OBSERVED_PATCH = "adopt-only-what-was-observed"
# Adopt never takes the operator's word for host work: a failed validate_clean is adopted only
# when a fresh validate_clean on the agent passes now; storage cleanup and GPU scrub cannot be
# observed afterwards and are refused (retry_stage runs them); a reimage's agent enrollment is
# observed again. Runs that adopted these before go on as they did.
ADOPT_REOBSERVES_HOST_WORK_PATCH = "adopt-reobserves-host-work"
# A full decommission whose machine vanished from MAAS before MAAS released it is not adopted
# as done (docs/lifecycles/decommission.md#failures-and-recommended-actions "do not pretend full
# decommission completed"): the disks were never erased, the machine never powered off, its agent
# may still run. The adopt is refused with `host_not_wiped` (failed_manual_intervention). Runs that
# adopted a vanished machine before go on.
VANISHED_MACHINE_NOT_WIPED_PATCH = "vanished-machine-is-not-wiped"
# ... until the operator records where its disks went (record_disk_disposition, only while the
# job stands failed with host_not_wiped): the record goes to the job's followups and timeline,
# and the adopt it allows goes on (ends reconciled). Earlier runs never took this action.
OPERATOR_DISK_DISPOSITION_PATCH = "operator-records-the-disk-disposition"
# Host stages adopt cannot observe the outcome of: they are run again (retry_stage), never skipped.
_UNOBSERVABLE_HOST_WORK = (Stage.CLEANUP_STORAGE, Stage.SCRUB_GPU)
# Storage-only cleanup disables the node and releases (or refuses over) its live allocations
# before wiping scratch, and enables it after. Runs started before go on with their two stages.
STORAGE_CLEANUP_GUARD_PATCH = "storage-cleanup-disables-the-node"
LEGACY_STORAGE_CLEANUP_STAGES = (Stage.CLEANUP_STORAGE, Stage.VALIDATE_CLEAN_NODE)
# Issue 35: a reimage's deploy that ends in MAAS `Failed deployment` goes the way onboarding's
# does (docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions): wait_for_deployed
# classifies it with onboarding's classifier; a datasource-like failure gets the site's bounded
# redeploy (max_deploy_retry_attempts since the job or the operator's last action):
# release_maas_node takes the machine back to Ready (observed; without an erase, as onboarding's
# recover: this job's first release erased as requested), then deploy and wait again. Past the
# bound, or for a generic failure, the job stops with the machine left in Failed deployment. Runs
# that reached their deploy before this go on without the recovery.
REIMAGE_DEPLOY_RECOVERY_PATCH = "reimage-classifies-and-recovers-a-failed-deploy"
# Resume of a reimage whose deploy failed (Failed deployment) starts from release_maas_node, not
# from the deploy MAAS refuses in that state. A job that failed there before asks this at its
# resume, so a job stuck in the old dead end gets out of it too.
RESUME_FAILED_DEPLOY_FROM_RELEASE_PATCH = "reimage-resume-of-a-failed-deploy-releases-first"
_DEPLOY_GROUP = (Stage.DEPLOY_VIA_MAAS, Stage.WAIT_FOR_DEPLOYED)
# The failures of a deploy MAAS ended in Failed deployment (before the recovery, and after it).
_FAILED_DEPLOY_CODES = ("deploy_failed", REDEPLOY_FAILED, REDEPLOY_RETRIES_EXHAUSTED)


@workflow.defn(name=WORKFLOW_NAME)
class NodeDecommissionWorkflow(OperatorControlledJob[Stage, OperatorAction, DecommissionResult]):
    _kind = JobKind("decommission", OperatorAction, ALLOWED_ACTIONS, outcome_for)

    def __init__(self) -> None:
        super().__init__(Stage.DISABLE_NODE)  # the mode's first stage, once run() knows the mode
        self._input: DecommissionInput | None = None
        self._site: SiteConfig | None = None
        self._state = DecommissionState()
        self._task: NodeTaskRef | None = None
        self._skip_uninstall = False
        self._agent_drained = False
        self._legacy_storage_cleanup = False

    @property
    def _stages(self) -> tuple[Stage, ...]:
        assert self._input is not None
        if self._legacy_storage_cleanup:
            return LEGACY_STORAGE_CLEANUP_STAGES
        return STAGES_BY_MODE[Mode(self._input.mode)]

    # ------------------------------------------------------------------ run

    @workflow.run
    async def run(self, input: DecommissionInput) -> DecommissionResult:
        self._input = input
        self._legacy_storage_cleanup = Mode(
            input.mode
        ) == Mode.STORAGE_CLEANUP and not workflow.patched(STORAGE_CLEANUP_GUARD_PATCH)
        self._stage = self._stages[0]
        await self._set_status(
            JobStatus.RUNNING,
            workflow_run_id=workflow.info().run_id,
            domain_event="node.decommission.started",
        )
        start: Stage | None = self._stages[0]
        while True:
            outcome = await self._attempt(start)
            if outcome is not None:
                await workflow.wait_condition(workflow.all_handlers_finished)
                return outcome
            next_start = await self._await_operator()
            if isinstance(next_start, _Cancel):
                result = await self._cancel()
                await workflow.wait_condition(workflow.all_handlers_finished)
                return result
            start = next_start

    async def _attempt(self, start: Stage | None) -> DecommissionResult | None:
        """Run from `start` (None: nothing is left to run); the result when the job closed,
        None when it failed and waits for an operator."""
        self._stage_task = asyncio.create_task(self._run_from(start))
        try:
            await self._stage_task
        except StageFailure as failure:
            if self._interrupt is None or not workflow.patched(INTERRUPT_WINS_PATCH):
                await self._fail(failure)
                return None
            # The stage failed because it was stopped (its host task was cancelled, which
            # reaches the workflow as that task's failure): the operator's action decides.
            return await self._interrupted()
        except (asyncio.CancelledError, StoppedBeforeNextStep):
            if self._interrupt is None:  # the workflow itself was cancelled
                self._interrupt = OperatorAction.CANCEL
            return await self._interrupted()
        finally:
            self._stage_task = None
            self._task = None
        if self._interrupt is not None and workflow.patched(STOP_BEFORE_NEXT_STAGE_PATCH):
            # It came with the last stage's result: there is nothing left to stop, and
            # compensating a finished job would undo what was asked for. The job completes.
            workflow.logger.warning(
                "%s arrived as the last stage finished; the decommission completes",
                self._interrupt.value,
            )
            self._interrupt = None
        final = JobStatus.RECONCILED if self._adopted else JobStatus.COMPLETED
        await self._set_status(final, domain_event="node.decommission.completed", clear_error=True)
        return await self._result()

    async def _run_from(self, start: Stage | None) -> None:
        stages = self._stages
        if start is None:
            return
        assert self._input is not None
        # The guarded storage cleanup loads the node in disable_node, like the other modes.
        if self._legacy_storage_cleanup and self._state.hostname is None:
            result = await self._call("decommission.load_node", self._stage_input(), QUICK)
            self._state = result.state
        deploy_group_ran = False
        for stage in stages[stages.index(start) :]:
            self._stop_if_interrupted(STOP_BEFORE_NEXT_STAGE_PATCH)
            if stage in _DEPLOY_GROUP and self._recovers_failed_deploys():
                # deploy and wait run as one group, with the recovery loop between them.
                if not deploy_group_ran:
                    deploy_group_ran = True
                    await self._deploy_group(stage)
                continue
            await self._run_stage(stage)

    def _recovers_failed_deploys(self) -> bool:
        assert self._input is not None
        return Mode(self._input.mode) == Mode.REIMAGE and workflow.patched(
            REIMAGE_DEPLOY_RECOVERY_PATCH
        )

    async def _deploy_group(self, entry: Stage) -> None:
        """deploy → wait for Deployed; a deploy MAAS ends in Failed deployment (classified by
        wait_for_deployed) → bounded redeploy: release to Ready, deploy, wait (§4.6). The
        allowance counts the redeploys of this entry: the job's first deploy, or the first
        after an operator's action, is no redeploy."""
        redeploys = 0
        stage = entry
        while True:
            try:
                if stage == Stage.RELEASE_MAAS_NODE:
                    self._stop_if_interrupted(STOP_BEFORE_NEXT_STAGE_PATCH)
                    await self._cp_stage(Stage.RELEASE_MAAS_NODE, note=REDEPLOY_RELEASE_NOTE)
                    redeploys += 1
                    stage = Stage.DEPLOY_VIA_MAAS
                if stage == Stage.DEPLOY_VIA_MAAS:
                    self._stop_if_interrupted(STOP_BEFORE_NEXT_STAGE_PATCH)
                    await self._cp_stage(Stage.DEPLOY_VIA_MAAS)
                    stage = Stage.WAIT_FOR_DEPLOYED
                self._stop_if_interrupted(STOP_BEFORE_NEXT_STAGE_PATCH)
                await self._cp_stage(Stage.WAIT_FOR_DEPLOYED)
                return
            except StageFailure as failure:
                if failure.failure_class != FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value:
                    raise
                stage = self._after_failed_deploy(failure, redeploys)

    def _after_failed_deploy(self, failure: StageFailure[Stage], redeploys: int) -> Stage:
        """Where the deploy group goes on after a Failed deployment: release_maas_node for a
        redeploy the site allows; else the job fails (the machine stays in Failed deployment,
        its installation log readable in MAAS; resume releases it first)."""
        kind = str(failure.details.get("failure_kind") or "generic")
        policy = self._site.policy if self._site else None
        allowed = (
            policy is not None
            and policy.enable_deploy_retry_on_datasource_failure
            and redeploys < policy.max_deploy_retry_attempts
        )
        if kind == "datasource_like" and allowed:
            workflow.logger.info(
                "reimage deploy failed (%s); redeploy %d of %d",
                kind,
                redeploys + 1,
                policy.max_deploy_retry_attempts if policy else 0,
            )
            return Stage.RELEASE_MAAS_NODE
        code = REDEPLOY_RETRIES_EXHAUSTED if kind == "datasource_like" else REDEPLOY_FAILED
        note = (
            f"after {redeploys} redeploy(s)"
            if kind == "datasource_like"
            else "no automatic redeploy for a generic failure"
        )
        raise StageFailure(
            failure.stage,
            FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value,
            code,
            f"{failure.message} ({kind}, {note}); the machine is left in Failed deployment",
            {
                **failure.details,
                "failure_kind": kind,
                "redeploys": redeploys,
                "prior_error_code": failure.error_code,
            },
        )

    async def _run_stage(self, stage: Stage) -> None:
        assert self._input is not None
        mode = Mode(self._input.mode)
        if stage == Stage.DRAIN_NODE:
            await self._drain()
            if mode == Mode.SOFT_RESET:
                # The node stays: wait until nothing tenant-facing runs on it any more.
                await self._cp_stage(stage, activity="decommission.await_quiet_node")
        elif stage == Stage.ENABLE_NODE and self._agent_drained:
            await self._undrain()
            await self._cp_stage(stage)
        elif stage == Stage.CLEANUP_STORAGE:
            await self._cleanup_storage()
        elif stage == Stage.SCRUB_GPU:
            await self._scrub_gpu()
        elif stage == Stage.VALIDATE_CLEAN_NODE:
            await self._validate_clean()
        elif stage == Stage.REMOVE_GPUAAS_NODE_RECORD:
            await self._remove_node_record()
        else:
            await self._cp_stage(stage)

    # ------------------------------------------------------------------ control-plane stages

    def _stage_input(self, *, note: str = "") -> StageInput:
        assert self._input is not None
        return StageInput(
            decommission=self._input,
            state=self._state,
            site=self._site,
            attempt=self._entries.get(self._stage, 1),
            task=self._task,
            note=note,
        )

    async def _call(
        self,
        activity: str,
        arg: StageInput,
        timeout: timedelta,
        *,
        attempts: int = DEFAULT_ATTEMPTS,
        heartbeat: timedelta | None = None,
    ) -> StageResult:
        try:
            result: StageResult = await workflow.execute_activity(
                activity,
                arg,
                result_type=StageResult,
                start_to_close_timeout=timeout,
                heartbeat_timeout=heartbeat,
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=1),
                    maximum_interval=timedelta(seconds=30),
                    maximum_attempts=attempts,
                ),
            )
        except ActivityError as err:
            raise stage_failure_from(self._stage, err) from None
        return result

    async def _cp_stage(
        self, stage: Stage, *, activity: str | None = None, note: str = ""
    ) -> StageResult:
        self._enter(stage)
        wait = self._wait_seconds(stage)
        result = await self._call(
            activity or f"decommission.{stage.value}",
            self._stage_input(note=note),
            timedelta(seconds=wait + 120),
            attempts=STAGE_ATTEMPTS.get(stage, DEFAULT_ATTEMPTS),
            heartbeat=self._heartbeat_timeout() if wait else None,
        )
        self._state = result.state
        if result.site is not None:
            self._site = result.site
            self._upsert_search_attributes()
        return result

    def _wait_seconds(self, stage: Stage) -> float:
        assert self._input is not None
        policy = self._input.policy
        site = self._site.policy if self._site else None
        fixed: dict[Stage, float] = {
            Stage.FORCE_RELEASE_ALLOCATIONS: policy.allocation_release_timeout_seconds,
            Stage.DRAIN_NODE: policy.drain_wait_seconds,
            Stage.POWER_OFF_MAAS_NODE: policy.power_off_timeout_seconds,
        }
        if stage in fixed:
            return fixed[stage]
        if site is None:
            return 0
        if stage == Stage.RELEASE_MAAS_NODE:
            # Release, then (erase failed, fallback allowed) a second release.
            return 2 * site.deploy_timeout_seconds
        # The reimage stages run onboarding's stage bodies, and wait as long.
        return site.stage_wait_seconds(stage)

    def _heartbeat_timeout(self) -> timedelta:
        assert self._input is not None
        poll_ms = (
            self._site.policy.maas_poll_interval_ms
            if self._site
            else self._input.policy.poll_interval_ms
        )
        return timedelta(seconds=max(60.0, 3 * poll_ms / 1000.0 + 30))

    # ------------------------------------------------------------------ host tasks

    async def _node_task(
        self, stage: Stage, kind: str, spec: Any, result_type: type[Any], *, reason: str = ""
    ) -> Any:
        """One host task on `node-{id}`, mirrored as a node_tasks row. A task the agent does
        not pick up in time is `agent_unreachable` (manual intervention, §5.8); while MAAS
        still holds the machine deployed, that is the ambiguous case of
        docs/lifecycles/decommission.md#failures-and-recommended-actions."""
        assert self._input is not None
        # Compensation's own host tasks run after the interrupt is taken (and cleared).
        self._stop_if_interrupted(STOP_BEFORE_NEXT_HOST_TASK_PATCH)
        policy = self._input.policy
        task = NodeTaskRef(task_id=spec.task_id, kind=kind)
        self._task = task
        await self._record_task(task, "queued")
        try:
            result = await workflow.execute_activity(
                kind,
                spec,
                result_type=result_type,
                task_queue=node_task_queue(self._input.node_id),
                schedule_to_start_timeout=timedelta(seconds=policy.node_schedule_to_start_seconds),
                start_to_close_timeout=timedelta(seconds=policy.node_task_timeout_seconds),
                heartbeat_timeout=timedelta(seconds=policy.node_heartbeat_timeout_seconds),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=1),
                    maximum_interval=timedelta(seconds=30),
                    maximum_attempts=max(1, policy.node_task_attempts),
                    non_retryable_error_types=host_task_non_retryable(
                        e.value for e in NON_RETRYABLE_MAINTENANCE_ERRORS
                    ),
                ),
            )
        except ActivityError as err:
            failure = self._host_failure(stage, kind, err)
            await self._record_task(
                task, "failed", error_type=failure.error_code, error_message=failure.message
            )
            raise failure from None
        finally:
            self._task = None
        phases = [
            {"phase": p.phase, "status": p.status, "at": p.at, "message": p.message}
            for p in getattr(result, "phases", [])
        ]
        await self._record_task(
            task,
            "completed",
            phases=phases,
            started_at=getattr(result, "started_at", None),
            finished_at=getattr(result, "finished_at", None),
            output=_summary(result),
        )
        return result

    def _host_failure(self, stage: Stage, kind: str, err: ActivityError) -> StageFailure[Stage]:
        cause = err.cause
        if isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START:
            maas_mutable = self._state.maas_managed and not self._state.released_in_maas
            if stage == Stage.REMOVE_GPUAAS_NODE_RECORD:
                code, failure_class = (
                    "uninstall_agent_unreachable",
                    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
                )
            elif maas_mutable:
                code, failure_class = "agent_unreachable_maas_mutable", FailureClass.STATE_AMBIGUITY
            else:
                code, failure_class = (
                    "agent_unreachable",
                    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
                )
            return StageFailure(
                stage,
                failure_class.value,
                code,
                f"the node agent did not pick up {kind} in time",
                {"kind": kind},
            )
        if isinstance(cause, ApplicationError) and cause.type == HostErrorType.UNSUPPORTED.value:
            return StageFailure(
                stage,
                FailureClass.INPUT_CONFIG_ERROR.value,
                "storage_scope_unsupported" if kind == NODE_STORAGE_CLEANUP else "unsupported",
                cause.message,
                {"kind": kind},
            )
        if (missing := agent_capability_missing(err, kind)) is not None:
            return StageFailure(
                stage,
                FailureClass.SITE_CAPABILITY_MISSING.value,
                AGENT_CAPABILITY_MISSING,
                missing,
                {"kind": kind},
            )
        message = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
        code = "uninstall_failed" if kind == NODE_UNINSTALL else "host_task_failed"
        return StageFailure(
            stage,
            FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE.value,
            code,
            f"{kind} failed: {message}",
            {"kind": kind, "host_error": getattr(cause, "type", None)},
        )

    async def _record_task(self, task: NodeTaskRef, status: str, **values: Any) -> None:
        assert self._input is not None
        await workflow.execute_local_activity(
            "decommission.record_node_task",
            NodeTaskRecord(
                decommission_id=self._input.decommission_id,
                node_id=self._input.node_id,
                task_id=task.task_id,
                kind=task.kind,
                workflow_id=workflow.info().workflow_id,
                status=status,
                **values,
            ),
            start_to_close_timeout=LOCAL,
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        )

    async def _host_stage(self, stage: Stage, body: Callable[[], Any]) -> None:
        """A stage whose body is host work: started/succeeded events written by the workflow."""
        self._enter(stage)
        await self._event(stage, EventStatus.STARTED)
        message = await body()
        await self._event(stage, EventStatus.SUCCEEDED, str(message or ""))

    def _spec(self) -> NodeMaintenanceInput:
        assert self._input is not None
        return NodeMaintenanceInput(
            task_id=str(workflow.uuid4()),
            node_id=self._input.node_id,
            reason=f"decommission {self._input.decommission_id} ({self._input.mode})",
        )

    async def _drain(self) -> None:
        async def body() -> str:
            result: DrainResult = await self._node_task(
                Stage.DRAIN_NODE, NODE_DRAIN, self._spec(), DrainResult
            )
            self._agent_drained = True
            if not any(f.get("kind") == "agent_drained" for f in self._state.followups):
                self._state.followups.append(
                    {"kind": "agent_drained", "message": "the agent refuses new tenant work"}
                )
            return f"agent draining ({result.running_tasks} task(s) running)"

        await self._host_stage(Stage.DRAIN_NODE, body)

    async def _undrain(self) -> None:
        """A soft reset returns the node to service: the agent takes tenant work again."""

        async def body() -> str:
            await self._node_task(Stage.ENABLE_NODE, NODE_UNDRAIN, self._spec(), DrainResult)
            self._agent_drained = False
            self._state.followups = [
                f for f in self._state.followups if f.get("kind") != "agent_drained"
            ]
            return "agent takes tenant work again"

        await self._host_stage(Stage.ENABLE_NODE, body)

    async def _cleanup_storage(self) -> None:
        assert self._input is not None
        scope = StorageScope(self._input.storage_cleanup)
        if scope == StorageScope.NONE:
            self._enter(Stage.CLEANUP_STORAGE)
            await self._event(Stage.CLEANUP_STORAGE, EventStatus.SKIPPED, "storage_cleanup none")
            return
        scopes = {
            StorageScope.LOCAL: [STORAGE_SCOPE_LOCAL_SCRATCH],
            StorageScope.WEKA: [STORAGE_SCOPE_WEKA],
            StorageScope.ALL: [STORAGE_SCOPE_LOCAL_SCRATCH, STORAGE_SCOPE_WEKA],
        }[scope]

        async def body() -> str:
            assert self._input is not None
            removed = 0
            for agent_scope in scopes:
                result: StorageCleanupResult = await self._node_task(
                    Stage.CLEANUP_STORAGE,
                    NODE_STORAGE_CLEANUP,
                    StorageCleanupInput(
                        task_id=str(workflow.uuid4()),
                        node_id=self._input.node_id,
                        scope=agent_scope,
                    ),
                    StorageCleanupResult,
                )
                removed += sum(r.entries_removed for r in result.roots)
            return f"storage {scope.value}: {removed} entries removed"

        await self._host_stage(Stage.CLEANUP_STORAGE, body)

    async def _scrub_gpu(self) -> None:
        async def body() -> str:
            result: GpuScrubResult = await self._node_task(
                Stage.SCRUB_GPU, NODE_GPU_SCRUB, self._spec(), GpuScrubResult
            )
            failed = [g.gpu for g in result.gpus if not g.scrubbed]
            if not result.gpus or failed:
                raise StageFailure(
                    Stage.SCRUB_GPU,
                    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE.value,
                    "host_task_failed",
                    "GPU scrub incomplete: " + (", ".join(failed) or "no GPUs reported"),
                    {"gpus": failed},
                )
            return f"{len(result.gpus)} GPU(s) scrubbed"

        await self._host_stage(Stage.SCRUB_GPU, body)

    async def _validate_clean(self) -> None:
        async def body() -> str:
            result: ValidateCleanResult = await self._node_task(
                Stage.VALIDATE_CLEAN_NODE, NODE_VALIDATE_CLEAN, self._spec(), ValidateCleanResult
            )
            if result.clean:
                return "no tenant residue"
            failed = [{"check": c.name, "reason": c.reason} for c in result.checks if not c.passed]
            self._state.followups.append({"kind": "validation_failed", "checks": failed})
            quarantined = await self._call(
                "decommission.quarantine_node", self._stage_input(), QUICK
            )
            self._state = quarantined.state
            raise StageFailure(
                Stage.VALIDATE_CLEAN_NODE,
                FailureClass.STATE_AMBIGUITY.value,
                "validation_residue",
                f"tenant residue remains ({', '.join(f['check'] for f in failed)}); "
                "the node is quarantined",
                {"checks": failed, "node_status": quarantined.message},
            )

        await self._host_stage(Stage.VALIDATE_CLEAN_NODE, body)

    async def _remove_node_record(self) -> None:
        """retired → removing → node.uninstall → deleted; on failure back to retired (§5.8).
        Uninstall is not dispatched when MAAS released the machine in this run (the agent went
        with its OS) or an operator adopted its absence."""
        stage = Stage.REMOVE_GPUAAS_NODE_RECORD
        begun = await self._cp_stage(stage, activity="decommission.begin_remove")
        if begun.skipped:
            return
        uninstall_needed = not (self._state.released_in_maas or self._skip_uninstall)
        note = "agent removed with its OS by the MAAS release"
        if self._skip_uninstall:
            note = "an operator adopted the agent's absence"
        if uninstall_needed:
            try:
                result: UninstallResult = await self._node_task(
                    stage, NODE_UNINSTALL, self._spec(), UninstallResult
                )
                note = f"agent uninstalled ({len(result.removed)} path(s) removed)"
            except StageFailure as failure:
                await self._call(
                    "decommission.finish_remove",
                    self._stage_input(note="uninstall_failed"),
                    QUICK,
                )
                raise failure from None
        await self._call("decommission.finish_remove", self._stage_input(), QUICK)
        await self._event(stage, EventStatus.SUCCEEDED, f"node deleted; {note}")

    # ------------------------------------------------------------------ failure and actions

    async def _await_operator(self) -> Stage | _Cancel | None:
        """Wait for an accepted action; answer where to start again (None: nothing left, all
        adopted; _Cancel: cancel)."""
        while True:
            action, failed_stage = await self._next_action(self._stages[0])
            if action == OperatorAction.CANCEL:
                return _Cancel()
            if action == OperatorAction.RETRY_STAGE:
                return failed_stage
            if action == OperatorAction.RESUME:
                if self._failed_deploy_in_reimage(failed_stage) and workflow.patched(
                    RESUME_FAILED_DEPLOY_FROM_RELEASE_PATCH
                ):
                    # MAAS refuses a deploy in Failed deployment: release to Ready first
                    # (a machine already Ready is skipped there), then on as the reimage goes.
                    return Stage.RELEASE_MAAS_NODE
                return checkpoint_for(failed_stage)
            try:
                if action == OperatorAction.RECORD_DISK_DISPOSITION and workflow.patched(
                    OPERATOR_DISK_DISPOSITION_PATCH
                ):
                    await self._record_disk_disposition(failed_stage)
                return await self._adopt(failed_stage)
            except StageFailure as failure:
                await self._fail(failure)
            except ActivityError as err:
                await self._fail(stage_failure_from(failed_stage, err))

    def _failed_deploy_in_reimage(self, failed_stage: Stage) -> bool:
        assert self._input is not None
        return (
            Mode(self._input.mode) == Mode.REIMAGE
            and failed_stage in _DEPLOY_GROUP
            and self._failure is not None
            and self._failure.failure_class == FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value
            and self._failure.error_code in _FAILED_DEPLOY_CODES
        )

    async def _adopt(self, failed: Stage) -> Stage | None:
        """Accept the observed state (or the operator's word for host work) for the failed
        stage and continue after it. Only what was observed is accepted: a job that never loaded
        its site loads it first, so MAAS is asked before anything is adopted; MAAS that cannot
        be asked refuses the adopt (unknown is not absent); MAAS stages are checked against
        MAAS (a machine not where the stage would have left it, or Ready without the erase
        asked for, cannot be adopted) and inventory stages against the node record."""
        observation = await self._observe()
        if failed in (
            *_UNOBSERVABLE_HOST_WORK,
            Stage.VALIDATE_CLEAN_NODE,
            Stage.WAIT_FOR_AGENT_ENROLLMENT,
        ) and workflow.patched(ADOPT_REOBSERVES_HOST_WORK_PATCH):
            await self._reobserve_host_work(failed, observation)
        observed_only = workflow.patched(ADOPT_ONLY_OBSERVED_PATCH)
        if observed_only and self._state.maas_managed and self._site is None:
            observation = await self._load_site_and_observe(failed, observation)

        def cannot(why: str) -> StageFailure[Stage]:
            return _cannot_adopt(failed, why, observation)

        if failed == Stage.FORCE_RELEASE_ALLOCATIONS and observation.live_allocations:
            raise cannot(f"{observation.live_allocations} allocation(s) are still live")
        if observed_only:
            self._check_observed(failed, observation)
            if (
                self._state.maas_managed
                and not observation.machine_present
                and self._input is not None
                and Mode(self._input.mode) == Mode.FULL_DECOMMISSION
                and not self._state.released_in_maas
                and operator_disk_disposition(self._state.followups) is None
                and workflow.patched(VANISHED_MACHINE_NOT_WIPED_PATCH)
            ):
                raise _host_not_wiped(failed, self._state.system_id, observation)
            if self._state.maas_managed and not observation.machine_present:
                self._state.machine_absent = True  # MAAS answered: it has no such machine
        elif self._state.maas_managed and not observation.machine_present:
            self._state.machine_absent = True  # (unpatched: a MAAS never asked counted too)
        if failed == Stage.RELEASE_MAAS_NODE:
            if observation.machine_present and observation.maas_status != "Ready":
                raise cannot(f"the machine is {observation.maas_status}, not Ready")
            self._state.released_in_maas = True
            self._note_adopted_disk_disposition(observation)
        if failed == Stage.POWER_OFF_MAAS_NODE:
            if observation.machine_present and observation.power_state != "off":
                raise cannot(f"the machine is powered {observation.power_state}")
            self._state.powered_off = True
        if failed in (Stage.DEPLOY_VIA_MAAS, Stage.WAIT_FOR_DEPLOYED):
            if observation.maas_status != "Deployed":
                raise cannot(f"the machine is {observation.maas_status}, not Deployed")
            failed = Stage.WAIT_FOR_DEPLOYED
        if failed == Stage.REMOVE_GPUAAS_NODE_RECORD:
            self._skip_uninstall = True  # the operator vouches the agent is gone
            self._adopted = True
            return Stage.REMOVE_GPUAAS_NODE_RECORD
        self._adopted = True
        await self._event(failed, EventStatus.SKIPPED, "adopted by an operator")
        assert self._input is not None
        if (
            failed == Stage.VALIDATE_CLEAN_NODE
            and self._legacy_storage_cleanup  # (else enable_node is the next stage)
            and self._state.quarantined
        ):
            await self._cp_stage(Stage.ENABLE_NODE)
        stages = self._stages
        index = stages.index(failed) + 1 if failed in stages else 0
        return stages[index] if index < len(stages) else None

    async def _reobserve_host_work(self, failed: Stage, observation: Observation) -> None:
        """Adopt of a host-work stage stands only on what the workflow observes itself now
        (raises cannot_adopt otherwise): a fresh validate_clean that passes; the reimaged
        agent's enrollment, looked for again. Storage cleanup and GPU scrub leave nothing the
        workflow could check afterwards: they are refused, and retry_stage runs them."""
        if failed in _UNOBSERVABLE_HOST_WORK:
            raise _cannot_adopt(
                failed,
                f"{failed.value} is host work the workflow cannot observe as done afterwards; "
                "it is never skipped on an operator's word: retry the stage (or cancel)",
                observation,
            )
        if failed == Stage.VALIDATE_CLEAN_NODE:
            try:
                result: ValidateCleanResult = await self._node_task(
                    failed, NODE_VALIDATE_CLEAN, self._spec(), ValidateCleanResult
                )
            except StageFailure as failure:
                raise _cannot_adopt(
                    failed, f"a fresh validate_clean could not run: {failure.message}", observation
                ) from None
            if not result.clean:
                checks = ", ".join(c.name for c in result.checks if not c.passed)
                raise _cannot_adopt(
                    failed,
                    f"a fresh validate_clean still finds tenant residue ({checks}); the node "
                    "stays quarantined: clean it, then retry the stage (or cancel)",
                    observation,
                )
            await self._event(failed, EventStatus.SUCCEEDED, "adopt: a fresh validate_clean passed")
            return
        if failed == Stage.WAIT_FOR_AGENT_ENROLLMENT:
            try:
                await self._cp_stage(failed)
            except StageFailure as failure:
                raise _cannot_adopt(
                    failed,
                    f"the reimaged node's agent enrollment was not observed: {failure.message}",
                    observation,
                ) from None

    async def _observe(self) -> Observation:
        """The node record, MAAS's machine (through the loaded site) and live allocations, now;
        the run's state is refreshed from them."""
        observation: Observation = await workflow.execute_activity(
            "decommission.observe",
            self._stage_input(),
            result_type=Observation,
            start_to_close_timeout=QUICK,
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        self._state = observation.state
        return observation

    async def _load_site_and_observe(self, failed: Stage, observation: Observation) -> Observation:
        """A MAAS-managed node whose job never loaded its site (it failed before or at
        load_site_config) has never been looked at in MAAS: load the site, then look. A site
        that cannot be loaded (its MAAS token missing, MAAS unreachable) leaves MAAS unseen,
        and the adopt is refused."""
        try:
            loaded = await self._call(
                "decommission.load_site_config",
                self._stage_input(),
                QUICK,
                attempts=STAGE_ATTEMPTS.get(Stage.LOAD_SITE_CONFIG, DEFAULT_ATTEMPTS),
            )
        except StageFailure as failure:
            raise _cannot_adopt(
                failed, f"MAAS cannot be observed: {failure.message}", observation
            ) from None
        self._state = loaded.state
        if loaded.site is None:
            return observation  # still unseen: refused below
        self._site = loaded.site
        self._upsert_search_attributes()
        return await self._observe()

    def _note_adopted_disk_disposition(self, observation: Observation) -> None:
        """Where the disks went, for an adopted release (issue 35), from what adopt observed
        now: erased when MAAS's log shows an erase since the deployment (method unknown: not
        this job's release), else not erased and why. Workflow state only (no command), so
        earlier histories replay unchanged."""
        assert self._input is not None
        if operator_disk_disposition(self._state.followups) is not None:
            return  # where the operator says the disks went stands
        facts: dict[str, Any] = {
            "kind": "disk_disposition",
            "system_id": self._state.system_id,
            "requested": self._input.erase,
        }
        if not observation.machine_present:
            facts.update(disposition="not_erased", reason="machine_absent")
        elif observation.disks_erased:
            facts.update(
                disposition="erased",
                method="unknown",
                observed="MAAS event log (adopt): Disk erasing ended after the last deployment",
            )
        elif Erase(self._input.erase) == Erase.NONE:
            facts.update(
                disposition="not_erased",
                reason="operator_accepted_risk",
                accepted_by=self._input.requested_by or None,
                accepted_reason=self._input.reason or None,
            )
        else:
            return  # _check_observed refused this adopt already
        self._state.followups = [
            f for f in self._state.followups if f.get("kind") != "disk_disposition"
        ]
        self._state.followups.append({k: v for k, v in facts.items() if v is not None})

    async def _record_disk_disposition(self, failed: Stage) -> None:
        """The operator's record of where a vanished machine's disks went (the validator
        admitted it: the job stands failed with host_not_wiped), on the job's followups in place
        of `not_erased / machine_vanished`, and on the release stage's event in the timeline:
        named as the operator's word (`source: operator`, who, why, their reference), never as
        something this job erased or observed."""
        request = self._request
        assert request is not None
        disposition = DiskDisposition(request.details["disposition"])
        actor = request.actor or "an operator"
        record: dict[str, Any] = {
            "kind": DISK_DISPOSITION_KIND,
            "disposition": disposition.value,
            "reason": "machine_vanished",
            "system_id": self._state.system_id,
            "source": OPERATOR_RECORDED,
            "recorded_by": request.actor or None,
            "recorded_reason": request.reason,
            "reference": request.details.get("reference") or None,
            "detail": f"the machine left MAAS before it was released, so this job erased "
            f"nothing; {actor} recorded its disks {disposition.value.replace('_', ' ')}",
        }
        record = {k: v for k, v in record.items() if v is not None}
        self._state.followups = [
            f for f in self._state.followups if f.get("kind") != DISK_DISPOSITION_KIND
        ]
        self._state.followups.append(record)
        await self._set_status(
            self._status,
            stage=Stage.RELEASE_MAAS_NODE,
            event_status=EventStatus.SKIPPED,
            message=f"disk disposition recorded by {actor}: {disposition.value}",
            details={"disk_disposition": record, "failed_stage": failed.value},
        )

    def _check_observed(self, failed: Stage, observation: Observation) -> None:
        """What adopt needs to have seen before it accepts `failed` as done (raises
        cannot_adopt): MAAS itself, for a MAAS-managed node; the node record where the stage
        changes it; the requested erase, where the machine is already Ready; the machine gone,
        where its MAAS record was to be deleted."""
        assert self._input is not None
        if self._state.maas_managed and not observation.maas_observed:
            why = observation.maas_error or "no answer"
            raise _cannot_adopt(
                failed,
                f"MAAS could not be observed ({why}); adopt accepts only what MAAS shows",
                observation,
            )
        expected = ADOPTABLE_NODE_STATUSES.get(failed)
        if expected is not None and observation.node_status not in expected:
            raise _cannot_adopt(
                failed,
                f"the node is {observation.node_status}, not {' or '.join(sorted(expected))}",
                observation,
            )
        erase = Erase(self._input.erase)
        if (
            failed == Stage.RELEASE_MAAS_NODE
            and observation.machine_present
            and observation.maas_status == "Ready"
            and erase != Erase.NONE
            and not observation.disks_erased
        ):
            raise _cannot_adopt(
                failed,
                f"the machine is Ready but MAAS shows no disk erase since it was deployed "
                f"(the request asked for a {erase.value} erase)",
                observation,
            )
        if (
            failed == Stage.REMOVE_MAAS_RECORD
            and self._input.remove_maas_record
            and observation.machine_present
        ):
            raise _cannot_adopt(failed, "the machine is still in MAAS", observation)

    async def _cancel(self) -> DecommissionResult:
        await self._set_status(JobStatus.COMPENSATING)
        assert self._input is not None
        if (
            self._agent_drained
            and Mode(self._input.mode) == Mode.SOFT_RESET
            and workflow.patched(UNDRAIN_ON_CANCEL_PATCH)
        ):
            await self._undrain_for_cancel()
        try:
            await self._call("decommission.compensate", self._stage_input(), QUICK, attempts=3)
        except ActivityError as err:
            workflow.logger.warning("decommission compensation failed: %s", err)
        await self._set_status(JobStatus.CANCELLED, domain_event="node.decommission.cancelled")
        return await self._result()

    async def _undrain_for_cancel(self) -> None:
        """A cancelled soft reset keeps its node: the agent takes tenant work again, so the
        compensation can hand the node (offline) to the liveness loop rather than quarantine it
        for an operator. An agent that cannot be reached stays drained, and the node is
        quarantined as before."""
        try:
            await self._node_task(Stage.ENABLE_NODE, NODE_UNDRAIN, self._spec(), DrainResult)
        except (ActivityError, StageFailure) as err:
            workflow.logger.warning("undrain on cancel failed; the node stays quarantined: %s", err)
            return
        self._agent_drained = False
        self._state.followups = [
            f for f in self._state.followups if f.get("kind") != "agent_drained"
        ]

    # ------------------------------------------------------------------ operator surface

    def _check_request(self, request: OperatorRequest) -> None:
        """record_disk_disposition is admitted only while the job stands failed with
        host_not_wiped, with a known disposition, a reason and (optionally) a one-line
        reference; refused with action_not_allowed (the gateway's audited 409) otherwise."""
        if request.action != OperatorAction.RECORD_DISK_DISPOSITION.value:
            return
        failure = self._standing_failure()
        if failure is None or failure.error_code != HOST_NOT_WIPED:
            standing = f" with {failure.error_code}" if failure else ""
            raise ApplicationError(
                "record_disk_disposition is only for a full decommission stopped with "
                f"{HOST_NOT_WIPED} (its machine left MAAS unreleased); this one is "
                f"{self._status.value}{standing} at {self._stage.value}",
                type=ACTION_NOT_ALLOWED,
            )
        known = [d.value for d in DiskDisposition]
        extra = set(request.details) - {"disposition", "reference"}
        if request.details.get("disposition") not in known or extra:
            raise ApplicationError(
                f"record_disk_disposition needs a disposition, one of {', '.join(known)}, and "
                "nothing but a reference besides",
                type=ACTION_NOT_ALLOWED,
            )
        if not request.reason.strip():
            raise ApplicationError(
                "record_disk_disposition needs a reason", type=ACTION_NOT_ALLOWED
            )
        check_text("reference", request.details.get("reference", ""), max_chars=200)

    def _is_noop(self, action: OperatorAction) -> bool:
        return is_standing_action(action, self._status) or (
            # docs/lifecycles/decommission.md#actions: a live (or freshly queued) task already does
            # what resume asks.
            action == OperatorAction.RESUME
            and self._status in RUNNING_JOB_STATUSES
            and self._interrupt is None
        )

    def _noop_message(self, action: OperatorAction) -> str:
        if action != OperatorAction.RESUME:
            return ""
        if self._task is not None:
            return (
                f"resume: {self._task.kind} task {self._task.task_id} is live; nothing was requeued"
            )
        return f"resume: the decommission is {self._status.value} at {self._stage.value}"

    # ------------------------------------------------------------------ bookkeeping

    async def _event(self, stage: Stage, status: EventStatus, message: str = "") -> None:
        await self._set_status(self._status, stage=stage, event_status=status, message=message)

    def _progress(self, **fields: Any) -> Progress:
        return Progress(
            decommission_id=self._input.decommission_id if self._input else "",
            mode=self._input.mode if self._input else "",
            node_task=self._task,
            **fields,
        )

    def _progress_record(self, **fields: Any) -> ProgressRecord:
        assert self._input is not None
        return ProgressRecord(
            decommission_id=self._input.decommission_id, state=self._state, **fields
        )

    def _record_details(self) -> dict[str, Any]:
        assert self._input is not None
        return {"node_id": self._input.node_id, "mode": self._input.mode}

    def _search_attributes(self) -> list[SearchAttributeUpdate[Any]]:
        assert self._input is not None
        updates: list[SearchAttributeUpdate[Any]] = [sa.NODE_ID.value_set(self._input.node_id)]
        if self._state.site_id:
            updates.append(sa.SITE_ID.value_set(self._state.site_id))
        if self._state.hostname:
            updates.append(sa.HOSTNAME.value_set(self._state.hostname))
        return updates

    async def _result(self) -> DecommissionResult:
        assert self._input is not None
        node_status: str | None = await workflow.execute_local_activity(
            "decommission.node_status",
            self._input.node_id,
            result_type=str,
            start_to_close_timeout=LOCAL,
            retry_policy=RetryPolicy(maximum_attempts=5),
        )
        failure = self._standing_failure()
        return DecommissionResult(
            decommission_id=self._input.decommission_id,
            node_id=self._input.node_id,
            mode=self._input.mode,
            status=self._status.value,
            node_status=node_status,
            failure_class=failure.failure_class if failure else None,
            error_code=failure.error_code if failure else None,
        )


class _Cancel:
    """_await_operator's answer for cancel."""


def _cannot_adopt(failed: Stage, why: str, observation: Observation) -> StageFailure[Stage]:
    return StageFailure(
        failed,
        FailureClass.STATE_AMBIGUITY.value,
        "cannot_adopt",
        f"nothing to adopt: {why}",
        {"maas_status": observation.maas_status, "node_status": observation.node_status},
    )


def _host_not_wiped(
    failed: Stage, system_id: str | None, observation: Observation
) -> StageFailure[Stage]:
    """The machine is gone from MAAS before MAAS released it: nothing of the full decommission's
    host work can be taken as done."""
    return StageFailure(
        failed,
        FailureClass.STATE_AMBIGUITY.value,
        "host_not_wiped",
        f"machine {system_id} is gone from MAAS before it was released: its disks were not "
        "erased, it was not powered off and its agent was not removed; the full decommission "
        "is not complete",
        {
            "host_not_wiped": True,
            "system_id": system_id,
            "not_done": ["release_and_erase", "power_off", "agent_uninstall"],
            # Where the disks went (issue 35): nowhere this job can vouch for.
            "disk_disposition": {
                "kind": "disk_disposition",
                "disposition": "not_erased",
                "reason": "machine_vanished",
                "system_id": system_id,
                "detail": "the machine left MAAS before it was released: its disks were not "
                "erased and may still hold the previous tenant's data",
            },
            "maas_status": observation.maas_status,
            "node_status": observation.node_status,
        },
    )


def _summary(result: Any) -> dict[str, Any]:
    """The sanitised host result, without its phases (those go to node_task_events)."""
    out: dict[str, Any] = {}
    for name in ("draining", "running_tasks", "clean", "scope", "removed", "absent"):
        if hasattr(result, name):
            out[name] = getattr(result, name)
    if hasattr(result, "checks"):
        out["checks"] = [{"name": c.name, "passed": c.passed} for c in result.checks]
    if hasattr(result, "gpus"):
        out["gpus"] = [{"gpu": g.gpu, "scrubbed": g.scrubbed} for g in result.gpus]
    if hasattr(result, "roots"):
        out["roots"] = [{"root": r.root, "removed": r.entries_removed} for r in result.roots]
    return out
