"""The one agent registers every host task the control plane schedules on `node-{id}`.

The scheduled set is derived two ways, so neither a new workflow path nor a new contract name can
slip past: from the recorded workflow histories CI replays (every activity scheduled on a `node-`
queue, in every recorded path) and from the host-task names of contracts/host_tasks.py. The
registered set is what `agent.node_worker.node_activities` gives the production agent, the
simulated fleet and the tests alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from temporalio import activity

from agent.main import backend_names, make_services
from agent.node_worker import NodeServices, node_activities
from contracts import host_tasks as contract
from sim.config import SimHostConfig
from sim.host import SimulatedHost
from sim.node_services import machine_maintenance

HISTORIES = Path(__file__).parent / "histories"


def scheduled_on_node_queues() -> set[str]:
    names: set[str] = set()
    for path in HISTORIES.rglob("*.json"):
        for event in json.loads(path.read_text()).get("events", []):
            attrs = event.get("activityTaskScheduledEventAttributes")
            if attrs and attrs["taskQueue"]["name"].startswith("node-"):
                names.add(attrs["activityType"]["name"])
    return names


def registered(services: NodeServices) -> set[str]:
    names = set()
    for fn in node_activities(services, "00000000-0000-0000-0000-000000000001"):
        defn = activity._Definition.from_callable(fn)
        assert defn is not None
        assert defn.name is not None
        names.add(defn.name)
    return names


def test_histories_schedule_host_tasks() -> None:
    # The derivation itself must see host tasks, or the checks below would pass on nothing.
    scheduled = scheduled_on_node_queues()
    assert {contract.SLICE_VM_PROVISION, contract.NODE_GPU_SCRUB} <= scheduled


def test_the_agent_registers_every_host_task_the_workflows_schedule(tmp_path: Path) -> None:
    node = "00000000-0000-0000-0000-000000000001"
    services = NodeServices(
        SimulatedHost(node, config=SimHostConfig()), machine_maintenance(tmp_path)
    )
    names = registered(services)
    missing = scheduled_on_node_queues() - names
    assert not missing, f"scheduled on node queues but not registered: {sorted(missing)}"
    assert set(contract.TASK_SUMMARIES) <= names


def test_the_production_backend_is_the_default_and_the_simulator_a_plugin() -> None:
    assert backend_names()[0] == "host"
    assert "simulated" in backend_names()


def test_the_simulated_plugin_builds_the_same_services(tmp_path: Path) -> None:
    from agent.backends.system_root import SystemRoot
    from agent.main import BackendContext

    machine_root = tmp_path / "m" / "root"
    machine_root.mkdir(parents=True)
    node = "00000000-0000-0000-0000-000000000002"
    services = make_services(
        "simulated", BackendContext({}, SystemRoot(machine_root), node, "sim-host")
    )
    assert set(contract.TASK_SUMMARIES) <= registered(services)
