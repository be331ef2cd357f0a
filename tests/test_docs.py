"""The documentation is checked like code: the MkDocs site builds in strict mode (broken links and
anchors, pages missing from the nav fail), every generated state diagram equals what the
generator prints from the code's transition tables now, the configuration reference equals what
docs/gen_configuration.py draws from the settings classes and lists every variable the code
names, and the README stays a short entry point
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


def _generator(name: str = "gen_state_diagrams") -> ModuleType:
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


def test_configuration_reference_matches_the_code() -> None:
    gen = _generator("gen_configuration")
    text = gen.PAGE.read_text()
    blocks = gen.blocks_in(text)
    assert len(blocks) == text.count("<!-- generated:configuration:"), "a block without its end"
    for name, body in blocks:
        assert name in gen.names(), f"unknown configuration table {name!r}"
        assert body == gen.render(name), (
            f"docs/configuration.md: table {name!r} differs from the settings classes; "
            "run .venv/bin/python docs/gen_configuration.py --write"
        )
    assert sorted(name for name, _ in blocks) == sorted(gen.names())


def test_every_variable_the_code_names_is_in_the_reference() -> None:
    gen = _generator("gen_configuration")
    in_code = gen.variables_in_code()
    listed = gen.documented()
    missing = {v: files for v, files in in_code.items() if v not in listed | set(gen.INTERNAL)}
    assert not missing, (
        f"variables named by the code but in no configuration table: {missing}; give the "
        "settings field its core.config.env metadata, or list the variable in "
        "docs/gen_configuration.py (OTHER_VARIABLES, or INTERNAL)"
    )
    stale = sorted(v for v in listed | set(gen.INTERNAL) if v not in in_code)
    assert not stale, f"listed in docs/gen_configuration.py but named by no code: {stale}"
    assert not listed & set(gen.INTERNAL), "a variable both documented and internal"


def _sample(type_name: str, default: object) -> str:
    if type_name in ("bool", "bool | None"):
        return "0" if default else "1"
    if type_name in ("int", "float"):
        return "7"
    return "c2FtcGxl" if "tuple" in type_name else "http://sample.invalid:1"


def test_each_setting_reads_the_variable_it_names() -> None:
    """The metadata is not a comment that can drift: setting the variable it names changes that
    field, and only that field, of what from_env reads."""
    import dataclasses

    from core.config import ENV_METADATA

    gen = _generator("gen_configuration")
    checked = 0
    for cls in gen.settings_classes().values():
        unset = cls.from_env({})
        for f in dataclasses.fields(cls):
            meta = f.metadata.get(ENV_METADATA)
            if meta is None:
                continue
            default = getattr(unset, f.name)
            read = cls.from_env({meta.name: _sample(str(f.type), default)})
            assert getattr(read, f.name) != default, f"{cls.__name__}.{f.name} ignores {meta.name}"
            changed = [
                g.name
                for g in dataclasses.fields(cls)
                if getattr(read, g.name) != getattr(unset, g.name)
            ]
            assert changed == [f.name], f"{meta.name} changes {changed}"
            checked += 1
    assert checked >= 50
