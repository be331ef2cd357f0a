"""Onboarding decisions that are data, not code paths
(docs/lifecycles/onboarding.md#failure-classes-and-recommended-actions, docs/runbooks/index.md,
docs/lifecycles/onboarding.md#actions, docs/lifecycles/onboarding.md#timeouts-and-preflight): what a
failure means for the job state and which operator action to recommend, where each stage's safe
checkpoint is, and what each timeout maps to. Pure: the workflow and the activities both import
it."""

from __future__ import annotations

from dataclasses import dataclass

from contracts.onboarding import JobStatus, OperatorAction, Stage
from core.failures import FailureClass


@dataclass(frozen=True)
class TimeoutRule:
    """§4.14: a policy timeout's failure class and error code."""

    failure_class: FailureClass
    error_code: str


TIMEOUTS: dict[str, TimeoutRule] = {
    "discovery": TimeoutRule(FailureClass.PXE_DISCOVERY_FAILURE, "failed_discovery_timeout"),
    "commission": TimeoutRule(FailureClass.PXE_DISCOVERY_FAILURE, "failed_commission_timeout"),
    "deploy": TimeoutRule(FailureClass.DEPLOY_CLOUD_INIT_FAILURE, "failed_deploy_timeout"),
    "hw_sync_seed": TimeoutRule(FailureClass.HARDWARE_SYNC_FAILURE, "failed_hw_sync_seed"),
    "hw_sync_health": TimeoutRule(FailureClass.HARDWARE_SYNC_FAILURE, "failed_hw_sync_health"),
    "enrollment": TimeoutRule(FailureClass.AGENT_ENROLLMENT_FAILURE, "failed_enrollment"),
}


@dataclass(frozen=True)
class Outcome:
    job_status: JobStatus
    recommended_action: OperatorAction
    hint: str


_MANUAL = JobStatus.FAILED_MANUAL_INTERVENTION
_RETRYABLE = JobStatus.FAILED_RETRYABLE

# The failure class decides, unless an error code is more specific (below).
_BY_CLASS: dict[FailureClass, Outcome] = {
    FailureClass.INPUT_CONFIG_ERROR: Outcome(
        _RETRYABLE, OperatorAction.RERUN, "fix the request, SKU or site configuration, then rerun"
    ),
    FailureClass.SITE_CAPABILITY_MISSING: Outcome(
        _RETRYABLE, OperatorAction.RESUME, "fix the site (MAAS token, Vault secrets), then resume"
    ),
    FailureClass.UPSTREAM_TRANSIENT: Outcome(
        _RETRYABLE, OperatorAction.RESUME, "resume once MAAS and Vault answer again"
    ),
    FailureClass.BMC_POWER_FAILURE: Outcome(
        _MANUAL, OperatorAction.RETRY_STAGE, "check the BMC address and credentials, then retry"
    ),
    FailureClass.PXE_DISCOVERY_FAILURE: Outcome(
        _MANUAL, OperatorAction.RERUN, "check PXE wiring and the BMC boot order, then rerun"
    ),
    FailureClass.HARDWARE_MISMATCH: Outcome(
        _MANUAL, OperatorAction.RERUN, "fix the hardware (disk, NIC) in the rack, then rerun"
    ),
    FailureClass.DEPLOY_CLOUD_INIT_FAILURE: Outcome(
        _RETRYABLE,
        OperatorAction.RERUN,
        "the machine is back in Ready; read the MAAS installation log, then rerun",
    ),
    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "make the deployed host reachable over SSH as the deploy user, then resume",
    ),
    FailureClass.HARDWARE_SYNC_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "check maas-agent and the hardware-sync timer on the node, then resume (reseeds)",
    ),
    FailureClass.AGENT_ENROLLMENT_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "check the node agent can reach the API; adopt once it enrolls, or resume for a fresh "
        "token",
    ),
    FailureClass.STATE_AMBIGUITY: Outcome(
        _MANUAL, OperatorAction.ADOPT, "reconcile MAAS by hand, then adopt the observed state"
    ),
}

