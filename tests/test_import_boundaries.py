"""The node agent and the control plane do not depend on the simulator: agent/ imports neither
sim/ nor schema/, and activities/ does not import sim/ (simulators plug in by entry point:
`gpucloud.agent.backends`, `gpucloud.host_access`). Read from the source, imports inside
functions included, so a lazy import cannot slip through."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_packages(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"), [("agent", {"sim", "schema"}), ("activities", {"sim"})]
)
def test_no_import_crosses_the_boundary(package: str, forbidden: set[str]) -> None:
    imports = imported_packages(package)
    assert "core" in imports or "agent" in imports  # the scan reads real imports
    crossing = {name: sorted(imports[name]) for name in forbidden if name in imports}
    assert not crossing, f"{package}/ imports {crossing}"
