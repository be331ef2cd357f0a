"""The node decommission contract (docs/lifecycles/decommission.md,
docs/lifecycles/decommission.md#job-states, docs/lifecycles/decommission.md#actions): workflow name
and id, modes, the stage catalogue and each mode's stage list, operator actions, and the values that
cross the workflow / activity / gateway boundaries. Nothing here is secret.

    NodeDecommissionWorkflow   decommission-{decommission_id}

One workflow type runs all four modes (soft_reset, reimage, full_decommission, storage_cleanup):
they share the job-state model, the failure handling and the operator actions, and differ only
in their stage lists (`STAGES_BY_MODE`). Job states are onboarding's `JobStatus`
(docs/lifecycles/decommission.md#job-states says decommission uses the same model). Operator actions
are the `operator_action` update, as for onboarding: the validator refuses what the job state does
not allow (gateway: 409).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from contracts.lifecycle import (
    ADOPT_ACTION,
    CANCEL_ACTION,
    FREEZE_ACTION,
    RECORD_DISK_DISPOSITION_ACTION,
    RESUME_ACTION,
    RETRY_STAGE_ACTION,
    JobProgress,
    JobProgressRecord,
    JobStageResult,
)

# docs/lifecycles/decommission.md#job-states: decommission uses the same job-state model and
# operator-action update.
from contracts.lifecycle import OPERATOR_ACTION_UPDATE as OPERATOR_ACTION_UPDATE
from contracts.lifecycle import PROGRESS_QUERY as PROGRESS_QUERY
from contracts.lifecycle import ActionResult as ActionResult
from contracts.lifecycle import EventStatus as EventStatus
from contracts.lifecycle import JobStatus as JobStatus
from contracts.lifecycle import OperatorRequest as OperatorRequest
from contracts.onboarding import OnboardState, SiteConfig

WORKFLOW_NAME = "NodeDecommissionWorkflow"


def decommission_workflow_id(decommission_id: str) -> str:
    return f"decommission-{decommission_id}"


def decommission_id_from_workflow_id(workflow_id: str) -> str:
    prefix = "decommission-"
    if not workflow_id.startswith(prefix):
        raise ValueError(f"not a decommission workflow id: {workflow_id}")
    return workflow_id[len(prefix) :]


class Mode(StrEnum):
    SOFT_RESET = "soft_reset"
    REIMAGE = "reimage"
    FULL_DECOMMISSION = "full_decommission"
    STORAGE_CLEANUP = "storage_cleanup"


class Erase(StrEnum):
    """MAAS release erase modes (docs/lifecycles/decommission.md#modes: none | quick | secure;
    `standard` is MAAS's own erase without quick/secure)."""

    NONE = "none"
    QUICK = "quick"
    SECURE = "secure"
    STANDARD = "standard"


class StorageScope(StrEnum):
    """docs/lifecycles/decommission.md#soft-reset CleanupStorage: local scratch, Weka (shared
    storage), both, or nothing."""

    NONE = "none"
    LOCAL = "local"
    WEKA = "weka"
    ALL = "all"


class Stage(StrEnum):
    """docs/lifecycles/decommission.md#modes's catalogue, plus the reimage stages of
    docs/lifecycles/decommission.md#reimage (named as the onboarding stages they re-run) and
    enable_node (§5.2/§5.3 EnableNode)."""

    DISABLE_NODE = "disable_node"
    FORCE_RELEASE_ALLOCATIONS = "force_release_allocations"
    DRAIN_NODE = "drain_node"
    CLEANUP_STORAGE = "cleanup_storage"
    SCRUB_GPU = "scrub_gpu"
    VALIDATE_CLEAN_NODE = "validate_clean_node"
    LOAD_SITE_CONFIG = "load_site_config"
    RELEASE_MAAS_NODE = "release_maas_node"
    POWER_OFF_MAAS_NODE = "power_off_maas_node"
    RETIRE_GPUAAS_NODE = "retire_gpuaas_node"
    REMOVE_GPUAAS_NODE_RECORD = "remove_gpuaas_node_record"
    CLEANUP_SECRETS = "cleanup_secrets"
    REMOVE_MAAS_RECORD = "remove_maas_record"
    # reimage (docs/lifecycles/decommission.md#reimage)
    CONFIGURE_STORAGE = "configure_storage"
    APPLY_ROCE_PHASE2 = "apply_roce_phase2"
    ENSURE_PXE_INTERFACE_AUTO = "ensure_pxe_interface_auto"
    RENDER_CLOUD_INIT = "render_cloud_init"
    DEPLOY_VIA_MAAS = "deploy_via_maas"
    WAIT_FOR_DEPLOYED = "wait_for_deployed"
    ENSURE_HARDWARE_SYNC_CONFIGURED = "ensure_hardware_sync_configured"
    WAIT_FOR_HARDWARE_SYNC_HEALTHY = "wait_for_hardware_sync_healthy"
    WAIT_FOR_AGENT_ENROLLMENT = "wait_for_agent_enrollment"
    ENABLE_NODE = "enable_node"


STAGES_BY_MODE: dict[Mode, tuple[Stage, ...]] = {
    # §5.2. force_release_allocations runs (or is skipped) after disable so that an allocation
    # placed just before the node became unschedulable is not cleaned out from under a tenant.
    Mode.SOFT_RESET: (
        Stage.DISABLE_NODE,
        Stage.FORCE_RELEASE_ALLOCATIONS,
        Stage.DRAIN_NODE,
        Stage.CLEANUP_STORAGE,
        Stage.SCRUB_GPU,
        Stage.VALIDATE_CLEAN_NODE,
        Stage.ENABLE_NODE,
    ),
    # §5.3
    Mode.REIMAGE: (
        Stage.DISABLE_NODE,
        Stage.FORCE_RELEASE_ALLOCATIONS,
        Stage.DRAIN_NODE,
        Stage.CLEANUP_STORAGE,
        Stage.LOAD_SITE_CONFIG,
        Stage.RELEASE_MAAS_NODE,
        Stage.CONFIGURE_STORAGE,
        Stage.APPLY_ROCE_PHASE2,
        Stage.ENSURE_PXE_INTERFACE_AUTO,
        Stage.RENDER_CLOUD_INIT,
        Stage.DEPLOY_VIA_MAAS,
        Stage.WAIT_FOR_DEPLOYED,
        Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
        Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY,
        Stage.WAIT_FOR_AGENT_ENROLLMENT,
        Stage.ENABLE_NODE,
    ),
    # §5.4
    Mode.FULL_DECOMMISSION: (
        Stage.DISABLE_NODE,
        Stage.FORCE_RELEASE_ALLOCATIONS,
        Stage.DRAIN_NODE,
        Stage.LOAD_SITE_CONFIG,
        Stage.RELEASE_MAAS_NODE,
        Stage.POWER_OFF_MAAS_NODE,
        Stage.RETIRE_GPUAAS_NODE,
        Stage.REMOVE_GPUAAS_NODE_RECORD,
        Stage.CLEANUP_SECRETS,
        Stage.REMOVE_MAAS_RECORD,
    ),
    # §5.5, inside the same guard as soft reset: the node takes no new placements while its
    # scratch is wiped, and the live allocations are released first (force_release_allocations)
    # or the job stops before cleanup_storage, so a tenant's scratch is never wiped under it.
    Mode.STORAGE_CLEANUP: (
        Stage.DISABLE_NODE,
        Stage.FORCE_RELEASE_ALLOCATIONS,
        Stage.CLEANUP_STORAGE,
        Stage.VALIDATE_CLEAN_NODE,
        Stage.ENABLE_NODE,
    ),
}

# Stages whose body is a host task on the node's queue (node-{id}).
NODE_TASK_STAGES = frozenset(
    {
        Stage.DRAIN_NODE,
        Stage.CLEANUP_STORAGE,
        Stage.SCRUB_GPU,
        Stage.VALIDATE_CLEAN_NODE,
        Stage.REMOVE_GPUAAS_NODE_RECORD,
    }
)
# Once one of these has run, MAAS holds the machine in a state we changed: cancel no longer
# returns the node to service (its OS is gone or going).
MAAS_MUTATING_STAGES = frozenset(
    {
        Stage.RELEASE_MAAS_NODE,
        Stage.POWER_OFF_MAAS_NODE,
        Stage.CONFIGURE_STORAGE,
        Stage.APPLY_ROCE_PHASE2,
        Stage.ENSURE_PXE_INTERFACE_AUTO,
        Stage.DEPLOY_VIA_MAAS,
        Stage.WAIT_FOR_DEPLOYED,
        Stage.REMOVE_MAAS_RECORD,
    }
)
# The reimage stages run by the onboarding stage bodies (activities/decommission/reimage.py).
REIMAGE_ONBOARDING_STAGES = frozenset(
    {
        Stage.CONFIGURE_STORAGE,
        Stage.APPLY_ROCE_PHASE2,
        Stage.ENSURE_PXE_INTERFACE_AUTO,
        Stage.DEPLOY_VIA_MAAS,
        Stage.WAIT_FOR_DEPLOYED,
        Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
        Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY,
        Stage.WAIT_FOR_AGENT_ENROLLMENT,
    }
)


class OperatorAction(StrEnum):
    """docs/lifecycles/decommission.md#actions, the ones that make sense for a decommission (there
    is no rerun from a blank slate: a half-decommissioned node is resumed, retried, adopted or
    cancelled)."""

    RETRY_STAGE = RETRY_STAGE_ACTION
    RESUME = RESUME_ACTION
    CANCEL = CANCEL_ACTION
    ADOPT = ADOPT_ACTION
    MARK_MANUAL_INTERVENTION = FREEZE_ACTION
    # Only for a full decommission stopped with HOST_NOT_WIPED: the operator's record of where
    # the vanished machine's disks went, then the adopt that record allows (ends reconciled).
    RECORD_DISK_DISPOSITION = RECORD_DISK_DISPOSITION_ACTION


# A full decommission whose machine left MAAS before MAAS released (and erased) it (issue 35).
HOST_NOT_WIPED = "host_not_wiped"


class DiskDisposition(StrEnum):
    """Where the disks of a machine that vanished from MAAS unreleased went, as the operator
    who dealt with them records it (record_disk_disposition). Each one ends the disks' life
    with this tenant's data: a host that may still run its OS is no disposition (bring it back
    into MAAS and retry the release instead)."""

    DESTROYED = "destroyed"  # physically destroyed (shredded, degaussed); a certificate exists
    WIPED_OUT_OF_BAND = "wiped_out_of_band"  # sanitized outside MAAS (vendor secure erase)
    RETAINED_QUARANTINED = "retained_quarantined"  # pulled and held in secured custody


DISK_DISPOSITION_KIND = "disk_disposition"  # its followups entry (one per job)
OPERATOR_RECORDED = "operator"  # the `source` of a disposition an operator recorded


def operator_disk_disposition(followups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The disk disposition an operator recorded for this job (record_disk_disposition), if
    any: nothing the job observes later replaces it."""
    for followup in followups:
        if followup.get("kind") == DISK_DISPOSITION_KIND and (
            followup.get("source") == OPERATOR_RECORDED
        ):
            return followup
    return None


# Which operator actions each job state accepts (the workflow's update validator; the console
# offers exactly these).
_FAILED = {JobStatus.FAILED_RETRYABLE, JobStatus.FAILED_MANUAL_INTERVENTION}
ALLOWED_ACTIONS: dict[OperatorAction, frozenset[JobStatus]] = {
    OperatorAction.RETRY_STAGE: frozenset(_FAILED),
    # resume while pending/running is an idempotent no-op (docs/lifecycles/decommission.md#actions:
    # a live task exists).
    OperatorAction.RESUME: frozenset({JobStatus.PENDING, JobStatus.RUNNING, *_FAILED}),
    OperatorAction.ADOPT: frozenset(_FAILED),
    OperatorAction.CANCEL: frozenset({JobStatus.PENDING, JobStatus.RUNNING, *_FAILED}),
    OperatorAction.MARK_MANUAL_INTERVENTION: frozenset(
        {JobStatus.PENDING, JobStatus.RUNNING, *_FAILED}
    ),
    # ... and only while the job stands failed with HOST_NOT_WIPED (the workflow checks).
    OperatorAction.RECORD_DISK_DISPOSITION: frozenset({JobStatus.FAILED_MANUAL_INTERVENTION}),
}


@dataclass
class DecommissionPolicy:
    """Timeouts and bounds fixed at start, so the workflow stays deterministic and tests can
    shorten them. MAAS waits use the site policy (SitePolicyView) once the site is loaded."""

    node_schedule_to_start_seconds: float = 120.0
    node_task_timeout_seconds: float = 1800.0
    node_heartbeat_timeout_seconds: float = 60.0
    node_task_attempts: int = 3
    allocation_release_timeout_seconds: float = 1800.0
    poll_interval_ms: int = 5000
    power_off_timeout_seconds: float = 600.0
    drain_wait_seconds: float = 600.0  # soft_reset: live host tasks on the node must finish


@dataclass
class DecommissionInput:
    decommission_id: str
    node_id: str
    mode: str  # Mode
    erase: str = Erase.NONE.value
    storage_cleanup: str = StorageScope.NONE.value
    remove_maas_record: bool = False
    force_release_allocations: bool = False
    reason: str = ""
    requested_by: str = ""
    policy: DecommissionPolicy = field(default_factory=DecommissionPolicy)
    # The site profile whose policy the MAAS stages resolve (docs/maas-sites.md#site-profiles);
    # None: the one the node was onboarded with, else the site's default.
    profile_id: str | None = None


@dataclass
class NodeTaskRef:
    """A node_tasks row this run created for a host task (kind = the agent activity name)."""

    task_id: str
    kind: str


@dataclass
class DecommissionState:
    """What the run knows so far; each stage gets it and answers it updated."""

    hostname: str | None = None
    node_status_at_start: str | None = None
    site_id: str | None = None
    profile_id: str | None = None
    sku_id: str | None = None
    system_id: str | None = None
    maas_managed: bool = False
    maas_status: str | None = None
    power_state: str | None = None
    released_in_maas: bool = False  # the OS is gone: node.uninstall is not needed any more
    erase_used: str | None = None
    erase_fell_back: bool = False
    powered_off: bool = False
    machine_absent: bool = False  # gone from MAAS and adopted: MAAS stages have nothing to do
    allocations_released: list[str] = field(default_factory=list)
    quarantined: bool = False
    followups: list[dict[str, Any]] = field(default_factory=list)
    # The reimage stages run with onboarding's stage bodies, which carry their own state.
    onboard: OnboardState = field(default_factory=OnboardState)


@dataclass
class StageInput:
    decommission: DecommissionInput
    state: DecommissionState
    site: SiteConfig | None = None
    attempt: int = 1
    task: NodeTaskRef | None = None
    note: str = ""  # finish_remove: "uninstall_failed" sends the node back to retired


# StageInput.note for release_maas_node in a reimage's bounded redeploy (issue 35): back to
# Ready without an erase, as onboarding's recover_for_datasource_retry releases. This job's
# first release already erased as requested; since then only the failed install is on the disks.
REDEPLOY_RELEASE_NOTE = "redeploy_after_failed_deployment"


@dataclass(kw_only=True)
class StageResult(JobStageResult):
    state: DecommissionState
    site: SiteConfig | None = None  # load_site_config's answer


@dataclass
class NodeTaskRecord:
    """A host task's bookkeeping: `queued` before dispatch, then completed / failed."""

    decommission_id: str
    node_id: str
    task_id: str
    kind: str
    workflow_id: str
    status: str  # queued | completed | failed
    output: dict[str, Any] = field(default_factory=dict)
    phases: list[dict[str, str]] = field(default_factory=list)
    started_at: str | None = None
    finished_at: str | None = None
    error_type: str | None = None
    error_message: str | None = None


@dataclass(kw_only=True)
class ProgressRecord(JobProgressRecord):
    decommission_id: str
    state: DecommissionState | None = None


@dataclass
class Observation:
    """What adopt_observed_state decides from: MAAS's machine and the node record now.

    `machine_present` is only meaningful when `maas_observed`: MAAS was asked and answered (the
    machine, or that it has none by that id). When MAAS could not be asked (no site loaded, its
    token missing, MAAS unreachable) `maas_observed` is False and `maas_error` says why: unknown,
    never absent. `disks_erased` answers, for a Ready machine whose decommission asked for an
    erase, whether MAAS's event log shows the disks erased since the machine was last deployed
    (None: not asked)."""

    node_status: str | None
    machine_present: bool
    maas_status: str | None
    power_state: str | None
    live_allocations: int
    state: DecommissionState
    maas_observed: bool = False
    maas_error: str = ""
    disks_erased: bool | None = None


@dataclass(kw_only=True)
class Progress(JobProgress):
    decommission_id: str
    mode: str
    node_task: NodeTaskRef | None = None


@dataclass
class DecommissionResult:
    decommission_id: str
    node_id: str
    mode: str
    status: str
    node_status: str | None = None
    failure_class: str | None = None
    error_code: str | None = None
