"""The onboarding stages that join MAAS with our own records (docs/lifecycles/onboarding.md#stages):
the site config, the node record and its cloud-init, the deploy itself, hardware sync (§9.1) and
agent enrollment, plus what the workflow needs for operator actions (observe, compensate, refresh
the token) and its own read-model writes (`record_progress`, a local activity).

Secrets never leave these activities: the enrollment token and the cloud-init content are made
inside `deploy_via_maas` (a fresh token per deploy) and handed straight to MAAS; the deploy
password and the machine token are read where they are used.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio import activity

from activities.cloud_init import (
    AgentBootstrap,
    CloudInitError,
    CloudInitInput,
    DeployUser,
    MaasMachineCredentials,
    NodeFacts,
    SiteFacts,
    hardware_sync_minutes,
    hash_deploy_password,
    render_agent_toml,
    render_cloud_init,
    render_machine_creds,
)
from activities.cloud_init import RoceAssignment as CloudInitRoce
from activities.enrollment_tokens import issue_enrollment_token
from activities.maas.client import MaasClient
from activities.maas.errors import MaasNotAdmin, MaasNotFound
from activities.maas.types import Machine, MachineStatus
from activities.node_lifecycle import transition_node
from activities.onboarding import read_model
from activities.onboarding.host_access import SshLogin
from activities.onboarding.maas_stages import (
    RELEASABLE,
    get_machine_or_ambiguity,
    release_to_ready,
)
from activities.onboarding.stage_errors import StageError, as_application_error
from activities.onboarding.stage_runtime import (
    StageActivitiesBase,
    StageRun,
    observe,
    poll_until,
    timeout_error,
)
from contracts.onboarding import (
    NodeObservation,
    OnboardState,
    ProgressRecord,
    SiteConfig,
    Stage,
    StageInput,
    StageResult,
    profile_value,
    resolve_policy,
)
from contracts.states import NodeStatus
from core.failures import ClassifiedError, FailureClass
from schema.models import (
    GpuSlot,
    MaasRoceAssignment,
    MaasSite,
    MaasSitePolicy,
    MaasSiteProfile,
    Node,
    NodeEnrollmentToken,
    NodeMaasState,
    NodeOnboarding,
    NodeOnboardingEvent,
    Sku,
)

S = MachineStatus
CREATED_BY = "onboarding"
ONBOARDING_ACTOR = "onboarding"  # who moved the node, in its node.status_changed events
SSH_PORT = 22
NODE_AGENT_ACCESS = "node_agent"  # host work goes through the node's agent
# (docs/lifecycles/node.md#access-fields)
# The deploy_via_maas event detail that says this job asked MAAS to deploy that machine.
DEPLOYED_BY_JOB = "deployed_by_job"


class NodeStageActivities(StageActivitiesBase):
    # ------------------------------------------------------------------ site config

    @activity.defn(name="onboarding.load_site_config")
    async def load_site_config(self, input: StageInput) -> StageResult:
        """Site, policy, profile and SKU from the database; the MAAS token from Vault, checked
        against MAAS (§4.14 preflight: site active, MAAS reachable, token valid and an admin's:
        a non-admin's key would pass `version/` and fail at the first accept or commission)."""
        async with self.stage(input, Stage.LOAD_SITE_CONFIG) as run:
            site = await self._site_config(input)
            async with self.maas(site) as maas:
                version = await maas.version()
                try:
                    await maas.require_admin()
                except MaasNotAdmin as err:
                    raise StageError(
                        FailureClass.SITE_CAPABILITY_MISSING,
                        "maas_token_not_admin",
                        err.message,
                        details={"maas_username": err.username},
                        non_retryable=True,
                    ) from err
            site.maas_version = version.version
            run.result = StageResult(
                state=input.state,
                message=f"site {site.site_name}, MAAS {version.version}",
                site=site,
            )
        assert run.result is not None
        return run.result

    async def _site_config(self, input: StageInput) -> SiteConfig:
        ob = input.onboarding

        def bad_input(code: str, message: str) -> StageError:
            return StageError(FailureClass.INPUT_CONFIG_ERROR, code, message, non_retryable=True)

        async with self.deps.sessions() as session:
            site = await session.get(MaasSite, uuid.UUID(ob.site_id))
            policy = await session.get(MaasSitePolicy, uuid.UUID(ob.site_id))
            profile = await session.get(MaasSiteProfile, uuid.UUID(ob.profile_id))
            if site is None or policy is None:
                raise bad_input("unknown_site", f"MAAS site {ob.site_id} does not exist")
            if site.status != "active":
                raise bad_input("site_disabled", f"MAAS site {site.name} is disabled")
            if profile is None or profile.site_id != site.id:
                raise bad_input("unknown_profile", f"profile {ob.profile_id} is not this site's")
            sku = await session.get(Sku, (ob.sku_id, site.region_code))
            if sku is None or not sku.active:
                raise bad_input("unknown_sku", f"SKU {ob.sku_id} is not sold in {site.region_code}")
            return SiteConfig(
                site_id=str(site.id),
                site_name=site.name,
                region_code=site.region_code,
                api_base_url=site.api_base_url,
                api_token_vault_path=site.api_token_vault_path,
                deploy_password_vault_path=site.deploy_password_vault_path,
                pxe_vlan_vid=profile_value(profile, site, "pxe_vlan_vid"),
                node_pxe_iface=profile_value(profile, site, "node_pxe_iface"),
                deploy_user=site.deploy_user,
                deploy_ssh_iface=site.deploy_ssh_iface,
                upstream_dns_servers=list(site.upstream_dns_servers or []),
                distro_series=profile_value(profile, site, "distro_series"),
                architecture=profile_value(profile, site, "architecture"),
                sku_id=sku.name,
                gpu_count=max(sku.allowed_gpu_counts),
                policy=resolve_policy(policy, profile),
            )

    # ------------------------------------------------------------------ node record

    @activity.defn(name="onboarding.render_cloud_init")
    async def render_cloud_init(self, input: StageInput) -> StageResult:
        """Create (or recover) the node record in `enrolling`, and prove the cloud-init renders
        for this site and node. The content deployed is rendered again at deploy time with a
        fresh enrollment token, so it never has to be stored or passed around."""
        async with self.stage(input, Stage.RENDER_CLOUD_INIT) as run:
            node_id, how = await self._ensure_node(run)
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
            state = input.state
            state.cloud_init_layers = list(rendered.layers)
            run.done(
                state,
                f"node {how}; cloud-init renders",
                node_id=node_id,
                layers=state.cloud_init_layers,
            )
        assert run.result is not None
        return run.result

    async def _ensure_node(self, run: StageRun) -> tuple[str, str]:
        ob, site = run.input.onboarding, run.site
        node_id = uuid.UUID(ob.node_id)
        async with self.deps.sessions() as session, session.begin():
            existing = await session.scalar(
                select(Node).where(Node.hostname == ob.hostname, Node.status != NodeStatus.DELETED)
            )
            if existing is not None and existing.id != node_id:
                recoverable = existing.onboarding_mode == "maas" and existing.status in (
                    NodeStatus.ENROLLING,
                    NodeStatus.BOOTSTRAP_ISSUED,
                )
                if not recoverable:
                    raise StageError(
                        FailureClass.STATE_AMBIGUITY,
                        "node_exists",
                        f"node {existing.id} already holds hostname {ob.hostname} "
                        f"({existing.status})",
                        details={"node_id": str(existing.id)},
                        non_retryable=True,
                    )
                # §4.6: a duplicate node record is recovered, not duplicated.
                await transition_node(
                    session,
                    existing.id,
                    [NodeStatus.BOOTSTRAP_ISSUED],
                    NodeStatus.ENROLLING,
                    actor=ONBOARDING_ACTOR,
                    reason="onboarding recovered the node record",
                )
                await self._set_job_node(session, run, existing.id)
                run.input.onboarding.node_id = str(existing.id)
                return str(existing.id), "recovered"
            if existing is not None:
                return str(node_id), "already created"
            await session.execute(
                insert(Node)
                .values(
                    id=node_id,
                    hostname=ob.hostname,
                    region=site.region_code,
                    sku=site.sku_id,
                    status=NodeStatus.ENROLLING,
                    gpu_count=site.gpu_count,
                    onboarding_mode="maas",
                    # §8.1: the node is reached as the deploy user its cloud-init creates, over
                    # SSH's port, and run through its agent; host is set once it is deployed.
                    port=SSH_PORT,
                    ssh_username=site.deploy_user,
                    access_method=NODE_AGENT_ACCESS,
                )
                .on_conflict_do_nothing(index_elements=[Node.id])
            )
            return str(node_id), "created"

    @staticmethod
    async def _set_job_node(session: AsyncSession, run: StageRun, node_id: uuid.UUID) -> None:
        await session.execute(
            update(NodeOnboarding)
            .where(NodeOnboarding.onboarding_id == run.onboarding_id)
            .values(node_id=node_id)
        )

    async def _cloud_init_spec(self, run: StageRun, *, enrollment_token: str) -> CloudInitInput:
        site, ob = run.site, run.input.onboarding
        password = await self.read_secret(
            site.deploy_password_vault_path, "password", "deploy_password"
        )
        async with self.deps.sessions() as session:
            roce = (
                await session.execute(
                    select(MaasRoceAssignment.interface, MaasRoceAssignment.ipv4_cidr).where(
                        MaasRoceAssignment.site_id == uuid.UUID(site.site_id),
                        MaasRoceAssignment.hostname == ob.hostname,
                    )
                )
            ).all()
        return CloudInitInput(
            site=SiteFacts(
                name=site.site_name,
                deploy_user=DeployUser(
                    name=site.deploy_user, password_hash=hash_deploy_password(password)
                ),
                hardware_sync_interval=site.policy.hardware_sync_interval,
                upstream_dns_servers=tuple(site.upstream_dns_servers),
                site_bootstrap_bundle_ref=site.policy.site_bootstrap_bundle_ref,
            ),
            node=NodeFacts(
                hostname=ob.hostname,
                maas_system_id=run.system_id,
                maas_url=site.api_base_url,
            ),
            agent=AgentBootstrap(
                api_url=self.deps.api_url,
                enrollment_token=enrollment_token,
                storage_export_root=self.deps.storage_export_root,
            ),
            roce=tuple(CloudInitRoce(i, c) for i, c in roce)
            if site.policy.enable_phase2_roce
            else (),
        )

    # ------------------------------------------------------------------ deploy

    @activity.defn(name="onboarding.deploy_via_maas")
    async def deploy_via_maas(self, input: StageInput) -> StageResult:
        """Never deploy blindly (§4.10): a machine already Deploying or Deployed is adopted; a
        Failed deployment goes to the classify/recover path instead of a second deploy."""
        async with self.stage(input, Stage.DEPLOY_VIA_MAAS) as run, self.maas(run.site) as maas:
            machine = await get_machine_or_ambiguity(maas, run.system_id)
            state = observe(input.state, machine)
            if machine.status in (S.DEPLOYING, S.DEPLOYED):
                if state.deployed_since is None:
                    node_id = uuid.UUID(input.onboarding.node_id)
                    state.deployed_since = await self._deploy_issued_at(node_id)
                run.skipped(state, f"already {machine.status.label}; adopted")
            elif machine.status == S.FAILED_DEPLOYMENT:
                raise StageError(
                    FailureClass.DEPLOY_CLOUD_INIT_FAILURE,
                    "deploy_failed",
                    f"the machine is in Failed deployment: {machine.error_description}",
                    non_retryable=True,
                )
            elif machine.status not in (S.READY, S.ALLOCATED):
                raise StageError(
                    FailureClass.STATE_AMBIGUITY,
                    "not_deployable",
                    f"cannot deploy a machine in {machine.status.label}",
                    non_retryable=True,
                )
            else:
                await self._deploy(run, maas, state)
        assert run.result is not None
        return run.result

    async def _deploy(self, run: StageRun, maas: MaasClient, state: OnboardState) -> None:
        site = run.site
        node_id = uuid.UUID(run.input.onboarding.node_id)
        async with self.deps.sessions() as session, session.begin():
            await _expire_unused_tokens(session, node_id)
            _, token = await issue_enrollment_token(
                session,
                node_id,
                created_by=CREATED_BY,
                ttl_seconds=site.policy.enrollment_token_ttl_seconds,
            )
            issued_at = await session.scalar(select(func.clock_timestamp()))
            # The read model records, before MAAS is asked, that this job deploys the machine:
            # compensation releases only a machine this job deployed (issue 35), also when
            # this attempt dies after asking MAAS and a retry finds the deploy under way. (A
            # reimage runs this stage for a decommission, which has no onboarding row.)
            job = await session.scalar(
                select(NodeOnboarding.onboarding_id).where(
                    NodeOnboarding.onboarding_id == run.onboarding_id
                )
            )
            if job is not None:
                await read_model.add_event(
                    session,
                    run.onboarding_id,
                    stage=Stage.DEPLOY_VIA_MAAS.value,
                    attempt=run.input.attempt,
                    status="started",
                    message=f"deploy of {run.system_id} requested by this job",
                    details={DEPLOYED_BY_JOB: run.system_id},
                )
            # A fresh OS: what the node's GPUs are is unknown until this deployment's agent
            # reports them. The enrollment stage waits for that report (inventory_matches set
            # again by its first heartbeat), so a reimage never activates on the last OS's one.
            await session.execute(
                update(Node)
                .where(Node.id == node_id)
                .values(gpu_inventory=[], inventory_matches=None, updated_at=func.now())
            )
        spec = await self._cloud_init_spec(run, enrollment_token=token)
        rendered = render_cloud_init(spec)
        del token, spec
        machine = await maas.deploy(
            run.system_id,
            distro_series=site.distro_series,
            user_data=rendered.content,
            enable_hw_sync=site.policy.require_hw_sync,
            comment=f"gpucloud onboarding {run.input.onboarding.onboarding_id}",
        )
        state.cloud_init_version = rendered.version
        state.deployed_since = issued_at.isoformat() if issued_at else None
        state.deploy_attempts += 1
        run.done(observe(state, machine), "deploy issued", cloud_init_version=rendered.version)

    async def _deploy_issued_at(self, node_id: uuid.UUID) -> str:
        """When the deploy MAAS is running was issued, for a retried stage that finds it already
        under way (its first attempt died after asking MAAS): the node's newest enrollment
        token, the one that deploy's cloud-init carries. Not now: the agent of that deploy may
        have enrolled already, and an enrollment before `deployed_since` does not count."""
        async with self.deps.sessions() as session:
            issued = await session.scalar(
                select(
                    func.coalesce(func.max(NodeEnrollmentToken.created_at), func.clock_timestamp())
                ).where(NodeEnrollmentToken.node_id == node_id)
            )
        assert isinstance(issued, dt.datetime)
        return issued.isoformat()

    # ------------------------------------------------------------------ hardware sync

    @activity.defn(name="onboarding.ensure_hardware_sync_configured")
    async def ensure_hardware_sync_configured(self, input: StageInput) -> StageResult:
        async with self.stage(input, Stage.ENSURE_HARDWARE_SYNC_CONFIGURED) as run:
            if not run.site.policy.require_hw_sync:
                run.skipped(input.state, "hardware sync is not required by this site")
            else:
                async with self.maas(run.site) as maas:
                    machine, address = await self._seed(run, maas)
                    run.done(observe(input.state, machine), f"seeded over SSH at {address}")
        assert run.result is not None
        return run.result

    async def _current_hw_sync_interval(self, site_id: str) -> str | None:
        """The site policy's hardware_sync_interval as it is now (None without a policy row)."""
        async with self.deps.sessions() as session:
            value = await session.scalar(
                select(MaasSitePolicy.hardware_sync_interval).where(
                    MaasSitePolicy.site_id == uuid.UUID(site_id)
                )
            )
        return str(value) if value else None

    async def _seed(self, run: StageRun, maas: MaasClient) -> tuple[Machine, str]:
        """§9.1 re-sync steps 2-5: enable_hw_sync, the machine token (waiting for MAAS to make
        it), the credentials file and the timer pushed over SSH."""
        site = run.site
        # Step 1: MAAS's global hardware_sync_interval, which MAAS copies into the machine's
        # sync_interval when enable_hw_sync is saved (step 2). The site reconciler owns the
        # site-wide MAAS settings (it writes them from the site's current policy on each run,
        # activities/maas_reconcile.py); this job only makes MAAS agree with the site's policy
        # as it reads it NOW, right before step 2, never with the value it loaded at its start
        # (a job doing that made the last job to run win, whatever the site said by then).
        current = await self._current_hw_sync_interval(run.input.onboarding.site_id)
        if current is not None:
            await maas.ensure_hardware_sync_interval(current)
        await maas.update_machine(run.system_id, enable_hw_sync=True)

        async def token_ready() -> object | None:
            return await maas.get_machine_token(run.system_id)

        token = await poll_until(site, site.policy.hw_sync_seed_timeout_seconds, token_ready)
        if token is None:
            raise timeout_error("hw_sync_seed", "MAAS never issued the machine's token")
        machine = await get_machine_or_ambiguity(maas, run.system_id)
        address = await self._ssh_address(maas, site, machine)
        creds = render_machine_creds(
            NodeFacts(run.input.onboarding.hostname, run.system_id, site.api_base_url),
            MaasMachineCredentials.from_token(token),
        )
        login = await self._ssh_login(site, address)
        last_error: ClassifiedError | None = None

        async def pushed() -> bool | None:
            nonlocal last_error
            try:
                await self.deps.host_access.seeder.seed_hardware_sync(
                    login,
                    creds_yaml=creds,
                    interval_minutes=hardware_sync_minutes(site.policy.hardware_sync_interval),
                )
                return True
            except ClassifiedError as err:
                last_error = err
                return None

        if await poll_until(site, site.policy.hw_sync_seed_timeout_seconds, pushed) is None:
            message = last_error.message if last_error else "the SSH seed never succeeded"
            raise StageError(
                FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
                "hw_sync_seed_push_failed",
                message,
                details={"address": address},
                non_retryable=True,
            )
        return machine, address

    async def _ssh_address(self, maas: MaasClient, site: SiteConfig, machine: Machine) -> str:
        """The site's deploy SSH interface's address, else the first deployed IP (§4.3)."""
        for iface in await maas.list_interfaces(machine.system_id):
            if iface.name == site.deploy_ssh_iface:
                for link in iface.links:
                    if link.ip_address:
                        return str(link.ip_address)
        if machine.ip_addresses:
            return machine.ip_addresses[0]
        raise StageError(
            FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE,
            "no_ssh_address",
            "MAAS reports no address to reach the deployed host",
            non_retryable=True,
        )

    async def _ssh_login(self, site: SiteConfig, address: str) -> SshLogin:
        password = await self.read_secret(
            site.deploy_password_vault_path, "password", "deploy_password"
        )
        return SshLogin(address=address, user=site.deploy_user, password=password)

    @activity.defn(name="onboarding.wait_for_hardware_sync_healthy")
    async def wait_for_hardware_sync_healthy(self, input: StageInput) -> StageResult:
        """Healthy means a sync MAAS observed *after* this stage began (a fresh last_sync,
        §9.1 step 6), not the timestamp deployment left behind. Reseeds periodically."""
        async with self.stage(input, Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY) as run:
            site = run.site
            if not site.policy.require_hw_sync:
                run.skipped(input.state, "hardware sync is not required by this site")
            else:
                async with self.maas(site) as maas:
                    first = await get_machine_or_ambiguity(maas, run.system_id)
                    if not first.hardware_sync.available:
                        # A MAAS build whose machine read has no REST sync fields (before
                        # 3.4): nothing here can ever turn healthy, so do not wait for it.
                        # The seed is in place (previous stage); the health cannot be
                        # verified through the REST API, and the stage says so (§9.1:
                        # is_sync_healthy may be null on builds that omit it).
                        warning = (
                            "MAAS does not expose the hardware-sync fields on machines "
                            f"(version {site.maas_version or 'unknown'}); sync health cannot "
                            "be verified through the REST API"
                        )
                        run.done(
                            observe(input.state, first),
                            "hardware sync seeded; health unverifiable on this MAAS build",
                            warning=warning,
                            hw_sync_verifiable=False,
                            warning_code="hw_sync_unverifiable",
                        )
                        assert run.result is not None
                        return run.result
                    baseline = first.hardware_sync.last_sync
                    reseed_every = max(site.policy.hw_sync_health_timeout_seconds / 4, 1.0)
                    next_reseed = [dt.datetime.now(dt.UTC) + dt.timedelta(seconds=reseed_every)]
                    last: list[Machine] = [first]

                    async def healthy() -> Machine | None:
                        machine = await get_machine_or_ambiguity(maas, run.system_id)
                        last[0] = machine
                        sync = machine.hardware_sync
                        now = dt.datetime.now(dt.UTC)
                        fresh = sync.last_sync is not None and (
                            baseline is None or sync.last_sync > baseline
                        )
                        if sync.enabled and fresh and (sync.healthy(now) or not sync.available):
                            return machine
                        if now >= next_reseed[0]:
                            next_reseed[0] = now + dt.timedelta(seconds=reseed_every)
                            try:
                                await self._seed(run, maas)
                            except ClassifiedError as err:
                                activity.logger.warning("hardware-sync reseed failed: %s", err)
                        return None

                    machine = await poll_until(
                        site,
                        site.policy.hw_sync_health_timeout_seconds,
                        healthy,
                        progress=lambda: {
                            "last_sync": str(last[0].hardware_sync.last_sync),
                            "enabled": last[0].hardware_sync.enabled,
                        },
                    )
                    if machine is None:
                        raise timeout_error(
                            "hw_sync_health",
                            "MAAS never observed a fresh hardware sync from the node",
                            last_sync=str(last[0].hardware_sync.last_sync),
                        )
                    run.done(observe(input.state, machine), "hardware sync healthy")
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ enrollment

    @activity.defn(name="onboarding.wait_for_agent_enrollment")
    async def wait_for_agent_enrollment(self, input: StageInput) -> StageResult:
        """The node's agent enrolled since the deploy AND reported its GPU inventory (its first
        heartbeat, right after enrolling): only then is the node active, with GPU slots made
        from that inventory. An enrolled agent that never reports fails like a missing
        enrollment (failed_enrollment: the workflow pushes a fresh token, which restarts it)."""
        async with self.stage(input, Stage.WAIT_FOR_AGENT_ENROLLMENT) as run:
            site = run.site
            node_id = uuid.UUID(input.onboarding.node_id)
            seen = {"enrolled": False, "inventory_reported": False}

            async def reported() -> bool | None:
                enrolled, inventory = await self._enrollment(node_id, input.state)
                seen.update(enrolled=enrolled, inventory_reported=inventory is not None)
                return True if enrolled and inventory is not None else None

            found = await poll_until(
                site, site.policy.enrollment_timeout_seconds, reported, progress=lambda: seen
            )
            if found is None:
                raise timeout_error(
                    "enrollment",
                    "the node agent enrolled but did not report its GPU inventory in time"
                    if seen["enrolled"]
                    else "the node agent did not enroll in time",
                    attempt=input.state.enrollment_attempts + 1,
                    **seen,
                )
            activation = await self._activate(run)
            run.done(
                input.state,
                f"agent enrolled; {activation.describe()}; node active",
                node_id=str(node_id),
                gpus=activation.gpus,
                slots_created=activation.slots_created,
            )
        assert run.result is not None
        return run.result

    async def _enrolled(self, node_id: uuid.UUID, state: OnboardState) -> bool:
        return (await self._enrollment(node_id, state))[0]

    async def _enrollment(
        self, node_id: uuid.UUID, state: OnboardState
    ) -> tuple[bool, list[dict[str, Any]] | None]:
        """(enrolled since the deploy, the GPU inventory its agent reported or None)."""
        since = dt.datetime.fromisoformat(state.deployed_since) if state.deployed_since else None
        async with self.deps.sessions() as session:
            row = (
                await session.execute(
                    select(Node.enrolled_at, Node.gpu_inventory, Node.inventory_matches).where(
                        Node.id == node_id
                    )
                )
            ).first()
        if row is None:
            return False, None
        enrolled_at, inventory, matches = row
        enrolled = enrolled_at is not None and (since is None or enrolled_at >= since)
        return enrolled, _reported(inventory, matches)

    async def _activate(self, run: StageRun) -> _Activation:
        """enrolling → active (the onboarding workflow owns this transition,
        docs/lifecycles/node.md#who-moves-it), the node's MAAS binding, and its GPU slots from the
        inventory its agent reported, in one transaction. The node row is locked first, so a
        heartbeat cannot change the inventory between the check and the slots made from it."""
        state, site = run.input.state, run.site
        node_id = uuid.UUID(run.input.onboarding.node_id)
        async with self.deps.sessions() as session, session.begin():
            node = (
                await session.execute(
                    select(Node.gpu_inventory, Node.inventory_matches, Node.numa_layout)
                    .where(Node.id == node_id)
                    .with_for_update()
                )
            ).first()
            inventory = _reported(*node[:2]) if node is not None else None
            if node is None or inventory is None:
                raise StageError(
                    FailureClass.AGENT_ENROLLMENT_FAILURE,
                    "no_gpu_inventory",
                    "the node agent has not reported its GPU inventory",
                )
            gpus = [_inventory_gpu(g) for g in inventory]
            if len(gpus) != site.gpu_count:
                # Never a silently smaller (or larger) node: placement would offer GPUs the
                # hardware does not have. The node stays enrolling, out of placement.
                raise StageError(
                    FailureClass.HARDWARE_MISMATCH,
                    "gpu_count_mismatch",
                    f"the node agent reports {len(gpus)} GPU(s); SKU {site.sku_id} has "
                    f"{site.gpu_count}",
                    details={
                        "reported": len(gpus),
                        "expected": site.gpu_count,
                        "pci_addresses": [pci for pci, _ in gpus][:16],
                    },
                    non_retryable=True,
                )
            has_slots = await session.scalar(
                select(func.count()).select_from(GpuSlot).where(GpuSlot.node_id == node_id)
            )
            node_values: dict[str, Any] = {"updated_at": func.now()}
            if not has_slots:
                # Index = the agent's order (PCI bus order, as NVML enumerates). A reimaged node
                # keeps the slots it has: the heartbeats flag any change of hardware.
                await session.execute(
                    insert(GpuSlot),
                    [
                        {
                            "id": uuid.uuid4(),
                            "node_id": node_id,
                            "gpu_index": index,
                            "numa_node": numa,
                            "pci_address": pci,
                        }
                        for index, (pci, numa) in enumerate(gpus)
                    ],
                )
                node_values["inventory_matches"] = True  # the slots are that inventory
            if not node[2]:
                # What the inventory tells of the NUMA layout: each NUMA node's GPUs (CPUs and
                # memory per node are not reported; the hypervisor reads those from the host).
                per_numa = Counter(numa for _, numa in gpus)
                node_values["numa_layout"] = [
                    {"numa_node": numa, "gpus": count} for numa, count in sorted(per_numa.items())
                ]
            await session.execute(update(Node).where(Node.id == node_id).values(**node_values))
            await transition_node(
                session,
                node_id,
                [NodeStatus.ENROLLING],
                NodeStatus.ACTIVE,
                actor=ONBOARDING_ACTOR,
                reason="agent enrolled and reported its inventory",
            )
            binding = {
                "site_id": uuid.UUID(site.site_id),
                "maas_system_id": run.system_id,
                "last_maas_status": state.observed.maas_status,
                "last_maas_power_state": state.observed.power_state,
                "last_maas_ips": list(state.observed.ip_addresses),
            }
            await session.execute(
                insert(NodeMaasState)
                .values(node_id=node_id, **binding)
                .on_conflict_do_update(index_elements=[NodeMaasState.node_id], set_=binding)
            )
        return _Activation(gpus=len(gpus), slots_created=not has_slots)

    @activity.defn(name="onboarding.refresh_enrollment_token")
    async def refresh_enrollment_token(self, input: StageInput) -> StageResult:
        """§4.6 WaitForAgentEnrollment: a fresh token pushed to the running OS, then wait again."""
        async with self.stage(input, Stage.WAIT_FOR_AGENT_ENROLLMENT) as run:
            site = run.site
            node_id = uuid.UUID(input.onboarding.node_id)
            async with self.deps.sessions() as session, session.begin():
                await _expire_unused_tokens(session, node_id)
                _, token = await issue_enrollment_token(
                    session,
                    node_id,
                    created_by=CREATED_BY,
                    ttl_seconds=site.policy.enrollment_token_ttl_seconds,
                )
            agent_toml = render_agent_toml(
                AgentBootstrap(
                    api_url=self.deps.api_url,
                    enrollment_token=token,
                    storage_export_root=self.deps.storage_export_root,
                )
            )
            del token
            async with self.maas(site) as maas:
                machine = await get_machine_or_ambiguity(maas, run.system_id)
                address = await self._ssh_address(maas, site, machine)
            login = await self._ssh_login(site, address)
            await self.deps.host_access.seeder.push_agent_config(login, agent_toml=agent_toml)
            state = input.state
            state.enrollment_attempts += 1
            run.done(state, "fresh enrollment token pushed to the node", address=address)
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ operator support

    @activity.defn(name="onboarding.observe")
    async def observe_state(self, input: StageInput) -> NodeObservation:
        """What MAAS and the node record say now, for adopt_observed_state (§4.13)."""
        state = input.state
        machine_present, maas_status = False, None
        if input.site is not None and state.system_id is not None:
            async with self.maas(input.site) as maas:
                try:
                    machine = await maas.get_machine(state.system_id)
                    machine_present, maas_status = True, machine.status.label
                    observe(state, machine)
                except MaasNotFound:
                    pass
        node_id = uuid.UUID(input.onboarding.node_id)
        async with self.deps.sessions() as session:
            node_status = await session.scalar(select(Node.status).where(Node.id == node_id))
        return NodeObservation(
            machine_present=machine_present,
            maas_status=maas_status,
            node_status=node_status,
            enrolled_since_deploy=await self._enrolled(node_id, state),
            state=state,
        )

    @activity.defn(name="onboarding.activate_adopted")
    async def activate_adopted(self, input: StageInput) -> StageResult:
        """Adopt a late success: the agent enrolled after the workflow gave up (§4.13)."""
        async with self.stage(input, Stage.WAIT_FOR_AGENT_ENROLLMENT) as run:
            activation = await self._activate(run)
            run.done(input.state, f"late enrollment adopted; {activation.describe()}; node active")
        assert run.result is not None
        return run.result

    @activity.defn(name="onboarding.compensate")
    async def compensate(self, input: StageInput) -> StageResult:
        """Cancel / restart_clean compensation (§4.6). Before the OS runs: a machine the
        deploy took goes back to Ready, unused enrollment tokens are consumed and the node
        record (never enrolled) is deleted. After it (the node enrolled, or post-deploy
        stages began): MAAS is left alone and an enrolling node is quarantined."""
        notes: list[str] = []
        state = input.state
        node_id = uuid.UUID(input.onboarding.node_id)
        onboarding_id = uuid.UUID(input.onboarding.onboarding_id)
        async with self.deps.sessions() as session:
            node = await session.get(Node, node_id)
        # restart_clean starts over from bare metal: it releases a deployed machine too.
        os_running = input.compensation != "restart_clean" and (
            state.os_running or (node is not None and node.enrolled_at is not None)
        )
        try:
            if input.site is not None and state.system_id is not None and not os_running:
                # Only a machine this job deployed goes back to Ready (issue 35): one it found
                # Deployed (or Deploying, Allocated) is someone else's, and is left alone.
                ours = state.deploy_attempts > 0 or await _deployed_by_job(
                    self.deps.sessions, onboarding_id, state.system_id
                )
                async with self.maas(input.site) as maas:
                    try:
                        machine: Machine | None = await maas.get_machine(state.system_id)
                    except MaasNotFound:
                        machine = None
                    releasable = machine is not None and (
                        machine.status in RELEASABLE or machine.status == S.DEPLOYING
                    )
                    if machine is not None and releasable and ours:
                        machine = await release_to_ready(maas, input.site, machine.system_id)
                        notes.append("machine released back to Ready")
                    elif machine is not None and releasable:
                        notes.append(
                            f"machine {machine.system_id} left {machine.status.label}: "
                            "this job did not deploy it"
                        )
                    if machine is not None:
                        observe(state, machine)
        except ClassifiedError as err:
            async with self.deps.sessions() as session, session.begin():
                await read_model.add_event(
                    session,
                    uuid.UUID(input.onboarding.onboarding_id),
                    stage=Stage.DEPLOY_VIA_MAAS.value,
                    attempt=input.attempt,
                    status="failed",
                    message=f"compensation failed: {err.message}",
                )
            raise as_application_error(err) from err
        async with self.deps.sessions() as session, session.begin():
            await _expire_unused_tokens(session, node_id)
            if (
                node is not None
                and node.enrolled_at is None
                and node.status == NodeStatus.ENROLLING
            ):
                await session.execute(
                    delete(NodeEnrollmentToken).where(NodeEnrollmentToken.node_id == node_id)
                )
                await session.execute(
                    delete(Node).where(Node.id == node_id, Node.status == NodeStatus.ENROLLING)
                )
                notes.append("node record deleted")
            elif (
                node is not None
                and node.status == NodeStatus.ENROLLING
                and input.compensation == "restart_clean"
            ):
                # The OS that enrolled is being wiped: keep the identity, enroll again later.
                await session.execute(
                    update(Node)
                    .where(Node.id == node_id, Node.status == NodeStatus.ENROLLING)
                    .values(enrolled_at=None, updated_at=func.now())
                )
                notes.append("node enrollment reset")
            elif node is not None and node.status == NodeStatus.ENROLLING:
                await transition_node(
                    session,
                    node_id,
                    [NodeStatus.ENROLLING],
                    NodeStatus.QUARANTINED,
                    actor=ONBOARDING_ACTOR,
                    reason=f"onboarding {input.compensation or 'compensation'}: OS running",
                )
                notes.append("node quarantined (its OS is running; MAAS left alone)")
            await read_model.add_event(
                session,
                uuid.UUID(input.onboarding.onboarding_id),
                stage=Stage.DEPLOY_VIA_MAAS.value if notes else "compensate",
                attempt=input.attempt,
                status="compensated",
                message="; ".join(notes) or "nothing to compensate",
            )
        return StageResult(
            state=state,
            message="; ".join(notes) or "nothing to compensate",
            details={"compensated": notes},
        )

    @activity.defn(name="onboarding.record_progress")
    async def record_progress(self, record: ProgressRecord) -> None:
        async with self.deps.sessions() as session, session.begin():
            await read_model.record_progress(session, record)


@dataclass(frozen=True)
class _Activation:
    gpus: int
    slots_created: bool

    def describe(self) -> str:
        if self.slots_created:
            return f"{self.gpus} GPU slot(s) from its inventory"
        return f"{self.gpus} GPU(s) reported; the node keeps its slots"


def _reported(inventory: Any, matches: bool | None) -> list[dict[str, Any]] | None:
    """The inventory the agent reported, or None if none was reported since the last deploy
    (record_heartbeat sets inventory_matches with every reported inventory, even an empty one;
    the deploy clears it)."""
    if matches is None or not isinstance(inventory, list):
        return None
    return [g for g in inventory if isinstance(g, dict)]


def _inventory_gpu(gpu: dict[str, Any]) -> tuple[str, int]:
    """(PCI address, NUMA node) of one reported GPU. A GPU the kernel gives no NUMA affinity
    (-1, single-socket hosts) counts as on node 0: a slot's NUMA node is never unknown."""
    numa = gpu.get("numa_node")
    return str(gpu.get("pci_address", "")).lower(), numa if isinstance(numa, int) else 0


async def _deployed_by_job(sessions: Any, onboarding_id: uuid.UUID, system_id: str) -> bool:
    """Whether this job's read model records a deploy of `system_id` it requested."""
    async with sessions() as session:
        found = await session.scalar(
            select(NodeOnboardingEvent.id)
            .where(
                NodeOnboardingEvent.onboarding_id == onboarding_id,
                NodeOnboardingEvent.stage == Stage.DEPLOY_VIA_MAAS.value,
                NodeOnboardingEvent.details[DEPLOYED_BY_JOB].astext == system_id,
            )
            .limit(1)
        )
    return found is not None


async def _expire_unused_tokens(session: AsyncSession, node_id: uuid.UUID) -> None:
    """A fresh token supersedes the older ones that were never used."""
    await session.execute(
        update(NodeEnrollmentToken)
        .where(
            NodeEnrollmentToken.node_id == node_id,
            NodeEnrollmentToken.used_at.is_(None),
            NodeEnrollmentToken.expires_at > func.clock_timestamp(),
        )
        .values(expires_at=func.clock_timestamp())
    )
