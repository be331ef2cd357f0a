"""Mermaid state diagrams generated from the code's own transition tables.

Each lifecycle page under docs/lifecycles/ carries its diagram between the markers

    <!-- generated:state-diagram:NAME -->
    ...
    <!-- /generated -->

and tests/test_docs.py fails when a block differs from what this module prints now, so the
picture cannot drift from the tables. It imports only `contracts` (pure types; no database, no
Temporal server), so it runs wherever the project's virtual environment does:

    .venv/bin/python docs/gen_state_diagrams.py            # every diagram, each with its name
    .venv/bin/python docs/gen_state_diagrams.py node       # one diagram
    .venv/bin/python docs/gen_state_diagrams.py --write    # rewrite the blocks in docs/

Lifecycles whose states have no transition table in the code (payment session, balance, and the
automatic part of the job states) are drawn by hand on their pages and marked as hand-drawn.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN = "<!-- generated:state-diagram:{name} -->"
END = "<!-- /generated -->"
BLOCK_RE = re.compile(
    r"<!-- generated:state-diagram:(?P<name>[a-z0-9_-]+) -->\n(?P<body>.*?)<!-- /generated -->",
    re.DOTALL,
)


@dataclass(frozen=True)
class Diagram:
    source: str  # where the table lives, printed in the diagram's comment line
    initial: tuple[str, ...]
    edges: tuple[tuple[str, str, str], ...]  # (from, to, label)
    states: tuple[str, ...]


def _from_table(
    source: str,
    table: Mapping[Any, Iterable[Any]],
    initial: Iterable[StrEnum],
) -> Diagram:
    states = tuple(s.value for s in table)
    order = {s: i for i, s in enumerate(states)}
    edges = tuple(
        (src.value, dst.value, "")
        for src, targets in table.items()
        for dst in sorted(targets, key=lambda t: order[t.value])
    )
    return Diagram(source, tuple(s.value for s in initial), edges, states)


def _job_actions(
    source: str,
    allowed: Mapping[Any, Iterable[Any]],
    statuses: Iterable[StrEnum],
    expected: Callable[[str], StrEnum],
) -> Diagram:
    """A lifecycle job's operator actions: from each state that admits an action to where the
    action leads when all goes well (contracts.lifecycle.expected_job_status)."""
    states = tuple(s.value for s in statuses)
    order = {s: i for i, s in enumerate(states)}
    labels: dict[tuple[str, str], list[str]] = {}
    for action, sources in allowed.items():
        dst = expected(action.value).value
        for src in sorted(sources, key=lambda s: order[s.value]):
            labels.setdefault((src.value, dst), []).append(action.value)
    edges = tuple(
        (src, dst, ", ".join(names))
        for (src, dst), names in sorted(
            labels.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])
        )
    )
    used = {s for edge in edges for s in edge[:2]}
    return Diagram(source, (), edges, tuple(s for s in states if s in used))


def diagrams() -> dict[str, Diagram]:
    from contracts import decommission, onboarding_policy, storage, terminal_session
    from contracts import states as st
    from contracts.lifecycle import JobStatus, expected_job_status

    return {
        "allocation": _from_table(
            "contracts/states.py ALLOCATION_TRANSITIONS",
            st.ALLOCATION_TRANSITIONS,
            [st.AllocationStatus.REQUESTED],
        ),
        "allocation-group": _from_table(
            "contracts/states.py ALLOCATION_GROUP_TRANSITIONS",
            st.ALLOCATION_GROUP_TRANSITIONS,
            [st.AllocationGroupStatus.REQUESTED],
        ),
        "storage-attachment": _from_table(
            "contracts/storage.py TRANSITIONS",
            storage.TRANSITIONS,
            [storage.AttachmentStatus.REQUESTED],
        ),
        "terminal-session": _from_table(
            "contracts/terminal_session.py TERMINAL_SESSION_TRANSITIONS",
            terminal_session.TERMINAL_SESSION_TRANSITIONS,
            [terminal_session.TerminalSessionStatus.OPENING],
        ),
        "node": _from_table(
            "contracts/states.py NODE_TRANSITIONS",
            st.NODE_TRANSITIONS,
            [st.NodeStatus.BOOTSTRAP_ISSUED],
        ),
        "onboarding-actions": _job_actions(
            "contracts/onboarding_policy.py ALLOWED_ACTIONS + contracts/lifecycle.py "
            "expected_job_status",
            onboarding_policy.ALLOWED_ACTIONS,
            JobStatus,
            expected_job_status,
        ),
        "decommission-actions": _job_actions(
            "contracts/decommission.py ALLOWED_ACTIONS + contracts/lifecycle.py "
            "expected_job_status",
            decommission.ALLOWED_ACTIONS,
            JobStatus,
            expected_job_status,
        ),
    }


def render(name: str, diagram: Diagram) -> str:
    """The Markdown between the markers: a fenced Mermaid block, ending in a newline."""
    lines = ["```mermaid", "stateDiagram-v2", f"    %% generated from {diagram.source}"]
    lines += [f"    [*] --> {s}" for s in diagram.initial]
    for src, dst, label in diagram.edges:
        lines.append(f"    {src} --> {dst}" + (f": {label}" if label else ""))
    if not diagram.initial:  # an actions diagram: no start, no end
        return "\n".join([*lines, "```"]) + "\n"
    onward = {src for src, _, _ in diagram.edges}
    lines += [f"    {s} --> [*]" for s in diagram.states if s not in onward]
    return "\n".join([*lines, "```"]) + "\n"


def block(name: str) -> str:
    return f"{BEGIN.format(name=name)}\n{render(name, diagrams()[name])}{END}"


def blocks_in(text: str) -> list[tuple[str, str]]:
    """(name, body) of every generated block in a page."""
    return [(m["name"], m["body"]) for m in BLOCK_RE.finditer(text)]


def write(docs: Path = DOCS) -> list[Path]:
    """Rewrite every generated block under `docs`; returns the pages changed."""
    changed = []
    every = diagrams()
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text()
        new = BLOCK_RE.sub(
            lambda m: f"{BEGIN.format(name=m['name'])}\n{render(m['name'], every[m['name']])}{END}",
            text,
        )
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        for page in write():
            print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    every = diagrams()
    names = argv or list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        print(
            f"unknown diagram(s): {', '.join(unknown)}; known: {', '.join(every)}", file=sys.stderr
        )
        return 2
    for name in names:
        if len(names) > 1:
            print(f"## {name}")
        print(render(name, every[name]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
