"""Issue 20 items 4 and 5 against the MAAS simulator over HTTP: RoCE NICs on their fabric's VLAN
(a link to a subnet on another VLAN is refused, as real MAAS refuses it), the global config
`hardware_sync_interval` (maas/?op=get_config / set_config), a MAAS build whose machine read has
no REST sync fields, and what onboarding and the reconciler make of each."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from temporalio.client import Client

from activities.maas.types import Machine, MachineStatus
from activities.maas_reconcile import Binding, SyncPolicy, decide
from core.config import Settings
from schema.models import MaasRoceAssignment, Node, NodeDriftEvent, NodeMaasState
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_maas_reconciler import make_site, reconciler, run_once
from tests.test_maas_reconciler_reseed import wait_hw_sync_late

__all__ = ["reconciler"]  # the fixture, used by name below

_INVALID_CHOICE = "Select a valid choice. That choice is not one of the available choices."


def _roce_machine(hostname: str, bmc: str, **extra: Any) -> dict[str, Any]:
    """A GPU node whose two RoCE NICs are cabled to their own fabrics (untagged VLANs)."""
    base = sim_machine(hostname, bmc, **extra)
    pxe, roce = base["interfaces"]
    second_mac = roce["mac"][:-2] + "03"
    base["interfaces"] = [
        pxe,
        {**roce, "fabric": f"roce-{hostname}-a", "vid": 0},
        {"name": "ens1f1np1", "mac": second_mac, "speed": 400000,
         "fabric": f"roce-{hostname}-b", "vid": 0},
    ]  # fmt: skip
    return base


ROCE = sim_scenario(
    _roce_machine("roce-a", "10.176.16.60"),
    sim_machine("sync-stale", "10.176.16.61", status="Deployed", enable_hw_sync=True,
                faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("sync-off", "10.176.16.62", status="Deployed"),
    site={"hardware_sync_interval": "30m"},
)  # fmt: skip
NO_SYNC_FIELDS = sim_scenario(
    sim_machine("nosync-a", "10.176.16.63"),
    sim_machine("nosync-d", "10.176.16.64", status="Deployed", enable_hw_sync=True),
    site={"hw_sync_fields": False, "maas_version": "3.3.5"},
)
STALE = sim_scenario(
    sim_machine("sync-stale", "10.176.16.61", status="Deployed", enable_hw_sync=True,
                faults=[{"kind": "hw_sync_never_healthy"}]),
    sim_machine("sync-off", "10.176.16.62", status="Deployed"),
    site={"hardware_sync_interval": "1s"},
)  # fmt: skip


async def _roce_iface(maas: Any, system_id: str, name: str) -> dict[str, Any]:
    interfaces = (await maas.get(f"nodes/{system_id}/interfaces/")).json()
    return next(i for i in interfaces if i["name"] == name)


# ---------------------------------------------------------------------------- simulator


@pytest.mark.maas_scenario(ROCE)
async def test_sim_roce_nic_is_on_its_fabric_vlan_and_refuses_other_subnets(maas_sim: Any) -> None:
    system_id = (await maas_sim.machine("roce-a"))["system_id"]
    async with maas_sim.client() as maas:
        roce = await _roce_iface(maas, system_id, "ens1f0np0")
        assert roce["vlan"] is not None
        assert roce["vlan"]["fabric"] == "roce-roce-a-a"
        url = f"nodes/{system_id}/interfaces/{roce['id']}/"
        # A /31 created on the default VLAN (no vlan given) is not a choice for this NIC.
        default = (await maas.post("subnets/", data={"cidr": "172.30.0.0/31"})).json()
        assert default["vlan"]["id"] != roce["vlan"]["id"]
        refused = await maas.post(
            url, params={"op": "link_subnet"},
            data={"mode": "STATIC", "subnet": default["id"], "ip_address": "172.30.0.1"},
        )  # fmt: skip
        assert refused.status_code == 400
        assert refused.json() == {"subnet": [_INVALID_CHOICE]}
        # On the NIC's VLAN (by its database id) it links.
        on_vlan = (
            await maas.post("subnets/", data={"cidr": "172.30.0.2/31", "vlan": roce["vlan"]["id"]})
        ).json()
        linked = await maas.post(
            url, params={"op": "link_subnet"},
            data={"mode": "STATIC", "subnet": on_vlan["id"], "ip_address": "172.30.0.3"},
        )  # fmt: skip
        assert linked.status_code == 200, linked.text
        assert [lk["ip_address"] for lk in linked.json()["links"] if lk["mode"] == "static"] == [
            "172.30.0.3"
        ]


@pytest.mark.maas_scenario(ROCE)
async def test_sim_hardware_sync_interval_config(maas_sim: Any) -> None:
    async with maas_sim.client() as maas:
        got = await maas.get("maas/", params={"op": "get_config", "name": "hardware_sync_interval"})
        assert got.status_code == 200
        assert got.json() == "30m"
        bad = await maas.post(
            "maas/", params={"op": "set_config"},
            data={"name": "hardware_sync_interval", "value": "soon"},
        )  # fmt: skip
        assert bad.status_code == 400
        assert "value" in bad.json()
        unknown = await maas.get("maas/", params={"op": "get_config", "name": "nope"})
        assert unknown.status_code == 400
        ok = await maas.post(
            "maas/", params={"op": "set_config"},
            data={"name": "hardware_sync_interval", "value": "10m"},
        )  # fmt: skip
        assert (ok.status_code, ok.text) == (200, "OK")
        got = await maas.get("maas/", params={"op": "get_config", "name": "hardware_sync_interval"})
        assert got.json() == "10m"
        # Saving enable_hw_sync copies the config into the machine's sync_interval.
        system_id = (await maas_sim.machine("sync-off"))["system_id"]
        put = await maas.put(f"machines/{system_id}/", data={"enable_hw_sync": "true"})
        assert put.status_code == 200, put.text
        assert put.json()["sync_interval"] == 600


@pytest.mark.maas_scenario(NO_SYNC_FIELDS)
async def test_sim_build_without_rest_sync_fields(maas_sim: Any) -> None:
    system_id = (await maas_sim.machine("nosync-d"))["system_id"]
    async with maas_sim.client() as maas:
        machine = (await maas.get(f"machines/{system_id}/")).json()
        listed = (await maas.get("machines/")).json()
    for data in (machine, *listed):
        for key in ("enable_hw_sync", "last_sync", "sync_interval", "next_sync"):
            assert key not in data
    parsed = Machine.from_json(machine)
    assert not parsed.hardware_sync.available


# ---------------------------------------------------------------------------- reconciler


def test_decide_hw_sync_stale_only_when_enabled_visible_and_late() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
    binding = Binding(uuid.uuid4(), "active", "10.0.0.5", "abc123", False, None)

    def machine(**sync: Any) -> Machine:
        return Machine.from_json(
            {"system_id": "abc123", "hostname": "h", "status": int(MachineStatus.DEPLOYED),
             "power_state": "on", "ip_addresses": ["10.0.0.5"], **sync}
        )  # fmt: skip

    def last(minutes: int) -> str:
        return (now - dt.timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    def rule(m: Machine, policy: SyncPolicy | None = None) -> str | None:
        d = decide(binding, m, sync=policy or SyncPolicy(), now=now)
        return d.rule.name if d.rule else None

    fresh = machine(enable_hw_sync=True, last_sync=last(10), sync_interval=900)
    late = machine(enable_hw_sync=True, last_sync=last(30), sync_interval=900)
    never = machine(enable_hw_sync=True, last_sync=None, sync_interval=900)
    disabled = machine(enable_hw_sync=False, last_sync=None, sync_interval=None)
    assert rule(fresh) is None
    assert rule(late) == "hw_sync_stale"  # 30 min > 1.5 x 15 min
    assert rule(never) == "hw_sync_stale"
    assert rule(disabled) is None
    assert rule(machine()) is None  # a build without the fields cannot show drift
    assert rule(late, SyncPolicy(required=False)) is None


@pytest.mark.maas_scenario(STALE)
async def test_reconciler_records_hw_sync_drift_with_the_reseed_action(
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> None:
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    ids: dict[str, uuid.UUID] = {}
    async with db_sessions() as session, session.begin():
        for name in ("sync-stale", "sync-off"):
            machine = await maas_sim.machine(name)
            node_id = ids[name] = uuid.uuid4()
            session.add(
                Node(id=node_id, hostname=f"{name}-{node_id.hex[:6]}", region="us-east-1",
                     sku="h100-8x", status="active", gpu_count=8,
                     host_address=machine["ip_addresses"][0])
            )  # fmt: skip
            await session.flush()
            session.add(
                NodeMaasState(node_id=node_id, site_id=site_id, maas_system_id=machine["system_id"])
            )
    # sync_interval is 1 s (the site config): the deployment's sync goes stale after 1.5 s.
    await wait_hw_sync_late(maas_sim, (await maas_sim.machine("sync-stale"))["system_id"])
    result = await run_once(temporal_client, settings, site_id)
    assert result.drift_detected == 1
    async with db_sessions() as session:
        rows = list(
            await session.scalars(select(NodeDriftEvent).where(NodeDriftEvent.site_id == site_id))
        )
        state = await session.get(NodeMaasState, ids["sync-stale"])
        node = await session.get(Node, ids["sync-stale"])
    assert [(r.node_id, r.rule, r.severity) for r in rows] == [
        (ids["sync-stale"], "hw_sync_stale", "WARN")
    ]
    details = rows[0].details
    assert details["recommended_action"] == "node.hw_sync_reseed"
    assert details["task_queue"] == f"node-{ids['sync-stale']}"
    assert details["sync_interval_s"] == 1
    assert state is not None
    assert state.drift_rule == "hw_sync_stale"
    assert node is not None
    assert node.status == "active"  # a WARN: no quarantine
    # The same drift is not recorded twice.
    again = await run_once(temporal_client, settings, site_id)
    assert again.drift_detected == 0


# ---------------------------------------------------------------------------- onboarding


async def _assign_roce(rig: OnboardingRig, hostname: str, links: dict[str, str]) -> None:
    async with rig.sessions() as session, session.begin():
        for interface, cidr in links.items():
            session.add(
                MaasRoceAssignment(
                    id=uuid.uuid4(), site_id=rig.site_id, hostname=hostname,
                    interface=interface, ipv4_cidr=cidr,
                )
            )  # fmt: skip


@pytest.mark.maas_scenario(ROCE)
async def test_onboarding_roce_on_the_nic_vlan_and_a_refused_link_fails_the_stage(
    onboarding: OnboardingRig,
) -> None:
    # ens1f1np1's /31 already exists in MAAS, on the default VLAN: MAAS refuses that link.
    async with onboarding.maas_sim.client() as maas:
        created = await maas.post("subnets/", data={"cidr": "172.29.1.220/31"})
        assert created.status_code == 200, created.text
    await _assign_roce(
        onboarding,
        "roce-a",
        {"ens1f0np0": "172.29.1.219/31", "ens1f1np1": "172.29.1.221/31"},
    )
    job = await onboarding.start("roce-a", "10.176.16.60")
    row = await onboarding.wait_status(job, "completed")  # non-fatal by policy

    roce_events = [e for e in await onboarding.events(job) if e.stage == "apply_roce_phase2"]
    finished = [e for e in roce_events if e.status != "started"]
    assert [e.status for e in finished] == ["failed"]
    details = finished[0].details
    assert details["failure_class"] == "input_config_error"
    assert details["error_code"] == "roce_link_refused"
    assert (details["links_applied"], details["links_total"]) == (1, 2)
    assert [f["interface"] for f in details["links_failed"]] == ["ens1f1np1"]
    assert "1 of 2 RoCE link(s) in place" in (finished[0].message or "")

    machine = await onboarding.maas_sim.machine(row.maas_system_id)
    async with onboarding.maas_sim.client() as maas:
        iface = await _roce_iface(maas, machine["system_id"], "ens1f0np0")
        # Hardware sync: the site's interval (policy 15m) was written to MAAS's config.
        config = await maas.get(
            "maas/", params={"op": "get_config", "name": "hardware_sync_interval"}
        )
        deployed = (await maas.get(f"machines/{machine['system_id']}/")).json()
    static = [lk for lk in iface["links"] if lk["mode"] == "static"]
    assert [lk["ip_address"] for lk in static] == ["172.29.1.219"]
    assert static[0]["subnet"]["vlan"]["id"] == iface["vlan"]["id"]
    assert config.json() == "15m"
    assert deployed["sync_interval"] == 900


@pytest.mark.maas_scenario(NO_SYNC_FIELDS)
async def test_onboarding_on_a_build_without_sync_fields_passes_with_a_warning(
    onboarding: OnboardingRig,
) -> None:
    job = await onboarding.start("nosync-a", "10.176.16.63")
    await onboarding.wait_status(job, "completed")
    health = [
        e
        for e in await onboarding.events(job)
        if e.stage == "wait_for_hardware_sync_healthy" and e.status != "started"
    ]
    assert [e.status for e in health] == ["succeeded"]
    assert health[0].details["hw_sync_verifiable"] is False
    assert health[0].details["warning_code"] == "hw_sync_unverifiable"
