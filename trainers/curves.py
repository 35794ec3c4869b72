"""A run's curves: TensorBoard scalars while it trains, and curves.png from its logs.

`Board` writes rank 0's scalars into RUN/tensorboard when `tensorboard` imports (through
`torch.utils.tensorboard`): train/loss, train/lr, train/samples_per_s, train/data_wait_share
at each logged step, eval/<metric> (eval/loss, eval/accuracy; segmentation's eval/miou and
eval/iou_<class>) after each evaluation.
`draw` renders curves.png from metrics.jsonl and eval.jsonl alone (matplotlib's Agg canvas,
written atomically): `fit` draws it at the end of a run, `tools/plot_run.py` at any time, also
while a run is going or after it was killed. Steps logged again after a resume count once
(the last line of a step). Its evaluation panel plots every metric but the counts and the
per-class IoUs: segmentation's miou beside its accuracy.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

from shardflow.atomic import write_atomic

log = logging.getLogger(__name__)

METRICS, EVALS, PNG, BOARD = "metrics.jsonl", "eval.jsonl", "curves.png", "tensorboard"
# evaluation figures that count (0, not NaN, when none): not plotted
COUNTS = ("scored_rows", "labelled_points", "unpredicted_points")
PER_CLASS = "iou_"  # segmentation's IoU of each class: in eval.jsonl, not in the panel (miou is)
TRAIN_SCALARS = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s",
                 "data_wait": "train/data_wait_share"}


class Board:
    """TensorBoard scalars of one run (rank 0 only). `open` gives None where TensorBoard
    does not import: the run goes on without it, saying so once."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, run_dir: Path, purge_step: int | None = None) -> Board | None:
        """`purge_step`: the first step after a resume; the events a killed run logged from
        it on are hidden (they are logged again)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as err:  # absent, or broken (a protobuf it cannot use, say)
            log.info("no TensorBoard scalars: tensorboard does not import (%s); pip install "
                     "tensorboard (in the dev extra) to get them in %s", err, run_dir / BOARD)
            return None
        return cls(SummaryWriter(str(run_dir / BOARD), purge_step=purge_step, flush_secs=30))

    def train(self, record: dict[str, Any]) -> None:
        for key, tag in TRAIN_SCALARS.items():
            if key in record:
                self.writer.add_scalar(tag, float(record[key]), record["step"])

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"eval/{name.removeprefix('eval_')}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close; also on the way out of a failed run, whose error it never hides."""
        try:
            self.writer.close()  # flushes first
        except Exception as err:
            log.warning("TensorBoard scalars may be incomplete: %s", err)


def read_records(path: Path) -> list[dict[str, Any]]:
    """One record per step, the last line of a step counting, by step. A last line cut short
    (a run killed while writing it, or being written now) is left out."""
    lines = path.read_text().splitlines() if path.exists() else []
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a record of a step: {line[:80]!r}") from None
        by_step[step] = record
    return [by_step[step] for step in sorted(by_step)]


def draw(run_dir: Path, out: Path | None = None) -> tuple[Path, int]:
    """Render RUN/curves.png (or `out`) from RUN/metrics.jsonl and RUN/eval.jsonl; returns
    where it went and how many logged steps it shows. Needs matplotlib (ImportError)."""
    if not (run_dir / METRICS).is_file():
        raise FileNotFoundError(f"{run_dir}: no {METRICS} here (not a run folder of "
                                "tools/train.py, or a run that has not started)")
    records = read_records(run_dir / METRICS)
    if not records:
        raise ValueError(f"{run_dir / METRICS}: no step logged yet; try again after "
                         "--log-every steps")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("curves.png needs matplotlib, a dependency of shardflow: pip "
                          "install matplotlib") from None
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    _panels(fig, records, read_records(run_dir / EVALS))
    fig.suptitle(f"{run_dir.resolve().name}: {len(records)} logged steps, up to step "
                 f"{records[-1]['step']}")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    out = out or run_dir / PNG
    write_atomic(out, png.getvalue())
    return out, len(records)


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0
            ) -> tuple[list[int], list[float]]:
    steps = [int(r["step"]) for r in records if key in r]
    values = [float(r[key]) * scale for r in records if key in r]
    return steps, values


def _panels(fig: Any, records: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    (loss, metric), (speed, wait) = fig.subplots(2, 2, sharex=True)
    style = {"marker": "." if len(records) <= 60 else None}
    loss.plot(*_series(records, "loss"), label="train (mean over the logging window)", **style)
    if any("eval_loss" in e for e in evals):
        loss.plot(*_series(evals, "eval_loss"), "o--", label="eval")
    loss.legend()
    loss.set(title="loss", ylabel="loss")
    names = sorted({k for e in evals for k in e if not k.startswith(PER_CLASS)}
                   - {"step", "eval_loss", *COUNTS})
    for name in names:
        metric.plot(*_series(evals, name), "o-", label=name)
    if names:
        metric.legend()
    else:
        metric.text(0.5, 0.5, "no evaluation logged", ha="center", va="center",
                    transform=metric.transAxes, color="gray")
    # Accuracy, mIoU and AUC are fractions: the whole 0..1 axis, so that 0.02 of change
    # does not fill the panel; an unbounded metric (none logged yet) keeps its own range.
    bounded = all(0 <= v <= 1 for name in names for v in _series(evals, name)[1])
    metric.set(title="evaluation", ylabel="metric", **({"ylim": (0, 1)} if bounded and names
                                                       else {}))
    speed.plot(*_series(records, "samples_per_s"), color="tab:green", **style)
    speed.set(title="throughput (all ranks)", ylabel="samples/s", xlabel="step", ylim=(0, None))
    wait.plot(*_series(records, "data_wait", 100.0), color="tab:red", **style)
    wait.set(title="waiting for data (rank 0)", ylabel="% of wall time", xlabel="step",
             ylim=(0, 100))
    wait.xaxis.get_major_locator().set_params(integer=True)  # steps (the x axis is shared)


def evaluated(metrics: dict[str, float]) -> bool:
    """Whether an evaluation measured anything (no held-out sample gives all NaN)."""
    return any(not math.isnan(v) for k, v in metrics.items() if k not in COUNTS)
