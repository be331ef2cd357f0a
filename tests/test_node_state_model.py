"""The node state model of docs/lifecycles/node.md#states-and-transitions end to end: every status
change goes through the one transition function with its `node.status_changed` event (liveness,
heartbeats, the reconciler), and the admin node routes (inventory, detail, activate, retire with its
drain lifecycle, reactivate) through the gateway, the worker, the MAAS simulator and real agent
workers."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from activities import node_liveness
from activities.node_admin import DRAIN_POLL_ENV
from agent.heartbeat import send_heartbeat
from contracts.node_drain import NodeDrainResult, node_drain_workflow_id
from contracts.node_liveness import LivenessInput
from contracts.node_presence import ReportedGpu
from contracts.states import NodeStatus
from core.config import Settings
from schema.models import AuditEntry, DomainEvent, GpuSlot, Node, NodeMaasState
from tests.factories import BAREMETAL_SKU, create_node
from tests.histories import record_history
from tests.lifecycle_support import Tenant, create_fleet, eventually, slice_request, wait_status
from tests.maas_fixtures import sim_machine, sim_scenario
from tests.onboarding_fixtures import OnboardingRig
from tests.test_maas_reconciler import make_site, run_once
from workflows.node_liveness import NodeLivenessWorkflow

REASON = {"reason": "node checked by ops; ticket OPS-9"}


async def moves(sessions: async_sessionmaker[AsyncSession], node_id: Any) -> list[tuple[str, ...]]:
    """The node's node.status_changed events: (from, to, actor), oldest first."""
    async with sessions() as session:
        payloads = await session.scalars(
            select(DomainEvent.payload)
            .where(
                DomainEvent.type == "node.status_changed",
                DomainEvent.subject_id == str(node_id),
            )
            .order_by(DomainEvent.id)
        )
        return [(p["from"], p["to"], p["actor"]) for p in payloads]


async def status_of(sessions: async_sessionmaker[AsyncSession], node_id: Any) -> str:
    async with sessions() as session:
        node = await session.get(Node, node_id)
        assert node is not None
        return node.status


async def heartbeat(client: Client, settings: Settings, node_id: Any, sessions: Any) -> None:
    """What the node's agent sends: its GPU inventory (the node's slots' PCI addresses)."""
    async with sessions() as session:
        pcis = list(
            await session.scalars(select(GpuSlot.pci_address).where(GpuSlot.node_id == node_id))
        )
    await send_heartbeat(
        client,
        str(node_id),
        control_plane_queue=settings.control_plane_task_queue,
        gpus=[ReportedGpu(pci_address=p) for p in pcis],
    )


async def sweep(client: Client, settings: Settings, offline_after: float) -> Any:
    return await client.execute_workflow(
        NodeLivenessWorkflow.run,
        LivenessInput(offline_after_seconds=offline_after),
        id=f"node-liveness-test-{uuid.uuid4()}",
        task_queue=settings.control_plane_task_queue,
    )


@pytest.mark.usefixtures("control_plane")
async def test_liveness_moves_each_node_with_its_status_changed_event(
    db_sessions: Any, temporal_client: Client, settings: Settings
) -> None:
    a, b = await create_fleet(db_sessions, slice_nodes=2)
    for node in (a, b):
        await heartbeat(temporal_client, settings, node.id, db_sessions)

    async def heard() -> bool:
        async with db_sessions() as session:
            nodes = [await session.get(Node, n.id) for n in (a, b)]
            return all(n is not None and n.last_agent_contact_at for n in nodes)

    await eventually(heard)

    async def silent_past_the_window() -> bool:  # on the database's clock, as the sweep judges
        async with db_sessions() as session:
            rows = (
                await session.execute(
                    select(Node.last_agent_contact_at, func.clock_timestamp()).where(
                        Node.id.in_([a.id, b.id])
                    )
                )
            ).all()
        return all(now - contact > dt.timedelta(seconds=1.0) for contact, now in rows)

    await eventually(silent_past_the_window)
    result = await sweep(temporal_client, settings, offline_after=1.0)  # one set-based statement
    assert sorted(result.went_offline) == sorted([str(a.id), str(b.id)])
    for node in (a, b):
        assert await moves(db_sessions, node.id) == [("active", "offline", "node_liveness")]

    await heartbeat(temporal_client, settings, a.id, db_sessions)  # a's agent is back

    async def back() -> bool:
        return await status_of(db_sessions, a.id) == "active"

    await eventually(back)
    assert await moves(db_sessions, a.id) == [
        ("active", "offline", "node_liveness"),
        ("offline", "active", "node_liveness"),
    ]
    assert await status_of(db_sessions, b.id) == "offline"


