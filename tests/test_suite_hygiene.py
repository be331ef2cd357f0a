"""The suite's own honesty, checked statically (issue 34): a test gets its nodes, jobs and
lifecycle states the way production does, never by writing lifecycle rows or starting a lifecycle
workflow itself.

`SHORTCUTS` below is the one place that allows a module to take a shortcut. Its first part names
the tests of pure SQL functions, which may write rows forever; its second part is debt, counted
per module: a module may not take more shortcuts than listed (a new shortcut fails here), and an
entry whose module takes fewer must be lowered (paid debt stays paid).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent

# Tables whose rows only a lifecycle may write.
LIFECYCLE_TABLES = (
    "nodes",
    "allocations",
    "node_onboardings",
    "node_decommissions",
    "storage_attachments",
    "terminal_sessions",
)
LIFECYCLE_MODELS = (
    "Node",
    "Allocation",
    "NodeOnboarding",
    "NodeDecommission",
    "StorageAttachment",
    "TerminalSession",
)
# Workflows a tenant or an operator starts through the API (or the admin-operation workflow).
LIFECYCLE_WORKFLOWS = (
    "AllocationWorkflow",
    "AllocationGroupWorkflow",
    "MaasNodeOnboardWorkflow",
    "MaasNodeBatchOnboardWorkflow",
    "NodeDecommissionWorkflow",
    "StorageAttachmentWorkflow",
    "TerminalSessionWorkflow",
    "PaymentSessionWorkflow",
)

_TABLES = "|".join(LIFECYCLE_TABLES)
_MODELS = "|".join(LIFECYCLE_MODELS)
# Rows inserted or forced to a state by hand, in SQL text or SQLAlchemy.
_ROW_WRITES = re.compile(
    rf"\b(INSERT\s+INTO|UPDATE)\s+({_TABLES})\b"
    rf"|\b(insert|update)\(\s*({_MODELS})\s*\)"
    rf"|\.add\(\s*({_MODELS})\(",
    re.IGNORECASE,
)
# The factories and fixture helpers that make SQL nodes and hand-inserted jobs.
_SHORTCUT_CALLS = {"create_node", "create_fleet", "plain_node", "insert_job"}


def _makes_nodes(call: ast.Call) -> bool:
    """create_fleet(..., slice_nodes=0) makes only the catalog (SKUs), which is admin data."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name != "create_fleet":
        return True
    counts = {
        kw.arg: kw.value.value
        for kw in call.keywords
        if isinstance(kw.value, ast.Constant) and kw.arg in {"slice_nodes", "baremetal_nodes"}
    }
    return counts.get("slice_nodes", 1) != 0 or counts.get("baremetal_nodes", 0) != 0


# Tests of pure SQL functions (placement ranking, ledger queries, counters kept by triggers):
# rows are their input, so they may write them.
PURE_SQL = {
    "factories.py",
    "test_node_free_gpu_counters.py",
    "test_placement_activity.py",
}

# Debt: module -> how many shortcuts it still takes. Only ever lowered.
SHORTCUTS: dict[str, int] = {
    "decommission_fixtures.py": 2,
    "gateway_fixtures.py": 1,
    "lifecycle_support.py": 2,
    "onboarding_fixtures.py": 3,
    "terminal_fixtures.py": 1,
    "test_admin_operations.py": 1,
    "test_agent_demo_fleet.py": 1,
    "test_agent_enrollment.py": 2,
    "test_agent_liveness.py": 2,
    "test_allocation_cleanup_proof.py": 6,
    "test_allocation_concurrency.py": 1,
    "test_allocation_crash.py": 1,
    "test_allocation_detach.py": 2,
    "test_allocation_libvirt_e2e.py": 1,
    "test_allocation_rejections.py": 1,
    "test_allocation_release_steps.py": 1,
    "test_allocation_requested.py": 2,
    "test_allocation_timeline.py": 2,
    "test_attachment_abandon.py": 1,
    "test_billing.py": 6,
    "test_billing_crash.py": 2,
    "test_billing_notifications.py": 1,
    "test_console.py": 1,
    "test_console_browser.py": 1,
    "test_decommission_api.py": 7,
    "test_decommission_failures.py": 7,
    "test_decommission_workflow.py": 2,
    "test_first_boot_sim.py": 2,
    "test_gateway_auth.py": 1,
    "test_gateway_operations.py": 2,
    "test_gpu_quarantine.py": 1,
    "test_hostile_input.py": 1,
    "test_maas_reconciler.py": 1,
    "test_maas_reconciler_reseed.py": 1,
    "test_maas_sim_roce_hwsync.py": 1,
    "test_multi_process.py": 1,
    "test_node_liveness.py": 4,
    "test_node_presence.py": 3,
    "test_node_state_model.py": 7,
    "test_onboard_cli.py": 2,
    "test_onboarding_api.py": 5,
    "test_reconciliation_routes.py": 1,
    "test_slice_vlan_isolation.py": 1,
    "test_slice_vlan_pool.py": 3,
    "test_storage_attachments.py": 1,
}


def shortcuts_in(path: Path) -> int:
    source = path.read_text()
    count = len(_ROW_WRITES.findall(source))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _SHORTCUT_CALLS and _makes_nodes(node):
                count += 1
                continue
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"start_workflow", "execute_workflow"}
            and node.args
        ):
            continue
        first = ast.get_source_segment(source, node.args[0]) or ""
        if any(re.search(rf"\b{name}\b", first) for name in LIFECYCLE_WORKFLOWS):
            count += 1
    return count


def scan() -> Counter[str]:
    found: Counter[str] = Counter()
    for path in sorted(TESTS.glob("*.py")):
        if path.name in PURE_SQL or path.name == Path(__file__).name:
            continue
        n = shortcuts_in(path)
        if n:
            found[path.name] = n
    return found


def test_no_new_shortcuts() -> None:
    grown = {
        name: (n, SHORTCUTS.get(name, 0))
        for name, n in scan().items()
        if n > SHORTCUTS.get(name, 0)
    }
    assert not grown, (
        "these test modules write lifecycle rows or start lifecycle workflows themselves "
        "(found, allowed): get the node, job or state through onboarding, the API or a "
        f"caused fault instead: {grown}"
    )


def test_paid_debt_stays_paid() -> None:
    found = scan()
    stale = {name: (found.get(name, 0), n) for name, n in SHORTCUTS.items() if found[name] < n}
    assert not stale, f"lower these SHORTCUTS entries to what the modules take now: {stale}"


def test_the_scanner_sees_each_kind_of_shortcut(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "async def t(client, s):\n"
        "    await create_node(s)\n"
        "    await create_fleet(s, slice_nodes=0)\n"
        "    await s.execute(text('insert into node_decommissions (id) values (1)'))\n"
        "    await s.execute(insert(Allocation).values())\n"
        "    s.add(\n        Node(id=1))\n"
        "    await s.execute(text('UPDATE nodes SET status = 1'))\n"
        "    await client.start_workflow(NodeDecommissionWorkflow.run, 1, id='x', task_queue='q')\n"
        "    await client.start_workflow(BillingMeterWorkflow.run, 1, id='y', task_queue='q')\n"
    )
    assert shortcuts_in(sample) == 6
