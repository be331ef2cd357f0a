"""Admin routes for MAAS sites (docs/maas-sites.md#admin-api): sites and their policy, profiles
(§3.7), credentials (validated against MAAS, written to Vault), probe, RoCE assignments and power
credential overrides. What calls MAAS or Vault, and the RoCE assignments, run in the worker
(gateway.maas_sites, AdminOperationWorkflow)."""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from litestar import Controller, Response, delete, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from sqlalchemy import ScalarResult, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway import maas_sites
from gateway.auth import admin_guard
from gateway.controllers.common import AdminCall, provide_admin_call
from gateway.maas_schemas import (
    CredentialsWritten,
    PowerOverrideCreate,
    PowerOverrideList,
    PowerOverridePatch,
    PowerOverrideView,
    ProbeResult,
    ProfileCreate,
    ProfileList,
    ProfilePatch,
    ProfileView,
    RoceBulk,
    RoceList,
    RoceUpserted,
    SiteCreate,
    SiteCredentials,
    SiteList,
    SitePatch,
    SiteView,
)
from gateway.openapi import errors
from schema.models import MaasPowerCredentialOverride, MaasRoceAssignment

SiteRow = TypeVar("SiteRow", MaasRoceAssignment, MaasPowerCredentialOverride)


async def _site_rows(
    db: AsyncSession, site_id: uuid.UUID, model: type[SiteRow], *order_by: Any
) -> ScalarResult[SiteRow]:
    """A site's rows of `model`, in `order_by` order; an unknown site is 404, not no rows."""
    await maas_sites.load_site(db, site_id)
    return await db.scalars(select(model).where(model.site_id == site_id).order_by(*order_by))


