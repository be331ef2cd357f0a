"""MAAS site use cases behind the admin controller (docs/maas-sites.md#admin-api,
docs/maas-sites.md#credential-lifecycle).

Sites, their policy and profiles are plain configuration (no secret, no call outside Temporal):
the gateway writes them in one short transaction with their audit row. Everything that talks to
MAAS or Vault (credentials, probe, BMC credential overrides) and the RoCE assignments run in the
worker through AdminOperationWorkflow (gateway.admin_operations): the gateway validates the
request and reads what it needs to answer 404/422 as before, then waits for the workflow's
answer. Secrets go to Vault only, after MAAS accepted the token; the database keeps their paths.
No response, log line, audit row or exception message carries a secret value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import re
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import msgspec
import sqlalchemy.exc
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client

from contracts.admin_operation import (
    MAAS_TOKEN_REJECTED,
    MAAS_UNREACHABLE,
    POWER_OVERRIDE_CREATE,
    POWER_OVERRIDE_DELETE,
    POWER_OVERRIDE_UPDATE,
    ROCE_DELETE,
    ROCE_UPSERT,
    SITE_CREDENTIALS_WRITE,
    SITE_PROBE,
    PowerOverrideCreateInput,
    PowerOverrideDeleteInput,
    PowerOverrideState,
    PowerOverrideUpdateInput,
    PowerSecret,
    RoceDeleteInput,
    RoceItem,
    RoceUpsertInput,
    RoceUpsertResult,
    SiteCredentialsInput,
    SiteCredentialsResult,
    SiteProbeInput,
    SiteProbeResult,
)
from contracts.maas_reconciler import WORKFLOW_NAME as RECONCILER_WORKFLOW
from contracts.maas_reconciler import ReconcileInput, reconciler_schedule_id
from contracts.onboarding import SITE_ONLY_KNOBS, profile_value, resolve_policy
from core.config import Settings
from core.schedules import periodic_schedule, put_schedule
from core.secret_paths import (
    site_api_token_path,
    site_default_power_path,
    site_deploy_password_path,
)
from core.timestamps import parse_iso
from gateway import audit
from gateway.admin_operations import actor, per_request, run_admin_operation
from gateway.auth import Principal
from gateway.errors import (
    ApiError,
    Conflict,
    FieldError,
    NotFound,
    Unprocessable,
    unprocessable,
)
from gateway.maas_schemas import (
    DEFAULT_PROFILE_NAME,
    PROFILE_OVERRIDES,
    CredentialsWritten,
    PowerOverrideCreate,
    PowerOverridePatch,
    PowerOverrideView,
    ProbeResult,
    ProfileCreate,
    ProfileEffective,
    ProfilePatch,
    ProfileView,
    RackControllerView,
    RoceBulk,
    RoceUpserted,
    RoceView,
    SiteCreate,
    SiteCredentials,
    SitePatch,
    SitePolicy,
    SitePolicyPatch,
    SiteView,
)
from gateway.temporal import TemporalOps
from schema.constraints import constraint_name
from schema.models import (
    MaasPowerCredentialOverride,
    MaasRoceAssignment,
    MaasSite,
    MaasSitePolicy,
    MaasSiteProfile,
)

_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


# --- views ----------------------------------------------------------------------------------


def policy_view(policy: MaasSitePolicy) -> SitePolicy:
    return SitePolicy(
        **{field: getattr(policy, field) for field in SitePolicy.__struct_fields__},
    )


def site_view(
    site: MaasSite, policy: MaasSitePolicy, profiles: Sequence[MaasSiteProfile] = ()
) -> SiteView:
    ordered = sorted(profiles, key=lambda p: p.name)
    return SiteView(
        id=site.id,
        name=site.name,
        region_code=site.region_code,
        api_base_url=site.api_base_url,
        status=site.status,
        pxe_iface=site.pxe_iface,
        pxe_vlan_vid=site.pxe_vlan_vid,
        node_pxe_iface=site.node_pxe_iface,
        distro_series=site.distro_series,
        architecture=site.architecture,
        deploy_user=site.deploy_user,
        deploy_ssh_iface=site.deploy_ssh_iface,
        upstream_dns_servers=list(site.upstream_dns_servers),
        api_token_vault_path=site.api_token_vault_path,
        default_power_creds_vault_path=site.default_power_creds_vault_path,
        deploy_password_vault_path=site.deploy_password_vault_path,
        credentials_updated_at=site.credentials_updated_at,
        maas_version=site.maas_version,
        policy=policy_view(policy),
        default_profile_id=site.default_profile_id,
        profile_ids=[p.id for p in ordered],
        created_at=site.created_at,
        updated_at=site.updated_at,
    )


def profile_view(profile: MaasSiteProfile, site: MaasSite, policy: MaasSitePolicy) -> ProfileView:
    """The profile's own overrides and what a run with it uses (resolved as load_site_config
    resolves it: contracts.onboarding.resolve_policy)."""
    resolved = dataclasses.asdict(resolve_policy(policy, profile))
    return ProfileView(
        id=profile.id,
        site_id=profile.site_id,
        name=profile.name,
        description=profile.description,
        status=profile.status,
        is_default=site.default_profile_id == profile.id,
        effective=ProfileEffective(
            **resolved,
            distro_series=profile_value(profile, site, "distro_series"),
            architecture=profile_value(profile, site, "architecture"),
            node_pxe_iface=profile_value(profile, site, "node_pxe_iface"),
            pxe_vlan_vid=profile_value(profile, site, "pxe_vlan_vid"),
        ),
        created_at=profile.created_at,
        updated_at=profile.updated_at,
        **{name: getattr(profile, name) for name in PROFILE_OVERRIDES},
    )


def override_view(row: MaasPowerCredentialOverride) -> PowerOverrideView:
    return PowerOverrideView(
        id=row.id,
        site_id=row.site_id,
        selector_type=row.selector_type,
        selector_value=row.selector_value,
        vault_path=row.vault_path,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def roce_view(row: MaasRoceAssignment) -> RoceView:
    return RoceView(
        id=row.id,
        hostname=row.hostname,
        interface=row.interface,
        ipv4_cidr=row.ipv4_cidr,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


# --- sites ----------------------------------------------------------------------------------


def _check_dns(servers: Sequence[str]) -> list[str]:
    try:
        return [str(ipaddress.ip_address(s)) for s in servers]
    except ValueError:
        raise Unprocessable(
            "upstream_dns_servers must be IP addresses", code="invalid_dns_servers"
        ) from None


def _apply_policy(policy: MaasSitePolicy, patch: SitePolicyPatch | None) -> dict[str, Any]:
    changed: dict[str, Any] = {}
    if patch is None:
        return changed
    for field in patch.__struct_fields__:
        value = getattr(patch, field)
        if value is not None and getattr(policy, field) != value:
            setattr(policy, field, value)
            changed[field] = value
    return changed


async def load_site(db: AsyncSession, site_id: uuid.UUID) -> tuple[MaasSite, MaasSitePolicy]:
    site = await db.get(MaasSite, site_id)
    policy = await db.get(MaasSitePolicy, site_id)
    if site is None or policy is None:
        raise NotFound("MAAS site not found")
    return site, policy


async def sync_reconciler_schedule(
    temporal: TemporalOps,
    settings: Settings,
    site_id: uuid.UUID,
    *,
    every_seconds: int,
    paused: bool,
) -> None:
    """The site's reconciler schedule `maas-reconciler-{site_id}` as the site says it should be:
    created with the site, its interval from the site policy, paused while the site is disabled
    (a running reconcile finishes; no new ones start)."""
    schedule_id = reconciler_schedule_id(str(site_id))
    schedule = periodic_schedule(
        schedule_id,
        RECONCILER_WORKFLOW,
        ReconcileInput(str(site_id)),
        every=timedelta(seconds=every_seconds),
        task_queue=settings.control_plane_task_queue,
        paused=paused,
        note="site disabled" if paused else "",
    )

    async def apply(client: Client) -> None:
        await put_schedule(client, schedule_id, schedule)

    await temporal.update(apply)


async def create_site(
    db: AsyncSession,
    principal: Principal,
    body: SiteCreate,
    reason: str | None,
    temporal: TemporalOps,
    settings: Settings,
) -> SiteView:
    site_id = uuid.uuid4()
    site = MaasSite(
        id=site_id,
        name=body.name,
        region_code=body.region_code,
        api_base_url=body.api_base_url.rstrip("/"),
        api_token_vault_path=site_api_token_path(site_id),
        default_power_creds_vault_path=site_default_power_path(site_id),
        deploy_password_vault_path=site_deploy_password_path(site_id),
        pxe_iface=body.pxe_iface,
        pxe_vlan_vid=body.pxe_vlan_vid,
        node_pxe_iface=body.node_pxe_iface,
        distro_series=body.distro_series,
        architecture=body.architecture,
        deploy_user=body.deploy_user,
        deploy_ssh_iface=body.deploy_ssh_iface,
        upstream_dns_servers=_check_dns(body.upstream_dns_servers),
        status="active",
    )
    db.add(site)
    try:
        await db.flush()
    except sqlalchemy.exc.IntegrityError as err:
        raise Conflict("a MAAS site with this name already exists", code="site_exists") from err
    policy = MaasSitePolicy(site_id=site_id)
    db.add(policy)
    # The profile the site's own columns describe (no overrides), so onboarding can name one.
    profile_id = uuid.uuid4()
    db.add(MaasSiteProfile(id=profile_id, site_id=site_id, name=DEFAULT_PROFILE_NAME))
    await db.flush()
    site.default_profile_id = profile_id
    await db.refresh(policy)
    _apply_policy(policy, body.policy)
    audit.record_by(
        db,
        principal,
        action="maas_site.create",
        target_type="maas_site",
        target_id=str(site_id),
        reason=reason,
        expected_state="active",
        details={
            "name": body.name,
            "api_base_url": site.api_base_url,
            "default_profile_id": str(profile_id),
        },
    )
    # The schedule before the commit: if Temporal cannot take it, no site is created (503).
    await sync_reconciler_schedule(
        temporal, settings, site_id, every_seconds=policy.reconcile_interval_seconds, paused=False
    )
    await db.commit()
    return await get_site_view(db, site_id)


async def get_site_view(db: AsyncSession, site_id: uuid.UUID) -> SiteView:
    site, policy = await load_site(db, site_id)
    await db.refresh(site)
    await db.refresh(policy)
    profiles = await db.scalars(select(MaasSiteProfile).where(MaasSiteProfile.site_id == site_id))
    return site_view(site, policy, list(profiles))


async def list_sites(db: AsyncSession) -> list[SiteView]:
    rows = (
        await db.execute(
            select(MaasSite, MaasSitePolicy)
            .join(MaasSitePolicy, MaasSitePolicy.site_id == MaasSite.id)
            .order_by(MaasSite.name)
        )
    ).all()
    by_site: dict[uuid.UUID, list[MaasSiteProfile]] = {}
    for profile in await db.scalars(select(MaasSiteProfile)):
        by_site.setdefault(profile.site_id, []).append(profile)
    return [site_view(site, policy, by_site.get(site.id, [])) for site, policy in rows]


async def patch_site(
    db: AsyncSession,
    principal: Principal,
    site_id: uuid.UUID,
    body: SitePatch,
    reason: str | None,
    temporal: TemporalOps,
    settings: Settings,
    *,
    action: str = "maas_site.update",
) -> SiteView:
    site, policy = await load_site(db, site_id)
    prior_status = site.status
    changed: dict[str, Any] = {}
    for field in SitePatch.__struct_fields__:
        if field in ("policy", "reason"):
            continue
        value = getattr(body, field)
        if value is None:
            continue
        if field == "upstream_dns_servers":
            value = _check_dns(value)
        if field == "api_base_url":
            value = value.rstrip("/")
        if field == "default_profile_id":
            _, problem = await usable_profile(db, site_id, value, key=field)
            if problem is not None:
                raise unprocessable([problem])
        if getattr(site, field) != value:
            setattr(site, field, value)
            changed[field] = value
    policy_changes = _apply_policy(policy, body.policy)
    if policy_changes:
        policy.updated_at = func.now()
        changed["policy"] = policy_changes
    if changed:
        site.updated_at = func.now()
        audit.record_by(
            db,
            principal,
            action=action,
            target_type="maas_site",
            target_id=str(site_id),
            reason=reason,
            prior_state=prior_status,
            expected_state=site.status,
            details={"changed": sorted(changed)},
        )
        if "status" in changed or "reconcile_interval_seconds" in policy_changes:
            await sync_reconciler_schedule(
                temporal,
                settings,
                site_id,
                every_seconds=policy.reconcile_interval_seconds,
                paused=site.status == "disabled",
            )
        await db.commit()
    return await get_site_view(db, site_id)


# --- profiles (docs/maas-sites.md#site-profiles)
# ---------------------------------------------------------------


async def usable_profile(
    db: AsyncSession, site_id: uuid.UUID | None, profile_id: uuid.UUID, key: str = "profile_id"
) -> tuple[MaasSiteProfile | None, FieldError | None]:
    """The profile when it is one of the site's, and a field error `key` unless it is an active
    one (unknown_profile, profile_disabled): what an onboarding or decommission may name and
    what a site may take as its default."""
    profile = await db.get(MaasSiteProfile, profile_id)
    if profile is None or profile.site_id != site_id:
        return None, FieldError(key, "unknown_profile", "this site has no such profile")
    if profile.status != "active":
        return profile, FieldError(key, "profile_disabled", "this profile is disabled")
    return profile, None


def _refuse_site_only(body: ProfileCreate | ProfilePatch) -> None:
    """422 site_only_setting for a value of a knob a profile cannot set (`null` is no value)."""
    errors = [
        FieldError(
            name,
            "site_only_setting",
            f"{name} is one MAAS setting for the whole site (MAAS keeps a single global value):"
            " set it in the site policy",
        )
        for name in sorted(SITE_ONLY_KNOBS)
        if getattr(body, name) not in (None, msgspec.UNSET)
    ]
    if errors:
        raise unprocessable(errors)


async def load_profile(
    db: AsyncSession, site_id: uuid.UUID, profile_id: uuid.UUID
) -> MaasSiteProfile:
    profile = await db.get(MaasSiteProfile, profile_id)
    if profile is None or profile.site_id != site_id:
        raise NotFound("site profile not found")
    return profile


def _profile_conflict(err: sqlalchemy.exc.IntegrityError) -> ApiError | None:
    if constraint_name(err) == "maas_site_profile_name":
        return Conflict("this site already has a profile with this name", code="profile_exists")
    return None


async def create_profile(
    db: AsyncSession,
    principal: Principal,
    site_id: uuid.UUID,
    body: ProfileCreate,
    reason: str | None,
) -> ProfileView:
    site, policy = await load_site(db, site_id)
    _refuse_site_only(body)
    profile_id = uuid.uuid4()
    profile = MaasSiteProfile(
        id=profile_id,
        site_id=site_id,
        name=body.name,
        description=body.description,
        **{name: getattr(body, name) for name in PROFILE_OVERRIDES},
    )
    db.add(profile)
    try:
        await db.flush()
    except sqlalchemy.exc.IntegrityError as err:
        conflict = _profile_conflict(err)
        if conflict is None:
            raise
        raise conflict from err
    audit.record_by(
        db,
        principal,
        action="maas_site.profile_create",
        target_type="maas_site_profile",
        target_id=str(profile_id),
        reason=reason,
        expected_state="active",
        details={
            "site_id": str(site_id),
            "name": body.name,
            "overrides": sorted(n for n in PROFILE_OVERRIDES if getattr(body, n) is not None),
        },
    )
    await db.commit()
    await db.refresh(profile)
    return profile_view(profile, site, policy)


async def list_profiles(db: AsyncSession, site_id: uuid.UUID) -> list[ProfileView]:
    site, policy = await load_site(db, site_id)
    rows = await db.scalars(
        select(MaasSiteProfile)
        .where(MaasSiteProfile.site_id == site_id)
        .order_by(MaasSiteProfile.name)
    )
    return [profile_view(p, site, policy) for p in rows]


async def get_profile(db: AsyncSession, site_id: uuid.UUID, profile_id: uuid.UUID) -> ProfileView:
    site, policy = await load_site(db, site_id)
    return profile_view(await load_profile(db, site_id, profile_id), site, policy)


async def patch_profile(
    db: AsyncSession,
    principal: Principal,
    site_id: uuid.UUID,
    profile_id: uuid.UUID,
    body: ProfilePatch,
    reason: str | None,
    *,
    action: str = "maas_site.profile_update",
) -> ProfileView:
    site, policy = await load_site(db, site_id)
    profile = await load_profile(db, site_id, profile_id)
    _refuse_site_only(body)
    prior_status = profile.status
    changed: list[str] = []
    for field in ProfilePatch.__struct_fields__:
        if field == "reason" or field in SITE_ONLY_KNOBS:
            continue
        value = getattr(body, field)
        if value is msgspec.UNSET or getattr(profile, field) == value:
            continue
        if field == "name" and profile.name == DEFAULT_PROFILE_NAME:
            raise Conflict(
                "the site's default profile keeps its name", code="default_profile_rename"
            )
        if field == "status" and value == "disabled" and site.default_profile_id == profile.id:
            raise Conflict(
                "the site's default profile cannot be disabled: make another one the default "
                "first (PATCH the site's default_profile_id)",
                code="default_profile_disable",
            )
        setattr(profile, field, value)
        changed.append(field)
    if changed:
        profile.updated_at = func.now()
        try:
            await db.flush()
        except sqlalchemy.exc.IntegrityError as err:
            conflict = _profile_conflict(err)
            if conflict is None:
                raise
            raise conflict from err
        audit.record_by(
            db,
            principal,
            action=action,
            target_type="maas_site_profile",
            target_id=str(profile_id),
            reason=reason,
            prior_state=prior_status,
            expected_state=profile.status,
            details={"site_id": str(site_id), "changed": sorted(changed)},
        )
        await db.commit()
        await db.refresh(profile)
    return profile_view(profile, site, policy)


# --- credentials and probe ------------------------------------------------------------------
# MAAS and Vault are called by the worker (AdminOperationWorkflow): the gateway reads the site
# (404 as before), then runs the operation and waits for its answer.


async def set_credentials(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    body: SiteCredentials,
    reason: str | None,
) -> CredentialsWritten:
    """The worker validates the key against MAAS, writes the secrets to Vault (putting the
    previous ones back if a write or the commit fails) and commits the site row and its audit
    row. The secrets travel only in the encrypted workflow payload; the workflow id is this
    request's own, so a concurrent change with other secrets is never answered with this one."""
    await load_site(db, site_id)
    await db.close()  # no connection held across the Temporal call
    result = await run_admin_operation(
        temporal,
        task_queue,
        SITE_CREDENTIALS_WRITE,
        SiteCredentialsInput(
            actor=actor(principal, reason),
            site_id=str(site_id),
            maas_api_key=body.maas_api_key,
            power=(
                PowerSecret(user=body.power.user, password=body.power.password)
                if body.power is not None
                else None
            ),
            deploy_password=body.deploy_password,
        ),
        key=per_request(site_id),
        result_type=SiteCredentialsResult,
    )
    return CredentialsWritten(
        site_id=uuid.UUID(result.site_id),
        maas_version=result.maas_version,
        written_paths=result.written_paths,
    )


