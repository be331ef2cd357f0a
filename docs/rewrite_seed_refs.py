"""Rewrite the code's "seed 00x §…" references into links to the docs page that states the same
contract, e.g. `seed 003 §5.8` → `docs/lifecycles/decommission.md#failures-and-recommended-actions`.

The seed documents are not in the repository; these pages are. `SECTIONS` maps each cited seed
section to its page and anchor; a section not listed falls back to its nearest listed parent
(§4.2.1 → §4.2 → §4), then to the seed's own page. Only comments and docstrings are touched
(never a string the program uses), only text matching the reference pattern, and a line the
rewrite makes longer than the line limit is re-wrapped inside its comment or docstring. Running it
twice changes nothing the second time.

    .venv/bin/python docs/rewrite_seed_refs.py            # dry run: the planned changes and a count
    .venv/bin/python docs/rewrite_seed_refs.py --write    # apply them
    .venv/bin/python docs/rewrite_seed_refs.py --write FILE...   # only these files

tests/test_doc_links.py checks that every `docs/….md#anchor` a .py file names exists.
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_LIMIT = 100  # pyproject.toml [tool.ruff] line-length

L = "docs/lifecycles/"
# (seed, section) → page or page#anchor. Section "" is the seed as a whole.
SECTIONS: dict[tuple[str, str], str] = {
    # 000: the allocation lifecycle, placement, provisioning and release
    ("000", ""): f"{L}allocation.md",
    # 001: state machines
    ("001", ""): f"{L}index.md",
    ("001", "1"): f"{L}allocation.md",
    ("001", "1a"): f"{L}allocation-group.md",
    ("001", "2"): f"{L}allocation.md#who-moves-it",
    ("001", "3"): "docs/billing.md#metering-and-balances",
    ("001", "4"): f"{L}balance.md",
    ("001", "5"): f"{L}payment-session.md",
    ("001", "6"): f"{L}terminal-session.md",
    ("001", "7"): f"{L}storage-attachment.md",
    # 002: the allocation task timeline
    ("002", ""): f"{L}allocation.md#task-timeline",
    # 003: MAAS bare-metal lifecycle
    ("003", ""): "docs/maas-nodes.md",
    ("003", "2"): f"{L}node.md#what-the-control-plane-asks-of-a-node",
    ("003", "2.4"): f"{L}node.md#what-the-control-plane-asks-of-a-node",
    ("003", "3"): "docs/maas-sites.md",
    ("003", "3.1"): "docs/maas-sites.md#the-site",
    ("003", "3.2"): "docs/maas-sites.md#secrets-in-vault",
    ("003", "3.2.1"): "docs/maas-sites.md#power-credential-overrides",
    ("003", "3.3"): "docs/maas-sites.md#roce-assignments",
    ("003", "3.4"): "docs/maas-sites.md#admin-api",
    ("003", "3.5"): "docs/maas-sites.md#credential-lifecycle",
    ("003", "3.6"): "docs/maas-sites.md#policy-knobs",
    ("003", "3.7"): "docs/maas-sites.md#site-profiles",
    ("003", "4"): f"{L}onboarding.md",
    ("003", "4.1"): f"{L}onboarding.md#submitting",
    ("003", "4.2"): f"{L}onboarding.md#monitoring",
    ("003", "4.3"): f"{L}onboarding.md#stages",
    ("003", "4.4"): f"{L}onboarding.md#batches",
    ("003", "4.5"): f"{L}onboarding.md#monitoring",
    ("003", "4.6"): f"{L}onboarding.md#failure-classes-and-recommended-actions",
    ("003", "4.7"): "docs/runbooks/index.md",
    ("003", "4.8"): f"{L}onboarding.md#job-states",
    ("003", "4.9"): f"{L}onboarding.md#actions",
    ("003", "4.10"): f"{L}onboarding.md#safe-re-entry",
    ("003", "4.11"): f"{L}onboarding.md#mark-manual-intervention",
    ("003", "4.12"): f"{L}onboarding.md#monitoring",
    ("003", "4.13"): f"{L}onboarding.md#safe-re-entry",
    ("003", "4.14"): f"{L}onboarding.md#timeouts-and-preflight",
    ("003", "4.15"): f"{L}onboarding.md#actions",
    ("003", "4.16"): f"{L}onboarding.md#discovery-ambiguity",
    ("003", "5"): f"{L}decommission.md",
    ("003", "5.1"): f"{L}decommission.md#modes",
    ("003", "5.2"): f"{L}decommission.md#soft-reset",
    ("003", "5.3"): f"{L}decommission.md#reimage",
    ("003", "5.4"): f"{L}decommission.md#full-decommission",
    ("003", "5.5"): f"{L}decommission.md#storage-only-cleanup",
    ("003", "5.6"): f"{L}decommission.md#node-tasks",
    ("003", "5.7"): f"{L}decommission.md#monitoring",
    ("003", "5.8"): f"{L}decommission.md#failures-and-recommended-actions",
    ("003", "6"): f"{L}node.md#drift-with-maas",
    ("003", "6.3"): f"{L}node.md#detection",
    ("003", "6.4"): f"{L}node.md#reconciliation-rules",
    ("003", "6.6"): "docs/maas-nodes.md#drift-between-maas-and-the-platform",
    ("003", "7"): f"{L}node.md",
    ("003", "8"): f"{L}node.md#access-fields",
    ("003", "8.1"): f"{L}node.md#access-fields",
    ("003", "9"): f"{L}onboarding.md#cloud-init",
    ("003", "9.1"): f"{L}onboarding.md#hardware-sync",
    ("003", "11"): f"{L}storage-attachment.md#providers",
    # 004: MAAS node state model
    ("004", ""): f"{L}node.md",
    ("004", "3"): f"{L}node.md#states-and-transitions",
    ("004", "3.3"): f"{L}node.md#who-moves-it",
    ("004", "4"): f"{L}onboarding.md#job-states",
    ("004", "4.2"): f"{L}onboarding.md#stages",
    ("004", "5"): f"{L}decommission.md#job-states",
    ("004", "5.2"): f"{L}decommission.md#modes",
    ("004", "6"): f"{L}node.md#drift-with-maas",
    ("004", "7"): f"{L}decommission.md#failures-and-recommended-actions",
    ("004", "8"): f"{L}decommission.md#actions",
    ("004", "9"): "docs/console.md",
}

# A reference without a section that names its topic in the words right after it.
CONTEXT: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("000", re.compile(r"^[^.;)]{0,40}(NUMA|best-fit|ranking)"), f"{L}allocation.md#placement"),
    (
        "000",
        re.compile(r"^\s*(failure|'s failure)"),
        f"{L}allocation.md#failures-and-recommended-actions",
    ),
    ("003", re.compile(r"^\s+[A-Z][a-z]+[A-Z]\w+"), f"{L}onboarding.md#stages"),
)

_SECTION = r"§[ \t]?\d+[a-z]?(?:\.\d+)*"
# Between two words of one reference: spaces, or a line break inside a comment block.
_GAP = r"(?:[ \t]*\n[ \t]*(?:\#[ \t]*)?|[ \t]*)"
_JOIN = rf"{_GAP}(?:,|/|-|\u2013|and)?{_GAP}"  # \u2013: an en dash
REFERENCE = re.compile(
    rf"\b[Ss]eed (?P<seed>00[0-4])(?![\d/])(?P<sections>{_GAP}{_SECTION}(?:{_JOIN}{_SECTION})*)?"
)
# What the rewrite writes, and tests/test_doc_links.py checks.
DOC_LINK = re.compile(r"\bdocs/[\w./-]+\.md(?:#[\w-]+)?")


@dataclass(frozen=True)
class Change:
    path: Path
    line: int
    old: str
    new: str


def target(seed: str, section: str) -> str:
    """The page (and anchor) of one seed section: its own, a parent's, or the seed's."""
    parts = section.split(".") if section else []
    while parts:
        found = SECTIONS.get((seed, ".".join(parts)))
        if found:
            return found
        parts.pop()
    return SECTIONS[(seed, "")]


def _sections(text: str) -> list[str]:
    """The sections a reference names, a range (§5.2-§5.5) spelled out; a range of more than
    three becomes its parent (§4.3-§4.13 → §4: the whole page)."""
    parts = re.split(r"(§[ \t]?\d+[a-z]?(?:\.\d+)*)", text)
    names = [re.sub(r"§[ \t]?", "", part) for part in parts[1::2]]
    joins = parts[2::2]
    found: list[str] = []
    index = 0
    while index < len(names):
        name = names[index]
        if index + 1 < len(names) and re.fullmatch(r"[\s#]*[-\u2013][\s#]*", joins[index]):
            head, _, low = name.rpartition(".")
            end_head, _, high = names[index + 1].rpartition(".")
            if head == end_head and low.isdigit() and high.isdigit():
                prefix = f"{head}." if head else ""
                span = [f"{prefix}{n}" for n in range(int(low), int(high) + 1)]
                found += span if len(span) <= 3 else [head or name]
                index += 2
                continue
        found.append(name)
        index += 1
    return found


def replacement(match: re.Match[str], after: str) -> str:
    seed = match["seed"]
    sections = _sections(match["sections"] or "")
    if not sections:
        for context_seed, pattern, page in CONTEXT:
            if context_seed == seed and pattern.search(after):
                return page
        return target(seed, "")
    found: list[str] = []
    for section in sections:
        page = target(seed, section)
        if page not in found:
            found.append(page)
    pages = {page.split("#")[0] for page in found}
    if len(found) > 2 and len(pages) == 1:
        return pages.pop()  # many anchors of one page: the page
    return ", ".join(found)


def _prose_mask(text: str) -> list[bool]:
    """True for each character of a comment or a docstring (and the line breaks inside a block
    of comments), the only text the rewrite touches."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(row: int, col: int) -> int:
        return starts[row - 1] + col

    mask = [False] * len(text)
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docstrings.add((node.value.lineno, node.value.col_offset))
    previous_comment: tuple[int, int] | None = None  # (row, end offset)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            begin, end = offset(*tok.start), offset(*tok.end)
            if previous_comment and previous_comment[0] == tok.start[0] - 1:
                begin = previous_comment[1]  # the break and indentation between them
            mask[begin:end] = [True] * (end - begin)
            previous_comment = (tok.start[0], end)
        elif tok.type == tokenize.STRING and tok.start in docstrings:
            begin, end = offset(*tok.start), offset(*tok.end)
            mask[begin:end] = [True] * (end - begin)
    return mask


