"""Decommission decisions that are data
(docs/lifecycles/decommission.md#failures-and-recommended-actions,
docs/lifecycles/decommission.md#failures-and-recommended-actions,
docs/lifecycles/decommission.md#actions): what a stage failure means for the job state, which
operator action to recommend, how many automatic attempts each stage gets, and which actions each
job state accepts. Pure: the workflow and the activities both import it.

The §5.8 rule of thumb is encoded by the error codes: where ownership of the node becomes
ambiguous (the agent is unreachable while MAAS still holds the machine, MAAS release or power-off
does not converge, the machine changed out of band, allocations stay attached) the job stops in
failed_manual_intervention; where a safe recovery path exists (uninstall failed but the node is
retired again, MAAS or Vault briefly unavailable) it stops in failed_retryable and recommends
resume.
"""

from __future__ import annotations

from dataclasses import dataclass

# Which operator actions each job state accepts lives in the contract (the console offers them).
from contracts.decommission import ALLOWED_ACTIONS as ALLOWED_ACTIONS
from contracts.decommission import OperatorAction, Stage
from contracts.host_task_errors import AGENT_CAPABILITY_MISSING
from contracts.onboarding import JobStatus
from contracts.states import NodeStatus
from core.failures import FailureClass


@dataclass(frozen=True)
class Outcome:
    job_status: JobStatus
    recommended_action: OperatorAction
    hint: str


# A reimage's failed deploy, after classification (issue 35): see _BY_CODE.
REDEPLOY_RETRIES_EXHAUSTED = "redeploy_retries_exhausted"
REDEPLOY_FAILED = "redeploy_failed"

_MANUAL = JobStatus.FAILED_MANUAL_INTERVENTION
_RETRYABLE = JobStatus.FAILED_RETRYABLE

# §5.8 "retry strategy", in automatic attempts per stage (the activity's retry policy).
# Inventory updates: 3; everything else bounded by DEFAULT_ATTEMPTS. Host tasks use the
# policy's node_task_attempts instead (their failures are retried by the agent activity).
STAGE_ATTEMPTS: dict[Stage, int] = {
    Stage.DISABLE_NODE: 3,
    Stage.RETIRE_GPUAAS_NODE: 3,
    Stage.ENABLE_NODE: 3,
    Stage.RELEASE_MAAS_NODE: 2,
    Stage.DEPLOY_VIA_MAAS: 2,
    Stage.REMOVE_MAAS_RECORD: 2,
}
DEFAULT_ATTEMPTS = 3

_BY_CLASS: dict[FailureClass, Outcome] = {
    FailureClass.INPUT_CONFIG_ERROR: Outcome(
        _RETRYABLE,
        OperatorAction.CANCEL,
        "the request cannot be carried out on this node as given; cancel and submit another",
    ),
    FailureClass.SITE_CAPABILITY_MISSING: Outcome(
        _RETRYABLE, OperatorAction.RESUME, "fix the site (MAAS token, Vault secrets), then resume"
    ),
    FailureClass.UPSTREAM_TRANSIENT: Outcome(
        _RETRYABLE, OperatorAction.RESUME, "resume once MAAS, Vault and the database answer again"
    ),
    FailureClass.BMC_POWER_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "MAAS could not drive the BMC; fix power control, then retry (full decommission is not "
        "complete while the machine may be on)",
    ),
    FailureClass.HARDWARE_MISMATCH: Outcome(
        _MANUAL, OperatorAction.RESUME, "fix the hardware (disk, NIC) in the rack, then resume"
    ),
    FailureClass.PXE_DISCOVERY_FAILURE: Outcome(
        _MANUAL, OperatorAction.RESUME, "check PXE wiring, then resume"
    ),
    FailureClass.DEPLOY_CLOUD_INIT_FAILURE: Outcome(
        _RETRYABLE,
        OperatorAction.RESUME,
        "the redeploy failed (MAAS: Failed deployment); read the MAAS installation log, then "
        "resume: the machine is released back to Ready first (erased as requested), then "
        "deployed again",
    ),
    FailureClass.POST_DEPLOY_CONNECTIVITY_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the node agent (or SSH to the host) is unreachable; bring it back, then resume",
    ),
    FailureClass.HARDWARE_SYNC_FAILURE: Outcome(
        _MANUAL, OperatorAction.RESUME, "check maas-agent and the hardware-sync timer, then resume"
    ),
    FailureClass.AGENT_ENROLLMENT_FAILURE: Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "the reimaged node's agent did not enroll; adopt once it does, or resume for a fresh "
        "deploy wait",
    ),
    FailureClass.STATE_AMBIGUITY: Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "MAAS or the node changed in a way automation cannot safely adopt; reconcile by hand, "
        "then adopt the observed state (or resume)",
    ),
    # An operator protected the node while the job ran: the destructive MAAS step refused.
    # Never adopt (nothing was done to adopt); retry once the protection is cleared.
    FailureClass.NODE_PROTECTED: Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "the node is protected: nothing destructive runs on it. Unprotect it "
        "(POST /api/v1/admin/nodes/{id}/unprotect, audited), then retry the stage; or cancel",
    ),
}

