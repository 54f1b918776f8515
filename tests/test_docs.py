"""Every page of the documentation runs as written: README.md and docs/*.md.

How a page's fenced blocks are treated (the conventions for whoever writes one):

- ```` ```python ```` blocks run on the CPU, in page order, in one namespace per page that starts with ``torch``
  and ``epicute`` imported: a block sees the names the blocks above it defined. Calls that would launch a kernel
  run on the reference backend (``backend="reference"`` or ``with epicute.use_backend("reference"):``, bf16/fp16
  tensors, GEMM sizes multiples of 8), and ``explain`` plans on ``device="meta"`` tensors.
- A block that needs a Hopper GPU is shown, parsed and not run: one that mentions ``cuda`` (``device="cuda"``,
  ``.cuda()``), or one whose fence comes right after the line ``<!-- gpu -->`` (for GPU code that names no
  device, e.g. a CUDA graph capture written with ``torch.cuda`` calls only).
- ```` ```bash ```` lines that start with ``epicute explain`` run through the command line (in process) and must
  exit 0; other shell lines (installs, the examples, compiles) are not run here.
- ```` ```toml ```` blocks must parse.
- Each page must run at least ``MIN_RUN[page]`` Python blocks (pages of prose and tables: 0), so a page whose
  examples drift into GPU-only ones fails here; every page must be declared there and listed in docs/README.md.
- Relative links must point at files that exist, and ``#anchors`` at headings of the page they name.
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import epicute
from epicute.cli import app
from epicute.runtime.backend import resolve_backend

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GPU_MARK = "<!-- gpu -->"

#: Python blocks each page must run on the CPU (a lower bound; raise it when you add runnable blocks).
MIN_RUN = {
    "README.md": 1,
    "docs/README.md": 0,
    "docs/gemm.md": 5,
    "docs/fp8.md": 3,
    "docs/grouped.md": 8,
    "docs/attention.md": 8,
    "docs/training.md": 7,
    "docs/models.md": 4,
    "docs/runtime.md": 3,
    "docs/performance.md": 0,
    "docs/layout.md": 0,
    "docs/roadmap.md": 0,
}


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the block's first code line in its page
    marked_gpu: bool

    @property
    def needs_gpu(self) -> bool:
        return self.marked_gpu or "cuda" in self.code


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, with the line each starts at and whether ``<!-- gpu -->`` precedes its fence."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{_name(page)}:{i + 1}: a fence that never closes"
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(fence.group(1), "\n".join(lines[start:end]) + "\n", start + 1, previous == GPU_MARK))
        i = end + 1
    return blocks


PAGES = [pytest.param(page, id=_name(page)) for page in _pages()]


@pytest.mark.parametrize("page", PAGES)
def test_the_python_blocks_of_a_page_run_on_the_cpu(page, capsys):
    namespace: dict = {"torch": torch, "epicute": epicute, "__name__": "__docs__"}
    ran = 0
    for block in _blocks(page):
        if block.lang != "python" or block.needs_gpu:
            continue
        # Padded so that a traceback's line numbers are the page's.
        code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
        exec(code, namespace)
        ran += 1
        assert resolve_backend(None) == "kernel", f"{_name(page)}:{block.line} left another default backend set"
    capsys.readouterr()
    want = MIN_RUN[_name(page)]
    assert ran >= want, f"{_name(page)}: {ran} Python blocks ran on the CPU, expected at least {want}"


def test_every_page_is_declared_and_indexed():
    names = {_name(page) for page in _pages()}
    assert names == set(MIN_RUN), "declare each page's MIN_RUN (and drop pages that are gone)"
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_parses_gpu_ones_included(page):
    for block in _blocks(page):
        if block.lang == "python":
            ast.parse("\n" * (block.line - 1) + block.code, filename=str(page))


def _commands(block: Block) -> list[tuple[int, str]]:
    """Shell lines with their backslash continuations joined and trailing comments dropped."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(block.code.splitlines(), start=block.line):
        if not pending:
            first = n
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    return [(n, shlex.split(cmd, comments=True)) for n, cmd in out if cmd.strip()]


@pytest.mark.parametrize("page", PAGES)
def test_explain_commands_of_a_page_run(page):
    runner = CliRunner()
    for block in _blocks(page):
        if block.lang != "bash":
            continue
        for line, argv in _commands(block):
            if argv[:2] != ["epicute", "explain"]:
                continue
            result = runner.invoke(app, argv[1:])
            assert result.exit_code == 0, f"{_name(page)}:{line}: {' '.join(argv)}\n{result.output}"


@pytest.mark.parametrize("page", PAGES)
def test_toml_blocks_parse(page):
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    for block in _blocks(page):
        if block.lang == "toml":
            tomllib.loads(block.code)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading and not in_fence:
            slug = _slug(heading.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{_name(page)}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{_name(page)}: link to {target}: no such heading"
