"""MaasNodeOnboardWorkflow `onboarding-{id}` (docs/lifecycles/onboarding.md,
docs/lifecycles/onboarding.md#job-states).

The stages of §4.3 run in order as activities (activities/onboarding/); each is status-aware, so
re-entering from any point converges. The workflow owns the job state (§4.8): a stage failure
that its retry policy cannot cure is classified (contracts/onboarding_policy.py) into
failed_retryable or failed_manual_intervention with a recommended action, and the workflow then
*waits* for an operator action instead of closing, so every recovery of §4.9 is an update on the
same workflow and the same history:

    retry_stage   the failed stage again, then onwards
    resume        from the failed stage's checkpoint (e.g. reseed before waiting for sync)
    rerun         from load_site_config, every stage adopting what is already done
    restart_clean compensate (release to Ready, drop the unenrolled node record), then rerun
    cancel        compensate where possible, close as cancelled (also while a stage runs)
    adopt         accept what MAAS and the node show now and continue from there (reconciled)
    mark_manual_intervention_required   freeze: stop the running stage, wait for a human

Deploy failures go through classify_deploy_failure: a datasource/cloud-init-like failure gets
the site's bounded redeploy (recover_for_datasource_retry releases to Ready first); anything else
(or the bound reached) releases back to Ready and fails. Post-deploy failures never touch MAAS.
Enrollment gets one token refresh before it fails.

A child of a batch signals its parent once, the first time it settles (completed, a failed
state, or cancelled), so the batch can move on while a failed node waits for an operator.

Per-site concurrency (§4.4, open question 5): after load_site_config a run takes one of its
site's batch_max_parallel permits (activities/onboarding/site_slots.py) before its next stage,
waiting in the acquire activity's retries while the site is full, and gives it back whenever
the run stops: completed, failed (waiting for an operator holds no permit), frozen or
cancelled. An operator action that runs stages again takes a permit again.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from contracts.lifecycle import STOP_BEFORE_NEXT_STAGE_PATCH
    from contracts.onboarding import (
        ACQUIRE_SITE_SLOT_ACTIVITY,
        CHILD_SETTLED_SIGNAL,
        DEPLOY_STAGES,
        POST_DEPLOY_STAGES,
        REDEPLOY_SINCE_OPERATOR_PATCH,
        RELEASE_SITE_SLOT_ACTIVITY,
        SITE_SLOT_PATCH,
        STAGE_ORDER,
        WORKFLOW_NAME,
        ChildSettled,
        JobStatus,
        NodeObservation,
        OnboardInput,
        OnboardResult,
        OnboardState,
        OperatorAction,
        Progress,
        ProgressRecord,
        SiteConfig,
        SiteSlotRequest,
        Stage,
        StageInput,
        StageResult,
    )
    from contracts.onboarding_policy import ALLOWED_ACTIONS, checkpoint_for, outcome_for
    from core import search_attributes as sa
    from core.failures import FailureClass
    from workflows.lifecycle_job import (
        JobKind,
        OperatorControlledJob,
        StageFailure,
        StoppedBeforeNextStep,
        stage_failure_from,
    )

QUICK_TIMEOUT = timedelta(minutes=2)
ENROLLMENT_ATTEMPTS = 2  # §4.6: regenerate the token once, then fail
# §4.6 retry strategy per stage (attempts in total); unlisted stages: DEFAULT_ATTEMPTS.
STAGE_ATTEMPTS = {
    Stage.LOAD_SITE_CONFIG: 3,
    Stage.CREATE_OR_FIND_IN_MAAS: 3,
    Stage.COMMISSION_NODE: 3,
    Stage.DEPLOY_VIA_MAAS: 2,
    Stage.ENSURE_PXE_INTERFACE_AUTO: 2,
    Stage.RECOVER_FOR_DATASOURCE_RETRY: 2,
}
DEFAULT_ATTEMPTS = 3
ACTIVITY_NAMES = {stage: f"onboarding.{stage.value}" for stage in Stage}


@workflow.defn(name=WORKFLOW_NAME)
class MaasNodeOnboardWorkflow(OperatorControlledJob[Stage, OperatorAction, OnboardResult]):
    _kind = JobKind("onboarding", OperatorAction, ALLOWED_ACTIONS, outcome_for)

    def __init__(self) -> None:
        super().__init__(Stage.LOAD_SITE_CONFIG)
        self._input: OnboardInput | None = None
        self._site: SiteConfig | None = None
        self._state = OnboardState()
        self._parent_told = False
        self._holds_site_slot = False

    # ------------------------------------------------------------------ run

    @workflow.run
    async def run(self, input: OnboardInput) -> OnboardResult:
        self._input = input
        await self._set_status(
            JobStatus.RUNNING,
            workflow_run_id=workflow.info().run_id,
            domain_event="node.onboarding.started",
        )
        start = Stage.LOAD_SITE_CONFIG
        while True:
            outcome = await self._attempt(start)
            if outcome is not None:
                return outcome
            next_start = await self._await_operator()
            if next_start is None:
                return await self._cancel()
            start = next_start

    async def _attempt(self, start: Stage) -> OnboardResult | None:
        """Run from `start`; the result when the job closed, None when it failed and waits.
        An operator interrupt (cancel, mark manual) wins over whatever the stage then did: it
        may arrive between stages, or in the same step a stage finishes."""
        if self._interrupt is not None:
            return await self._interrupted()
        self._stage_task = asyncio.create_task(self._run_from(start))
        try:
            await self._stage_task
        except StageFailure as failure:
            if self._interrupt is None:
                await self._fail(failure)
                return None
            # An operator interrupt: the cancelled stage's failure is not the job's outcome.
            return await self._interrupted()
        except (asyncio.CancelledError, StoppedBeforeNextStep):
            if self._interrupt is None:  # the workflow itself was cancelled: compensate
                self._interrupt = OperatorAction.CANCEL
            return await self._interrupted()
        finally:
            self._stage_task = None
            await self._release_site_slot()
        if self._interrupt is not None:
            return await self._interrupted()
        final = JobStatus.RECONCILED if self._adopted else JobStatus.COMPLETED
        await self._set_status(final, domain_event="node.onboarding.completed", clear_error=True)
        await self._tell_parent()
        return self._result()

    async def _run_from(self, start: Stage) -> None:
        order = list(STAGE_ORDER)
        # The deploy stages run as one group (deploy, wait, and the recovery loop between),
        # at wait_for_deployed's place, entered where `start` says.
        in_group = start in DEPLOY_STAGES
        for stage in order[order.index(Stage.WAIT_FOR_DEPLOYED if in_group else start) :]:
            if stage == Stage.DEPLOY_VIA_MAAS:
                continue
            if stage != Stage.LOAD_SITE_CONFIG:
                await self._hold_site_slot(stage)
            if stage == Stage.WAIT_FOR_DEPLOYED:
                await self._deploy_group(start if in_group else Stage.DEPLOY_VIA_MAAS)
            elif stage == Stage.WAIT_FOR_AGENT_ENROLLMENT:
                await self._enrollment()
            else:
                await self._run_stage(stage)

    async def _deploy_group(self, entry: Stage) -> None:
        """deploy → wait; on failure classify → bounded datasource redeploy, else release to
        Ready and fail (§4.6)."""
        stage = entry
        while True:
            try:
                if stage == Stage.DEPLOY_VIA_MAAS:
                    await self._run_stage(Stage.DEPLOY_VIA_MAAS)
                    stage = Stage.WAIT_FOR_DEPLOYED
                if stage == Stage.WAIT_FOR_DEPLOYED:
                    await self._run_stage(Stage.WAIT_FOR_DEPLOYED)
                    return
                if stage == Stage.RECOVER_FOR_DATASOURCE_RETRY:
                    await self._run_stage(Stage.RECOVER_FOR_DATASOURCE_RETRY)
                    stage = Stage.DEPLOY_VIA_MAAS
                    continue
                if stage == Stage.CLASSIFY_DEPLOY_FAILURE:
                    raise StageFailure(
                        stage, FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value, "deploy_failed", "", {}
                    )
            except StageFailure as failure:
                if failure.failure_class != FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value:
                    raise
                stage = await self._after_deploy_failure(failure)

    async def _after_deploy_failure(self, failure: StageFailure[Stage]) -> Stage:
        result = await self._run_stage(Stage.CLASSIFY_DEPLOY_FAILURE)
        kind = str(result.details.get("failure_kind", "generic"))
        policy = self._site.policy if self._site else None
        # The first deploy since the operator's last action is no redeploy.
        deploys = self._state.deploy_attempts
        if workflow.patched(REDEPLOY_SINCE_OPERATOR_PATCH):
            deploys -= self._state.deploys_before_operator
        redeploys = max(deploys - 1, 0)
        if (
            kind == "datasource_like"
            and policy is not None
            and policy.enable_deploy_retry_on_datasource_failure
            and redeploys < policy.max_deploy_retry_attempts
        ):
            return Stage.RECOVER_FOR_DATASOURCE_RETRY
        # Compensation: the machine goes back to Ready before the job fails (§4.6).
        await self._run_stage(Stage.RECOVER_FOR_DATASOURCE_RETRY)
        code = (
            "deploy_datasource_retries_exhausted"
            if kind == "datasource_like"
            else failure.error_code
        )
        raise StageFailure(
            Stage.WAIT_FOR_DEPLOYED,
            FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value,
            code,
            f"{failure.message} ({kind}); the machine was released back to Ready",
            {**failure.details, "failure_kind": kind, "evidence": result.details.get("evidence")},
        )

    async def _enrollment(self) -> None:
        while True:
            try:
                await self._run_stage(Stage.WAIT_FOR_AGENT_ENROLLMENT)
                return
            except StageFailure as failure:
                if (
                    failure.error_code != "failed_enrollment"
                    or self._state.enrollment_attempts + 1 >= ENROLLMENT_ATTEMPTS
                ):
                    raise
                await self._run_stage(
                    Stage.WAIT_FOR_AGENT_ENROLLMENT, activity="onboarding.refresh_enrollment_token"
                )

    async def _run_stage(self, stage: Stage, *, activity: str | None = None) -> StageResult:
        assert self._input is not None
        self._stop_if_interrupted(STOP_BEFORE_NEXT_STAGE_PATCH)
        if stage in POST_DEPLOY_STAGES:
            self._state.os_running = True
        self._enter(stage)
        wait_seconds = self._wait_seconds(stage)
        try:
            result: StageResult = await workflow.execute_activity(
                activity or ACTIVITY_NAMES[stage],
                StageInput(self._input, self._site, self._state, self._entries[stage]),
                result_type=StageResult,
                start_to_close_timeout=timedelta(seconds=wait_seconds + 120),
                heartbeat_timeout=self._heartbeat_timeout(),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=1),
                    maximum_interval=timedelta(seconds=30),
                    maximum_attempts=STAGE_ATTEMPTS.get(stage, DEFAULT_ATTEMPTS),
                ),
            )
        except ActivityError as err:
            raise stage_failure_from(stage, err) from None
        self._state = result.state
        if result.site is not None:
            self._site = result.site
        node_id = result.details.get("node_id")
        if isinstance(node_id, str) and node_id != self._input.node_id:
            self._input.node_id = node_id  # a recovered duplicate node record (§4.6)
        return result

    async def _hold_site_slot(self, stage: Stage) -> None:
        """Take one of the site's permits before `stage` (a no-op while held). The acquire
        activity answers SITE_AT_CAPACITY until one is free; its retries are the queue, at
        the site's poll interval, for as long as it takes (an operator cancel stops it)."""
        if self._holds_site_slot or not workflow.patched(SITE_SLOT_PATCH):
            return
        assert self._input is not None
        poll_s = self._site.policy.maas_poll_interval_ms / 1000.0 if self._site else 10.0
        interval = timedelta(seconds=min(max(poll_s, 0.2), 10.0))
        try:
            await workflow.execute_activity(
                ACQUIRE_SITE_SLOT_ACTIVITY,
                SiteSlotRequest(self._input.site_id, self._input.onboarding_id),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(
                    initial_interval=interval,
                    backoff_coefficient=1.0,
                    maximum_interval=interval,
                    maximum_attempts=0,
                    non_retryable_error_types=["site_policy_missing"],
                ),
            )
        except ActivityError as err:
            raise stage_failure_from(stage, err) from None
        self._holds_site_slot = True

    async def _release_site_slot(self) -> None:
        if not self._holds_site_slot:
            return
        assert self._input is not None
        await workflow.execute_activity(
            RELEASE_SITE_SLOT_ACTIVITY,
            SiteSlotRequest(self._input.site_id, self._input.onboarding_id),
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)),
        )
        self._holds_site_slot = False

    def _wait_seconds(self, stage: Stage) -> int:
        return self._site.policy.stage_wait_seconds(stage) if self._site else 0

    def _heartbeat_timeout(self) -> timedelta:
        # Every stage heartbeats at least every few seconds (stage_runtime keep-alive), polls
        # after each MAAS check: a dead worker is noticed in seconds.
        poll_ms = self._site.policy.maas_poll_interval_ms if self._site else 10_000
        return timedelta(seconds=max(15.0, 3 * poll_ms / 1000.0 + 10))

    # ------------------------------------------------------------------ failure and actions

    async def _fail(self, failure: StageFailure[Stage], *, forced: JobStatus | None = None) -> None:
        self._observe_failure(failure)
        await super()._fail(failure, forced=forced)
        await self._tell_parent()

    def _observe_failure(self, failure: StageFailure[Stage]) -> None:
        """A stage that failed on what it saw in MAAS names that status (a commissioning that
        ended in Failed commissioning, a timeout): the job's last_maas_status is refreshed with
        it (§4.12). A failure the workflow built after later stages ran (the deploy group's,
        after the release to Ready) keeps what those stages saw."""
        seen = failure.details.get("maas_status")
        if failure.stage == self._stage and isinstance(seen, str):
            self._state.observed.maas_status = seen

    async def _await_operator(self) -> Stage | None:
        """Wait for an accepted action; answer where to start again (None: cancel)."""
        while True:
            action, failed_stage = await self._next_action(Stage.LOAD_SITE_CONFIG)
            if action == OperatorAction.CANCEL:
                return None
            self._state.deploys_before_operator = self._state.deploy_attempts
            if action == OperatorAction.RERUN:
                return Stage.LOAD_SITE_CONFIG
            if action == OperatorAction.RESTART_CLEAN:
                await self._compensate("restart_clean")
                self._state = OnboardState()
                self._adopted = False
                return Stage.LOAD_SITE_CONFIG
            if action in (OperatorAction.RETRY_STAGE, OperatorAction.RESUME):
                start = failed_stage
                if action == OperatorAction.RESUME:
                    start = checkpoint_for(failed_stage)
                if start == Stage.WAIT_FOR_AGENT_ENROLLMENT:
                    self._state.enrollment_attempts = 0  # a fresh token before failing again
                return start
            # adopt_observed_state
            try:
                adopted_start = await self._adopt()
            except StageFailure as failure:
                await self._fail(failure)
                continue
            if adopted_start is not None:
                return adopted_start

    async def _adopt(self) -> Stage | None:
        assert self._input is not None
        if self._site is None:
            await self._run_stage(Stage.LOAD_SITE_CONFIG)
        observation: NodeObservation = await workflow.execute_activity(
            "onboarding.observe",
            StageInput(self._input, self._site, self._state, 1),
            result_type=NodeObservation,
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        self._state = observation.state
        self._adopted = True
        status = observation.maas_status
        if observation.machine_present and status == "Deployed":
            # Hardware sync is an invariant (§9.1): adoption skips it only when this run has
            # already seen it healthy (it failed later, at enrollment). An operator who fixed
            # the node's sync by hand gets it verified, not re-seeded.
            failed_stage = self._failure.stage if self._failure else None
            if failed_stage == Stage.WAIT_FOR_AGENT_ENROLLMENT:
                return Stage.WAIT_FOR_AGENT_ENROLLMENT  # at once if the agent has enrolled
            if failed_stage == Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY:
                return Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY
            return Stage.ENSURE_HARDWARE_SYNC_CONFIGURED
        starts = {
            "Deploying": Stage.WAIT_FOR_DEPLOYED,
            "Ready": Stage.CONFIGURE_STORAGE,
            "Allocated": Stage.DEPLOY_VIA_MAAS,
            "Commissioning": Stage.WAIT_FOR_READY,
            "Testing": Stage.WAIT_FOR_READY,
            "New": Stage.COMMISSION_NODE,
        }
        if observation.machine_present and status in starts:
            return starts[status]
        if not observation.machine_present and self._state.system_id is None:
            return Stage.CREATE_OR_FIND_IN_MAAS
        self._adopted = False
        await self._fail(
            StageFailure(
                self._stage,
                FailureClass.STATE_AMBIGUITY.value,
                "cannot_adopt",
                f"nothing to adopt: the machine is {status or 'absent from MAAS'}",
                {"maas_status": status, "node_status": observation.node_status},
            )
        )
        return None

    async def _cancel(self) -> OnboardResult:
        await self._set_status(JobStatus.COMPENSATING)
        await self._compensate("cancel")
        await self._set_status(JobStatus.CANCELLED, domain_event="node.onboarding.cancelled")
        await self._tell_parent()
        return self._result()

    async def _compensate(self, mode: str) -> None:
        assert self._input is not None
        try:
            result: StageResult = await workflow.execute_activity(
                "onboarding.compensate",
                StageInput(self._input, self._site, self._state, 1, compensation=mode),
                result_type=StageResult,
                start_to_close_timeout=timedelta(
                    seconds=(self._site.policy.deploy_timeout_seconds if self._site else 600) + 120
                ),
                heartbeat_timeout=self._heartbeat_timeout(),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
            self._state = result.state
        except ActivityError as err:
            # Compensation that cannot finish is surfaced, never retried blindly.
            workflow.logger.warning("onboarding compensation failed: %s", err)

    # ------------------------------------------------------------------ bookkeeping

    def _progress(self, **fields: Any) -> Progress:
        return Progress(
            onboarding_id=self._input.onboarding_id if self._input else "",
            system_id=self._state.system_id,
            node_id=self._input.node_id if self._input else None,
            **fields,
        )

    def _progress_record(self, **fields: Any) -> ProgressRecord:
        assert self._input is not None
        return ProgressRecord(onboarding_id=self._input.onboarding_id, state=self._state, **fields)

    def _record_details(self) -> dict[str, Any]:
        assert self._input is not None
        return {"node_id": self._input.node_id}

    def _search_attributes(self) -> list[SearchAttributeUpdate[Any]]:
        assert self._input is not None
        updates: list[SearchAttributeUpdate[Any]] = [
            sa.SITE_ID.value_set(self._input.site_id),
            sa.HOSTNAME.value_set(self._input.hostname),
            sa.NODE_ID.value_set(self._input.node_id),
        ]
        if self._input.batch_id:
            updates.append(sa.BATCH_ID.value_set(self._input.batch_id))
        return updates

    async def _tell_parent(self) -> None:
        parent = workflow.info().parent
        if parent is None or self._parent_told or self._input is None:
            return
        self._parent_told = True
        failure = self._standing_failure()
        await workflow.get_external_workflow_handle(parent.workflow_id).signal(
            CHILD_SETTLED_SIGNAL,
            ChildSettled(
                onboarding_id=self._input.onboarding_id,
                status=self._status.value,
                failure_class=failure.failure_class if failure else None,
                error_code=failure.error_code if failure else None,
            ),
        )

    def _result(self) -> OnboardResult:
        assert self._input is not None
        failure = self._standing_failure()
        return OnboardResult(
            onboarding_id=self._input.onboarding_id,
            hostname=self._input.hostname,
            status=self._status.value,
            node_id=self._input.node_id,
            system_id=self._state.system_id,
            failure_class=failure.failure_class if failure else None,
            error_code=failure.error_code if failure else None,
        )
