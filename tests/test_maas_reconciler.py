"""MaasSiteReconcilerWorkflow end to end: the workflow on a real Temporal dev server, its local
activity against real PostgreSQL, the Vault-compatible server and the MAAS simulator over HTTP.
Every docs/lifecycles/node.md#reconciliation-rules row is driven through the simulator's out-of-band
controls."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.client import Client, WorkflowHandle

from activities.maas.types import Machine, MachineStatus, PowerState
from activities.maas_reconcile import Binding, decide, judge_list
from contracts.maas_reconciler import ReconcileInput, ReconcileResult
from core.config import Settings
from core.secret_paths import site_api_token_path
from schema.models import (
    DomainEvent,
    MaasSite,
    MaasSitePolicy,
    Node,
    NodeDriftEvent,
    NodeMaasState,
)
from tests.histories import record_history
from tests.maas_fixtures import sim_machine, sim_scenario
from workflows.maas_reconciler import MaasSiteReconcilerWorkflow

# node name -> initial node status; every machine starts Deployed (powered on, with an IP).
NODES = {
    "ok": "active",
    "released": "active",
    "broken": "active",
    "recommission": "active",
    "moved": "active",
    "deleted": "active",
    "retired": "retired",
    "offline": "offline",
    "enrolling": "enrolling",
}
SCENARIO = sim_scenario(
    *(
        sim_machine(f"rec-{name}", f"10.176.16.{20 + i}", status="Deployed")
        for i, name in enumerate([*NODES, "unmanaged"])
    )
)


@pytest.fixture
async def reconciler(
    settings: Settings, temporal_client: Client, db_engine: AsyncEngine, secret_store: Any
) -> AsyncIterator[None]:
    """The control-plane worker with the test's Vault-backed secret store."""
    from worker import build_worker

    async with build_worker(temporal_client, settings, db_engine, secret_store=secret_store):
        yield


async def make_site(
    sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
    **policy: Any,
) -> uuid.UUID:
    """A site (and, given `policy` knobs, its policy row with them)."""
    site_id = uuid.uuid4()
    async with sessions() as session, session.begin():
        session.add(
            MaasSite(
                id=site_id,
                name=f"rec-{site_id.hex[:6]}",
                region_code="us-east-1",
                api_base_url=maas_sim.base_url,
                api_token_vault_path=site_api_token_path(site_id),
                default_power_creds_vault_path=f"kv/maas-sites/{site_id}/power/default",
                deploy_password_vault_path=f"kv/maas-sites/{site_id}/deploy-password",
                pxe_iface="ens19",
                pxe_vlan_vid=46,
                node_pxe_iface="eno8303",
            )
        )
        if policy:
            await session.flush()
            session.add(MaasSitePolicy(site_id=site_id, **policy))
    await secret_store.write(site_api_token_path(site_id), {"token": maas_sim.api_key})
    return site_id


async def bind_nodes(
    sessions: async_sessionmaker[AsyncSession], site_id: uuid.UUID, maas_sim: Any
) -> dict[str, uuid.UUID]:
    ids: dict[str, uuid.UUID] = {}
    async with sessions() as session, session.begin():
        for name, status in NODES.items():
            machine = await maas_sim.machine(f"rec-{name}")
            node_id = ids[name] = uuid.uuid4()
            session.add(
                Node(
                    id=node_id,
                    hostname=f"rec-{name}-{node_id.hex[:6]}",
                    region="us-east-1",
                    sku="h100-8x",
                    status=status,
                    gpu_count=8,
                    host_address=machine["ip_addresses"][0],
                )
            )
            await session.flush()
            session.add(
                NodeMaasState(node_id=node_id, site_id=site_id, maas_system_id=machine["system_id"])
            )
    return ids


LAST_HANDLE: dict[str, WorkflowHandle[Any, Any]] = {}


