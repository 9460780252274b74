"""Citations of this repository's docs resolve: every section number (and quoted subsection) of
docs/REFERENCE.md that code, docs or notebooks cite exists, every cited docs/*.md file exists, and
every repository path the Markdown pages name in backticks exists.

Code comments cite the architecture reference by number (docs/REFERENCE.md, its section 3
"Indexer"), so a renumbered section or a moved file would leave them pointing at nothing; these
tests read the real files and fail with the file, line and citation that no longer resolves.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "REFERENCE.md"
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", "venv", "build", "dist", "node_modules", ".ipynb_checkpoints"}
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".yaml", ".yml"}
SECTION = "\u00a7"  # the section sign, spelled out so this file cites nothing itself

# a section number, then optionally quoted subsection titles: <sign>3 "Compressor", "Indexer"
SECTION_CITE = re.compile(SECTION + r'(\d+)((?:\s*(?:,|and)?\s*"[^"\n]+")*)')
QUOTED = re.compile(r'"([^"\n]+)"')
DOCS_CITE = re.compile(r"(?<![\w/.])docs/([A-Za-z0-9_.-]+\.md)\b")
# a backticked repository path in Markdown: `dsv41_jax/serving/engine.py`, `layers/moe.py: swiglu`
BACKTICK = re.compile(r"`([^`\n]+)`")
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?$")
TOP_DIRS = ("dsv41_jax", "pallas_kernels", "sharding", "tests", "bench", "notebooks", "docs")


def _text_files():
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            yield path


def _lines(path: pathlib.Path):
    """(line number, text) of a file; a notebook yields its cells' source lines, unescaped."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        n = 0
        for cell in cells:
            src = cell["source"]
            for line in (src if isinstance(src, list) else src.splitlines(keepends=True)):
                n += 1
                yield n, line
        return
    yield from enumerate(text.splitlines(), 1)


def _reference_sections() -> dict[int, list[str]]:
    """Section number -> the titles of its ### subsections, from the `## N. Title` headings."""
    sections: dict[int, list[str]] = {}
    current = None
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^## (\d+)\. \S", line)
        if m:
            current = int(m.group(1))
            if current in sections:
                raise AssertionError(f"docs/REFERENCE.md has two sections numbered {current}")
            sections[current] = []
        elif line.startswith("## "):
            current = None
        elif line.startswith("### ") and current is not None:
            sections[current].append(line[4:].strip())
    return sections


def test_reference_has_the_nine_numbered_sections():
    sections = _reference_sections()
    assert sorted(sections) == list(range(1, 10)), f"docs/REFERENCE.md sections: {sorted(sections)}, expected 1..9"


def _citation_problems(m: re.Match, sections: dict[int, list[str]]) -> list[str]:
    """What is wrong with one section citation (empty when it resolves)."""
    number = int(m.group(1))
    if number not in sections:
        return [f"docs/REFERENCE.md has no section {number} (it has {sorted(sections)})"]
    return [f"section {number} has no subsection titled like {title!r} (its subsections: {sections[number]})"
            for title in QUOTED.findall(m.group(2))
            if not any(title.lower() in sub.lower() for sub in sections[number])]


def test_section_citations_resolve():
    sections = _reference_sections()
    bad, n_cites = [], 0
    for path in _text_files():
        if path == pathlib.Path(__file__).resolve():
            continue
        for lineno, line in _lines(path):
            for m in SECTION_CITE.finditer(line):
                n_cites += 1
                bad += [f"{path.relative_to(REPO)}:{lineno}: {m.group(0).strip()!r}: {p}" for p in _citation_problems(m, sections)]
    assert n_cites > 50, f"found only {n_cites} section citations; the pattern no longer matches how the repo cites"
    assert not bad, "citations of docs/REFERENCE.md that do not resolve; fix the citation or the section:\n" + "\n".join(bad)


def test_docs_file_citations_resolve():
    bad = []
    for path in _text_files():
        for lineno, line in _lines(path):
            for m in DOCS_CITE.finditer(line):
                if not (REPO / "docs" / m.group(1)).is_file():
                    bad.append(f"{path.relative_to(REPO)}:{lineno}: cites docs/{m.group(1)}, which does not exist")
    assert not bad, "citations of missing docs pages:\n" + "\n".join(bad)


def _resolves(token: str, page: pathlib.Path) -> bool:
    """A path named in a Markdown page exists: from the repository root, inside dsv41_jax/ or
    pallas_kernels/ (pages name subpackage files as `serving/engine.py`), or next to the page."""
    return any((base / token).exists() for base in (REPO, REPO / "dsv41_jax", REPO / "pallas_kernels", page.parent))


def test_markdown_paths_exist():
    """Backticked paths (`serving/engine.py`) must exist; so must bare file names (`kv_layout.py`),
    somewhere in the repository. Files of the upstream reference are named without backticks."""
    names = {f.name for f in _text_files()}
    bad = []
    for path in _text_files():
        if path.suffix != ".md":
            continue
        for lineno, line in _lines(path):
            for m in BACKTICK.finditer(line):
                token = re.split(r"[:\s]", m.group(1).strip(), maxsplit=1)[0]
                if not PATH_TOKEN.match(token) or token.startswith(("../", "./", "/")):
                    continue
                if "/" not in token:
                    if token.endswith((".py", ".md", ".ipynb")) and token not in names:
                        bad.append(f"{path.relative_to(REPO)}:{lineno}: `{token}`: no file of this name in the repository")
                    continue
                is_repo_path = token.split("/")[0] in TOP_DIRS or token.endswith((".py", ".md", ".ipynb", ".json"))
                if is_repo_path and not _resolves(token, path):
                    bad.append(f"{path.relative_to(REPO)}:{lineno}: `{token}` does not exist")
    assert not bad, "Markdown pages name paths that do not exist (moved or deleted files?):\n" + "\n".join(bad)


@pytest.mark.parametrize("line, ok", [
    ('see docs/REFERENCE.md ' + SECTION + '3 "Indexer".', True),
    ('see docs/REFERENCE.md ' + SECTION + '3 "Compressor", "Indexer"', True),
    ('see docs/REFERENCE.md ' + SECTION + '3 "Nonexistent"', False),
    ('see docs/REFERENCE.md ' + SECTION + '12', False),
])
def test_checker_catches_a_bad_citation(line, ok):
    """The matcher itself: a real subsection passes, a missing subsection or number fails."""
    m = SECTION_CITE.search(line)
    assert m is not None
    assert (not _citation_problems(m, _reference_sections())) is ok
