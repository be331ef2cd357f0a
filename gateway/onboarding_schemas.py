"""Request and response bodies of the MAAS onboarding admin API (docs/lifecycles/onboarding.md).

Hostnames and IPMI addresses are checked by the service, not here, so a bad value is a 422 with
a field error (`{"key": "nodes[3].hostname", "code": "invalid_hostname", ...}`) rather than a
generic 400; the bounds below only keep absurd input out.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import uuid
from typing import Annotated, Any

import msgspec

from gateway.lifecycle_jobs import JobEventView
from gateway.schemas import Reason, Request

MAX_BATCH_NODES = 500
# An RFC 1123 label in lower case: what MAAS accepts as a machine hostname.
HOSTNAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
HOSTNAME_RULE = "1-63 lowercase letters, digits or '-', not starting or ending with '-'"


def canonical_ip(value: str) -> str | None:
    """An IPv4 or IPv6 address (no prefix, no zone, not unspecified or multicast) in canonical
    form, else None. Shared with the `gpucloud-onboard` CLI, which checks a CSV before
    submitting it."""
    if "%" in value or "/" in value:
        return None
    try:
        address = ipaddress.ip_address(value.strip())
    except ValueError:
        return None
    if address.is_unspecified or address.is_multicast:
        return None
    return str(address)


SkuId = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
HostnameInput = Annotated[str, msgspec.Meta(max_length=253)]
IpInput = Annotated[str, msgspec.Meta(max_length=64)]


class OnboardingCreate(Request):
    site_id: uuid.UUID
    profile_id: uuid.UUID
    sku_id: SkuId
    ipmi_ip: IpInput
    hostname: HostnameInput


class BatchNodeCreate(Request):
    ipmi_ip: IpInput
    hostname: HostnameInput


class OnboardingBatchCreate(Request):
    """One shared site, profile and SKU; 1 to 500 nodes, hostnames and IPMI addresses unique
    within the batch."""

    site_id: uuid.UUID
    profile_id: uuid.UUID
    sku_id: SkuId
    nodes: list[BatchNodeCreate]


class OnboardingCreated(msgspec.Struct, kw_only=True):
    onboarding_id: uuid.UUID
    status: str
    node_id: uuid.UUID


class BatchOnboarding(msgspec.Struct, kw_only=True):
    hostname: str
    onboarding_id: uuid.UUID
    node_id: uuid.UUID


class BatchCreated(msgspec.Struct, kw_only=True):
    batch_id: uuid.UUID
    onboardings: list[BatchOnboarding]


class OnboardingView(msgspec.Struct, kw_only=True):
    """One row of the node_onboardings read model (docs/lifecycles/onboarding.md#monitoring)."""

    onboarding_id: uuid.UUID
    batch_id: uuid.UUID | None
    site_id: uuid.UUID
    profile_id: uuid.UUID
    sku_id: str
    hostname: str
    ipmi_ip: str
    pxe_mac: str | None
    node_id: uuid.UUID | None
    maas_system_id: str | None
    requested_by: str | None
    status: str
    current_stage: str
    current_attempt: int
    failure_class: str | None
    error_code: str | None
    error_message: str | None
    error_details: dict[str, Any]
    recommended_action: str | None
    last_maas_status: str | None
    last_maas_power_state: str | None
    last_maas_ips: list[str]
    boss_disk_id: int | None
    cloud_init_version: str | None
    deploy_attempts: int
    workflow_id: str
    workflow_run_id: str | None
    idempotency_key: str | None
    requested_at: dt.datetime
    started_at: dt.datetime | None
    completed_at: dt.datetime | None
    updated_at: dt.datetime


class OnboardingDetail(OnboardingView, kw_only=True):
    # The most recent stage events, newest first.
    events: list[JobEventView]


class OnboardingList(msgspec.Struct, kw_only=True):
    items: list[OnboardingView]
    next_cursor: str | None
    # With ?batch_id=: how many of the batch's onboardings are in each job state (whole batch,
    # not just this page), and how many there are in all.
    summary: dict[str, int] | None = None
    total: int | None = None


class OperatorActionRequest(Request):
    reason: Reason


class OperatorActionAnswer(msgspec.Struct, kw_only=True):
    onboarding_id: uuid.UUID
    action: str
    accepted: bool
    prior_status: str
    prior_stage: str
    expected_status: str
    message: str