def rewrite_text(text: str) -> tuple[str, int, int]:
    """The text with its references rewritten; how many were, and how many were left because
    they are not in a comment or docstring."""
    mask = _prose_mask(text)
    out: list[str] = []
    done = skipped = 0
    last = 0
    for match in REFERENCE.finditer(text):
        if not all(mask[match.start() : match.end()]):
            skipped += 1
            continue
        out.append(text[last : match.start()])
        out.append(replacement(match, text[match.end() : match.end() + 60]))
        last = match.end()
        done += 1
    out.append(text[last:])
    new = "".join(out)
    return (_rewrap(new) if done else new), done, skipped


def _prose_lines(text: str) -> dict[int, str]:
    """Row → 'comment' or 'docstring' (or 'docstring-end' for a docstring's last row)."""
    kinds: dict[int, str] = {}
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docstrings.add((node.value.lineno, node.value.col_offset))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            kinds[tok.start[0]] = "comment"
        elif tok.type == tokenize.STRING and tok.start in docstrings:
            for row in range(tok.start[0], tok.end[0]):
                kinds[row] = "docstring"
            kinds[tok.end[0]] = "docstring-end"
    return kinds


_STRUCTURED = re.compile(r"^(?:[-*|>]|\d+[.)]\s|```|$)")