async def probe(
    db: AsyncSession, temporal: TemporalOps, task_queue: str, site_id: uuid.UUID
) -> ProbeResult:
    """The worker reads the token from Vault now (a rotated token is used at once) and asks
    MAAS; MAAS trouble is 502 here (the stored key stopped working), 422 on a credentials
    write."""
    await load_site(db, site_id)
    await db.close()
    result = await run_admin_operation(
        temporal,
        task_queue,
        SITE_PROBE,
        SiteProbeInput(site_id=str(site_id)),
        key=per_request(site_id),
        result_type=SiteProbeResult,
        statuses={MAAS_TOKEN_REJECTED: 502, MAAS_UNREACHABLE: 502},
    )
    return ProbeResult(
        site_id=uuid.UUID(result.site_id),
        reachable=True,
        maas_version=result.maas_version,
        subversion=result.subversion,
        capabilities=result.capabilities,
        rack_controllers=[
            RackControllerView(system_id=r.system_id, hostname=r.hostname, version=r.version)
            for r in result.rack_controllers
        ],
    )


# --- RoCE assignments -----------------------------------------------------------------------


def _check_roce(body: RoceBulk) -> list[RoceItem]:
    """The items, each CIDR normalised; 422 for a bad one or a repeated hostname + interface."""
    rows: list[RoceItem] = []
    seen: set[tuple[str, str]] = set()
    for index, item in enumerate(body.items):
        try:
            cidr = str(ipaddress.IPv4Interface(item.ipv4_cidr))
            if "/" not in item.ipv4_cidr:
                raise ValueError
        except ValueError:
            raise Unprocessable(
                f"items[{index}].ipv4_cidr is not an IPv4 address with a prefix (a.b.c.d/n)",
                code="invalid_cidr",
                details={"index": index},
            ) from None
        key = (item.hostname, item.interface)
        if key in seen:
            raise Unprocessable(
                f"items[{index}] repeats hostname {item.hostname!r} interface {item.interface!r}",
                code="duplicate_assignment",
                details={"index": index},
            )
        seen.add(key)
        rows.append(RoceItem(hostname=item.hostname, interface=item.interface, ipv4_cidr=cidr))
    return rows