class AdminMaasSitesController(Controller):
    path = "/api/v1/admin/maas-sites"
    guards = [admin_guard]
    tags = ["admin: MAAS sites"]
    dependencies = {"admin": Provide(provide_admin_call)}

    @post(
        "/",
        status_code=201,
        summary="Create a site (non-secret fields and policy)",
        responses=errors(400, 403, 409, 413, 422),
    )
    async def create_site(
        self,
        data: JSONBody[SiteCreate],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
    ) -> SiteView:
        return await maas_sites.create_site(
            db,
            admin.principal,
            data,
            admin.reason(data.reason),
            admin.temporal,
            admin.settings,
        )

    @get("/", summary="List sites", responses=errors(403))
    async def list_sites(self, db: NamedDependency[AsyncSession]) -> SiteList:
        return SiteList(items=await maas_sites.list_sites(db))

    @get("/{site_id:uuid}", summary="One site with its policy", responses=errors(403, 404))
    async def get_site(
        self, db: NamedDependency[AsyncSession], site_id: FromPath[uuid.UUID]
    ) -> SiteView:
        return await maas_sites.get_site_view(db, site_id)

    @patch(
        "/{site_id:uuid}",
        summary="Update site fields, policy, or status (disable/enable)",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def patch_site(
        self,
        data: JSONBody[SitePatch],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> SiteView:
        return await maas_sites.patch_site(
            db,
            admin.principal,
            site_id,
            data,
            admin.reason(data.reason),
            admin.temporal,
            admin.settings,
        )

    @delete(
        "/{site_id:uuid}",
        status_code=200,
        summary="Disable the site (soft delete: new onboardings are rejected, running ones "
        "continue)",
        responses=errors(403, 404),
    )
    async def disable_site(
        self,
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> SiteView:
        return await maas_sites.patch_site(
            db,
            admin.principal,
            site_id,
            SitePatch(status="disabled"),
            admin.reason(),
            admin.temporal,
            admin.settings,
            action="maas_site.disable",
        )

    @post(
        "/{site_id:uuid}/credentials",
        status_code=200,
        summary="Validate a MAAS API key against MAAS, then write it (and optional power and "
        "deploy credentials) to Vault",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def set_credentials(
        self,
        data: JSONBody[SiteCredentials],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> CredentialsWritten:
        return await admin.operate(
            maas_sites.set_credentials, db, site_id, data, admin.reason(data.reason)
        )

    @post(
        "/{site_id:uuid}/probe",
        status_code=200,
        summary="Reach MAAS with the stored token: version and rack controllers",
        responses=errors(403, 404, 409, 502),
    )
    async def probe(
        self,
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> ProbeResult:
        return await maas_sites.probe(db, admin.temporal, admin.queue, site_id)

    # --- profiles ---

    @post(
        "/{site_id:uuid}/profiles",
        status_code=201,
        summary="Add a profile: a policy bundle and runtime shape of the site (overrides of "
        "distro series, architecture, PXE interface and VLAN, and of every policy knob but the "
        "site-only hardware_sync_interval, 422 site_only_setting; absent = the site's value)",
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def create_profile(
        self,
        data: JSONBody[ProfileCreate],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> ProfileView:
        return await maas_sites.create_profile(
            db, admin.principal, site_id, data, admin.reason(data.reason)
        )

    @get(
        "/{site_id:uuid}/profiles",
        summary='The site\'s profiles, by name ("default" is created with the site)',
        responses=errors(403, 404),
    )
    async def list_profiles(
        self, db: NamedDependency[AsyncSession], site_id: FromPath[uuid.UUID]
    ) -> ProfileList:
        return ProfileList(items=await maas_sites.list_profiles(db, site_id))

    @get(
        "/{site_id:uuid}/profiles/{profile_id:uuid}",
        summary="One profile with its effective values",
        responses=errors(403, 404),
    )
    async def get_profile(
        self,
        db: NamedDependency[AsyncSession],
        site_id: FromPath[uuid.UUID],
        profile_id: FromPath[uuid.UUID],
    ) -> ProfileView:
        return await maas_sites.get_profile(db, site_id, profile_id)

    @patch(
        "/{site_id:uuid}/profiles/{profile_id:uuid}",
        summary="Change a profile; null clears an override (the default profile keeps its name "
        "and cannot be disabled; a site-only knob is 422 site_only_setting)",
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def patch_profile(
        self,
        data: JSONBody[ProfilePatch],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
        profile_id: FromPath[uuid.UUID],
    ) -> ProfileView:
        return await maas_sites.patch_profile(
            db, admin.principal, site_id, profile_id, data, admin.reason(data.reason)
        )

    @delete(
        "/{site_id:uuid}/profiles/{profile_id:uuid}",
        status_code=200,
        summary="Disable a profile (soft delete: new onboardings and decommissions naming it are "
        "rejected, running ones continue; 409 default_profile_disable for the site's default)",
        responses=errors(403, 404, 409),
    )
    async def disable_profile(
        self,
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
        profile_id: FromPath[uuid.UUID],
    ) -> ProfileView:
        return await maas_sites.patch_profile(
            db,
            admin.principal,
            site_id,
            profile_id,
            ProfilePatch(status="disabled"),
            admin.reason(),
            action="maas_site.profile_disable",
        )

    # --- RoCE assignments ---

    @post(
        "/{site_id:uuid}/roce-assignments",
        status_code=200,
        summary="Bulk upsert, idempotent on site + hostname + interface",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def upsert_roce(
        self,
        data: JSONBody[RoceBulk],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> RoceUpserted:
        return await admin.operate(
            maas_sites.upsert_roce, db, site_id, data, admin.reason(data.reason)
        )

    @get("/{site_id:uuid}/roce-assignments", summary="List", responses=errors(403, 404))
    async def list_roce(
        self, db: NamedDependency[AsyncSession], site_id: FromPath[uuid.UUID]
    ) -> RoceList:
        rows = await _site_rows(
            db,
            site_id,
            MaasRoceAssignment,
            MaasRoceAssignment.hostname,
            MaasRoceAssignment.interface,
        )
        return RoceList(items=[maas_sites.roce_view(r) for r in rows])

    @delete(
        "/{site_id:uuid}/roce-assignments/{assignment_id:uuid}",
        status_code=204,
        summary="Remove one",
        responses=errors(403, 404),
    )
    async def delete_roce(
        self,
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
        assignment_id: FromPath[uuid.UUID],
    ) -> Response[None]:
        await maas_sites.delete_roce(
            admin.temporal,
            admin.queue,
            admin.principal,
            site_id,
            assignment_id,
            admin.reason(),
        )
        return Response(None, status_code=204)

    # --- power credential overrides ---

    @post(
        "/{site_id:uuid}/power-overrides",
        status_code=201,
        summary="Add a per-node BMC credential override (secret written to Vault)",
        responses=errors(400, 403, 404, 409, 413, 422),
    )
    async def create_override(
        self,
        data: JSONBody[PowerOverrideCreate],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
    ) -> PowerOverrideView:
        return await admin.operate(
            maas_sites.create_override, db, site_id, data, admin.reason(data.reason)
        )

    @get("/{site_id:uuid}/power-overrides", summary="List overrides", responses=errors(403, 404))
    async def list_overrides(
        self, db: NamedDependency[AsyncSession], site_id: FromPath[uuid.UUID]
    ) -> PowerOverrideList:
        rows = await _site_rows(
            db,
            site_id,
            MaasPowerCredentialOverride,
            MaasPowerCredentialOverride.selector_type,
            MaasPowerCredentialOverride.selector_value,
        )
        return PowerOverrideList(items=[maas_sites.override_view(r) for r in rows])

    @get(
        "/{site_id:uuid}/power-overrides/{override_id:uuid}",
        summary="One override",
        responses=errors(403, 404),
    )
    async def get_override(
        self,
        db: NamedDependency[AsyncSession],
        site_id: FromPath[uuid.UUID],
        override_id: FromPath[uuid.UUID],
    ) -> PowerOverrideView:
        return maas_sites.override_view(await maas_sites.load_override(db, site_id, override_id))

    @patch(
        "/{site_id:uuid}/power-overrides/{override_id:uuid}",
        summary="Rotate the override's credentials and/or enable/disable it",
        responses=errors(400, 403, 404, 413, 422),
    )
    async def patch_override(
        self,
        data: JSONBody[PowerOverridePatch],
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
        override_id: FromPath[uuid.UUID],
    ) -> PowerOverrideView:
        return await admin.operate(
            maas_sites.patch_override, db, site_id, override_id, data, admin.reason(data.reason)
        )

    @delete(
        "/{site_id:uuid}/power-overrides/{override_id:uuid}",
        status_code=204,
        summary="Remove an override and its secret",
        responses=errors(403, 404),
    )
    async def delete_override(
        self,
        db: NamedDependency[AsyncSession],
        admin: NamedDependency[AdminCall],
        site_id: FromPath[uuid.UUID],
        override_id: FromPath[uuid.UUID],
    ) -> Response[None]:
        await admin.operate(maas_sites.delete_override, db, site_id, override_id, admin.reason())
        return Response(None, status_code=204)