_BY_CODE: dict[str, Outcome] = {
    # §5.8 DrainNode / cleanup: the agent did not pick the task up.
    "agent_unreachable": Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the node agent did not pick up its task; bring the agent back and resume (a fresh "
        "task is queued), or cancel",
    ),
    "agent_unreachable_maas_mutable": Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the node agent is unreachable while MAAS still holds the machine deployed: nothing "
        "was released; bring the agent back and resume, or cancel",
    ),
    # The node's agent does not register the task (older than the control plane): not retried.
    AGENT_CAPABILITY_MISSING: Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the node's agent does not offer this host task; upgrade the agent, then resume",
    ),
    "host_task_failed": Outcome(
        _MANUAL, OperatorAction.RESUME, "the host task kept failing; inspect the node, then resume"
    ),
    # §5.2 ValidateCleanNode: tenant residue remains; the node is quarantined.
    "validation_residue": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "tenant residue remains on the node (it is quarantined); clean it by hand, then retry "
        "validation, or cancel and keep it quarantined",
    ),
    # §5.8 ForceReleaseAllocations
    "allocations_release_failed": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "allocations remain attached (their release failed); fix the node or release them, then "
        "retry",
    ),
    "allocations_attached": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "live allocations hold the node and the request did not ask to force-release them; "
        "release them, then retry, or cancel",
    ),
    # §5.8 ReleaseMaasNode / PowerOffMaasNode: did not converge.
    "release_failed": Outcome(
        _MANUAL, OperatorAction.ADOPT, "MAAS did not release the machine; reconcile, then adopt"
    ),
    "release_timeout": Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "the machine did not reach Ready; reconcile MAAS, then adopt (or retry)",
    ),
    "erase_failed": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "disk erasing failed and the site does not allow a no-erase fallback; fix the disks "
        "(or allow the fallback), then retry",
    ),
    "erase_not_observed": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "MAAS shows the machine Ready but no disk erase since it was deployed; erase it in MAAS "
        "(allocate, then release with erase), then retry",
    ),
    "power_off_failed": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "the machine did not power off; full decommission is not complete until it does",
    ),
    # §5.8 RemoveGPUaaSNodeRecord: the node is back in retired, identity preserved.
    "uninstall_failed": Outcome(
        _RETRYABLE,
        OperatorAction.RESUME,
        "node.uninstall failed; the node is retired again. Resume requeues the uninstall",
    ),
    "uninstall_agent_unreachable": Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the node agent is unreachable after retirement; the node stays retired. Bring the agent "
        "back and resume",
    ),
    # Issue 35: a reimage's deploy that ended in Failed deployment, classified with onboarding's
    # classifier. A datasource-like failure got the site's bounded redeploy (release to Ready,
    # deploy again) and failed again; a generic one gets none. Resume starts from the release
    # step, never from a deploy MAAS refuses in Failed deployment.
    REDEPLOY_RETRIES_EXHAUSTED: Outcome(
        _MANUAL,
        OperatorAction.RESUME,
        "the deploy failed again after the site's bounded redeploy (the machine is left in "
        "Failed deployment for its installation log); fix the image or the network metadata "
        "path, then resume: the machine is released back to Ready (erased as requested) and "
        "deployed again",
    ),
    REDEPLOY_FAILED: Outcome(
        _RETRYABLE,
        OperatorAction.RESUME,
        "the deploy failed (MAAS: Failed deployment; not a datasource failure, so no automatic "
        "redeploy); read the MAAS installation log, fix, then resume: the machine is released "
        "back to Ready (erased as requested) and deployed again",
    ),
    "machine_deleted": Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "the machine disappeared from MAAS during the decommission; adopt to continue",
    ),
    # Issue 35: a full decommission whose machine vanished from MAAS unreleased is never adopted
    # as done; the host keeps its OS, tenant data and agent.
    "host_not_wiped": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "the machine vanished from MAAS before it was released: its disks were not wiped, it was "
        "not powered off and its agent not removed. Bring it back into MAAS (enlist and "
        "commission it), then retry the stage so MAAS releases and erases it; or, once its "
        "disks are dealt with out of band, record where they went "
        "(POST /api/v1/admin/decommissions/{id}/record-disk-disposition: destroyed, "
        "wiped_out_of_band or retained_quarantined), which adopts and completes the job; or "
        "cancel",
    ),
    "maas_changed_out_of_band": Outcome(
        _MANUAL,
        OperatorAction.ADOPT,
        "MAAS changed the machine out of band during the decommission; reconcile, then adopt",
    ),
    "node_not_decommissionable": Outcome(
        _MANUAL,
        OperatorAction.CANCEL,
        "the node is not in a state this decommission can start from",
    ),
    # A refused adopt: what it needs was not observed now. Never recommends adopt again (the
    # action just refused): the stage is run (and so observed) again, or the job cancelled.
    "cannot_adopt": Outcome(
        _MANUAL,
        OperatorAction.RETRY_STAGE,
        "adopt was refused: what it accepts was not observed now (see the message); fix that, "
        "then retry the stage, or cancel",
    ),
    "storage_scope_unsupported": Outcome(
        _RETRYABLE,
        OperatorAction.CANCEL,
        "the node cannot clean this storage scope (no Weka integration yet); cancel and submit "
        "scope local",
    ),
}


