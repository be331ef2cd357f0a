"""The code points at the contract in docs/, never at documents outside the repository: every
`docs/….md` or `docs/….md#anchor` a .py file names is an existing page and, with an anchor, one of
that page's headings. docs/rewrite_seed_refs.py turns the old "seed 00x §…" references into such
links; its table is checked here too, so the rewrite can only write links that resolve. No
database and no Temporal here."""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_LINK = re.compile(r"\bdocs/(?P<page>[\w./-]+\.md)(?:#(?P<anchor>[\w-]+))?")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*(?:\{#(?P<id>[\w-]+)\})?\s*#*\s*$", re.MULTILINE)
SKIP = {".git", ".venv", ".state", "node_modules", "__pycache__", "site", "build", "dist"}


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """No database here (overrides conftest's)."""


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ inside docs/
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module


@cache
def anchors(page: Path) -> frozenset[str]:
    """The ids MkDocs gives the page's headings (toc's slugify), outside fenced code."""
    text = FENCE.sub("", page.read_text())
    found = set()
    for m in HEADING.finditer(text):
        found.add(m["id"] or slugify(re.sub(r"[`*]", "", m["title"]), "-"))
    return frozenset(found)


def unresolved(link: str) -> str | None:
    """Why `docs/page.md#anchor` does not resolve, or None."""
    m = DOC_LINK.fullmatch(link)
    if m is None:
        return "not a docs link"
    page = DOCS / m["page"]
    if not page.is_file():
        return f"no page {m['page']}"
    if m["anchor"] and m["anchor"] not in anchors(page):
        return f"no heading #{m['anchor']} in {m['page']}"
    return None


def _python_files() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if not SKIP & set(p.relative_to(ROOT).parts)
        and not p.relative_to(ROOT).parts[0].endswith(".egg-info")
        and p != Path(__file__).resolve()  # its own examples of broken links
    ]


def test_every_docs_link_in_the_code_resolves() -> None:
    broken = []
    for path in _python_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in DOC_LINK.finditer(line):
                why = unresolved(m[0])
                if why:
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {m[0]}: {why}")
    assert not broken, "\n".join(broken)


def test_the_link_check_refuses_a_missing_page_and_anchor() -> None:
    assert unresolved("docs/lifecycles/decommission.md#adopt") is None
    assert unresolved("docs/lifecycles/decommission.md#no-such-heading")
    assert unresolved("docs/lifecycles/no-such-page.md")
    # A heading inside a fenced block is a shell comment, not an anchor.
    assert unresolved("docs/tenant-guide.md#1-register-an-ssh-public-key")


def test_every_seed_section_maps_to_a_resolving_link() -> None:
    rewrite = _load("rewrite_seed_refs")
    broken = {
        f"seed {seed} §{section}": f"{page}: {unresolved(page)}"
        for (seed, section), page in rewrite.SECTIONS.items()
        if unresolved(page)
    }
    broken |= {f"context {s}": page for s, _, page in rewrite.CONTEXT if unresolved(page)}
    assert not broken, broken


def test_the_rewrite_touches_only_prose_and_is_idempotent() -> None:
    rewrite = _load("rewrite_seed_refs")
    source = (
        '"""A module (seed 003 §5.8).\n\nSeed 001 §1\'s "admin removes the assignment"."""\n'
        "\n"
        "X = 'seed 003 §4.9'  # a value the program uses: left alone; seed 004 §8 here\n"
        "# the stages (seed 003 §5.2-§5.3; seed 004\n"
        "# §3.3) and placement (seed 000: NUMA-fit, then best-fit)\n"
        "def f() -> None:\n"
        "    '''A docstring whose reference pushes it over the line limit, seed 003 §4.10 x.'''\n"
    )
    new, done, skipped = rewrite.rewrite_text(source)
    assert (done, skipped) == (7, 1)
    assert "X = 'seed 003 §4.9'" in new
    assert '"""A module (docs/lifecycles/decommission.md#failures-and-recommended-actions).' in new
    assert 'docs/lifecycles/allocation.md\'s "admin removes the assignment"' in new
    assert "# a value the program uses: left alone; docs/lifecycles/decommission.md#actions" in new
    assert (
        "docs/lifecycles/decommission.md#soft-reset, docs/lifecycles/decommission.md#reimage;"
        in new
    )
    assert "docs/lifecycles/node.md#who-moves-it" in new
    assert "docs/lifecycles/allocation.md#placement:" in new
    assert all(len(line) <= rewrite.LINE_LIMIT for line in new.splitlines())
    compile(new, "<rewritten>", "exec")
    assert rewrite.rewrite_text(new) == (new, 0, 1)
    for link in rewrite.DOC_LINK.findall(new):
        assert unresolved(link) is None, link
