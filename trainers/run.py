"""`fit`: drive a Trainer to its step count, logging metrics.jsonl and writing summary.json.

Each logging step appends one JSON object to metrics.jsonl: step, loss (the mean over the
window's steps), lr, samples_per_s (all ranks together), data_wait (rank 0's share of wall
time spent waiting for the next batch), skipped (samples all loaders dropped so far) and
skipped_steps (optimizer steps skipped for non-finite gradients so far: they still count as
steps, see loop.py).
After a resume, the steps between the checkpoint and the kill are logged again: the last
line of a step is the one that counts. summary.json holds the run's totals, the resolved device and
precision, and what was held out for evaluation; eval.jsonl the evaluation's metrics, one
line per evaluation (step, eval_loss, accuracy). Rank 0 also writes TensorBoard scalars
where tensorboard imports and, at the end, curves.png (curves.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardflow.errors import DataError
from shardflow.trainers import bottleneck, curves
from shardflow.trainers.distributed import gather, parameter_digest, sum_over_ranks
from shardflow.trainers.loop import Trainer, log_line

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], None]


class _Window:
    """Counters between two logging steps. The steps' losses stay on the device until
    `read` fetches them all at once: one host sync per log step (or checkpoint), not per
    step; a run that diverges is stopped there (Precision.check_loss)."""

    def __init__(self) -> None:
        self.start, self.samples, self.wait = time.perf_counter(), 0, 0.0
        self.pending: list[Any] = []  # device tensors of the steps not read yet
        self.losses: list[float] = []

    def read(self, trainer: Trainer) -> None:
        if self.pending:
            import torch

            values = torch.stack(self.pending).tolist()  # the host sync
            self.pending = []
            # Every rank must see the same non-finite steps: stopping a diverged run and
            # refusing a checkpoint are decided alike on every rank (saving is collective).
            bad = sum_over_ranks([float(v != v or abs(v) == float("inf")) for v in values],
                                 trainer.dist)
            for value, others in zip(values, bad, strict=True):
                trainer.precision.check_loss(value if not others else float("nan"))
            self.losses.extend(values)

    def record(self, step: int, lr: float, skipped: int) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {"step": step, "loss": sum(self.losses) / max(len(self.losses), 1), "lr": lr,
                "samples_per_s": self.samples / elapsed, "data_wait": self.wait / elapsed,
                "skipped": skipped}


def fit(trainer: Trainer, *, eval_loader: Any = None, held_out: str = "none",
        progress: Progress | None = None) -> dict[str, Any]:
    """Train to `cfg.steps` (resuming if the run folder has a checkpoint); evaluate; summarise."""
    cfg, started = trainer.cfg, time.perf_counter()
    resumed_at = trainer.step if trainer.resume() else None
    if resumed_at is not None and resumed_at >= cfg.steps:
        log.info("the run in %s already finished (step %d); nothing to do", cfg.run_dir,
                 resumed_at)
        return trainer.summary_so_far
    board = None
    if trainer.dist.is_main:
        board = curves.Board.open(cfg.run_dir, None if resumed_at is None else resumed_at + 1)
    try:
        last_loss = _train(trainer, _observed(progress, board))
        summary = _finish(trainer, eval_loader, held_out, last_loss, started, resumed_at, board)
    finally:
        if board is not None:
            board.close()
    if trainer.dist.is_main:
        _draw_curves(cfg.run_dir)
    return summary


def _train(trainer: Trainer, progress: Progress | None) -> Any:
    """The steps up to `cfg.steps`; the last loss (a device tensor) or None."""
    window, last_loss = _Window(), None
    while trainer.step < trainer.cfg.steps:
        waited_from, useful, batches = time.perf_counter(), 0, 0
        for batch in trainer.loader:
            batches += 1
            waited = time.perf_counter() - waited_from
            window.wait += waited
            trainer.wait_s += waited
            useful += bool(len(batch))
            loss = _one(trainer, batch, window)
            if loss is not None:
                last_loss = loss
                window = _after_step(trainer, window, progress)
                if trainer.step >= trainer.cfg.steps:
                    break
            waited_from = time.perf_counter()
        # A pass with no batch at all is a resume at the very end of an epoch (the next pass
        # starts the next epoch); batches that all came out empty mean the data is unusable.
        if batches and not useful:
            raise DataError("no-data", "a whole pass over the training data gave no usable "
                            "sample (all skipped?); see the loader's skip report")
    return last_loss


def _observed(progress: Progress | None, board: curves.Board | None) -> Progress | None:
    """`progress`, with each logged record also sent to TensorBoard."""
    if board is None:
        return progress

    def both(record: dict[str, Any]) -> None:
        board.train(record)
        if progress:
            progress(record)
    return both


def _draw_curves(run_dir: Path) -> None:
    """curves.png at the end of a run. A figure that cannot be drawn does not fail the run
    it shows: it is said, and tools/plot_run.py draws it later."""
    try:
        curves.draw(run_dir)
    except ImportError as err:
        log.info("no %s: %s", curves.PNG, err)
    except Exception as err:
        log.warning("%s not drawn (%s: %s); tools/plot_run.py %s draws it from %s",
                    curves.PNG, type(err).__name__, err, run_dir, curves.METRICS)


def _one(trainer: Trainer, batch: Any, window: _Window) -> Any:
    started = time.perf_counter()
    try:
        return _train_on(trainer, batch, window)
    finally:
        trainer.compute_s += time.perf_counter() - started


def _train_on(trainer: Trainer, batch: Any, window: _Window) -> Any:
    """The loss tensor when the optimizer stepped, else None."""
    if trainer.cfg.log_keys:
        log_line(trainer.cfg.run_dir / "keys.jsonl", {
            "rank": trainer.dist.rank, "step": trainer.step, "micro": trainer.micro,
            "epoch": trainer.loader.epoch, "keys": list(batch.keys)})
    if not _everyone_has_data(trainer, batch):
        return None  # every sample of this batch (or of another rank's) was skipped
    window.samples += len(batch)
    trainer.samples += len(batch)
    loss = trainer.micro_step(batch)
    if loss is not None:
        window.pending.append(loss)
    return loss


def _everyone_has_data(trainer: Trainer, batch: Any) -> bool:
    """Whether this micro-step trains. A batch can come out empty (all its samples skipped);
    under DDP every rank must then skip the step, since one rank's backward without the
    others' would pair its gradient all-reduce with their next one. The rest of the ranks'
    samples of that step are then not trained on: counted, and logged."""
    if trainer.vote is None:
        return bool(len(batch))
    # Rank 0's checkpoint clock rides along: the others send 1, so the minimum is rank 0's.
    late = int(trainer.late()) if trainer.dist.is_main else 1
    all_have, trainer.clock_late = (bool(v) for v in trainer.vote([int(bool(len(batch))), late]))
    if all_have:
        return True
    if len(batch):
        trainer.dropped_for_sync += len(batch)
        log.warning("rank %d: step %d skipped on every rank because another rank's batch was "
                    "all bad samples; %d samples of this rank's batch not trained on",
                    trainer.dist.rank, trainer.step, len(batch))
    return False


def _after_step(trainer: Trainer, window: _Window, progress: Progress | None) -> _Window:
    if trainer.due_for_checkpoint():
        window.read(trainer)  # a diverged run is stopped before it replaces good checkpoints
        trainer.save({"final_loss": window.losses[-1] if window.losses else None})
    if trainer.step % trainer.cfg.max_nonfinite == 0:
        window.read(trainer)  # a diverged run stops within max_nonfinite steps of diverging
    if trainer.step % trainer.cfg.log_every and trainer.step != trainer.cfg.steps:
        return window
    window.read(trainer)
    # Every rank reaches this step: sum samples and skips over ranks, rank 0 writes.
    window.samples, skipped = (int(v) for v in sum_over_ranks(
        [window.samples, trainer.loader.skipped_samples()], trainer.dist))
    if not trainer.dist.is_main:
        return _Window()
    record = window.record(trainer.step, trainer.optimizer.param_groups[0]["lr"], skipped)
    # Steps skipped for non-finite gradients so far (counted on the device: read here).
    record["skipped_steps"] = trainer.bad_steps + trainer.precision.skipped_steps
    log_line(trainer.cfg.run_dir / "metrics.jsonl", record)
    if progress:
        progress(record)
    return _Window()


def _classes_unseen(trainer: Trainer) -> list[int]:
    """Classes of the held-out data that no training step of this run met (every rank's
    counted): an accuracy on them says nothing of learning, so it is said, not averaged in
    silently. Empty for a task without class counts."""
    counts = getattr(trainer.task, "class_counts", None)
    found = [counts(which) for which in ("train", "eval")] if counts is not None else []
    if not found or any(c is None for c in found):
        return []
    trained, evaluated = (sum_over_ranks(c.tolist(), trainer.dist) for c in found)
    unseen = [c for c, (t, e) in enumerate(zip(trained, evaluated, strict=True)) if e and not t]
    if unseen and trainer.dist.is_main:
        share = sum(evaluated[c] for c in unseen) / max(1, sum(evaluated))
        log.warning("%.0f%% of the held-out samples are of classes training never met (%s): "
                    "their accuracy is chance at best. Shuffle at conversion (shardflow "
                    "convert --shuffle-seed 0), so that every shard holds every class, or "
                    "give --eval-data", 100 * share, ", ".join(map(str, unseen[:10])))
    return unseen


def _traffic(trainer: Trainer) -> dict[str, Any] | None:
    """The gradients' bytes per step (trainers/compression.py), None for one process."""
    from shardflow.trainers.distributed import compression_of

    comp = compression_of(trainer.task.model)
    return None if comp is None else comp.bytes_per_step()


