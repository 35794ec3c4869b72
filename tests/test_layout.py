"""The package layout holds its rules (pipeline/README.md): no import circles, the benchmark
imported only from beside it, the trainers never touching the conversion side, a small root,
short functions. Run as a script for the figures:

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
PACKAGES = ("pipeline", "trainers")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


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
    for folder in (*PACKAGES, "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        rows.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    return rows


def test_no_import_circles():
    assert circles(graph()) == []


def test_only_the_commands_and_tests_import_the_benchmark():
    commands = ("pipeline.bench", "pipeline.cli")
    offenders = {name: sorted(t for t in targets if t.startswith("pipeline.bench"))
                 for name, targets in graph().items() if not name.startswith(commands)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_trainers_and_the_read_side_never_import_the_conversion_side():
    # The commands of trainers/cli (demo, soak) make their data first: they compose both.
    write_side = ("pipeline.convert", "pipeline.shards.writer", "pipeline.shards.verify")
    readers = ("trainers", "pipeline.loading", "pipeline.image", "pipeline.text",
               "pipeline.pointcloud", "pipeline.tabular", "pipeline.samples")
    offenders = {name: sorted(t for t in targets if t.startswith(write_side))
                 for name, targets in graph().items()
                 if name.startswith(readers) and not name.startswith("trainers.cli")}
    assert {k: v for k, v in offenders.items() if v} == {}


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


def unnamed(package: str, readme: str) -> list[str]:
    """Modules of `package` its README does not name where their folder is named: five
    loader.py in five folders need five mentions, each beside its own folder (the same unit:
    its entry, paragraph, or the section headed by the folder)."""
    units = readme_units(readme)
    missing = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name == "__init__.py" or "builtin" in path.parts:
            continue
        folder = "/".join(path.relative_to(ROOT / package).parts[:-1])
        folder = f"{folder}/" if folder else ""
        if not any(path.name in body and (heading == folder or folder in body)
                   for heading, body in units):
            missing.append(f"{folder}{path.name}")
    return missing


def test_every_module_is_named_in_its_package_readme():
    for package in PACKAGES:
        missing = unnamed(package, (ROOT / package / "README.md").read_text())
        assert missing == [], f"{package}/README.md does not name {missing}"


def test_a_module_named_only_beside_another_folder_is_unnamed():
    """The planted bug of the test above: text/loader.py dropped from its entry, while
    image/ (and others) still name a loader.py."""
    readme = (ROOT / "pipeline" / "README.md").read_text()
    planted = readme.replace("text/        config.py (TextConfig) -> loader.py (document checks)",
                             "text/        config.py (TextConfig) -> (document checks)")
    assert planted != readme
    assert unnamed("pipeline", planted) == ["text/loader.py"]


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