async def test_a_sweep_past_its_bound_takes_offline_only_nodes_it_described(
    db_sessions: Any, temporal_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three active nodes silent past the threshold and an offline one silent for longer, with
    room for two queues a sweep: the two stalest active nodes are described (no poller) and go
    offline; the third waits for the next sweep rather than going offline unseen, and the
    offline one, whose dead agent would be the stalest for good, does not take its place."""
    monkeypatch.setattr(node_liveness, "MAX_QUEUES_PER_SWEEP", 2)
    nodes = await create_fleet(db_sessions, slice_nodes=4)
    *silent, gone = [n.id for n in nodes]
    now = dt.datetime.now(dt.UTC)
    async with db_sessions() as session, session.begin():
        for minutes, node_id in zip((12, 11, 10, 20), (*silent, gone), strict=True):
            await session.execute(
                update(Node)
                .where(Node.id == node_id)
                .values(last_agent_contact_at=now - dt.timedelta(minutes=minutes))
            )
        await session.execute(
            update(Node).where(Node.id == gone).values(status=NodeStatus.OFFLINE.value)
        )
    liveness = node_liveness.NodeLivenessActivities(db_sessions, temporal_client)

    first = await liveness.check_liveness(LivenessInput())
    assert first.queues_described == 2
    assert sorted(first.went_offline) == sorted(str(n) for n in silent[:2])
    assert await status_of(db_sessions, silent[2]) == "active"

    second = await liveness.check_liveness(LivenessInput())
    assert second.queues_described == 2
    assert second.went_offline == [str(silent[2])]
    assert await moves(db_sessions, silent[2]) == [("active", "offline", "node_liveness")]
    assert await moves(db_sessions, gone) == []


# --- quarantine by the reconciler, then activate after a health proof --------------------------

SCENARIO = sim_scenario(sim_machine("nsm-a", "10.176.18.10", status="Deployed"))


@pytest.fixture
async def worker_with_vault(
    settings: Settings, temporal_client: Client, db_engine: AsyncEngine, secret_store: Any
) -> AsyncIterator[None]:
    from worker import build_worker

    async with build_worker(temporal_client, settings, db_engine, secret_store=secret_store):
        yield


async def maas_node(sessions: Any, secret_store: Any, maas_sim: Any) -> tuple[uuid.UUID, Any]:
    """A site on the simulator and an active node bound to its Deployed machine nsm-a."""
    site_id = await make_site(sessions, secret_store, maas_sim)
    node = await create_node(sessions)
    machine = await maas_sim.machine("nsm-a")
    async with sessions() as session, session.begin():
        bound = await session.get(Node, node.id)
        assert bound is not None
        bound.host_address = machine["ip_addresses"][0]
        session.add(
            NodeMaasState(node_id=node.id, site_id=site_id, maas_system_id=machine["system_id"])
        )
    return site_id, node


@pytest.mark.maas_scenario(SCENARIO)
async def test_a_quarantined_node_returns_to_service_only_with_a_health_proof(
    worker_with_vault: None,
    api: Any,
    make_token: Any,
    temporal_client: Client,
    settings: Settings,
    db_sessions: Any,
    secret_store: Any,
    maas_sim: Any,
    start_node_agent: Any,
) -> None:
    admin = await api(token=await make_token("admin"))
    site_id, node = await maas_node(db_sessions, secret_store, maas_sim)
    await start_node_agent(node.id)  # it answers the health proof's probe on its queue
    await maas_sim.release("nsm-a")  # out of band, as an admin in the MAAS UI would
    await run_once(temporal_client, settings, site_id)
    assert await status_of(db_sessions, node.id) == "quarantined"
    assert await moves(db_sessions, node.id) == [("active", "quarantined", "maas_reconciler")]

    # The inventory and detail views show it.
    listed = (await admin.get("/api/v1/admin/nodes", params={"drift": "true"})).json()
    assert [i["id"] for i in listed["items"]] == [str(node.id)]
    assert listed["items"][0]["status"] == "quarantined"
    detail = (await admin.get(f"/api/v1/admin/nodes/{node.id}")).json()
    assert detail["maas"]["site_id"] == str(site_id)
    assert detail["maas"]["last_maas_status"] in ("Releasing", "Ready")
    assert detail["drift"]["rule"] == "released_outside_workflow"
    assert detail["gpu_slots"] == {"total": 8, "free": 8, "reserved": 0, "quarantined": 0}
    assert detail["lifecycle_job"] is None

    no_reason = await admin.post(f"/api/v1/admin/nodes/{node.id}/activate", json={})
    assert no_reason.status_code == 400, no_reason.text
    refused = await admin.post(f"/api/v1/admin/nodes/{node.id}/activate", json=REASON)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "node_not_proven_healthy"
    assert set(error["details"]["failed"]) == {
        "gpu_inventory",
        "maas_deployed",
        "maas_power_on",
        "drift_resolved",
    }
    # MAAS was asked now (the machine is released: off), not read from the binding row.
    assert error["details"]["power_state"] == "off"
    assert error["details"]["agent_seen_at"] is not None
    assert await status_of(db_sessions, node.id) == "quarantined"

    # The operator fixes the machine, acknowledges the drift; the agent heartbeats.
    await maas_sim.set_status("nsm-a", "Deployed")
    await maas_sim.set_power("nsm-a", "on")
    await run_once(temporal_client, settings, site_id)
    resolved = await admin.post(
        f"/api/v1/admin/reconciliation/drift/{node.id}/resolve", json=REASON
    )
    assert resolved.status_code == 200, resolved.text
    await heartbeat(temporal_client, settings, node.id, db_sessions)

    async def inventory_in() -> bool:
        async with db_sessions() as session:
            row = await session.get(Node, node.id)
            return row is not None and bool(row.inventory_matches)

    await eventually(inventory_in)
    activated = await admin.post(f"/api/v1/admin/nodes/{node.id}/activate", json=REASON)
    assert activated.status_code == 200, activated.text
    assert activated.json()["status"] == "active"
    assert all(c["passed"] for c in activated.json()["health"])
    assert await status_of(db_sessions, node.id) == "active"
    assert (await moves(db_sessions, node.id))[-1][:2] == ("quarantined", "active")
    async with db_sessions() as session:
        audit = (
            await session.scalars(
                select(AuditEntry).where(
                    AuditEntry.target_id == str(node.id), AuditEntry.action == "node.activate"
                )
            )
        ).one()
    assert audit.reason == REASON["reason"]
    assert (audit.prior_state, audit.expected_state) == ("quarantined", "active")

    again = await admin.post(f"/api/v1/admin/nodes/{node.id}/activate", json=REASON)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "node_status_conflict"


# --- retire (draining → retired by the drain lifecycle), then reactivate ------------------------


async def test_retire_drains_across_a_worker_restart_then_reactivates(
    settings: Settings,
    temporal_client: Client,
    db_engine: AsyncEngine,
    db_sessions: Any,
    api: Any,
    make_token: Any,
    tenant: Tenant,
    start_node_agent: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker import build_worker

    monkeypatch.setenv(DRAIN_POLL_ENV, "0.5")
    admin = await api(token=await make_token("admin"))
    node, spare = await create_fleet(db_sessions, slice_nodes=2)
    await start_node_agent(node.id)
    async with build_worker(temporal_client, settings, db_engine):
        created = await tenant.client.post(
            "/api/v1/allocations", json=slice_request(8, tenant.ssh_key_id)
        )
        assert created.status_code == 201, created.text
        allocation = created.json()
        busy = uuid.UUID(allocation["node_id"])
        if busy != node.id:  # placement chose the other node: drain that one instead
            await start_node_agent(busy)
        await wait_status(tenant.client, allocation["allocation_id"], "active")

        no_reason = await admin.post(f"/api/v1/admin/nodes/{busy}/retire", json={"reason": " "})
        assert no_reason.status_code == 400, no_reason.text
        retired = await admin.post(f"/api/v1/admin/nodes/{busy}/retire", json=REASON)
        assert retired.status_code == 202, retired.text
        assert retired.json()["status"] == "draining"
        drain_id = retired.json()["drain_id"]
        repeat = await admin.post(f"/api/v1/admin/nodes/{busy}/retire", json=REASON)
        assert repeat.json()["drain_id"] == drain_id  # the same drain, not a second one

        job = (await admin.get(f"/api/v1/admin/nodes/{busy}")).json()["lifecycle_job"]
        assert (job["kind"], job["id"], job["status"]) == ("drain", drain_id, "running")
        draining = (await admin.get("/api/v1/admin/nodes", params={"status": "draining"})).json()
        assert [i["id"] for i in draining["items"]] == [str(busy)]
        drain = temporal_client.get_workflow_handle(node_drain_workflow_id(str(busy)))

        async def looked_and_waits() -> bool:  # its check ran, then its poll timer started
            history = await drain.fetch_history()
            return any(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED for e in history.events)

        await eventually(looked_and_waits)
        assert await status_of(db_sessions, busy) == "draining"

    # The worker was stopped while the drain waited; a new one resumes it.
    async with build_worker(temporal_client, settings, db_engine):
        released = await tenant.client.post(
            f"/api/v1/allocations/{allocation['allocation_id']}/release"
        )
        assert released.status_code == 202, released.text
        await wait_status(tenant.client, allocation["allocation_id"], "released")
        handle = temporal_client.get_workflow_handle(
            node_drain_workflow_id(str(busy)), result_type=NodeDrainResult
        )
        result = await handle.result()
        assert result.status == "completed"
        await record_history(handle, "node_drain", "waits_for_allocation_then_retires")
        assert await status_of(db_sessions, busy) == "retired"
        assert [m[:2] for m in await moves(db_sessions, busy)] == [
            ("active", "draining"),
            ("draining", "retired"),
        ]
        detail = (await admin.get(f"/api/v1/admin/nodes/{busy}")).json()
        assert detail["status"] == "retired"
        assert detail["lifecycle_job"] is None

        # Reactivation needs the agent's GPU inventory to match the node's slots (its agent,
        # asked now, answers).
        refused = await admin.post(f"/api/v1/admin/nodes/{busy}/reactivate", json=REASON)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["details"]["failed"] == ["gpu_inventory"]
        await heartbeat(temporal_client, settings, busy, db_sessions)

        async def heard() -> bool:
            async with db_sessions() as session:
                row = await session.get(Node, busy)
                return row is not None and row.inventory_matches is True

        await eventually(heard)
        back = await admin.post(f"/api/v1/admin/nodes/{busy}/reactivate", json=REASON)
        assert back.status_code == 200, back.text
        assert (back.json()["prior_status"], back.json()["status"]) == ("retired", "active")
        assert (await moves(db_sessions, busy))[-1][:2] == ("retired", "active")

        # A node with nothing on it retires at once.
        idle = spare.id if busy == node.id else node.id
        quick = await admin.post(f"/api/v1/admin/nodes/{idle}/retire", json=REASON)
        assert quick.status_code == 202, quick.text
        handle = temporal_client.get_workflow_handle(
            node_drain_workflow_id(str(idle)), result_type=NodeDrainResult
        )
        assert (await handle.result()).status == "completed"
        await record_history(handle, "node_drain", "no_allocations")
        assert await status_of(db_sessions, idle) == "retired"
        wrong = await admin.post(f"/api/v1/admin/nodes/{idle}/activate", json=REASON)
        assert wrong.status_code == 409
        assert wrong.json()["error"]["code"] == "node_status_conflict"


@pytest.mark.usefixtures("control_plane")
async def test_inventory_filters_and_pages(api: Any, make_token: Any, db_sessions: Any) -> None:
    admin = await api(token=await make_token("admin"))
    nodes = await create_fleet(db_sessions, slice_nodes=2, baremetal_nodes=1)
    first = (await admin.get("/api/v1/admin/nodes", params={"limit": 2})).json()
    assert len(first["items"]) == 2
    assert first["next_cursor"]
    rest = (
        await admin.get("/api/v1/admin/nodes", params={"limit": 2, "cursor": first["next_cursor"]})
    ).json()
    assert rest["next_cursor"] is None
    seen = [i["id"] for i in first["items"] + rest["items"]]
    assert sorted(seen) == sorted(str(n.id) for n in nodes)
    baremetal = (await admin.get("/api/v1/admin/nodes", params={"sku": BAREMETAL_SKU})).json()
    assert [i["id"] for i in baremetal["items"]] == [str(nodes[2].id)]
    none_drifted = (await admin.get("/api/v1/admin/nodes", params={"drift": "false"})).json()
    assert len(none_drifted["items"]) == 3
    by_site = (await admin.get("/api/v1/admin/nodes", params={"site_id": str(uuid.uuid4())})).json()
    assert by_site["items"] == []
    bad = await admin.get("/api/v1/admin/nodes", params={"status": "sleeping"})
    assert bad.status_code == 422
    assert (await admin.get(f"/api/v1/admin/nodes/{uuid.uuid4()}")).status_code == 404
    tenant = await api(token=await make_token("tenant"))
    assert (await tenant.get("/api/v1/admin/nodes")).status_code == 403


ONBOARD = sim_scenario(sim_machine("nsm-onb", "10.176.18.30"))


@pytest.mark.maas_scenario(ONBOARD)
async def test_onboarding_activates_the_node_through_the_transition_function(
    onboarding: OnboardingRig,
) -> None:
    job = await onboarding.start("nsm-onb", "10.176.18.30")
    await onboarding.wait_status(job, "completed")
    assert await moves(onboarding.sessions, job.node_id) == [("enrolling", "active", "onboarding")]
