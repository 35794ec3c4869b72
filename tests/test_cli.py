"""The `shardflow` command (tools/main.py): its subcommands, help, version and exit
codes, as installed in this venv; and the wheel on its own, installed outside the checkout
and run from another folder (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_image_folder

import shardflow as shardflow_package
from shardflow.tools.main import COMMANDS

SHARDFLOW = Path(sys.executable).parent / "shardflow"  # the console script pip installed
VERSION = re.search(r'(?m)^version = "(.+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def shardflow(*args: object, exe: Path = SHARDFLOW, cwd: Path | None = None,
              env: dict[str, str] | None = None, timeout: float = 300
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_command_is_installed_names_its_version_and_every_subcommand():
    assert SHARDFLOW.exists(), "make install puts the console script in the venv"
    version = shardflow("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"shardflow {VERSION}"
    assert shardflow_package.__version__ == VERSION
    top = shardflow("--help")
    assert top.returncode == 0
    assert all(name in top.stdout for name in COMMANDS)
    same = subprocess.run([sys.executable, "-m", "shardflow", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert same.returncode == 0 and same.stdout == top.stdout


def test_an_unknown_subcommand_or_none_is_a_usage_error_naming_the_choices():
    for args in (["bogus"], []):
        proc = shardflow(*args)
        assert proc.returncode == 2
        assert "convert" in proc.stderr and "train" in proc.stderr


def test_errors_keep_their_exit_codes_through_the_command(tmp_path):
    missing = shardflow("convert", "imagefolder", tmp_path / "nothing", tmp_path / "o")
    assert missing.returncode == 2 and "nothing" in missing.stderr
    assert "free space" not in missing.stderr  # the full-disk hint is for other OS errors
    src = make_image_folder(tmp_path / "src", classes=1, per_class=2)
    (src / "class0" / "zz_bad.jpg").write_bytes(b"not an image")
    bad = shardflow("convert", "imagefolder", src, tmp_path / "o", "--workers", 1)
    assert bad.returncode == 1 and "zz_bad" in bad.stderr and "bad-image" in bad.stderr
    good = shardflow("index", tmp_path / "nothing-here")
    assert good.returncode == 2, good.stderr


# -- the wheel on its own ---------------------------------------------------------------------

@pytest.mark.slow
def test_the_wheel_alone_installs_one_package_whose_every_command_runs(wheel_site, tmp_path):
    """The installed wheel, outside the checkout: one top-level package, every subcommand's
    help (a module left out of the wheel fails here), its package data, the GPU check and
    the benchmark. Converting, verifying and training from the wheel are tests/test_demo.py's
    whole run of `shardflow demo`."""
    env = {**os.environ, "PYTHONPATH": str(wheel_site)}
    exe = wheel_site / "bin" / "shardflow"
    away = tmp_path / "elsewhere"  # not the checkout: nothing may come from it
    away.mkdir()
    # One import name: nothing else at the top of the install but its metadata and command.
    installed = {p.name for p in wheel_site.iterdir() if not p.name.endswith(".dist-info")}
    assert installed == {"shardflow", "bin"}, installed
    # A project with a pipeline.py and a trainers/ of its own imports both theirs and ours.
    (away / "pipeline.py").write_text("MINE = 'the user pipeline.py'\n")
    (away / "trainers").mkdir()
    (away / "trainers" / "__init__.py").write_text("MINE = 'the user trainers/'\n")
    where = subprocess.run([sys.executable, "-c", "import pipeline, trainers, shardflow; "
                            "from shardflow import image_loader, text_loader, ShardDataset; "
                            "from shardflow.trainers.loop import Trainer; "
                            "import shardflow.tools.main; print(pipeline.MINE); "
                            "print(trainers.MINE); print(shardflow.__file__); "
                            "print(shardflow.trainers.__file__); print(shardflow.tools.__file__)"],
                           capture_output=True, text=True, cwd=away, env=env, check=True)
    mine, theirs = where.stdout.splitlines()[:2], where.stdout.splitlines()[2:]
    assert mine == ["the user pipeline.py", "the user trainers/"], where.stdout
    assert len(theirs) == 3 and all(p.startswith(str(wheel_site)) for p in theirs), theirs

    def run(*args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = shardflow(*args, exe=exe, cwd=away, env=env, timeout=timeout)
        assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
        return proc

    assert run("--version").stdout.strip() == f"shardflow {VERSION}"
    for name in COMMANDS:
        assert run(name, "--help").stdout.startswith(f"usage: shardflow {name} ")
    run("recipes", away / "cluster")  # package data: in the wheel
    assert (away / "cluster" / "slurm_train.sbatch").read_bytes() == \
        (ROOT / "tools" / "cluster" / "slurm_train.sbatch").read_bytes()
    run("gpu-check", "--dry-run", "--only", "delivery", "--json", away / "gpu.json")
    report = json.loads((away / "gpu.json").read_text())  # its part ran as a subprocess
    assert report["finished"] is True and report["parts"]["delivery"]["status"] == "ok"
    run("bench", "--images", 64, "--repeats", 1, "--batch-size", 16, "--work",
        away / "bench-work", "--json", away / "bench.json", timeout=600)
    figures = json.loads((away / "bench.json").read_text())
    assert figures["images_per_s"]["shardflow"] > 0


def test_the_cli_reference_is_the_parsers_own_help():
    """docs/cli.md is made from the parsers (tools/reference.py): an option added,
    renamed or described anew without regenerating it fails here."""
    from shardflow.tools import reference

    current = (ROOT / "docs" / "cli.md").read_text()
    made = reference.reference()
    assert made == current, ("docs/cli.md is stale: python -m shardflow.tools.reference > "
                             "docs/cli.md")
    for name in COMMANDS:
        assert f"## shardflow {name}\n" in made and f"usage: shardflow {name} " in made
    assert "### shardflow convert imagefolder" in made and "--max-side" in made


def test_data_writes_the_built_in_datasets_and_refuses_a_folder_in_use(tmp_path):
    made = shardflow("data", tmp_path / "s", "--only", "images,text")
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["images", "text"]
    assert len(list((tmp_path / "s" / "images").iterdir())) == 10  # class folders
    again = shardflow("data", tmp_path / "s", "--only", "images")
    assert again.returncode == 2 and "not empty" in again.stderr
    unknown = shardflow("data", tmp_path / "t", "--only", "videos")
    assert unknown.returncode == 2 and "videos" in unknown.stderr and "clicks" in unknown.stderr


def test_recipes_writes_the_cluster_recipes_and_keeps_edited_ones(tmp_path):
    shipped = ROOT / "tools" / "cluster"
    made = shardflow("recipes", tmp_path / "cluster")
    assert made.returncode == 0, made.stderr
    names = sorted(p.name for p in shipped.iterdir())
    assert {"slurm_train.sbatch", "pytorchjob.yaml", "convert_job.yaml", "README.md"} <= set(names)
    assert all((tmp_path / "cluster" / n).read_bytes() == (shipped / n).read_bytes()
               for n in names)
    (tmp_path / "cluster" / "pytorchjob.yaml").write_text("# edited")
    again = shardflow("recipes", tmp_path / "cluster")
    assert again.returncode == 2 and "pytorchjob.yaml" in again.stderr
    assert (tmp_path / "cluster" / "pytorchjob.yaml").read_text() == "# edited"
    assert shardflow("recipes", tmp_path / "cluster", "--overwrite").returncode == 0
    assert (tmp_path / "cluster" / "pytorchjob.yaml").read_bytes() == \
        (shipped / "pytorchjob.yaml").read_bytes()
