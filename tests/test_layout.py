"""The package layout holds its rules (pipeline/README.md): one import name, `shardflow`, over
three folders whose layers point one way (the library, then the training side, then the
commands); no import circles; a small root; short functions; every module named in its
folder's README, and every file or module a docstring or README names exists. Run as a script
for the figures:

    .venv/bin/python tests/test_layout.py     # modules per folder, arrows, depth, circles
"""

from __future__ import annotations

import ast
import collections
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each folder of the checkout and the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"pipeline": "shardflow", "trainers": "shardflow.trainers", "tools": "shardflow.tools"}
LIBRARY, TRAINERS, TOOLS = FOLDERS.values()


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([FOLDERS[folder], *rest]).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    return {module_name(path): path
            for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}


def layer(name: str) -> int:
    """0 the library, 1 the training side, 2 the commands; an arrow may not point up."""
    if name == TOOLS or name.startswith(TOOLS + ".") or name == f"{LIBRARY}.__main__":
        return 2  # `python -m shardflow` is the command
    return 1 if name == TRAINERS or name.startswith(TRAINERS + ".") else 0


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `name` imports, TYPE_CHECKING and function-level imports included (a
    package importing its own submodules, or a module its parent package, is not an arrow)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in arrows[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in arrows:
        if v not in index:
            visit(v)
    return found


def depth(arrows: dict[str, set[str]]) -> int:
    """Modules on the longest import chain (meaningful once there are no circles)."""
    @cache
    def longest(v: str) -> int:
        return 1 + max((longest(w) for w in arrows[v]), default=0)

    return max(longest(v) for v in arrows)


def long_functions(limit: int = 60) -> list[str]:
    rows = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    rows.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    return rows


def upward(arrows: dict[str, set[str]]) -> list[str]:
    """Arrows that point up a layer: the library into the trainers or the commands, the
    trainers into the commands."""
    return sorted(f"{name} -> {target}" for name, targets in arrows.items()
                  for target in targets if layer(target) > layer(name))


def test_no_import_circles():
    assert circles(graph()) == []


def test_a_planted_circle_is_found():
    arrows = graph()
    assert "shardflow.errors" in arrows["shardflow.loading.loader"]
    arrows["shardflow.errors"] = arrows["shardflow.errors"] | {"shardflow.loading.loader"}
    assert [group for group in circles(arrows)
            if {"shardflow.errors", "shardflow.loading.loader"} <= set(group)]


def test_the_layers_point_one_way():
    assert upward(graph()) == []


def test_an_import_up_a_layer_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from shardflow.trainers.loop import Trainer\n"
                       "    from shardflow.tools import util\n")
    arrows = graph()
    arrows["shardflow.loading.planted"] = imports_of("shardflow.loading.planted", planted,
                                                     modules())
    assert upward(arrows) == ["shardflow.loading.planted -> shardflow.tools",
                              "shardflow.loading.planted -> shardflow.tools.util",
                              "shardflow.loading.planted -> shardflow.trainers.loop"]


def test_trainers_and_the_read_side_never_import_the_conversion_side():
    write_side = ("shardflow.convert", "shardflow.shards.writer", "shardflow.shards.verify")
    readers = (TRAINERS, "shardflow.loading", "shardflow.image", "shardflow.text",
               "shardflow.pointcloud", "shardflow.tabular", "shardflow.samples")
    offenders = {name: sorted(t for t in targets if t.startswith(write_side))
                 for name, targets in graph().items() if name.startswith(readers)}
    assert {k: v for k, v in offenders.items() if v} == {}


OLD_IMPORT = re.compile(
    r"^\s*(?:from|import)\s+(?:pipeline|trainers)\b|-m\s+(?:pipeline|trainers)\b", re.M)


PROJECT_FILES = (*FOLDERS, "tests", "datasets", "docs", "README.md", "Makefile", "pyproject.toml")


