"""The markers say what a test needs: a `gpu` test that decodes on the GPU (decode="gpu":
DALI's mixed decode or graph) must also be marked `dali`, so that `pytest -m gpu` on a CUDA
machine without DALI (the GPU machine we test on has none) skips it instead of failing.
Read from the test files' syntax, so it holds on every machine, GPU or not."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _markers(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for deco in fn.decorator_list:
        node = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "mark":
            names.add(node.attr)
    return names


def _decodes_on_the_gpu(fn: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.keyword) and node.arg == "decode" and
               isinstance(node.value, ast.Constant) and node.value.value == "gpu"
               for node in ast.walk(fn))


def gpu_tests_needing_dali_unmarked(folder: Path = TESTS) -> list[str]:
    """`file::test` of every gpu-marked test that asks for decode="gpu" without `dali`."""
    found = []
    for path in sorted(folder.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                marks = _markers(node)
                if "gpu" in marks and "dali" not in marks and _decodes_on_the_gpu(node):
                    found.append(f"{path.name}::{node.name}")
    return found


def test_every_gpu_decode_test_is_marked_dali() -> None:
    assert gpu_tests_needing_dali_unmarked() == []


def test_the_check_finds_an_unmarked_gpu_decode_test(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    load(decode='gpu')\n\n"
        "@pytest.mark.gpu\n@pytest.mark.dali\ndef test_y():\n    load(decode='gpu')\n")
    assert gpu_tests_needing_dali_unmarked(tmp_path) == ["test_planted.py::test_x"]