async def run_once(client: Client, settings: Settings, site_id: uuid.UUID) -> ReconcileResult:
    """One reconcile run, as the site's schedule would start it (the last handle is kept for
    recording its history)."""
    handle = await client.start_workflow(
        MaasSiteReconcilerWorkflow.run,
        ReconcileInput(str(site_id)),
        id=f"maas-reconciler-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )
    result = await handle.result()
    LAST_HANDLE["last"] = handle
    return result


async def node_status(sessions: async_sessionmaker[AsyncSession], node_id: uuid.UUID) -> str:
    async with sessions() as session:
        node = await session.get(Node, node_id)
        assert node is not None
        return node.status


async def state_of(sessions: async_sessionmaker[AsyncSession], node_id: uuid.UUID) -> NodeMaasState:
    async with sessions() as session:
        state = await session.get(NodeMaasState, node_id)
        assert state is not None
        return state


async def events(
    sessions: async_sessionmaker[AsyncSession], site_id: uuid.UUID
) -> list[tuple[uuid.UUID, str, str]]:
    async with sessions() as session:
        rows = await session.execute(
            select(NodeDriftEvent.node_id, NodeDriftEvent.rule, NodeDriftEvent.severity)
            .where(NodeDriftEvent.site_id == site_id)
            .order_by(NodeDriftEvent.id)
        )
        return [(r[0], r[1], r[2]) for r in rows]


@pytest.mark.maas_scenario(SCENARIO)
async def test_every_rule_against_the_simulator(
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> None:
    # The site's policy releases retired nodes' machines (off by default: retire leaves the
    # machine alone, test_maas_reconciler_policy.py).
    site_id = await make_site(db_sessions, secret_store, maas_sim, release_retired_machines=True)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    sysid = {name: (await maas_sim.machine(f"rec-{name}"))["system_id"] for name in NODES}

    # Run 1, everything Deployed: only the offline node (WARN) and the retired node (INFO:
    # released and powered off through the MAAS API, after a fresh look at it) drift.
    first = await run_once(temporal_client, settings, site_id)
    assert first.machines_seen == len(NODES) + 1
    assert first.nodes_checked == len(NODES)
    assert first.unmanaged_machines == 1
    assert first.drift_detected == 2
    assert f"released:{ids['retired']}" in first.actions
    assert f"powered_off:{ids['retired']}" in first.actions
    assert sorted((ids_name(ids, n), r, s) for n, r, s in await events(db_sessions, site_id)) == [
        ("offline", "deployed_offline", "WARN"),
        ("retired", "retired_cleanup", "INFO"),
    ]
    counters = await maas_sim.counters()
    retired_ops = counters["machines"][sysid["retired"]]
    assert retired_ops.get("machine.release") == 1
    assert retired_ops.get("machine.power_off") == 1
    assert counters["ops"].get("machines.read") == 1  # one list call per run
    # What the reconciler did itself is recorded as its own, with the status its action left
    # (not the Deployed it listed before the release).
    retired_state = await state_of(db_sessions, ids["retired"])
    assert retired_state.last_maas_status in ("Releasing", "Ready")
    assert retired_state.drift_details is not None
    assert retired_state.drift_details["released_by"] == "maas_reconciler"
    assert retired_state.drift_details["actions"] == ["released", "powered_off"]
    assert await node_status(db_sessions, ids["offline"]) == "offline"  # no MAAS action
    ok = await state_of(db_sessions, ids["ok"])
    assert ok.last_maas_status == "Deployed"
    assert ok.last_maas_power_state == "on"
    assert ok.last_maas_ips
    assert ok.last_reconciled_at is not None
    assert not ok.drift_detected
    enrolling = await state_of(db_sessions, ids["enrolling"])
    assert enrolling.last_maas_status == "Deployed"
    assert not enrolling.drift_detected

    # Out of band, as an admin in the MAAS UI would.
    await maas_sim.release(f"rec-{'released'}")
    await maas_sim.mark_broken("rec-broken")
    await maas_sim.set_status("rec-recommission", "Commissioning")
    new_ip = await maas_sim.change_ip("rec-moved")
    await maas_sim.delete("rec-deleted")
    await maas_sim.release("rec-enrolling")  # an in-flight onboarding owns this node
    await maas_sim.reset_counters()

    second = await run_once(temporal_client, settings, site_id)
    assert second.nodes_checked == len(NODES)
    assert await node_status(db_sessions, ids["released"]) == "quarantined"
    assert await node_status(db_sessions, ids["broken"]) == "quarantined"
    assert await node_status(db_sessions, ids["deleted"]) == "quarantined"
    assert await node_status(db_sessions, ids["recommission"]) == "active"
    assert await node_status(db_sessions, ids["moved"]) == "active"
    assert await node_status(db_sessions, ids["enrolling"]) == "enrolling"
    assert await node_status(db_sessions, ids["ok"]) == "active"
    async with db_sessions() as session:
        moved = await session.get(Node, ids["moved"])
        assert moved is not None
        assert moved.host_address == new_ip
    assert f"host_updated:{ids['moved']}" in second.actions
    assert {f"quarantined:{ids[n]}" for n in ("released", "broken", "deleted")} <= set(
        second.actions
    )
    assert second.drift_detected == 5
    # The retired node's machine is no longer Deployed: its drift healed.
    assert second.drift_resolved == 1
    retired = await state_of(db_sessions, ids["retired"])
    assert not retired.drift_detected
    assert retired.drift_resolved_at is not None
    assert retired.drift_rule == "retired_cleanup"

    after_second = await events(db_sessions, site_id)
    assert sorted((ids_name(ids, n), r, s) for n, r, s in after_second[2:]) == [
        ("broken", "hardware_failure", "CRITICAL"),
        ("deleted", "machine_deleted", "CRITICAL"),
        ("moved", "ip_changed", "INFO"),
        ("recommission", "recommissioning", "WARN"),
        ("released", "released_outside_workflow", "CRITICAL"),
    ]
    released = await state_of(db_sessions, ids["released"])
    assert released.drift_detected
    assert released.drift_rule == "released_outside_workflow"
    assert released.drift_details is not None
    assert released.drift_details["maas_status"] in ("Releasing", "Ready")
    assert released.drift_details["expected"] == "Deployed"
    deleted = await state_of(db_sessions, ids["deleted"])
    assert deleted.last_maas_status is None
    assert deleted.drift_rule == "machine_deleted"
    enrolling = await state_of(db_sessions, ids["enrolling"])
    assert enrolling.last_maas_status in ("Releasing", "Ready")
    assert not enrolling.drift_detected
    # No MAAS write in this run (the retired machine is released already).
    ops = (await maas_sim.counters())["ops"]
    assert not {op for op in ops if op.endswith((".release", ".power_off"))}

    # Run 3: idempotent. Nothing new is recorded for drifts already open; the IP drift heals
    # (host now matches), quarantined nodes keep their drift open for an admin.
    third = await run_once(temporal_client, settings, site_id)
    assert third.drift_detected == 0
    assert await events(db_sessions, site_id) == after_second
    assert not [a for a in third.actions if a.startswith(("quarantined", "host_updated"))]
    moved_state = await state_of(db_sessions, ids["moved"])
    assert not moved_state.drift_detected
    assert moved_state.drift_resolved_at is not None
    assert (await state_of(db_sessions, ids["broken"])).drift_detected
    assert (await state_of(db_sessions, ids["released"])).drift_resolved_at is None

    # Healing: the recommissioned machine is Deployed again.
    await maas_sim.set_status("rec-recommission", "Deployed")
    fourth = await run_once(temporal_client, settings, site_id)
    assert fourth.drift_resolved == 1
    assert fourth.drift_detected == 0
    healed = await state_of(db_sessions, ids["recommission"])
    assert not healed.drift_detected
    assert healed.drift_resolved_at is not None
    assert await node_status(db_sessions, ids["recommission"]) == "active"

    # Unmanaged machines are counted, never written.
    async with db_sessions() as session:
        assert await session.scalar(select(func.count()).select_from(NodeMaasState)) == len(NODES)
    await record_history(LAST_HANDLE["last"], "maas_site_reconciler", "drift_heal")


async def snapshot(
    sessions: async_sessionmaker[AsyncSession], site_id: uuid.UUID
) -> tuple[list[Any], list[Any], int]:
    """Everything a reconcile may change: nodes, their MAAS state rows, drift events."""
    async with sessions() as session:
        nodes = (
            await session.execute(
                select(Node.id, Node.status, Node.host_address, Node.updated_at)
                .join(NodeMaasState, NodeMaasState.node_id == Node.id)
                .where(NodeMaasState.site_id == site_id)
                .order_by(Node.id)
            )
        ).all()
        states = (
            await session.execute(
                select(
                    NodeMaasState.node_id,
                    NodeMaasState.last_maas_status,
                    NodeMaasState.last_maas_ips,
                    NodeMaasState.last_reconciled_at,
                    NodeMaasState.drift_detected,
                    NodeMaasState.drift_rule,
                    NodeMaasState.drift_resolved_at,
                )
                .where(NodeMaasState.site_id == site_id)
                .order_by(NodeMaasState.node_id)
            )
        ).all()
        drift = await session.scalar(
            select(func.count())
            .select_from(NodeDriftEvent)
            .where(NodeDriftEvent.site_id == site_id)
        )
    return list(nodes), list(states), int(drift or 0)


async def suspect_alerts(
    sessions: async_sessionmaker[AsyncSession], site_id: uuid.UUID
) -> list[dict[str, Any]]:
    async with sessions() as session:
        rows = await session.scalars(
            select(DomainEvent.payload)
            .where(
                DomainEvent.type == "maas.reconcile_suspect",
                DomainEvent.subject_type == "maas_site",
                DomainEvent.subject_id == str(site_id),
            )
            .order_by(DomainEvent.id)
        )
        return [dict(p) for p in rows]


# How the list is broken -> the suspect reason. The truncated list keeps the first 3 of the 10
# machines (rec-ok, rec-released, rec-broken): 4 of the 7 bound active/offline nodes' machines
# are missing, where 1 may be (10 %, at least one).
BROKEN_LISTS = {
    "truncated": ({"kind": "truncate_list", "op": "machines.read", "keep": 3}, "missing_share"),
    "empty": ({"kind": "truncate_list", "op": "machines.read"}, "empty_list"),
    "failed": ({"kind": "http_error", "op": "machines.read", "status": 503}, "list_failed"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_LISTS))
@pytest.mark.maas_scenario(SCENARIO)
async def test_a_list_that_cannot_be_whole_changes_nothing(
    broken: str,
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> None:
    """A truncated, empty or failed machines list would quarantine every bound node as
    machine_deleted: instead the run records one reconcile_suspect alert on the site and
    changes no node, no host, no drift, no node_maas_state row. The next whole list is acted
    on as usual."""
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    await run_once(temporal_client, settings, site_id)  # a whole list: the baseline
    await maas_sim.release("rec-released")  # real drift too: still not acted on
    before = await snapshot(db_sessions, site_id)
    await maas_sim.reset_counters()
    fault, reason = BROKEN_LISTS[broken]
    await maas_sim.add_request_fault(**fault)

    result = await run_once(temporal_client, settings, site_id)
    assert result.actions == [f"suspect:{reason}"]
    assert (result.drift_detected, result.drift_resolved, result.nodes_checked) == (0, 0, 0)
    assert await snapshot(db_sessions, site_id) == before
    assert [await node_status(db_sessions, ids[n]) for n in NODES] == list(NODES.values())
    alerts = await suspect_alerts(db_sessions, site_id)
    assert len(alerts) == 1
    alert = alerts[0]
    assert (alert["rule"], alert["severity"], alert["reason"]) == (
        "reconcile_suspect",
        "CRITICAL",
        reason,
    )
    if broken == "truncated":
        assert (alert["machines_listed"], alert["watched_nodes"], alert["missing"]) == (3, 7, 4)
        assert alert["missing_allowed"] == 1
        await record_history(LAST_HANDLE["last"], "maas_site_reconciler", "suspect")
    if broken == "failed":
        assert alert["error"] == "MaasUnavailable"
        assert alert["maas_status_code"] == 503
    ops = (await maas_sim.counters())["ops"]
    assert not {op for op in ops if op.endswith((".release", ".power_off"))}

    await maas_sim.clear_request_faults()
    whole = await run_once(temporal_client, settings, site_id)
    assert f"quarantined:{ids['released']}" in whole.actions
    assert await node_status(db_sessions, ids["ok"]) == "active"
    assert len(await suspect_alerts(db_sessions, site_id)) == 1


def test_judge_list_allows_a_policy_share_and_at_least_one() -> None:
    def bindings(n: int) -> list[Binding]:
        return [Binding(uuid.uuid4(), "active", None, f"m{i}", False, None) for i in range(n)]

    def listed(bound: list[Binding], missing: int) -> dict[str, Machine]:
        return {b.maas_system_id: _machine(MachineStatus.DEPLOYED) for b in bound[missing:]}

    twenty = bindings(20)
    assert judge_list(twenty, listed(twenty, 2)) is None  # 10 % of 20
    suspect = judge_list(twenty, listed(twenty, 3))
    assert suspect is not None
    assert suspect.reason == "missing_share"
    assert judge_list(twenty, listed(twenty, 3), max_missing_share=0.5) is None
    three = bindings(3)
    assert judge_list(three, listed(three, 1)) is None  # one real deletion on a small site
    empty = judge_list(three[:1], {})
    assert empty is not None
    assert empty.reason == "empty_list"
    # Nodes the machine_deleted row does not watch never make a list suspect.
    gone = [Binding(uuid.uuid4(), s, None, f"q{s}", True, None) for s in ("quarantined", "retired")]
    assert judge_list([*twenty, *gone], listed(twenty, 0)) is None


@pytest.mark.maas_scenario(SCENARIO)
async def test_ip_changes_each_write_their_event_and_a_first_host_is_no_drift(
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> None:
    """A node without a host address yet gets its machine's address with no ip_changed drift;
    a real change is ip_changed, and a second change while that drift is still open is applied
    with its own event, never silently."""
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    async with db_sessions() as session, session.begin():
        fresh = await session.get(Node, ids["ok"])
        assert fresh is not None
        fresh.host_address = None
    first = await run_once(temporal_client, settings, site_id)
    assert f"host_set:{ids['ok']}" in first.actions
    async with db_sessions() as session:
        fresh = await session.get(Node, ids["ok"])
        assert fresh is not None
        assert fresh.host_address == (await maas_sim.machine("rec-ok"))["ip_addresses"][0]
    assert ids["ok"] not in {node for node, _, _ in await events(db_sessions, site_id)}
    assert not (await state_of(db_sessions, ids["ok"])).drift_detected

    second_ip = await maas_sim.change_ip("rec-moved")
    second = await run_once(temporal_client, settings, site_id)
    assert f"host_updated:{ids['moved']}" in second.actions
    third_ip = await maas_sim.change_ip("rec-moved")  # again, before any run healed the drift
    third = await run_once(temporal_client, settings, site_id)
    assert f"host_updated:{ids['moved']}" in third.actions
    async with db_sessions() as session:
        moved = await session.get(Node, ids["moved"])
        assert moved is not None
        assert moved.host_address == third_ip
        details = list(
            await session.scalars(
                select(NodeDriftEvent.details)
                .where(NodeDriftEvent.node_id == ids["moved"])
                .order_by(NodeDriftEvent.id)
            )
        )
    assert [(d["rule"], d["new_host"]) for d in details] == [
        ("ip_changed", second_ip),
        ("ip_changed", third_ip),
    ]
    assert details[1]["old_host"] == second_ip
    fourth = await run_once(temporal_client, settings, site_id)
    assert not [a for a in fourth.actions if a.startswith("host_")]
    assert not (await state_of(db_sessions, ids["moved"])).drift_detected


def ids_name(ids: dict[str, uuid.UUID], node_id: uuid.UUID) -> str:
    return next(name for name, value in ids.items() if value == node_id)


@pytest.mark.maas_scenario(SCENARIO)
async def test_disabled_site_does_nothing(
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
) -> None:
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    async with db_sessions() as session, session.begin():
        site = await session.get(MaasSite, site_id)
        assert site is not None
        site.status = "disabled"
    await maas_sim.reset_counters()
    result = await run_once(temporal_client, settings, site_id)
    assert result.actions == ["skipped:disabled"]
    assert result.machines_seen == 0
    assert (await maas_sim.counters())["ops"] == {}
    assert (await state_of(db_sessions, ids["ok"])).last_reconciled_at is None
    await record_history(LAST_HANDLE["last"], "maas_site_reconciler", "disabled")


def _machine(status: MachineStatus, power: PowerState = PowerState.ON) -> Machine:
    data = {
        "system_id": "abc123",
        "hostname": "h",
        "status": int(status),
        "power_state": str(power),
        "ip_addresses": ["10.0.0.5"],
    }
    return Machine.from_json(data)


@pytest.mark.parametrize(
    ("node_status", "maas_status", "power", "rule"),
    [
        ("active", MachineStatus.DEPLOYED, PowerState.ON, None),
        ("active", MachineStatus.DEPLOYED, PowerState.OFF, "deployed_powered_off"),
        ("active", MachineStatus.ALLOCATED, PowerState.ON, "released_outside_workflow"),
        ("active", MachineStatus.DEPLOYING, PowerState.ON, "redeployed_outside_workflow"),
        ("active", MachineStatus.FAILED_TESTING, PowerState.ON, "hardware_failure"),
        ("active", MachineStatus.TESTING, PowerState.ON, "recommissioning"),
        ("active", MachineStatus.RESCUE_MODE, PowerState.ON, "unexpected_maas_status"),
        ("offline", MachineStatus.READY, PowerState.OFF, "released_outside_workflow"),
        ("retired", MachineStatus.READY, PowerState.OFF, None),
        ("quarantined", MachineStatus.READY, PowerState.OFF, None),
        ("draining", MachineStatus.READY, PowerState.OFF, None),
        ("removing", MachineStatus.DEPLOYED, PowerState.ON, None),
    ],
)
def test_decide_table(
    node_status: str, maas_status: MachineStatus, power: PowerState, rule: str | None
) -> None:
    binding = Binding(uuid.uuid4(), node_status, "10.0.0.5", "abc123", False, None)
    decision = decide(binding, _machine(maas_status, power))
    assert (decision.rule.name if decision.rule else None) == rule


def test_decide_a_retired_machine_is_left_alone_unless_the_policy_releases_it() -> None:
    retired = Binding(uuid.uuid4(), "retired", "10.0.0.5", "abc123", False, None)
    assert decide(retired, _machine(MachineStatus.DEPLOYED)).rule is None
    cleanup = decide(retired, _machine(MachineStatus.DEPLOYED), release_retired=True).rule
    assert cleanup is not None
    assert cleanup.name == "retired_cleanup"


def test_decide_never_quarantines_the_reconcilers_own_release() -> None:
    """A node active again (reactivated) whose machine the reconciler itself released while the
    node was retired: a WARN for the admin, not released_outside_workflow CRITICAL quarantine."""
    own = Binding(uuid.uuid4(), "active", "10.0.0.5", "abc123", False, None, own_release=True)
    rule = decide(own, _machine(MachineStatus.READY, PowerState.OFF)).rule
    assert rule is not None
    assert (rule.name, rule.severity, rule.quarantine) == ("released_by_reconciler", "WARN", False)
    other = Binding(uuid.uuid4(), "active", "10.0.0.5", "abc123", False, None)
    rule = decide(other, _machine(MachineStatus.READY, PowerState.OFF)).rule
    assert rule is not None
    assert (rule.name, rule.quarantine) == ("released_outside_workflow", True)


def test_decide_a_node_without_a_host_gets_one_without_drift() -> None:
    binding = Binding(uuid.uuid4(), "active", None, "abc123", False, None)
    decision = decide(binding, _machine(MachineStatus.DEPLOYED))
    assert (decision.rule, decision.new_host) == (None, "10.0.0.5")
    moved = Binding(uuid.uuid4(), "active", "10.0.0.9", "abc123", False, None)
    changed = decide(moved, _machine(MachineStatus.DEPLOYED))
    assert changed.rule is not None
    assert (changed.rule.name, changed.new_host) == ("ip_changed", "10.0.0.5")


@pytest.mark.maas_scenario(SCENARIO)
async def test_drift_api_shows_and_filters_by_severity(
    reconciler: None,
    temporal_client: Client,
    settings: Settings,
    db_sessions: async_sessionmaker[AsyncSession],
    secret_store: Any,
    maas_sim: Any,
    api: Any,
    make_token: Any,
) -> None:
    """The drift list and detail carry the severity the reconciler recorded (§6.4), and the list
    filters by it."""
    site_id = await make_site(db_sessions, secret_store, maas_sim, release_retired_machines=True)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    await maas_sim.mark_broken("rec-broken", "PSU failure")
    await run_once(temporal_client, settings, site_id)
    admin = await api(token=await make_token("admin"))
    base = "/api/v1/admin/reconciliation/drift"

    listed = (await admin.get(base, params={"site_id": str(site_id)})).json()["items"]
    by_node = {uuid.UUID(d["node_id"]): (d["rule"], d["severity"]) for d in listed}
    assert by_node == {
        ids["broken"]: ("hardware_failure", "CRITICAL"),
        ids["offline"]: ("deployed_offline", "WARN"),
        ids["retired"]: ("retired_cleanup", "INFO"),
    }
    critical = (await admin.get(base, params={"severity": "critical"})).json()["items"]
    assert [uuid.UUID(d["node_id"]) for d in critical] == [ids["broken"]]
    warn = (await admin.get(base, params={"severity": "WARN"})).json()["items"]
    assert [uuid.UUID(d["node_id"]) for d in warn] == [ids["offline"]]
    bad = await admin.get(base, params={"severity": "urgent"})
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "unknown_severity"

    detail = await admin.get(f"{base}/{ids['broken']}")
    assert detail.status_code == 200, detail.text
    assert (detail.json()["rule"], detail.json()["severity"]) == ("hardware_failure", "CRITICAL")
    assert (await admin.get(f"{base}/{ids['ok']}")).status_code == 404