def old_names() -> list[str]:
    """Lines anywhere in the project (code, docs, recipes) that import the 0.1 names."""
    found = []
    for top in PROJECT_FILES:
        paths = [ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob("*"))
        for path in paths:
            if path.suffix in (".png", ".jpg", ".pyc") or not path.is_file() \
                    or path.name == "test_layout.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if OLD_IMPORT.search(line) and not line.startswith("|"):  # the changelog's
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_nothing_imports_the_names_of_0_1():
    """One import name: `pipeline` and `trainers` are the user's own (a folder holding a
    pipeline.py of its own imports it and ours side by side: test_cli's wheel test)."""
    assert old_names() == []


def test_pyproject_installs_every_package_folder_under_its_one_name():
    text = (ROOT / "pyproject.toml").read_text()
    mapped = dict(re.findall(r'^"(shardflow[\w.]*)" = "(\w+)"$', text, re.M))
    assert mapped == {package: folder for folder, package in FOLDERS.items()}
    listed = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
    folders = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert set(re.findall(r'"([\w.]+)"', listed)) == folders


def test_the_root_of_pipeline_stays_small():
    assert len(list((ROOT / "pipeline").glob("*.py"))) <= 8


def test_no_function_is_over_60_lines():
    assert long_functions() == []


def readme_units(text: str) -> list[tuple[str | None, str]]:
    """A README cut into the places a module can be named in: (folder, text) for a section
    whose heading names a folder (`loading/`), and (None, text) for each prose paragraph and
    each code-block entry (a line at column 0 and the indented lines under it)."""
    units: list[tuple[str | None, str]] = []
    for section in re.split(r"^## ", text, flags=re.M):
        heading = re.match(r"`([\w/]+/)`", section)
        if heading:
            units.append((heading.group(1), section))
        for i, chunk in enumerate(re.split(r"^```.*$", section, flags=re.M)):
            pieces = re.split(r"\n(?=\S)", chunk) if i % 2 else re.split(r"\n\s*\n", chunk)
            units += [(None, piece) for piece in pieces]
    return units


def unnamed(folder_name: str, readme: str) -> list[str]:
    """Modules of a package folder its README does not name where their folder is named: five
    loader.py in five folders need five mentions, each beside its own folder (the same unit:
    its entry, paragraph, or the section headed by the folder)."""
    units = readme_units(readme)
    missing = []
    for path in sorted((ROOT / folder_name).rglob("*.py")):
        if path.name == "__init__.py" or "builtin" in path.parts:
            continue
        folder = "/".join(path.relative_to(ROOT / folder_name).parts[:-1])
        folder = f"{folder}/" if folder else ""
        if not any(path.name in body and (heading == folder or folder in body)
                   for heading, body in units):
            missing.append(f"{folder}{path.name}")
    return missing


def test_every_module_is_named_in_its_package_readme():
    for folder in FOLDERS:
        missing = unnamed(folder, (ROOT / folder / "README.md").read_text())
        assert missing == [], f"{folder}/README.md does not name {missing}"


def test_every_package_readme_starts_with_its_flow():
    for folder in FOLDERS:
        text = (ROOT / folder / "README.md").read_text()
        first_section = text.split("\n## ", 1)[0]
        assert "```" in first_section, f"{folder}/README.md: no flow before its first section"


def test_a_module_named_only_beside_another_folder_is_unnamed():
    """The planted bug of the test above: text/loader.py dropped from its entry, while
    image/ (and others) still name a loader.py."""
    readme = (ROOT / "pipeline" / "README.md").read_text()
    planted = readme.replace("text/        config.py (TextConfig) -> loader.py (document checks)",
                             "text/        config.py (TextConfig) -> (document checks)")
    assert planted != readme
    assert unnamed("pipeline", planted) == ["text/loader.py"]


# What a docstring, comment or README may name as a file: a .py file, a path under one of the
# project's folders, a dotted shardflow module (and an attribute of it).
NAMED_PY = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
NAMED_PATH = re.compile(r"(?<![\w./-])((?:pipeline|trainers|tools|tests|docs|datasets)/"
                        r"[\w./-]*\w)(?![\w/\\-]|\.\w)")
