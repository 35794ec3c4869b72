"""Curves of a run: TensorBoard scalars and curves.png from a real tools/train.py run (tiny
built-in images, CPU, the portable backend), read back with tensorboard's own reader;
tools/plot_run.py redraws the figure; a run without tensorboard still draws it."""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_tool

from shardflow.builtin import make_image_folder
from shardflow.trainers import curves
from shardflow.trainers.run import _draw_curves

STEPS, LOG_EVERY = 6, 2
TRAIN_TAGS = {"train/loss", "train/lr", "train/samples_per_s", "train/data_wait_share"}

# Runs tools/train.py in a Python where tensorboard (and torch's wrapper of it) does not
# import, as an absent package would not; argv: train.py's arguments.
NO_TENSORBOARD = """
import importlib.abc, runpy, sys
class NoTensorBoard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "tensorboard" or name.startswith("torch.utils.tensorboard"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, NoTensorBoard())
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def train_args(shards: Path, out: Path) -> list[object]:
    return ["--task", "image", "--data", shards, "--out", out, "--steps", STEPS,
            "--log-every", LOG_EVERY, "--batch-size", 8, "--size", 24, "--device", "cpu",
            "--backend", "portable", "--quiet"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("curves")
    make_image_folder(root / "src", per_class=6, size=32)
    run_tool("make_shards", "imagefolder", root / "src", root / "shards", "--max-count", 20,
             "--shuffle-seed", 0, check=True)
    return root / "shards"


@pytest.fixture(scope="module")
def run(shards: Path) -> Path:
    out = shards.parent / "run"
    run_tool("train", *train_args(shards, out), check=True)
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    assert data[-8:-4] == b"IEND"  # the whole file, not a cut one
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_run_ends_with_curves_png(run):
    width, height = png_size(run / "curves.png")
    assert width > 600 and height > 400
    assert 20_000 < (run / "curves.png").stat().st_size < 2_000_000
    assert not list(run.glob(".*.tmp"))
    from PIL import Image

    with Image.open(run / "curves.png") as img:
        img.verify()


def test_tensorboard_has_each_scalar_once_per_logged_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    assert set(board.Tags()["scalars"]) == TRAIN_TAGS | {"eval/loss", "eval/accuracy"}
    logged = records(run)
    assert [r["step"] for r in logged] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for key, tag in curves.TRAIN_SCALARS.items():
        events = board.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in logged], tag
        assert [e.value for e in events] == pytest.approx([r[key] for r in logged], rel=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    for tag, key in (("eval/loss", "eval_loss"), ("eval/accuracy", "accuracy")):
        (event,) = board.Scalars(tag)
        assert event.step == STEPS and event.value == pytest.approx(summary[key], rel=1e-6)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals == [{"step": STEPS, "eval_loss": summary["eval_loss"],
                      "accuracy": summary["accuracy"]}]


def test_plot_run_redraws_the_figure_train_wrote(run, tmp_path):
    elsewhere = tmp_path / "sub" / "again.png"
    proc = run_tool("plot_run", run, "--out", elsewhere, check=True)
    assert f"{STEPS // LOG_EVERY} logged steps" in proc.stdout
    assert elsewhere.read_bytes() == (run / "curves.png").read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("curves.png", "*.pt"))
    run_tool("plot_run", copy, check=True)
    assert png_size(copy / "curves.png") == png_size(run / "curves.png")


def test_plot_run_draws_a_killed_run(run, tmp_path):
    """No summary, no eval, steps logged again after a resume, a last line cut short."""
    killed = tmp_path / "killed"
    killed.mkdir()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    text = "\n".join([*lines[:2], lines[1], lines[2][:30]])  # kill while writing step 6
    (killed / "metrics.jsonl").write_text(text)
    assert [r["step"] for r in curves.read_records(killed / "metrics.jsonl")] == [2, 4]
    proc = run_tool("plot_run", killed, check=True)
    assert "2 logged steps" in proc.stdout
    png_size(killed / "curves.png")


@pytest.mark.parametrize("content", [None, "", "{not json\n{\"step\": 2}\n",
                                     "[1, 2]\n{\"step\": 2}\n"],
                         ids=["no-metrics", "no-step-yet", "damaged", "not-a-step"])
def test_plot_run_fails_cleanly_without_usable_metrics(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    proc = run_tool("plot_run", tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and "metrics.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "curves.png").exists()
    missing = run_tool("plot_run", tmp_path / "nothing-here")
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr


def test_without_tensorboard_the_run_still_draws_its_curves(shards, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", NO_TENSORBOARD, str(ROOT / "tools"),
           str(ROOT / "tools" / "train.py"), *map(str, train_args(shards, out))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no TensorBoard scalars" in proc.stderr and "pip install tensorboard" in proc.stderr
    assert not (out / "tensorboard").exists()
    png_size(out / "curves.png")
    assert (out / "summary.json").exists()


def test_without_matplotlib_the_end_of_a_run_says_so(run, tmp_path, monkeypatch, caplog):
    shutil.copy(run / "metrics.jsonl", tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with caplog.at_level(logging.INFO, logger="shardflow.trainers"):
        _draw_curves(tmp_path)  # what fit does at the end of a run
    assert "pip install matplotlib" in caplog.text
    assert not (tmp_path / "curves.png").exists()


def test_a_resumed_run_hides_the_steps_it_logs_again(tmp_path):
    """Killed after logging steps 1-4, resumed from a checkpoint at step 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = curves.Board.open(tmp_path)
    assert first is not None
    for step in (1, 2, 3, 4):
        first.train({"step": step, "loss": float(step)})
    first.close()
    again = curves.Board.open(tmp_path, purge_step=3)
    assert again is not None
    for step in (3, 4, 5):
        again.train({"step": step, "loss": 10.0 * step})
    again.evaluation(5, {"eval_loss": 1.5, "accuracy": math.nan})
    again.close()
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == \
        [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert [e.value for e in board.Scalars("eval/loss")] == [1.5]


def test_the_axes_tell_the_truth():
    """An accuracy stuck at 0 is drawn on 0..1, not on -0.04..0.04; the benchmark's memory
    axis starts at 0, so a 1% change looks like one."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    records = [{"step": s, "loss": 2.0 - s / 10, "samples_per_s": 50.0, "data_wait": 0.1}
               for s in range(5)]
    fig = Figure()
    curves._panels(fig, records, [{"step": 4, "eval_loss": 2.3, "accuracy": 0.0}])
    assert fig.axes[1].get_ylim() == (0.0, 1.0)
    fig = Figure()
    curves._panels(fig, records, [{"step": 4, "eval_loss": 2.3, "perplexity": 40.0}])
    assert fig.axes[1].get_ylim()[1] > 1  # an unbounded metric keeps its range


def test_the_bench_memory_axis_starts_at_zero(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from shardflow.tools import bench_loader

    drawn: list = []
    real = Figure.savefig

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)  # plt.subplots makes a Figure
    result = {"images": 800, "batch_size": 64, "threads": 2, "time_to_first_batch_s": 0.3,
              "images_per_s": {"shardflow": 1200.0, "torchvision-style uint8": 900.0},
              "rss_mb_after_each_epoch": [2613.0, 2630.0, 2643.0]}
    bench_loader.plot(result, tmp_path / "bench.png")
    memory = drawn[-1].axes[-1]
    assert memory.get_ylim()[0] == 0 and (tmp_path / "bench.png").stat().st_size > 1000