def _rewrap(text: str) -> str:
    """Re-wrap each comment or docstring line a link made longer than the limit: the words past
    the limit move to the start of the next line of the same paragraph, or onto a new line."""
    dirty = {i for i, line in enumerate(text.split("\n")) if DOC_LINK.search(line)}
    for _ in range(1000):
        lines = text.split("\n")
        kinds = _prose_lines(text)
        for index, line in enumerate(lines):
            row = index + 1
            if len(line) <= LINE_LIMIT or row not in kinds or index not in dirty:
                continue
            kind = kinds[row]
            indent = line[: len(line) - len(line.lstrip())]
            if kind == "comment":
                comment = line.index("#", len(indent)) if line.lstrip().startswith("#") else None
                if comment is not None:
                    prefix = re.match(r"[ \t]*#+[ \t]?", line)[0]  # type: ignore[index]
                else:  # a trailing comment: continued at the indentation of the code after it
                    after = next((n for n in lines[index + 1 :] if n.strip()), "")
                    code_indent = after[: len(after) - len(after.lstrip())]
                    prefix = (code_indent if len(code_indent) > len(indent) else indent) + "# "
            else:
                prefix = indent
            split = line.rfind(" ", len(prefix) + 1, LINE_LIMIT + 1)
            if split <= len(prefix):
                continue  # one word longer than the limit: leave it
            head, tail = line[:split].rstrip(), line[split + 1 :]
            following = lines[index + 1] if index + 1 < len(lines) else None
            merge = (
                following is not None
                and kind in ("comment", "docstring")
                and kinds.get(row + 1) in (kind, "docstring-end")
                and following.startswith(prefix)
                and following[len(prefix) :].strip() != '"""'
                and not following[len(prefix) :].startswith((" ", "\t"))
                and not _STRUCTURED.match(following[len(prefix) :])
            )
            if kind == "comment" and comment is None:
                merge = False  # a trailing comment is its own; the next one is another's
            if kind == "comment" and merge and not following.lstrip().startswith("#"):  # type: ignore[union-attr]
                merge = False
            if merge:
                lines[index + 1] = prefix + tail + " " + following[len(prefix) :]  # type: ignore[index]
                lines[index] = head
            else:
                lines[index : index + 1] = [head, prefix + tail]
                dirty = {i + 1 if i > index else i for i in dirty}
            dirty.add(index + 1)
            text = "\n".join(lines)
            break
        else:
            return text
    return text


