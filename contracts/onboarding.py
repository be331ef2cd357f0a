"""The MAAS onboarding contract (docs/lifecycles/onboarding.md,
docs/lifecycles/onboarding.md#job-states): workflow names and IDs, the stage catalogue in order, job
states, operator actions, and the values that cross the workflow / activity / gateway boundaries.
Nothing here is secret: power credentials, MAAS tokens, the enrollment token and the cloud-init
content stay inside the activities that use them.

    MaasNodeOnboardWorkflow       onboarding-{onboarding_id}
    MaasNodeBatchOnboardWorkflow  onboarding-batch-{batch_id}

Operator actions are workflow updates (`OPERATOR_ACTION_UPDATE`): the validator refuses an
action the job state does not allow (the gateway answers 409), and an update id derived from
the request makes a repeated call answer the first call's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from contracts.lifecycle import (
    ADOPT_ACTION,
    CANCEL_ACTION,
    FREEZE_ACTION,
    RESUME_ACTION,
    RETRY_STAGE_ACTION,
    JobProgress,
    JobProgressRecord,
    JobStageResult,
)
from contracts.lifecycle import (
    FAILED_JOB_STATUSES as FAILED_JOB_STATUSES,
)
from contracts.lifecycle import (
    LIVE_JOB_STATUSES as LIVE_JOB_STATUSES,
)
from contracts.lifecycle import (
    OPERATOR_ACTION_UPDATE as OPERATOR_ACTION_UPDATE,
)
from contracts.lifecycle import (
    PROGRESS_QUERY as PROGRESS_QUERY,
)
from contracts.lifecycle import (
    TERMINAL_JOB_STATUSES as TERMINAL_JOB_STATUSES,
)
from contracts.lifecycle import ActionResult as ActionResult
from contracts.lifecycle import EventStatus as EventStatus
from contracts.lifecycle import JobStatus as JobStatus
from contracts.lifecycle import OperatorRequest as OperatorRequest

WORKFLOW_NAME = "MaasNodeOnboardWorkflow"
BATCH_WORKFLOW_NAME = "MaasNodeBatchOnboardWorkflow"
CHILD_SETTLED_SIGNAL = "child_settled"
# Per-site concurrency (docs/lifecycles/onboarding.md#batches, open question 5): a run holds one of
# its site's batch_max_parallel permits while its stages run. A permit not free yet is the acquire
# activity's retryable SITE_AT_CAPACITY error: the workflow's retry policy is the wait queue.
ACQUIRE_SITE_SLOT_ACTIVITY = "onboarding.acquire_site_slot"
RELEASE_SITE_SLOT_ACTIVITY = "onboarding.release_site_slot"
SITE_AT_CAPACITY = "site_at_capacity"
SITE_SLOT_PATCH = "onboarding-holds-a-site-slot"
# A batch continues as new every BATCH_CHILDREN_PER_RUN children (about 7-13 parent events
# each, so ~1,300 per run, far under Temporal's 10,240-event warning); histories recorded
# before it replay as one run.
BATCH_CONTINUE_AS_NEW_PATCH = "onboarding-batch-continues-as-new"
BATCH_CHILDREN_PER_RUN = 100
# The datasource redeploy allowance counts the deploys since the last operator action, not
# every deploy of the job (histories recorded before it replay with the old count).
REDEPLOY_SINCE_OPERATOR_PATCH = "onboarding-redeploys-since-operator"


def onboarding_workflow_id(onboarding_id: str) -> str:
    return f"onboarding-{onboarding_id}"


def batch_workflow_id(batch_id: str) -> str:
    return f"onboarding-batch-{batch_id}"


class Stage(StrEnum):
    """docs/lifecycles/onboarding.md#stages, in execution order (classify/recover run only after a
    deploy failure)."""

    LOAD_SITE_CONFIG = "load_site_config"
    RESOLVE_POWER_CREDENTIALS = "resolve_power_credentials"
    CREATE_OR_FIND_IN_MAAS = "create_or_find_in_maas"
    COMMISSION_NODE = "commission_node"
    WAIT_FOR_READY = "wait_for_ready"
    CONFIGURE_STORAGE = "configure_storage"
    APPLY_ROCE_PHASE2 = "apply_roce_phase2"
    ENSURE_PXE_INTERFACE_AUTO = "ensure_pxe_interface_auto"
    RENDER_CLOUD_INIT = "render_cloud_init"
    DEPLOY_VIA_MAAS = "deploy_via_maas"
    WAIT_FOR_DEPLOYED = "wait_for_deployed"
    CLASSIFY_DEPLOY_FAILURE = "classify_deploy_failure"
    RECOVER_FOR_DATASOURCE_RETRY = "recover_for_datasource_retry"
    ENSURE_HARDWARE_SYNC_CONFIGURED = "ensure_hardware_sync_configured"
    WAIT_FOR_HARDWARE_SYNC_HEALTHY = "wait_for_hardware_sync_healthy"
    WAIT_FOR_AGENT_ENROLLMENT = "wait_for_agent_enrollment"


# The main line; the deploy-recovery stages are entered from wait_for_deployed only.
STAGE_ORDER: tuple[Stage, ...] = (
    Stage.LOAD_SITE_CONFIG,
    Stage.RESOLVE_POWER_CREDENTIALS,
    Stage.CREATE_OR_FIND_IN_MAAS,
    Stage.COMMISSION_NODE,
    Stage.WAIT_FOR_READY,
    Stage.CONFIGURE_STORAGE,
    Stage.APPLY_ROCE_PHASE2,
    Stage.ENSURE_PXE_INTERFACE_AUTO,
    Stage.RENDER_CLOUD_INIT,
    Stage.DEPLOY_VIA_MAAS,
    Stage.WAIT_FOR_DEPLOYED,
    Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
    Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY,
    Stage.WAIT_FOR_AGENT_ENROLLMENT,
)
# Stages after which the OS runs on the machine: failures there leave MAAS alone (§4.6).
POST_DEPLOY_STAGES = frozenset(
    {
        Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
        Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY,
        Stage.WAIT_FOR_AGENT_ENROLLMENT,
    }
)
DEPLOY_STAGES = frozenset(
    {
        Stage.DEPLOY_VIA_MAAS,
        Stage.WAIT_FOR_DEPLOYED,
        Stage.CLASSIFY_DEPLOY_FAILURE,
        Stage.RECOVER_FOR_DATASOURCE_RETRY,
    }
)


class OperatorAction(StrEnum):
    """docs/lifecycles/onboarding.md#actions: distinct operations, not synonyms."""

    RETRY_STAGE = RETRY_STAGE_ACTION  # rerun only the failed stage, then go on
    RESUME = RESUME_ACTION  # from the failed stage's last safe checkpoint, state refreshed
    RERUN = "rerun"  # from the top, every stage adopting what is already done
    RESTART_CLEAN = "restart_clean"  # compensate known progress, then from the top
    CANCEL = CANCEL_ACTION  # stop and compensate where possible
    ADOPT = ADOPT_ACTION  # accept externally advanced MAAS/node state
    MARK_MANUAL_INTERVENTION = FREEZE_ACTION  # freeze automation


