"""MaasSiteReconcilerWorkflow end to end: the workflow on a real Temporal dev server, its local
activity against real PostgreSQL, the Vault-compatible server and the MAAS simulator over HTTP.
Every seed 003 §6.4 row is driven through the simulator's out-of-band controls."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.client import Client, WorkflowHandle

from activities.maas.types import Machine, MachineStatus, PowerState
from activities.maas_reconcile import Binding, decide
from contracts.maas_reconciler import ReconcileInput, ReconcileResult
from core.config import Settings
from core.secret_paths import site_api_token_path
from schema.models import MaasSite, Node, NodeDriftEvent, NodeMaasState
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
    sessions: async_sessionmaker[AsyncSession], secret_store: Any, maas_sim: Any
) -> uuid.UUID:
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
    site_id = await make_site(db_sessions, secret_store, maas_sim)
    ids = await bind_nodes(db_sessions, site_id, maas_sim)
    sysid = {name: (await maas_sim.machine(f"rec-{name}"))["system_id"] for name in NODES}

    # Run 1, everything Deployed: only the offline node (WARN) and the retired node (INFO:
    # released and powered off through the MAAS API) drift.
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