def python_files(root: Path = ROOT) -> Iterator[Path]:
    skip = {".git", ".venv", ".state", "node_modules", "__pycache__", "site", "build", "dist"}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or rel.parts[0].endswith(".egg-info"):
            continue
        if rel in (Path("docs/rewrite_seed_refs.py"), Path("tests/test_doc_links.py")):
            continue  # their own examples
        yield path


def plan(paths: list[Path]) -> tuple[dict[Path, str], list[Change], int, int]:
    """The new text of each file that changes, the changed lines, how many references are
    rewritten and how many are left (not in a comment or docstring)."""
    rewritten: dict[Path, str] = {}
    changes: list[Change] = []
    total = left = 0
    for path in paths:
        text = path.read_text()
        new, done, skipped = rewrite_text(text)
        left += skipped
        total += done
        if not done:
            continue
        rewritten[path] = new
        old_lines, new_lines = text.split("\n"), new.split("\n")
        matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
        for op, a1, a2, b1, b2 in matcher.get_opcodes():
            if op != "equal":
                changes.append(
                    Change(path, a1 + 1, "\n".join(old_lines[a1:a2]), "\n".join(new_lines[b1:b2]))
                )
    return rewritten, changes, total, left


def main(argv: list[str]) -> int:
    write = "--write" in argv
    named = [Path(a).resolve() for a in argv if a != "--write"]
    paths = named or list(python_files())
    rewritten, changes, references, left = plan(paths)
    for change in changes:
        print(f"{change.path.relative_to(ROOT)}:{change.line}")
        for line in change.old.split("\n"):
            print(f"  - {line}")
        for line in change.new.split("\n"):
            print(f"  + {line}")
    print(
        f"{references} reference(s) in {len(rewritten)} file(s) "
        f"({'rewritten' if write else 'dry run; --write applies'}); "
        f"{left} left because they are not in a comment or docstring"
    )
    if write:
        for path, text in rewritten.items():
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