def _finish(trainer: Trainer, eval_loader: Any, held_out: str, last_loss: Any,
            started: float, resumed_at: int | None, board: curves.Board | None
            ) -> dict[str, Any]:
    wall = time.perf_counter() - started
    last_loss = float("nan") if last_loss is None else float(last_loss)
    metrics = trainer.evaluate(eval_loader) if eval_loader is not None else {}
    if trainer.dist.is_main and curves.evaluated(metrics):
        log_line(trainer.cfg.run_dir / curves.EVALS, {"step": trainer.step, **metrics})
        if board is not None:
            board.evaluation(trainer.step, metrics)
    digests = gather(parameter_digest(trainer.task.model), trainer.dist)
    samples, skipped, unknown = sum_over_ranks(
        [trainer.samples, trainer.loader.skipped_samples(),
         trainer.loader.skipped_of_unknown_size()], trainer.dist)
    unseen = _classes_unseen(trainer) if eval_loader is not None else []
    summary = {
        "steps": trainer.step, "final_loss": last_loss, **metrics,
        "steps_this_run": trainer.step - (resumed_at or 0),
        "eval_classes_unseen_in_training": unseen,
        "samples_per_s": samples / max(wall, 1e-9), "wall_s": wall,
        "data_wait": trainer.wait_s / max(wall, 1e-9),
        "device": str(trainer.device), "precision": trainer.precision.name,
        "backend": getattr(trainer.loader, "backend", None),  # "dali" or "portable"
        "held_out": held_out, "resumed_at_step": resumed_at,
        "skipped_samples": int(skipped), "skipped_shards_of_unknown_size": int(unknown),
        "nonfinite_skipped_steps": trainer.bad_steps,
        "samples_left_out_with_an_empty_rank": int(sum_over_ranks(
            [trainer.dropped_for_sync], trainer.dist)[0]),
        "fp16_skipped_steps": trainer.precision.skipped_steps,
        "setup": trainer.setup(),
        "world_size": trainer.dist.world_size, "parameter_digests": digests,
        "grad_compression": _traffic(trainer),
        "bottleneck": bottleneck.report(trainer.wait_s, trainer.compute_s, trainer.loader),
    }
    if trainer.dist.is_main:
        (trainer.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