async def upsert_roce(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    body: RoceBulk,
    reason: str | None,
) -> RoceUpserted:
    """Validated here; upserted and audited by the worker. The workflow id is the site and a
    digest of the validated items: an identical request racing this one gets this answer."""
    await load_site(db, site_id)
    items = _check_roce(body)
    await db.close()
    digest = hashlib.sha256(
        json.dumps([[i.hostname, i.interface, i.ipv4_cidr] for i in items]).encode()
    ).hexdigest()[:32]
    result = await run_admin_operation(
        temporal,
        task_queue,
        ROCE_UPSERT,
        RoceUpsertInput(actor=actor(principal, reason), site_id=str(site_id), items=items),
        key=f"{site_id}-{digest}",
        result_type=RoceUpsertResult,
    )
    return RoceUpserted(created=result.created, updated=result.updated, unchanged=result.unchanged)


async def delete_roce(
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    assignment_id: uuid.UUID,
    reason: str | None,
) -> None:
    """Deleted and audited by the worker; 404 for another site's or no assignment."""
    await run_admin_operation(
        temporal,
        task_queue,
        ROCE_DELETE,
        RoceDeleteInput(
            actor=actor(principal, reason), site_id=str(site_id), assignment_id=str(assignment_id)
        ),
        key=f"{site_id}-{assignment_id}",
        result_type=type(None),
    )


