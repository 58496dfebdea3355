"""The documentation cannot rot: its Python runs, and its site builds without a warning.

Every fenced ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` either runs here or
is preceded (on the line above its fence, blank lines aside) by an HTML comment giving the reason
it does not: ``<!-- not run: reason -->``. The blocks of one page run in order in one namespace,
as a reader would paste them, in a temporary directory with a temporary code cache, in this
process (small sizes). ``<!-- run: ranks=N -->`` runs a block as every rank of an N-rank
in-process world (``cube.debug.run``), each rank with its own copy of the page's namespace, as
``torchrun --nproc_per_node=N`` would run it.

The site test runs ``mkdocs build --strict`` (``mkdocs.yml``: broken links, missing anchors and
unresolvable API references are warnings, and strict makes them errors).
"""
from __future__ import annotations

import contextlib
import io
import linecache
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(not run|run)\s*:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str          # relative to the repository root
    line: int          # the line of the opening fence, 1-based
    code: str
    marker: Optional[str] = None    # "not run" / "run" / None
    note: str = ""                  # the marker's text: the reason, or the run options

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker != "not run"

    @property
    def ranks(self) -> int:
        found = re.fullmatch(r"ranks=(\d+)", self.note) if self.marker == "run" else None
        return int(found.group(1)) if found else 1


def parse(text: str, page: str) -> List[Block]:
    """The Python blocks of a Markdown text, each with the marker on the line above its fence."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        if lang in ("python", "py"):
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mark = MARKER.match(lines[k]) if k >= 0 else None
            code = textwrap.dedent("\n".join(lines[i + 1:j]))
            blocks.append(Block(page, i + 1, code + "\n", mark.group(1) if mark else None,
                                mark.group(2) if mark else ""))
        i = j + 1
    return blocks


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = {_rel(p): parse(p.read_text(), _rel(p)) for p in PAGES}
RUN_PAGES = [page for page, blocks in BLOCKS.items() if any(b.runs for b in blocks)]


def test_every_python_block_runs_or_says_why_not():
    every = [b for blocks in BLOCKS.values() for b in blocks]
    bad = [f"{b.where}: '<!-- not run: -->' without a reason" for b in every if b.marker == "not run" and not b.note]
    bad += [f"{b.where}: '<!-- run: {b.note} -->' (the run options are ranks=N)" for b in every
            if b.marker == "run" and not re.fullmatch(r"ranks=\d+", b.note)]
    assert not bad, "\n".join(bad)
    run = [b for b in every if b.runs]
    # every block not marked 'not run' is run by test_page_runs, page by page
    assert {b.where for b in run} == {b.where for p in RUN_PAGES for b in BLOCKS[p] if b.runs}
    print(f"\n{len(every)} Python blocks in README.md and docs/: {len(run)} run in tests, "
          f"{len(every) - len(run)} marked not run")
    for page, blocks in BLOCKS.items():
        if blocks:
            print(f"  {page}: {sum(b.runs for b in blocks)} of {len(blocks)} run")


def test_the_parser_sees_markers_fences_and_indented_blocks():
    text = textwrap.dedent("""\
        ```python
        a = 1
        ```
        <!-- not run: needs a GPU -->

        ```python
        b = 2
        ```
        - a list item:

          <!-- run: ranks=2 -->
          ```python
          c = 3
          ```

        ````markdown
        ```python
        inside = "a Markdown example, not a block"
        ```
        ````
        ```bash
        echo not python
        ```
        """)
    blocks = parse(text, "x.md")
    assert [(b.line, b.marker, b.note, b.code, b.ranks) for b in blocks] == [
        (1, None, "", "a = 1\n", 1), (6, "not run", "needs a GPU", "b = 2\n", 1), (12, "run", "ranks=2", "c = 3\n", 2)]


def _run_block(block: Block, namespace: dict) -> None:
    name = f"<{block.where}>"
    linecache.cache[name] = (len(block.code), None, block.code.splitlines(True), name)
    code = compile(block.code, name, "exec")
    if block.ranks == 1:
        exec(code, namespace)
        return
    import cube.debug

    def rank():
        exec(code, dict(namespace))
    cube.debug.run(rank, block.ranks)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs(page, tmp_path, monkeypatch):
    """The page's Python blocks, in order, in one namespace (a failure names the page and line)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUBE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT))
    namespace = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in BLOCKS[page]:
            if block.runs:
                _run_block(block, namespace)
    if page in ("README.md", "docs/getting-started.md"):   # the quick start's output, as the page shows it
        assert "step 0: loss 1.0290" in out.getvalue(), out.getvalue()


def test_site_builds_without_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs: pip install -r requirements.txt")
    pytest.importorskip("mkdocstrings", reason="the API reference needs mkdocstrings[python]")
    pytest.importorskip("material", reason="the site's theme: pip install mkdocs-material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('id="cube.compile"') == 1


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [_rel(p)[len("docs/"):] for p in PAGES[1:] if _rel(p)[len("docs/"):] not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_readme_links_resolve_and_stay_short():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    assert len(text.splitlines()) <= 250, "README.md is an on-ramp: move details into docs/"


def test_readme_test_command_is_the_one_ci_runs():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command.startswith("python -m pytest -q"), command
    assert f"\n{command}   " in (ROOT / "README.md").read_text(), command   # the README's first test command
    assert f"\n{command}\n" in (ROOT / "docs" / "testing.md").read_text(), command