def outcome_for(failure_class: str | None, error_code: str | None) -> Outcome:
    if error_code is not None and error_code in _BY_CODE:
        return _BY_CODE[error_code]
    try:
        return _BY_CLASS[FailureClass(failure_class or "")]
    except (ValueError, KeyError):
        return Outcome(_MANUAL, OperatorAction.RESUME, "unclassified failure: inspect, then resume")


# `resume` re-enters at the first stage of the group whose observed state must be refreshed
# together; `retry_stage` reruns the failed stage only.
_CHECKPOINTS: dict[Stage, Stage] = {
    Stage.WAIT_FOR_DEPLOYED: Stage.DEPLOY_VIA_MAAS,
    Stage.WAIT_FOR_HARDWARE_SYNC_HEALTHY: Stage.ENSURE_HARDWARE_SYNC_CONFIGURED,
    Stage.POWER_OFF_MAAS_NODE: Stage.POWER_OFF_MAAS_NODE,
}


def checkpoint_for(stage: Stage) -> Stage:
    return _CHECKPOINTS.get(stage, stage)


# adopt_observed_state accepts an inventory stage as done only where the node record shows it
# done (MAAS stages are checked against MAAS; host work is observed again, or refused).
ADOPTABLE_NODE_STATUSES: dict[Stage, frozenset[str]] = {
    Stage.DISABLE_NODE: frozenset(
        {NodeStatus.DRAINING.value, NodeStatus.RETIRED.value, NodeStatus.REMOVING.value}
    ),
    Stage.RETIRE_GPUAAS_NODE: frozenset(
        {NodeStatus.RETIRED.value, NodeStatus.REMOVING.value, NodeStatus.DELETED.value}
    ),
    Stage.ENABLE_NODE: frozenset({NodeStatus.ACTIVE.value}),
}
