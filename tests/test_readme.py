"""The README's Python examples run, on the CPU, as written; its links lead somewhere.

Each fenced ``python`` block of README.md runs in its own interpreter (the trainer's ``init`` is
process-wide state) in an empty temporary folder, with CUDA hidden and Hugging Face offline, so
an example that quietly needs a GPU, the network or a file from another block fails here. A
block that does need one is marked on the line before its fence with
``<!-- readme-test: skip (the reason) -->`` and is reported as skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]*)\)\s*-->")
#: seconds a block may take; the examples are sized to run in a few
TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced python block: where it is, its code, and why it is skipped (None: it runs)."""

    name: str
    line: int
    code: str
    skip: str | None


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a Markdown text, each named after the heading above it."""
    blocks = []
    lines = text.splitlines()
    heading = "top"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            start = i + 1
            end = start
            while lines[end].strip() != "```":
                end += 1
            marker = SKIP.search(lines[i - 1]) if i else None
            n = sum(b.name.startswith(heading) for b in blocks)
            blocks.append(Block(f"{heading} {n + 1}" if n else heading, start,
                                "\n".join(lines[start:end]) + "\n", marker.group("why") if marker else None))
            i = end
        i += 1
    return blocks


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


BLOCKS = python_blocks(_readme())


def test_the_readme_has_examples_and_stays_short() -> None:
    assert len([b for b in BLOCKS if b.skip is None]) >= 4
    assert len(_readme().splitlines()) < 300, "the README is for users: move detail into docs/"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_python_block_runs(block: Block, tmp_path: os.PathLike[str]) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1")
    script = os.path.join(tmp_path, "block.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(block.code)
    r = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, f"README.md line {block.line} ({block.name}) failed:\n{r.stderr[-3000:]}"


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (lower case, punctuation dropped, - for spaces)."""
    heads = re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_in_the_readme_and_docs_exist() -> None:
    pages = [README] + [os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                        if f.endswith(".md")]
    missing = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = os.path.join(os.path.dirname(page), target) if target else page
            if not os.path.exists(path):
                missing.append(f"{os.path.relpath(page, ROOT)}: {target}")
            elif anchor and path.endswith(".md"):
                with open(path, encoding="utf-8") as f:
                    if anchor not in anchors(f.read()):
                        missing.append(f"{os.path.relpath(page, ROOT)}: {target}#{anchor}")
    assert not missing, "links to missing files or headings:\n" + "\n".join(missing)


def test_block_extraction_names_and_skips() -> None:
    text = "# A\n```python\nx = 1\n```\n<!-- readme-test: skip (needs a GPU) -->\n```python\ny\n```\n"
    a, b = python_blocks(text)
    assert (a.name, a.code, a.skip) == ("A", "x = 1\n", None)
    assert (b.name, b.skip) == ("A 2", "needs a GPU")
    assert anchors("## Data parallel (torchrun)\n## What it guarantees, and what not\n") == {
        "data-parallel-torchrun", "what-it-guarantees-and-what-not"}