NAMED_MODULE = re.compile(r"(?<![\w./])(shardflow(?:\.\w+)+)")
OLD_MODULE = re.compile(r"(?<![\w./])((?:pipeline|trainers)\.(?!py\b)[A-Za-z_]\w*)")
# Files of other projects or of the user that the docs name: FFCV's and SemanticKITTI's, the
# scripts the dataset recipes write out, a user's own pipeline.py, a placeholder and the
# files the tests plant; the producer's name a manifest records.
NOT_OURS = {"setup.py", "auxiliary/laserscan.py", "unpack_cifar10.py", "presample_modelnet40.py",
            "split_tinystories.py", "pipeline.py", "NAME.py", "tools/NAME.py", "planted.py",
            "test_planted.py", "shardflow.make_shards", "trainers.BpeTrainer", "pipeline.MINE",
            "trainers.MINE"}  # and HF tokenizers' trainers module, a user's own modules


def named_texts() -> list[Path]:
    code = [p for folder in (*FOLDERS, "tests") for p in sorted((ROOT / folder).rglob("*.py"))
            if p.name != "test_layout.py"]  # which plants stale names
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "datasets").glob("*.md")), *sorted(ROOT.glob("*/README.md")),
            *sorted(ROOT.glob("tools/*/README.md")), ROOT / "Makefile"]
    return code + docs


def stale_names(path: Path, text: str) -> list[str]:
    """The files and modules `text` (the contents of `path`) names that do not exist. A .py
    name is looked for from the root, from each package folder, beside `path`, and, with no
    folder, anywhere; a module's attribute must be defined at its top level."""
    known = modules()
    everywhere = {p.name for folder in (*FOLDERS, "tests") for p in (ROOT / folder).rglob("*.py")}
    stale = []
    for name in set(NAMED_PY.findall(text)) - NOT_OURS:
        places = [ROOT, path.parent, *(ROOT / folder for folder in FOLDERS)]
        if not any((place / name).exists() for place in places) and \
                ("/" in name or name not in everywhere):
            stale.append(name)
    stale += [name for name in set(NAMED_PATH.findall(text)) - NOT_OURS
              if not (ROOT / name).exists()]
    stale += set(OLD_MODULE.findall(text)) - NOT_OURS  # 0.1's import names
    for dotted in set(NAMED_MODULE.findall(text)) - NOT_OURS:
        parts = dotted.split(".")
        module = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                       if ".".join(parts[:n]) in known), None)
        rest = dotted.removeprefix(module or "").lstrip(".").split(".")[0]
        if module is None or rest and not rest.startswith("__") and not re.search(
                rf"^(?:def |class |async def )?{rest}\b|^from .* import .*\b{rest}\b|\"{rest}\"",
                known[module].read_text(), re.M):
            stale.append(dotted)
    return sorted(stale)


def test_every_file_and_module_named_in_a_docstring_or_readme_exists():
    # README.md's changelog names 0.1's modules on purpose: what a user of 0.1 changes.
    stale = {str(p.relative_to(ROOT)): found for p in named_texts()
             if (found := stale_names(p, p.read_text().split("\n## Changes\n")[0]))}
    assert stale == {}


def test_a_stale_name_is_found():
    """The planted bugs of the test above: the names of the old flat layout."""
    text = ("the decode stage (image_decode.py), see pipeline/ops/README.md, run "
            "shardflow.tools.bench_loader.main, shardflow.cli.main and pipeline.cli.main, not "
            "shardflow.image.loader.image_loader nor image/loader.py")
    assert stale_names(ROOT / "pipeline" / "image" / "x.py", text) == [
        "image_decode.py", "pipeline.cli", "pipeline/ops/README.md", "shardflow.cli.main"]


def figures() -> str:
    arrows = graph()
    per_folder = collections.Counter(str(p.parent.relative_to(ROOT)) for p in modules().values())
    lines = [f"modules: {len(arrows)}, arrows: {sum(map(len, arrows.values()))}, "
             f"circles: {len(circles(arrows))}"]
    if not circles(arrows):
        lines.append(f"longest import chain: {depth(arrows)} modules")
    lines += [f"  {folder}: {count}" for folder, count in sorted(per_folder.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    print(figures())
