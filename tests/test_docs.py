"""The documentation holds together: README.md and docs/*.md link only to files, folders and headings that
exist, the README stays short, and its quick-start commands are the ones CI runs (.ci/run)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
README_MAX_LINES = 220

_FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) or [text](target "title"); images (![alt](src)) are links too. Text may hold `code`.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A code span may wrap onto the next line, never across a blank line (a paragraph break).
_CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> List[Path]:
    return [README] + sorted((ROOT / "docs").glob("*.md"))


def _prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(path: Path) -> List[Tuple[int, str]]:
    """Every Markdown link target in ``path`` (outside code), with its line number."""
    lines = dict(_prose_lines(path.read_text(encoding="utf-8")))
    prose = "\n".join(lines.get(n, "") for n in range(1, max(lines, default=0) + 1))
    # Inline code (which may wrap onto the next line) never holds a link, but a link's text may hold inline
    # code: replace each code span by a placeholder, keeping its line breaks so line numbers stay right.
    prose = _CODE_SPAN.sub(lambda m: "`x`" + "\n" * m.group(0).count("\n"), prose)
    found = []
    for number, line in enumerate(prose.split("\n"), 1):
        found.extend((number, m.group(1)) for m in _LINK.finditer(line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation other than '-' and '_'
    removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """The anchors of every heading in ``path``, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: Dict[str, int] = {}
    result = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(path: Path) -> List[str]:
    """Every relative link in ``path`` that does not resolve, as 'file:line: target (why)'."""
    problems = []
    for number, target in links(path):
        if target.lower().startswith(_EXTERNAL):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{where} (no such file or directory)")
            continue
        if anchor:
            if linked.is_dir() or linked.suffix.lower() != ".md":
                problems.append(f"{where} (an anchor into something that is not a Markdown file)")
            elif anchor not in anchors(linked):
                problems.append(f"{where} (no heading with anchor #{anchor} in {linked.name})")
    return problems


def test_there_are_docs_pages():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"README.md", "correctness.md", "callback.md", "hydra.md", "serving.md", "performance.md",
            "architecture.md"} <= pages


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert links(path) or path == README, f"{path}: no links found (is the link pattern still right?)"
    assert broken_links(path) == []


def test_readme_and_index_link_every_docs_page():
    for index in (README, ROOT / "docs" / "README.md"):
        linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)
                  if not t.lower().startswith(_EXTERNAL)}
        for page in (ROOT / "docs").glob("*.md"):
            if page != index:
                assert page.resolve() in linked, f"{index.relative_to(ROOT)} does not link {page.relative_to(ROOT)}"


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


def _code_blocks(path: Path) -> List[List[str]]:
    blocks: List[List[str]] = []
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _ci_line(prefix: str) -> str:
    lines = [line.strip() for line in CI_RUN.read_text(encoding="utf-8").splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f".ci/run: expected one line starting with {prefix!r}, found {lines}"
    return lines[0]


def test_readme_setup_command_is_what_ci_runs():
    ci_setup = _ci_line("python3 -m venv")
    assert " -q " in ci_setup, ".ci/run's pip install is expected to be quiet (-q)"
    expected = ci_setup.replace(" -q ", " ", 1)  # the README shows the same install without -q
    setup = [line for block in _code_blocks(README) for line in block if line.startswith("python3 -m venv")]
    assert len(setup) == 1, f"README.md: expected one setup command, found {setup}"
    # The README's command also runs the main job after the install; .ci/run checks that in tests/test_examples.py.
    assert setup[0] == expected + " && .venv/bin/python examples/train.py"


def test_readme_test_command_is_what_ci_runs():
    ci_test = _ci_line(".venv/bin/python -m pytest")
    blocks = _code_blocks(README)
    assert [ci_test] in blocks, f"README.md has no code block that is exactly {ci_test!r}"
