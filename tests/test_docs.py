"""The docs run: every ```python and ```sh block of README.md and docs/*.md is executed, in
document order, on the built-in data (`shardflow data`), or says on its first line why it is
not (`# not run here: a GPU, a bucket, a cluster...`); ```text blocks are not code. A doc whose
example rots fails here; so does an untagged block, or one skipped without a reason.

docs/converting.md makes the shards the other pages load (its blocks run first, in one
folder that the other pages then share); the README's tour runs in a folder of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

# One worker runs every page (pytest-xdist's loadgroup): they share the folder
# converting.md's blocks fill.
pytestmark = pytest.mark.xdist_group("docs")

DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
NOT_RUN = re.compile(r"^# not run here: (?P<why>.{10,})$")
LANGS = ("python", "sh", "text")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        first = self.code.lstrip().split("\n", 1)[0]
        return self.lang in ("python", "sh") and not NOT_RUN.match(first)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, indented ones (in list items) dedented."""
    found, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, end = start["indent"], i + 1
        while end < len(lines) and lines[end].rstrip() != f"{indent}```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: a block never closed")
        code = textwrap.dedent("\n".join(lines[i + 1: end]))
        found.append(Block(path, i + 1, start["lang"], code))
        i = end + 1
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def run(block: Block, cwd: Path, timeout: float = 600) -> None:
    """Run one block in `cwd` with this venv's python and `shardflow` first on PATH; a
    failure names the block and shows what it printed."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}", "SHARDFLOW_DOCS_TEST": "1"}
    cmd = [sys.executable, "-c", block.code] if block.lang == "python" else \
        ["bash", "-euo", "pipefail", "-c", block.code]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise AssertionError(f"{block.where} ({block.lang}) exited {proc.returncode}:\n"
                             f"{block.code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                             f"{proc.stderr[-3000:]}")


def run_page(path: Path, cwd: Path) -> int:
    ran = 0
    for block in blocks(path):
        if block.runs:
            run(block, cwd)
            ran += 1
    return ran


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where docs/converting.md's blocks have run: the built-in data in sample/, and
    shards/train, text, modelnet, criteo made from it."""
    ws = tmp_path_factory.mktemp("docs")
    assert run_page(DOCS / "converting.md", ws) >= 4
    return ws


def test_every_block_is_tagged_and_a_block_not_run_says_why():
    problems = []
    for path in pages():
        for block in blocks(path):
            first = block.code.lstrip().split("\n", 1)[0]
            if block.lang not in LANGS:
                problems.append(f"{block.where}: tag it ```python, ```sh or ```text")
            elif first.startswith("# not run") and not NOT_RUN.match(first):
                problems.append(f"{block.where}: '# not run here: <why, 10+ characters>'")
    assert problems == []


def test_converting_makes_the_shards_the_other_pages_load(workspace):
    for name in ("train", "text", "modelnet", "criteo"):
        assert (workspace / "shards" / name / "manifest.json").exists(), name
    assert (workspace / "report.json").exists()  # verify's report


RUN_PAGES = [p.name for p in sorted(DOCS.glob("*.md"))
             if p.name != "converting.md" and any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_a_docs_page_runs(page, workspace):
    assert run_page(DOCS / page, workspace) >= 1


def test_the_readme_tour_runs_in_a_folder_of_its_own_and_learns(tmp_path):
    assert run_page(ROOT / "README.md", tmp_path) >= 2
    summary = json.loads((tmp_path / "runs" / "r1" / "summary.json").read_text())
    # 10 classes: chance is 0.1. Every class in the held-out shard was trained on.
    assert summary["accuracy"] > 0.25 and summary["eval_classes_unseen_in_training"] == []


# A command by its old script name: `shardflow X` is the one name (tools/main.py COMMANDS).
STALE = re.compile(r"\b(?:make_shards|verify_shards|show_shards|bench_loader|bench_convert|"
                   r"bench_stream|train_tokenizer|plot_run|gpu_check)\.py\b|tools/train\.py"
                   r"|\.venv/bin/python tools/")


def test_every_command_goes_by_one_name():
    found = [f"{path.name}:{n}: {line.strip()}" for path in pages()
             for n, line in enumerate(path.read_text().splitlines(), 1) if STALE.search(line)]
    assert found == []


LONGEST = 40  # words in a sentence of a page's prose (tables and code apart)
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`*\[])")


def long_sentences(path: Path) -> list[str]:
    """The sentences of `path`'s prose over LONGEST words: fenced blocks, tables and
    headings left out, each list item apart, an inline `code span` one word."""
    prose: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith(("|", "#", "![")):
            prose.append("\n" + line if ITEM.match(line) or not line.strip() else line)
    text = re.sub(r"`[^`]*`", "X", "\n".join(prose))
    found = []
    for item in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)", text):
        for sentence in SENTENCE_END.split(" ".join(ITEM.sub("", item).split())):
            if len(sentence.split()) > LONGEST:
                found.append(f"{path.name}: {len(sentence.split())} words: {sentence[:80]}...")
    return found


def test_sentences_are_short():
    assert [s for path in pages() if path.name != "cli.md" for s in long_sentences(path)] == []


def test_a_block_that_rotted_fails(workspace):
    """The planted bug: the text page's first example with a keyword the loader does not
    take, as an API rename would leave it."""
    [first] = [b for b in blocks(DOCS / "loading-text.md") if b.lang == "python"][:1]
    rotted = Block(first.path, first.line, "python",
                   first.code.replace("seq_len=256", "seq_length=256"))
    assert rotted.code != first.code
    with pytest.raises(AssertionError, match=r"docs/loading-text\.md:\d+ \(python\) exited 1"):
        run(rotted, workspace)


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12_500, "README.md: keep it a front page; move the rest"
    missing = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in readme]
    assert missing == []
