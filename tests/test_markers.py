"""The markers say what a test needs: a `gpu` test that decodes on the GPU (decode="gpu":
DALI's mixed decode or graph) must also be marked `dali`, so that `pytest -m gpu` on a CUDA
machine without DALI (the GPU machine we test on has none) skips it instead of failing.
Read from the test files' syntax, so it holds on every machine, GPU or not. A test that asks
for DALI through its parameters (a parametrized fixture too, under any name) gets the marker
from conftest.py at collection: shown on planted tests, run by pytest in a subprocess."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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


# Planted tests: the DALI ones fail if they ever run; conftest.py is the project's, loaded
# under another name (PLANTED_CUDA=1 makes its gpu_available() say yes, as on a GPU machine).
PLANTED_CONFTEST = f"""
import importlib.util
import os

spec = importlib.util.spec_from_file_location("project_conftest", {str(TESTS / "conftest.py")!r})
project = importlib.util.module_from_spec(spec)
spec.loader.exec_module(project)
if os.environ.get("PLANTED_CUDA"):
    project.gpu_available = lambda: True
pytest_collection_modifyitems = project.pytest_collection_modifyitems


def pytest_configure(config):
    for marker in ("gpu", "dali"):
        config.addinivalue_line("markers", marker)
"""

PLANTED_TESTS = """
import pytest


@pytest.fixture(params=["portable", "dali"])
def engine(request):
    return request.param


@pytest.mark.gpu
def test_through_a_fixture(engine):
    assert engine != "dali", "ran without DALI"


@pytest.mark.gpu
@pytest.mark.parametrize("resize_on", ["torch", "dali"])
def test_under_another_name(resize_on):
    assert resize_on != "dali", "ran without DALI"


@pytest.mark.gpu
@pytest.mark.parametrize("backend, decode", [("portable", "cpu"), ("auto", "gpu")])
def test_decoding_on_the_gpu(backend, decode):
    assert decode != "gpu", "ran without DALI"
"""

WITHOUT_DALI = {"test_through_a_fixture[portable]", "test_under_another_name[torch]",
                "test_decoding_on_the_gpu[portable-cpu]"}


def _pytest(folder: Path, *args: str, nodali: bool = False, cuda: bool = False
            ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PLANTED_CUDA": "1" if cuda else ""}
    if nodali:
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "nodali"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), *args, str(folder)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_test_asking_for_dali_by_its_parameters_is_marked_and_skips_without_it(
        tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(PLANTED_CONFTEST)
    (tmp_path / "test_planted.py").write_text(PLANTED_TESTS)
    listed = _pytest(tmp_path, "-q", "--collect-only", "-m", "gpu and not dali")
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    names = {line.split("::")[-1] for line in listed.stdout.splitlines() if "::" in line}
    assert names == WITHOUT_DALI  # on any machine, DALI there or not
    # -m gpu on a CUDA machine without DALI: the other three skip, none fails
    ran = _pytest(tmp_path, "-q", "-rs", "-m", "gpu", nodali=True, cuda=True)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "3 passed, 3 skipped" in ran.stdout and "needs nvidia.dali" in ran.stdout