# --- power credential overrides -------------------------------------------------------------


def normalise_selector(selector_type: str, value: str) -> str:
    value = value.strip()
    if selector_type == "pxe_mac":
        mac = value.lower().replace("-", ":")
        if not _MAC.match(mac):
            raise Unprocessable("pxe_mac must look like aa:bb:cc:dd:ee:ff", code="invalid_selector")
        return mac
    if selector_type == "ipmi_ip":
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise Unprocessable("ipmi_ip must be an IP address", code="invalid_selector") from None
    if not _HOSTNAME.match(value):
        raise Unprocessable("hostname is not a valid host name", code="invalid_selector")
    return value.lower()


def _override_view(state: PowerOverrideState) -> PowerOverrideView:
    created_at, updated_at = parse_iso(state.created_at), parse_iso(state.updated_at)
    assert created_at is not None
    assert updated_at is not None
    return PowerOverrideView(
        id=uuid.UUID(state.id),
        site_id=uuid.UUID(state.site_id),
        selector_type=state.selector_type,
        selector_value=state.selector_value,
        vault_path=state.vault_path,
        status=state.status,
        created_at=created_at,
        updated_at=updated_at,
    )


async def create_override(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    body: PowerOverrideCreate,
    reason: str | None,
) -> PowerOverrideView:
    """Validated here; the worker inserts the row, writes the secret to Vault and commits with
    the audit row (a failed write leaves nothing). 409 `override_exists` for a selector that
    already has one."""
    await load_site(db, site_id)
    selector_value = normalise_selector(body.selector_type, body.selector_value)
    await db.close()
    override_id = uuid.uuid4()
    state = await run_admin_operation(
        temporal,
        task_queue,
        POWER_OVERRIDE_CREATE,
        PowerOverrideCreateInput(
            actor=actor(principal, reason),
            site_id=str(site_id),
            override_id=str(override_id),
            selector_type=body.selector_type,
            selector_value=selector_value,
            user=body.user,
            password=body.password,
        ),
        key=str(override_id),
        result_type=PowerOverrideState,
    )
    return _override_view(state)


