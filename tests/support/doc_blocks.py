"""The fenced code blocks of README.md and docs/*.md, and how the documentation test treats each.

A block is run unless it is output (```text) or the line just before its fence says otherwise:

- ``<!-- not run: REASON -->``: shown, not run here, for the reason given;
- ``<!-- doc-test: setup for this page -->``: Python run before every later Python block of
  the page (the names the page's examples use);
- ``<!-- doc-test: setup for the next block -->``: Python run before the next block only.

The runnable blocks of a page run in order in one folder, as a reader would run them.
"""
import re
from dataclasses import dataclass
from typing import List, Optional

from launch import REPO

OUTPUT = ("text",)
PYTHON = ("python",)
SHELL = ("bash", "sh", "shell", "")
NOT_RUN = "not run"
PAGE_SETUP = "setup for this page"
NEXT_SETUP = "setup for the next block"
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r"^<!--\s*(not run|doc-test)\s*:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str               # relative to the repository root
    line: int               # of the opening fence, from 1
    info: str               # the fence's language, "" without one
    text: str
    marker: Optional[str]   # "not run: ...", "doc-test: ..." or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def setup(self) -> Optional[str]:
        """``PAGE_SETUP``, ``NEXT_SETUP`` or None."""
        if self.marker and self.marker.startswith("doc-test:"):
            return self.marker.split(":", 1)[1].strip()
        return None

    @property
    def not_run(self) -> bool:
        return bool(self.marker and self.marker.startswith(NOT_RUN + ":"))


def pages() -> List[str]:
    return ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def blocks(page: str) -> List[Block]:
    """Every fenced block of ``page``, in order."""
    lines = (REPO / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i].strip())
        if not opening:
            i += 1
            continue
        fence, end = opening.group(1), i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        marker = _MARKER.match(lines[i - 1].strip()) if i else None
        found.append(Block(page, i + 1, opening.group(2), "\n".join(lines[i + 1:end]) + "\n",
                           f"{marker.group(1)}: {marker.group(2)}" if marker else None))
        i = end + 1
    return found


@dataclass(frozen=True)
class Step:
    """One runnable block of a page and what runs for it: Python (the page's setup, the
    block's own setup, the block) or a bash script."""
    block: Block
    language: str           # "python" or "bash"
    script: str


def plan(page: str):
    """``(steps, unaccounted)``: the page's runnable blocks in order, and the blocks that are
    neither run, nor output, nor marked not run (each with why)."""
    steps, unaccounted = [], []
    page_setup, next_setup = "", None
    for block in blocks(page):
        if block.info in OUTPUT or block.not_run:
            if next_setup is not None:
                unaccounted.append(f"{next_setup.where}: a setup for a block that is not run")
                next_setup = None
            continue
        if block.setup in (PAGE_SETUP, NEXT_SETUP) and block.info in PYTHON:
            if block.setup == PAGE_SETUP:
                page_setup += block.text
            else:
                next_setup = block
            continue
        if block.marker:
            unaccounted.append(f"{block.where}: unknown marker <!-- {block.marker} -->")
        elif block.info in PYTHON:
            own = next_setup.text if next_setup else ""
            steps.append(Step(block, "python", page_setup + own + block.text))
        elif block.info in SHELL:
            if next_setup is not None:
                steps.append(Step(next_setup, "python", page_setup + next_setup.text))
            steps.append(Step(block, "bash", _commands(block.text)))
        else:
            unaccounted.append(f"{block.where}: ```{block.info} is neither run nor output "
                               "(mark it <!-- not run: why --> or make it ```text)")
        next_setup = None
    if next_setup is not None:
        unaccounted.append(f"{next_setup.where}: a setup with no block after it")
    return steps, unaccounted


def _commands(text: str) -> str:
    """The shell block as a script: a leading ``$ `` prompt dropped from each line."""
    return "".join(line[2:] + "\n" if line.startswith("$ ") else line + "\n"
                   for line in text.splitlines())