@dataclass
class OnboardInput:
    onboarding_id: str
    site_id: str
    profile_id: str
    sku_id: str
    hostname: str
    ipmi_ip: str
    node_id: str  # assigned at submission, so a batch answer can name it
    batch_id: str | None = None
    requested_by: str = ""
    pxe_mac: str | None = None


@dataclass
class SitePolicyView:
    """The site policy knobs (docs/maas-sites.md#policy-knobs) and timeouts (§4.14) a run uses."""

    strict_pxe_preflight: bool = True
    enable_phase2_roce: bool = True
    require_hw_sync: bool = True
    hardware_sync_interval: str = "15m"
    release_fallback_no_erase: bool = True
    enable_deploy_retry_on_datasource_failure: bool = True
    max_deploy_retry_attempts: int = 1
    auto_claim_single_new_machine: bool = False
    batch_max_parallel: int = 10
    site_bootstrap_bundle_ref: str | None = None
    enrollment_token_ttl_seconds: int = 7200
    maas_poll_interval_ms: int = 10_000
    discovery_timeout_seconds: int = 900
    commission_timeout_seconds: int = 3600
    deploy_timeout_seconds: int = 3600
    hw_sync_seed_timeout_seconds: int = 900
    hw_sync_health_timeout_seconds: int = 1800
    enrollment_timeout_seconds: int = 1800
    # A RoCE phase-2 link MAAS refuses stops the job (default: reported, non-fatal, §4.6).
    roce_failures_stop_job: bool = False

    def stage_wait_seconds(self, stage: str) -> int:
        """How long the stage (a Stage value) may wait on MAAS or the node, on top of its
        ordinary run time: 0 for a stage that does not wait."""
        waits: dict[str, int] = {
            Stage.CREATE_OR_FIND_IN_MAAS: self.discovery_timeout_seconds,
            Stage.WAIT_FOR_READY: self.commission_timeout_seconds,
            Stage.WAIT_FOR_DEPLOYED: self.deploy_timeout_seconds,
            Stage.RECOVER_FOR_DATASOURCE_RETRY: self.deploy_timeout_seconds,
            Stage.ENSURE_HARDWARE_SYNC_CONFIGURED: 2 * self.hw_sync_seed_timeout_seconds,
            Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY: self.hw_sync_health_timeout_seconds
            + 2 * self.hw_sync_seed_timeout_seconds,
            Stage.WAIT_FOR_AGENT_ENROLLMENT: self.enrollment_timeout_seconds
            + self.hw_sync_seed_timeout_seconds,
        }
        return waits.get(stage, 0)


# Every knob a run uses; a site profile may override each (docs/maas-sites.md#site-profiles) but the
# site-only ones.
POLICY_KNOBS: tuple[str, ...] = tuple(f.name for f in fields(SitePolicyView))
# Knobs a profile cannot override, each one setting of the site's whole MAAS region: MAAS has a
# single global config `hardware_sync_interval` (a machine's sync_interval is set from it when its
# enable_hw_sync is saved), which onboarding sets to the run's value, so two profiles with
# different values would overwrite each other's. A run always takes the site's value.
SITE_ONLY_KNOBS: frozenset[str] = frozenset({"hardware_sync_interval"})