_BY_CODE: dict[str, Outcome] = {
    # Repeated datasource/cloud-init failure after the bounded retry: §4.11 manual boundary.
    "deploy_datasource_retries_exhausted": Outcome(
        _MANUAL,
        OperatorAction.RERUN,
        "the datasource failure repeated after the bounded redeploy; fix the image or network "
        "metadata path, then rerun",
    ),
    "failed_commission": Outcome(
        _MANUAL, OperatorAction.RERUN, "read the MAAS commissioning results, fix, then rerun"
    ),
    "site_disabled": Outcome(
        _RETRYABLE, OperatorAction.RESUME, "enable the site again, then resume"
    ),
    # Discovery refused before a BMC power cycle (issue 35; error_details.bmc_check holds the
    # evidence). Nothing was created or powered, so there is nothing to adopt: the request
    # names another machine's BMC (fix the request: cancel, resubmit with the right address),
    # or the chassis runs a host MAAS does not know (power it off once it is the machine meant,
    # then retry the stage: the check runs again).
    "bmc_in_use": Outcome(
        _MANUAL,
        OperatorAction.CANCEL,
        "the BMC address belongs to another machine in MAAS (see error_details.bmc_check); if "
        "the address is mistyped, cancel and resubmit with the right ipmi_ip; nothing was "
        "powered or created",
    ),
    "bmc_address_mismatch": Outcome(
        _MANUAL,
        OperatorAction.CANCEL,
        "MAAS's record of this hostname names another BMC than the request (see "
        "error_details.bmc_check); cancel and resubmit with the right ipmi_ip, or correct the "
        "record's power address in MAAS and retry the stage",
    ),
    "bmc_chassis_on": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "the chassis at this BMC is on (or its state unknown) and MAAS knows no machine there "
        "(see error_details.bmc_check): make sure it is the machine to onboard, power it off at "
        "its BMC, then retry the stage; a wrong address is cancelled and resubmitted",
    ),
}


def outcome_for(failure_class: str | None, error_code: str | None) -> Outcome:
    if error_code is not None and error_code in _BY_CODE:
        return _BY_CODE[error_code]
    try:
        return _BY_CLASS[FailureClass(failure_class or "")]
    except (ValueError, KeyError):  # not a class, or one onboarding never classifies by
        # An unclassified failure is a bug or a surprise: stop and let a human look.
        return Outcome(_MANUAL, OperatorAction.RESUME, "unclassified failure: inspect, then resume")


# `resume` restarts from the failed stage's checkpoint: the first stage of the group whose
# observed state must be refreshed together (§4.10). `retry_stage` reruns the failed stage only.
_CHECKPOINTS: dict[Stage, Stage] = {
    Stage.WAIT_FOR_READY: Stage.COMMISSION_NODE,
    Stage.WAIT_FOR_DEPLOYED: Stage.DEPLOY_VIA_MAAS,
    Stage.CLASSIFY_DEPLOY_FAILURE: Stage.DEPLOY_VIA_MAAS,
    Stage.RECOVER_FOR_DATASOURCE_RETRY: Stage.DEPLOY_VIA_MAAS,
    Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY: Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
}


def checkpoint_for(stage: Stage) -> Stage:
    return _CHECKPOINTS.get(stage, stage)


# Which operator actions each job state accepts (§4.9). A repeat of an action already in
# effect is accepted as a no-op (idempotent) where the table says so.
_FAILED = {JobStatus.FAILED_RETRYABLE, JobStatus.FAILED_MANUAL_INTERVENTION}
ALLOWED_ACTIONS: dict[OperatorAction, frozenset[JobStatus]] = {
    OperatorAction.RETRY_STAGE: frozenset(_FAILED),
    OperatorAction.RESUME: frozenset(_FAILED),
    OperatorAction.RERUN: frozenset(_FAILED),
    OperatorAction.RESTART_CLEAN: frozenset(_FAILED),
    OperatorAction.ADOPT: frozenset(_FAILED),
    OperatorAction.CANCEL: frozenset({JobStatus.PENDING, JobStatus.RUNNING, *_FAILED}),
    OperatorAction.MARK_MANUAL_INTERVENTION: frozenset(
        {JobStatus.PENDING, JobStatus.RUNNING, *_FAILED}
    ),
}