async def load_override(
    db: AsyncSession, site_id: uuid.UUID, override_id: uuid.UUID
) -> MaasPowerCredentialOverride:
    row = await db.get(MaasPowerCredentialOverride, override_id)
    if row is None or row.site_id != site_id:
        raise NotFound("power credential override not found")
    return row


async def patch_override(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    override_id: uuid.UUID,
    body: PowerOverridePatch,
    reason: str | None,
) -> PowerOverrideView:
    """Rotation (a Vault write) and/or status change, by the worker, audited."""
    await load_override(db, site_id, override_id)
    if (body.user is None) != (body.password is None):
        raise Unprocessable("rotate with both user and password", code="incomplete_credentials")
    await db.close()
    state = await run_admin_operation(
        temporal,
        task_queue,
        POWER_OVERRIDE_UPDATE,
        PowerOverrideUpdateInput(
            actor=actor(principal, reason),
            site_id=str(site_id),
            override_id=str(override_id),
            status=body.status,
            user=body.user,
            password=body.password,
        ),
        key=per_request(override_id),
        result_type=PowerOverrideState,
    )
    return _override_view(state)


async def delete_override(
    db: AsyncSession,
    temporal: TemporalOps,
    task_queue: str,
    principal: Principal,
    site_id: uuid.UUID,
    override_id: uuid.UUID,
    reason: str | None,
) -> None:
    """The worker deletes the secret, then commits the row's removal with its audit row (a
    failed delete leaves the override as it was)."""
    await load_override(db, site_id, override_id)
    await db.close()
    await run_admin_operation(
        temporal,
        task_queue,
        POWER_OVERRIDE_DELETE,
        PowerOverrideDeleteInput(
            actor=actor(principal, reason), site_id=str(site_id), override_id=str(override_id)
        ),
        key=f"{site_id}-{override_id}",
        result_type=type(None),
    )