def profile_value(profile: object, site: object, name: str) -> Any:
    """The profile's own value of `name` when it sets one (not None), else the site's."""
    value = getattr(profile, name, None)
    return getattr(site, name) if value is None else value


def resolve_policy(site_policy: object, profile: object) -> SitePolicyView:
    """The policy a run with `profile` uses, resolved once (an activity, or the gateway's
    view) so the workflow only ever sees the snapshot. Site-only knobs are the site's."""
    return SitePolicyView(
        **{
            name: getattr(site_policy, name)
            if name in SITE_ONLY_KNOBS
            else profile_value(profile, site_policy, name)
            for name in POLICY_KNOBS
        }
    )


@dataclass
class SiteConfig:
    """load_site_config's answer: where things are, never what the secrets are."""

    site_id: str
    site_name: str
    region_code: str
    api_base_url: str
    api_token_vault_path: str
    deploy_password_vault_path: str
    pxe_vlan_vid: int
    node_pxe_iface: str
    deploy_user: str
    deploy_ssh_iface: str
    upstream_dns_servers: list[str]
    distro_series: str  # the profile's, else the site's
    architecture: str
    sku_id: str
    gpu_count: int
    policy: SitePolicyView
    maas_version: str = ""


@dataclass
class Observed:
    """What MAAS (and the node record) looked like the last time a stage checked."""

    maas_status: str | None = None
    power_state: str | None = None
    ip_addresses: list[str] = field(default_factory=list)


@dataclass
class OnboardState:
    """What the run knows so far; the workflow passes it to each stage and merges the answer."""

    system_id: str | None = None
    boss_disk_id: int | None = None
    power_source: str | None = None  # "site_default" | "override:<selector>"
    cloud_init_version: str | None = None
    cloud_init_layers: list[str] = field(default_factory=list)
    deployed_since: str | None = None  # ISO time the (latest) deploy was issued
    deploy_attempts: int = 0
    # deploy_attempts when an operator last sent the job on (retry, resume, rerun, adopt): the
    # datasource redeploy allowance counts the deploys since then
    # (docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions,
    # docs/lifecycles/onboarding.md#actions).
    deploys_before_operator: int = 0
    enrollment_attempts: int = 0
    roce_applied: int = 0
    os_running: bool = False  # post-deploy stages began: cancel leaves MAAS alone (§4.6)
    observed: Observed = field(default_factory=Observed)


@dataclass
class StageInput:
    onboarding: OnboardInput
    site: SiteConfig | None
    state: OnboardState
    attempt: int = 1
    compensation: str = ""  # compensate only: "cancel" | "restart_clean"


@dataclass(kw_only=True)
class StageResult(JobStageResult):
    state: OnboardState
    site: SiteConfig | None = None  # load_site_config's answer


@dataclass
class NodeObservation:
    """What adopt_observed_state decides from: MAAS's machine and the node record now."""

    machine_present: bool
    maas_status: str | None
    node_status: str | None
    enrolled_since_deploy: bool
    state: OnboardState


@dataclass(kw_only=True)
class ProgressRecord(JobProgressRecord):
    onboarding_id: str
    state: OnboardState | None = None


@dataclass(kw_only=True)
class Progress(JobProgress):
    onboarding_id: str
    system_id: str | None = None
    node_id: str | None = None


@dataclass
class OnboardResult:
    onboarding_id: str
    hostname: str
    status: str
    node_id: str | None = None
    system_id: str | None = None
    failure_class: str | None = None
    error_code: str | None = None


@dataclass
class BatchNode:
    hostname: str
    ipmi_ip: str
    onboarding_id: str
    node_id: str


@dataclass
class BatchInput:
    batch_id: str
    site_id: str
    profile_id: str
    sku_id: str
    nodes: list[BatchNode]
    max_parallel: int = 10
    requested_by: str = ""
    # Children one run starts before it continues as new (0: BATCH_CHILDREN_PER_RUN), so the
    # parent's history per run stays bounded whatever the batch size (issue 27).
    children_per_run: int = 0
    carried: BatchCarry | None = None


@dataclass
class SiteSlotRequest:
    site_id: str
    onboarding_id: str


@dataclass
class SiteSlotGrant:
    in_flight: int  # this run's included
    limit: int


@dataclass
class ChildSettled:
    """A child's first settled outcome: completed, a failed_* state, or cancelled."""

    onboarding_id: str
    status: str
    failure_class: str | None = None
    error_code: str | None = None


@dataclass
class BatchCarry:
    """What a continued run of the batch takes over from the runs before it: every child they
    started has settled (a run continues only once its own children have), so their outcomes
    and the high-water mark of children in flight are the whole state."""

    settled: list[ChildSettled] = field(default_factory=list)
    max_in_flight: int = 0


@dataclass
class BatchSummary:
    batch_id: str
    succeeded: int
    failed: int
    details: list[OnboardResult] = field(default_factory=list)
    max_in_flight: int = 0
