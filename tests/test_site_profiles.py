"""Site profiles as the policy surface (docs/maas-sites.md#site-profiles): a run resolves its
profile's policy once (load_site_config) and uses that snapshot; onboarding and decommission name
the profile. Real Temporal, PostgreSQL, the MAAS simulator over HTTP and the real agent process."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import func, select

from contracts.onboarding import SITE_ONLY_KNOBS, SitePolicyView, resolve_policy
from schema.models import MaasSiteProfile, NodeDecommission, NodeMaasState, NodeOnboarding
from tests.decommission_fixtures import DecommissionRig
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_gateway_auth import assert_error

MACHINES = sim_scenario(
    sim_machine("prof-a", "10.176.19.10"),
    sim_machine("prof-b", "10.176.19.11"),
)
BUNDLE = "infra/site-bootstrap@2026.11"


@pytest.fixture
async def admin(api: Any, make_token: Any, decommission: DecommissionRig) -> Any:
    return await api(token=await make_token("admin"))


async def _profile(admin: Any, site_id: uuid.UUID, **body: Any) -> dict[str, Any]:
    response = await admin.post(f"/api/v1/admin/maas-sites/{site_id}/profiles", json=body)
    assert response.status_code == 201, response.text
    profile: dict[str, Any] = response.json()
    return profile


@pytest.mark.maas_scenario(MACHINES)
async def test_onboarding_runs_with_its_profiles_policy(
    admin: Any, decommission: DecommissionRig
) -> None:
    rig: OnboardingRig = decommission.onboarding
    profile = await _profile(admin, rig.site_id, name="bundled", site_bootstrap_bundle_ref=BUNDLE)
    rig.profile_id = uuid.UUID(profile["id"])
    job = await rig.start("prof-a", "10.176.19.10")
    row = await rig.wait_status(job, "completed")
    assert row.profile_id == rig.profile_id
    machine = await rig.maas_sim.machine(row.maas_system_id)
    # The site sets no bundle: the one deployed is the profile's.
    assert BUNDLE in machine["user_data_text"]


@pytest.mark.maas_scenario(MACHINES)
async def test_decommission_takes_a_profile_of_the_nodes_site(
    admin: Any, decommission: DecommissionRig
) -> None:
    rig: OnboardingRig = decommission.onboarding
    node_id = await decommission.maas_node("prof-b", "10.176.19.11")
    await decommission.agent(node_id)
    url = f"/api/v1/admin/nodes/{node_id}/decommission"
    body = {"mode": "full_decommission", "erase": "quick", "reason": "rack move"}

    # Unknown, other-site and disabled profiles: 422 with the field's code, nothing started.
    other_site = await admin.post(
        "/api/v1/admin/maas-sites",
        json={
            "name": f"other-{uuid.uuid4().hex[:6]}",
            "region_code": "us-east-1",
            "api_base_url": "http://127.0.0.1:9/MAAS",
            "pxe_iface": "ens19",
            "pxe_vlan_vid": 46,
            "node_pxe_iface": "eno8303",
        },
    )
    foreign = other_site.json()["default_profile_id"]
    spare = await _profile(admin, rig.site_id, name="spare")
    disabled = await admin.delete(f"/api/v1/admin/maas-sites/{rig.site_id}/profiles/{spare['id']}")
    assert disabled.status_code == 200, disabled.text
    for profile_id, code in (
        (str(uuid.uuid4()), "unknown_profile"),
        (foreign, "unknown_profile"),
        (spare["id"], "profile_disabled"),
    ):
        assert_error(await admin.post(url, json={**body, "profile_id": profile_id}), 422, code)
    async with rig.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(NodeDecommission)) == 0

    # The site allows the no-erase fallback; the profile named by the request does not, and
    # the run follows the profile: the failed erase stops for an operator.
    strict = await _profile(admin, rig.site_id, name="strict", release_fallback_no_erase=False)
    async with rig.sessions() as session:
        binding = await session.get(NodeMaasState, uuid.UUID(node_id))
        assert binding is not None
        system_id = binding.maas_system_id
    await rig.maas_sim.set_fault(system_id, "erase_fails")
    started = await admin.post(url, json={**body, "profile_id": strict["id"]})
    assert started.status_code == 201, started.text
    job = decommission.track(started.json()["decommission_id"], node_id, "full_decommission")
    row = await decommission.wait_status(job, "failed_manual_intervention")
    assert (row.current_stage, row.error_code) == ("release_maas_node", "erase_failed")
    async with rig.sessions() as session:
        onboarded = await session.scalar(
            select(NodeOnboarding.profile_id).where(NodeOnboarding.node_id == uuid.UUID(node_id))
        )
    assert onboarded == rig.profile_id  # not the profile the decommission ran with


def test_the_resolver_takes_site_only_knobs_from_the_site() -> None:
    """MAAS has one global hardware_sync_interval, which onboarding sets to the run's value:
    a profile's value (even one a stand-in row still carries) never reaches a run, and the
    profiles table has no such column since 0027."""
    site = SitePolicyView(hardware_sync_interval="30m", max_deploy_retry_attempts=2)
    profile = SimpleNamespace(hardware_sync_interval="5m", max_deploy_retry_attempts=0)
    resolved = resolve_policy(site, profile)
    assert (resolved.hardware_sync_interval, resolved.max_deploy_retry_attempts) == ("30m", 0)
    assert "hardware_sync_interval" in SITE_ONLY_KNOBS
    assert not set(SITE_ONLY_KNOBS) & set(MaasSiteProfile.__table__.columns.keys())
