"""A submitted onboarding (single or batch) or decommission, recorded and started by the worker
(AdminOperationWorkflow operations ONBOARDING_SUBMIT / DECOMMISSION_SUBMIT): the job rows (the
lifecycle's read model, which the gateway never writes) and the lifecycle's workflow start
together, so an operation that runs late (the gateway gave up waiting) still leaves a job that
runs, never a pending row without a workflow. A start Temporal refuses withdraws the rows again.

The submit operation of a request with an idempotency key runs under that key: a concurrent or
later retry joins it or finds the rows it wrote, and the gateway compares them with its own body
(same: the earlier answer; different: idempotency_key_reused)."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.decommission import DecommissionInput


@dataclass
class OnboardingRow:
    onboarding_id: str
    node_id: str
    site_id: str
    profile_id: str
    sku_id: str
    hostname: str
    ipmi_ip: str
    requested_by: str
    current_stage: str
    workflow_id: str
    batch_id: str | None = None
    idempotency_key: str | None = None
    status: str = "pending"  # where the job is now, on rows answered for a replay


@dataclass
class HostnameConflict:
    """A live onboarding of the hostname at the site (code onboarding_in_progress, ref its id),
    or a live node with it (node_exists, ref the node id)."""

    hostname: str
    code: str
    ref: str


@dataclass
class OnboardingSubmission:
    """One row: a single onboarding. Several, or `batch_max_parallel` set: a batch, whose
    workflow starts the children."""

    site_id: str
    rows: list[OnboardingRow]
    batch_max_parallel: int | None = None


@dataclass
class OnboardingRecorded:
    """`rows`: what the key holds when `replayed` (an earlier request's rows), else the rows just
    written; `conflicts`: why nothing was written (empty when written)."""

    rows: list[OnboardingRow] = field(default_factory=list)
    replayed: bool = False
    conflicts: list[HostnameConflict] = field(default_factory=list)


@dataclass
class DecommissionSubmission:
    """The workflow's input, and what the job row holds besides (the row's stage and workflow id
    follow from the input)."""

    start: DecommissionInput
    hostname: str | None = None
    requested_by_token_id: str | None = None


@dataclass
class DecommissionRecorded:
    """False when another live decommission of the node got in first (the partial unique index)."""

    recorded: bool
