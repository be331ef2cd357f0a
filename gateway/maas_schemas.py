"""Request and response bodies of the MAAS site admin API (docs/maas-sites.md#admin-api). Secrets
only ever travel inward (credentials, power overrides); no response has a field that could hold
one."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas import Name, Reason, Request

Interface = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]
Hostname = Annotated[
    str,
    msgspec.Meta(
        min_length=1, max_length=253, pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$"
    ),
]
RegionCode = Annotated[str, msgspec.Meta(min_length=1, max_length=50, pattern=r"^[a-z0-9-]+$")]
Url = Annotated[str, msgspec.Meta(min_length=8, max_length=500, pattern=r"^https?://[^\s]+$")]
Secret = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
SiteStatus = Literal["active", "disabled"]
# The bounds of the maas_site_policies check constraints (poll 10 ms to 10 min), timeouts at most
# a week.
PollIntervalMs = Annotated[int, msgspec.Meta(ge=10, le=600_000)]
TimeoutSeconds = Annotated[int, msgspec.Meta(ge=1, le=7 * 24 * 3600)]
DistroSeries = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Architecture = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


HwSyncInterval = Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,5}[smh]$")]
DeployRetries = Annotated[int, msgspec.Meta(ge=0, le=10)]
BatchParallel = Annotated[int, msgspec.Meta(ge=1, le=500)]
BundleRef = Annotated[str, msgspec.Meta(max_length=300)]
EnrollmentTtl = Annotated[int, msgspec.Meta(ge=60, le=7 * 24 * 3600)]
VlanVid = Annotated[int, msgspec.Meta(ge=0, le=4094)]
Description = Annotated[str, msgspec.Meta(max_length=2000)]
# A site-only knob in a profile request (contracts.onboarding.SITE_ONLY_KNOBS): read only to
# refuse a value.
SiteOnly = Annotated[
    Any,
    msgspec.Meta(
        description="Site-only (MAAS keeps one global value): any value but null is refused, "
        "422 site_only_setting; set it in the site policy."
    ),
]


class RunPolicy(msgspec.Struct, kw_only=True):
    """Every knob an onboarding or decommission run uses (docs/maas-sites.md#policy-knobs,
    docs/lifecycles/onboarding.md#timeouts-and-preflight), with its default: the site policy's,
    which a profile may override knob by knob (§3.7)."""

    strict_pxe_preflight: bool = True
    enable_phase2_roce: bool = True
    require_hw_sync: bool = True
    hardware_sync_interval: HwSyncInterval = "15m"
    release_fallback_no_erase: bool = True
    enable_deploy_retry_on_datasource_failure: bool = True
    max_deploy_retry_attempts: DeployRetries = 1
    auto_claim_single_new_machine: bool = False
    batch_max_parallel: BatchParallel = 10
    site_bootstrap_bundle_ref: BundleRef | None = None
    enrollment_token_ttl_seconds: EnrollmentTtl = 7200
    # docs/lifecycles/onboarding.md#timeouts-and-preflight: how often onboarding waits poll MAAS,
    # and how long each wait may take.
    maas_poll_interval_ms: PollIntervalMs = 10_000
    discovery_timeout_seconds: TimeoutSeconds = 900
    commission_timeout_seconds: TimeoutSeconds = 3600
    deploy_timeout_seconds: TimeoutSeconds = 3600
    hw_sync_seed_timeout_seconds: TimeoutSeconds = 900
    hw_sync_health_timeout_seconds: TimeoutSeconds = 1800
    enrollment_timeout_seconds: TimeoutSeconds = 1800
    roce_failures_stop_job: bool = False


class SitePolicy(RunPolicy, kw_only=True):
    """The site policy: the run knobs' site values, and the site's own reconciler knobs."""

    reconcile_interval_seconds: Annotated[int, msgspec.Meta(ge=30, le=86400)] = 300
    reconcile_max_missing_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    release_retired_machines: bool = False
    reconcile_max_quarantine: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 10


class SitePolicyPatch(Request):
    strict_pxe_preflight: bool | None = None
    enable_phase2_roce: bool | None = None
    require_hw_sync: bool | None = None
    hardware_sync_interval: Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,5}[smh]$")] | None = None
    release_fallback_no_erase: bool | None = None
    enable_deploy_retry_on_datasource_failure: bool | None = None
    max_deploy_retry_attempts: Annotated[int, msgspec.Meta(ge=0, le=10)] | None = None
    auto_claim_single_new_machine: bool | None = None
    batch_max_parallel: Annotated[int, msgspec.Meta(ge=1, le=500)] | None = None
    site_bootstrap_bundle_ref: Annotated[str, msgspec.Meta(max_length=300)] | None = None
    enrollment_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=7 * 24 * 3600)] | None = (
        None
    )
    reconcile_interval_seconds: Annotated[int, msgspec.Meta(ge=30, le=86400)] | None = None
    maas_poll_interval_ms: PollIntervalMs | None = None
    discovery_timeout_seconds: TimeoutSeconds | None = None
    commission_timeout_seconds: TimeoutSeconds | None = None
    deploy_timeout_seconds: TimeoutSeconds | None = None
    hw_sync_seed_timeout_seconds: TimeoutSeconds | None = None
    hw_sync_health_timeout_seconds: TimeoutSeconds | None = None
    enrollment_timeout_seconds: TimeoutSeconds | None = None
    roce_failures_stop_job: bool | None = None
    reconcile_max_missing_share: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    release_retired_machines: bool | None = None
    reconcile_max_quarantine: Annotated[int, msgspec.Meta(ge=1, le=100000)] | None = None


class SiteCreate(Request):
    name: Name
    region_code: RegionCode
    api_base_url: Url
    pxe_iface: Interface
    pxe_vlan_vid: Annotated[int, msgspec.Meta(ge=0, le=4094)]
    node_pxe_iface: Interface
    distro_series: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "ubuntu/noble"
    architecture: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "amd64/generic"
    deploy_user: Annotated[str, msgspec.Meta(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")] = "hpcadmin"
    deploy_ssh_iface: Interface = "eno8303"
    upstream_dns_servers: Annotated[list[str], msgspec.Meta(min_length=1, max_length=8)] = (
        msgspec.field(default_factory=lambda: ["1.1.1.1", "8.8.8.8"])
    )
    policy: SitePolicyPatch | None = None
    reason: Reason | None = None


class SitePatch(Request):
    region_code: RegionCode | None = None
    api_base_url: Url | None = None
    pxe_iface: Interface | None = None
    pxe_vlan_vid: Annotated[int, msgspec.Meta(ge=0, le=4094)] | None = None
    node_pxe_iface: Interface | None = None
    distro_series: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    architecture: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    deploy_user: Annotated[str, msgspec.Meta(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")] | None = None
    deploy_ssh_iface: Interface | None = None
    upstream_dns_servers: Annotated[list[str], msgspec.Meta(min_length=1, max_length=8)] | None = (
        None
    )
    status: SiteStatus | None = None
    # One of the site's active profiles: what requests that name no profile run with.
    default_profile_id: uuid.UUID | None = None
    policy: SitePolicyPatch | None = None
    reason: Reason | None = None


class SiteView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    region_code: str
    api_base_url: str
    status: str
    pxe_iface: str
    pxe_vlan_vid: int
    node_pxe_iface: str
    distro_series: str
    architecture: str
    deploy_user: str
    deploy_ssh_iface: str
    upstream_dns_servers: list[str]
    # Where the secrets live (paths, never values) and whether the MAAS token was validated.
    api_token_vault_path: str
    default_power_creds_vault_path: str
    deploy_password_vault_path: str
    credentials_updated_at: dt.datetime | None
    maas_version: str | None
    policy: SitePolicy
    # The site's profiles (by name); `default_profile_id` is what a request that names no
    # profile runs with (at first the one named "default", created with the site).
    default_profile_id: uuid.UUID | None
    profile_ids: list[uuid.UUID]
    created_at: dt.datetime
    updated_at: dt.datetime


class SiteList(msgspec.Struct, kw_only=True):
    items: list[SiteView]


class PowerCredentials(Request):
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    password: Secret


class SiteCredentials(Request):
    """POST …/credentials. The MAAS API key is validated against MAAS before anything is
    written; power credentials and the deploy password are optional on rotation."""

    maas_api_key: Secret
    power: PowerCredentials | None = None
    deploy_password: Secret | None = None
    reason: Reason | None = None


class CredentialsWritten(msgspec.Struct, kw_only=True):
    site_id: uuid.UUID
    maas_version: str
    written_paths: list[str]


class RackControllerView(msgspec.Struct, kw_only=True):
    system_id: str
    hostname: str
    version: str | None = None


class ProbeResult(msgspec.Struct, kw_only=True):
    site_id: uuid.UUID
    reachable: bool
    maas_version: str
    subversion: str | None
    capabilities: list[str]
    rack_controllers: list[RackControllerView]


class RoceItem(Request):
    hostname: Hostname
    interface: Interface
    ipv4_cidr: Annotated[str, msgspec.Meta(min_length=9, max_length=18)]


class RoceBulk(Request):
    items: Annotated[list[RoceItem], msgspec.Meta(min_length=1, max_length=2000)]
    reason: Reason | None = None


class RoceView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    hostname: str
    interface: str
    ipv4_cidr: str
    created_at: dt.datetime
    updated_at: dt.datetime


class RoceUpserted(msgspec.Struct, kw_only=True):
    created: int
    updated: int
    unchanged: int


class RoceList(msgspec.Struct, kw_only=True):
    items: list[RoceView]


SelectorType = Literal["hostname", "ipmi_ip", "pxe_mac"]


class PowerOverrideCreate(Request):
    selector_type: SelectorType
    selector_value: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    password: Secret
    reason: Reason | None = None


class PowerOverridePatch(Request):
    """Rotate (user + password) and/or enable/disable."""

    user: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    password: Secret | None = None
    status: SiteStatus | None = None
    reason: Reason | None = None


class PowerOverrideView(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    site_id: uuid.UUID
    selector_type: str
    selector_value: str
    vault_path: str
    status: str
    created_at: dt.datetime
    updated_at: dt.datetime


class PowerOverrideList(msgspec.Struct, kw_only=True):
    items: list[PowerOverrideView]


# --- site profiles (docs/maas-sites.md#site-profiles): runtime shapes one site can deploy ---

DEFAULT_PROFILE_NAME = "default"


ProfileStatus = Literal["active", "disabled"]


class ProfileOverrides(msgspec.Struct, kw_only=True):
    """What a profile sets itself (docs/maas-sites.md#site-profiles): the profile-scoped site values
    of §3.6 and every run knob but the site-only ones (contracts.onboarding.SITE_ONLY_KNOBS). `null`
    falls back to the site's value."""

    distro_series: DistroSeries | None = None
    architecture: Architecture | None = None
    node_pxe_iface: Interface | None = None
    pxe_vlan_vid: VlanVid | None = None
    strict_pxe_preflight: bool | None = None
    enable_phase2_roce: bool | None = None
    require_hw_sync: bool | None = None
    release_fallback_no_erase: bool | None = None
    enable_deploy_retry_on_datasource_failure: bool | None = None
    max_deploy_retry_attempts: DeployRetries | None = None
    auto_claim_single_new_machine: bool | None = None
    batch_max_parallel: BatchParallel | None = None
    site_bootstrap_bundle_ref: BundleRef | None = None
    enrollment_token_ttl_seconds: EnrollmentTtl | None = None
    maas_poll_interval_ms: PollIntervalMs | None = None
    discovery_timeout_seconds: TimeoutSeconds | None = None
    commission_timeout_seconds: TimeoutSeconds | None = None
    deploy_timeout_seconds: TimeoutSeconds | None = None
    hw_sync_seed_timeout_seconds: TimeoutSeconds | None = None
    hw_sync_health_timeout_seconds: TimeoutSeconds | None = None
    enrollment_timeout_seconds: TimeoutSeconds | None = None
    roce_failures_stop_job: bool | None = None


# The fields of ProfileOverrides: the columns of maas_site_profiles a profile may set.
PROFILE_OVERRIDES = ProfileOverrides.__struct_fields__


class ProfileCreate(Request, ProfileOverrides, kw_only=True):
    """An absent (null) override falls back to the site's own value. A site-only knob is
    refused: 422 `site_only_setting` (set it in the site policy)."""

    name: Name
    description: Description | None = None
    hardware_sync_interval: SiteOnly = msgspec.UNSET
    reason: Reason | None = None


class ProfilePatch(Request):
    """Absent fields stay as they are; `null` clears an override (the site's value applies).
    `status: disabled` takes the profile out of new onboardings and decommissions (not the
    site's default profile); running jobs go on with the policy they resolved at their start.
    A site-only knob is refused as in ProfileCreate."""

    name: Name | msgspec.UnsetType = msgspec.UNSET
    description: Description | msgspec.UnsetType | None = msgspec.UNSET
    status: ProfileStatus | msgspec.UnsetType = msgspec.UNSET
    distro_series: DistroSeries | msgspec.UnsetType | None = msgspec.UNSET
    architecture: Architecture | msgspec.UnsetType | None = msgspec.UNSET
    node_pxe_iface: Interface | msgspec.UnsetType | None = msgspec.UNSET
    pxe_vlan_vid: VlanVid | msgspec.UnsetType | None = msgspec.UNSET
    strict_pxe_preflight: bool | msgspec.UnsetType | None = msgspec.UNSET
    enable_phase2_roce: bool | msgspec.UnsetType | None = msgspec.UNSET
    require_hw_sync: bool | msgspec.UnsetType | None = msgspec.UNSET
    hardware_sync_interval: SiteOnly = msgspec.UNSET
    release_fallback_no_erase: bool | msgspec.UnsetType | None = msgspec.UNSET
    enable_deploy_retry_on_datasource_failure: bool | msgspec.UnsetType | None = msgspec.UNSET
    max_deploy_retry_attempts: DeployRetries | msgspec.UnsetType | None = msgspec.UNSET
    auto_claim_single_new_machine: bool | msgspec.UnsetType | None = msgspec.UNSET
    batch_max_parallel: BatchParallel | msgspec.UnsetType | None = msgspec.UNSET
    site_bootstrap_bundle_ref: BundleRef | msgspec.UnsetType | None = msgspec.UNSET
    enrollment_token_ttl_seconds: EnrollmentTtl | msgspec.UnsetType | None = msgspec.UNSET
    maas_poll_interval_ms: PollIntervalMs | msgspec.UnsetType | None = msgspec.UNSET
    discovery_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    commission_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    deploy_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    hw_sync_seed_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    hw_sync_health_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    enrollment_timeout_seconds: TimeoutSeconds | msgspec.UnsetType | None = msgspec.UNSET
    roce_failures_stop_job: bool | msgspec.UnsetType | None = msgspec.UNSET
    reason: Reason | None = None


class ProfileEffective(RunPolicy, kw_only=True):
    """What a run with this profile uses: each override, else the site's value."""

    distro_series: str
    architecture: str
    node_pxe_iface: str
    pxe_vlan_vid: int


class ProfileView(ProfileOverrides, kw_only=True):
    id: uuid.UUID
    site_id: uuid.UUID
    name: str
    description: str | None
    status: str
    is_default: bool  # the one a request that names no profile runs with
    effective: ProfileEffective
    created_at: dt.datetime
    updated_at: dt.datetime


class ProfileList(msgspec.Struct, kw_only=True):
    items: list[ProfileView]
