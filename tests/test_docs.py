"""The documentation is checked like code: the MkDocs site builds in strict mode (broken links and
anchors, pages missing from the nav fail), every generated state diagram equals what the
generator prints from the code's transition tables now, and the README stays a short entry point
whose relative links resolve. No database and no Temporal here."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_BYTES = 14_000


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """No database here (overrides conftest's)."""


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_state_diagrams", DOCS / "gen_state_diagrams.py"
    )
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


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "lifecycles" / "node" / "index.html").is_file()


def test_generated_diagrams_match_the_code() -> None:
    gen = _generator()
    every = gen.diagrams()
    found: dict[str, list[Path]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        opened = text.count("<!-- generated:state-diagram:")
        blocks = gen.blocks_in(text)
        assert len(blocks) == opened, f"{page}: a generated block without its end marker"
        for name, body in blocks:
            assert name in every, f"{page}: unknown diagram {name!r}"
            assert body == gen.render(name, every[name]), (
                f"{page.relative_to(ROOT)}: diagram {name!r} differs from the code's table; "
                "run .venv/bin/python docs/gen_state_diagrams.py --write"
            )
            found.setdefault(name, []).append(page)
    assert set(found) == set(every), f"diagrams on no page: {set(every) - set(found)}"


def test_every_lifecycle_has_a_page() -> None:
    pages = {p.stem for p in (DOCS / "lifecycles").glob("*.md")}
    assert {
        "allocation",
        "allocation-group",
        "storage-attachment",
        "terminal-session",
        "node",
        "onboarding",
        "decommission",
        "payment-session",
        "balance",
    } <= pages


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_relative_links_resolve() -> None:
    links = _LINK.findall(README.read_text())
    assert links, "no links in README.md"
    for target in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to a missing file: {target}"


def test_readme_is_short() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"
