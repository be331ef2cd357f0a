"""The MAAS stages of a decommission that onboarding already knows how to do
(docs/lifecycles/decommission.md#reimage Reimage: LoadSiteConfig, ConfigureStorage, ApplyRoCEPhase2,
EnsurePxeInterfaceAuto, RenderCloudInit, DeployViaMaas, WaitForMaasStatus Deployed, hardware sync,
WaitForAgentEnrollment), run with onboarding's own stage bodies so both lifecycles deploy a node the
same way.

`ReimageActivities` inherits the onboarding stage classes and overrides only `stage()`, the
bookkeeping around each body: events go to node_decommission_events instead of
node_onboarding_events. Onboarding's activities, names and behaviour are untouched; these are
registered under `decommission.*` names. The onboarding bodies take onboarding's StageInput, so
each call wraps the decommission's input: the onboarding id slot carries the decommission id
(used only for bookkeeping and the deploy comment), the node id is the node's own (reimage keeps
the node identity), and the OnboardState travels inside DecommissionState.onboard.

Reimage specifics on top of the bodies:
- deploy_via_maas issues a fresh enrollment token (as onboarding does for every deploy) and
  renders the cloud-init with it; the reimaged OS's agent enrolls again with the same node id.
- wait_for_agent_enrollment accepts an enrollment newer than the deploy. Onboarding's
  enrolling → active step does not apply (the node is draining); enable_node makes it active.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.cloud_init import CloudInitError, render_cloud_init
from activities.decommission import read_model
from activities.maas.errors import MaasNotFound
from activities.onboarding.maas_stages import MaasStageActivities
from activities.onboarding.node_stages import NodeStageActivities
from activities.onboarding.stage_errors import StageError, as_application_error, error_code_of
from activities.onboarding.stage_runtime import StageRun
from contracts import onboarding as ob
from contracts.decommission import EventStatus, StageInput, StageResult
from core.failures import ClassifiedError, FailureClass
from core.secrets import SecretStoreError
from schema.models import MaasSite


def onboard_input(input: StageInput, stage_attempt: int = 1) -> ob.StageInput:
    """The onboarding stage input standing for this decommission (see the module doc)."""
    dec, state = input.decommission, input.state
    if state.site_id is None or state.hostname is None:
        raise StageError(
            FailureClass.INPUT_CONFIG_ERROR,
            "not_maas_managed",
            "the node has no MAAS binding (site, machine)",
            non_retryable=True,
        )
    state.onboard.system_id = state.system_id
    return ob.StageInput(
        onboarding=ob.OnboardInput(
            onboarding_id=dec.decommission_id,
            site_id=state.site_id,
            profile_id=state.profile_id or "",
            sku_id=state.sku_id or "",
            hostname=state.hostname,
            ipmi_ip="",
            node_id=dec.node_id,
            requested_by=dec.requested_by,
        ),
        site=input.site,
        state=state.onboard,
        attempt=stage_attempt,
    )


class ReimageActivities(MaasStageActivities, NodeStageActivities):
    @contextlib.asynccontextmanager
    async def stage(self, input: ob.StageInput, stage: ob.Stage) -> AsyncIterator[StageRun]:
        """Onboarding's stage bookkeeping, written to the decommission's read model."""
        run = StageRun(input=input, stage=stage)
        decommission_id = uuid.UUID(input.onboarding.onboarding_id)
        attempt = activity.info().attempt if activity.in_activity() else input.attempt
        async with self.deps.sessions() as session, session.begin():
            await read_model.stage_started(session, decommission_id, stage.value, attempt)
        try:
            yield run
        except ClassifiedError as err:
            await self._record(decommission_id, run, attempt, EventStatus.FAILED, err.message, err)
            raise as_application_error(err) from err
        except SecretStoreError as err:
            wrapped = StageError(FailureClass.UPSTREAM_TRANSIENT, "vault_unavailable", str(err))
            await self._record(decommission_id, run, attempt, EventStatus.FAILED, str(err), wrapped)
            raise as_application_error(wrapped) from err
        if run.result is None:
            raise RuntimeError(f"stage {stage} finished without a result")
        status = EventStatus.SKIPPED if run.result.skipped else EventStatus.SUCCEEDED
        await self._record(decommission_id, run, attempt, status, run.result.message, None)

    async def _record(
        self,
        decommission_id: uuid.UUID,
        run: StageRun,
        attempt: int,
        status: EventStatus,
        message: str,
        error: ClassifiedError | None,
    ) -> None:
        details: dict[str, Any] = dict(run.result.details) if run.result else {}
        if error is not None:
            details.update(failure_class=error.failure_class.value, error_code=error_code_of(error))
        observed = run.input.state.observed
        with contextlib.suppress(Exception):  # bookkeeping never masks the stage's outcome
            async with self.deps.sessions() as session, session.begin():
                await read_model.stage_finished(
                    session,
                    decommission_id,
                    run.stage.value,
                    attempt,
                    status=status.value,
                    state=None,
                    message=message,
                    details=details,
                    maas=(observed.maas_status, observed.power_state)
                    if observed.maas_status
                    else None,
                )

    def _wrap(self, input: StageInput, result: ob.StageResult) -> StageResult:
        state = input.state
        state.onboard = result.state
        if result.state.observed.maas_status:
            state.maas_status = result.state.observed.maas_status
            state.power_state = result.state.observed.power_state
        return StageResult(
            state=state,
            message=result.message,
            details=result.details,
            skipped=result.skipped,
            site=result.site,
        )

    # ------------------------------------------------------------------ site

    @activity.defn(name="decommission.load_site_config")
    async def decommission_load_site_config(self, input: StageInput) -> StageResult:
        """§5.3/§5.4 LoadSiteConfig: the node's site (from its MAAS binding), policy, profile
        (the request's, else the one it was onboarded with, else the site's default) and SKU;
        the MAAS token from Vault, checked against MAAS. A node without a MAAS binding skips
        every MAAS stage."""
        if not input.state.maas_managed:
            async with self.deps.sessions() as session, session.begin():
                await read_model.add_event(
                    session,
                    uuid.UUID(input.decommission.decommission_id),
                    stage=ob.Stage.LOAD_SITE_CONFIG.value,
                    attempt=input.attempt,
                    status=EventStatus.SKIPPED.value,
                    message="the node is not MAAS-managed: no MAAS stages",
                )
            return StageResult(state=input.state, message="not MAAS-managed", skipped=True)
        if input.state.profile_id is None and input.state.site_id is not None:
            async with self.deps.sessions() as session:
                profile = await session.scalar(
                    select(MaasSite.default_profile_id).where(
                        MaasSite.id == uuid.UUID(input.state.site_id)
                    )
                )
            if profile is not None:
                input.state.profile_id = str(profile)
        result = await NodeStageActivities.load_site_config(self, onboard_input(input))
        wrapped_result = self._wrap(input, result)
        if input.state.system_id is not None and result.site is not None:
            # Record what MAAS shows before anything is changed (adopt and §5.8 read it).
            with contextlib.suppress(ClassifiedError, MaasNotFound):
                async with self.maas(result.site) as maas:
                    machine = await maas.get_machine(input.state.system_id)
                input.state.maas_status = machine.status.label
                input.state.power_state = str(machine.power_state)
        return wrapped_result

    # ------------------------------------------------------------------ reimage stages

    @activity.defn(name="decommission.configure_storage")
    async def decommission_configure_storage(self, input: StageInput) -> StageResult:
        return self._wrap(
            input, await MaasStageActivities.configure_storage(self, onboard_input(input))
        )

    @activity.defn(name="decommission.apply_roce_phase2")
    async def decommission_apply_roce_phase2(self, input: StageInput) -> StageResult:
        return self._wrap(
            input, await MaasStageActivities.apply_roce_phase2(self, onboard_input(input))
        )

    @activity.defn(name="decommission.ensure_pxe_interface_auto")
    async def decommission_ensure_pxe_interface_auto(self, input: StageInput) -> StageResult:
        return self._wrap(
            input, await MaasStageActivities.ensure_pxe_interface_auto(self, onboard_input(input))
        )

    @activity.defn(name="decommission.render_cloud_init")
    async def decommission_render_cloud_init(self, input: StageInput) -> StageResult:
        """§5.3 RenderCloudInit: the node record already exists (same identity), so only the
        render is proven here; deploy_via_maas renders it again with a fresh enrollment token,
        which therefore never has to be stored or passed through history."""
        wrapped = onboard_input(input)
        async with self.stage(wrapped, ob.Stage.RENDER_CLOUD_INIT) as run:
            spec = await self._cloud_init_spec(run, enrollment_token="gpe_" + "x" * 43)
            try:
                rendered = render_cloud_init(spec)
            except CloudInitError as err:
                raise StageError(
                    FailureClass.INPUT_CONFIG_ERROR,
                    "cloud_init_invalid",
                    str(err),
                    non_retryable=True,
                ) from err
            wrapped.state.cloud_init_layers = list(rendered.layers)
            run.done(wrapped.state, "cloud-init renders", layers=list(rendered.layers))
        assert run.result is not None
        return self._wrap(input, run.result)

    @activity.defn(name="decommission.deploy_via_maas")
    async def decommission_deploy_via_maas(self, input: StageInput) -> StageResult:
        return self._wrap(
            input, await NodeStageActivities.deploy_via_maas(self, onboard_input(input))
        )

    @activity.defn(name="decommission.wait_for_deployed")
    async def decommission_wait_for_deployed(self, input: StageInput) -> StageResult:
        """Onboarding's wait for Deployed. A deploy that ends in MAAS `Failed deployment` is
        classified at once with onboarding's own classifier (classify_deploy_failure: its
        `datasource_like | generic` verdict from the machine and its MAAS events, recorded as
        that stage's event), and the verdict travels in the failure's details (`failure_kind`,
        `evidence`): the workflow decides from it whether the site's bounded redeploy applies
        (docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions, issue 35)."""
        wrapped = onboard_input(input)
        try:
            result = await MaasStageActivities.wait_for_deployed(self, wrapped)
        except ApplicationError as err:
            if err.type != FailureClass.DEPLOY_CLOUD_INIT_FAILURE.value:
                raise
            raise await self._classified(input, err) from err
        return self._wrap(input, result)

    async def _classified(self, input: StageInput, err: ApplicationError) -> ApplicationError:
        """The failed deploy's ApplicationError with onboarding's classification added."""
        info: dict[str, Any] = {}
        if err.details and isinstance(err.details[0], dict):
            info = dict(err.details[0])
        details = dict(info.get("details") or {})
        try:
            verdict = await MaasStageActivities.classify_deploy_failure(self, onboard_input(input))
            details["failure_kind"] = str(verdict.details.get("failure_kind", "generic"))
            details["evidence"] = str(verdict.details.get("evidence", ""))[:300]
            if verdict.state.observed.maas_status:
                details["maas_status"] = verdict.state.observed.maas_status
        except Exception as exc:  # best effort, as the classifier itself: generic
            details["failure_kind"] = "generic"
            details["evidence"] = f"classification failed: {type(exc).__name__}"
        return ApplicationError(
            err.message,
            {"error_code": info.get("error_code") or "deploy_failed", "details": details},
            type=err.type,
            non_retryable=True,
        )

    @activity.defn(name="decommission.ensure_hardware_sync_configured")
    async def decommission_ensure_hardware_sync_configured(self, input: StageInput) -> StageResult:
        return self._wrap(
            input,
            await NodeStageActivities.ensure_hardware_sync_configured(self, onboard_input(input)),
        )

    @activity.defn(name="decommission.wait_for_hardware_sync_healthy")
    async def decommission_wait_for_hardware_sync_healthy(self, input: StageInput) -> StageResult:
        return self._wrap(
            input,
            await NodeStageActivities.wait_for_hardware_sync_healthy(self, onboard_input(input)),
        )

    @activity.defn(name="decommission.wait_for_agent_enrollment")
    async def decommission_wait_for_agent_enrollment(self, input: StageInput) -> StageResult:
        """The reimaged OS's agent enrolled after the deploy was issued. Onboarding's body
        also refreshes the node's MAAS binding; its enrolling → active step matches nothing
        here (the node is draining), and enable_node activates it."""
        return self._wrap(
            input,
            await NodeStageActivities.wait_for_agent_enrollment(self, onboard_input(input)),
        )
