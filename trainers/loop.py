"""The training loop: batches from a Loader -> Task -> the AMP step -> metrics, checkpoints.

    for each batch:  wait for data (timed) -> forward under autocast -> backward (scaled for
    fp16); every `grad_accum` batches: unscale -> clip -> optimizer step -> zero -> lr step
    -> log every `log_every` steps -> checkpoint every `checkpoint_every` steps or minutes

Running the same command again resumes from the newest valid checkpoint in the run folder:
model, optimizer, precision (scaler), step, loader position and RNG states, so the steps
after a resume are the steps an uninterrupted run would have taken.

`step` counts optimizer steps taken, applied or skipped: a step whose gradients were not
finite (fp16's overflows, a NaN in bf16/fp32) is skipped inside the fused optimizer and still
counts, so `step` always says how much data was consumed (checkpoints, resume, --steps), and
the learning-rate schedule follows it, as torch's own AMP recipes let theirs advance on the
steps GradScaler skips. Counting only applied steps would need the skip flag on the host
every step (the sync the fused step avoids). The skips are counted instead, on the device:
`fp16_skipped_steps` and `nonfinite_skipped_steps` in summary.json, `skipped_steps` in each
metrics.jsonl record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from shardflow.loading.agreement import rank_vote
from shardflow.trainers import checkpoint
from shardflow.trainers.distributed import (
    DistInfo,
    compression_of,
    distributed_module,
    eval_barrier,
    gather,
    gather_to_main,
    is_compiled,
    sum_over_ranks,
    unwrap,
    wait_group,
)
from shardflow.trainers.offload import OffloadedOptimizer
from shardflow.trainers.precision import Precision, PrecisionName
from shardflow.trainers.schedule import warmup_cosine
from shardflow.trainers.task import EvalTotals, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Everything about the optimization; validated with messages that name the option."""

    run_dir: Path
    steps: int
    lr: float = 3e-3
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.05
    momentum: float = 0.9
    warmup: int = 20
    grad_accum: int = 1
    clip: float | None = 1.0
    precision: PrecisionName = "auto"
    log_every: int = 10
    checkpoint_every: int = 100
    checkpoint_minutes: float = 5.0
    keep: int = 3
    seed: int = 0
    max_nonfinite: int = 20
    offload_optimizer: bool = False  # master weights + optimizer state in host memory
    log_keys: bool = False  # write every step's sample keys to keys.jsonl (audits, tests)

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "log_every", "checkpoint_every", "keep",
                     "max_nonfinite"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr}: must be a finite number > 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}: choose adamw or sgd")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip={self.clip}: must be > 0, or None for no clipping")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r}: must be an integer >= 0")
        if not (np.isfinite(self.checkpoint_minutes) and self.checkpoint_minutes > 0):
            raise ValueError(f"checkpoint_minutes={self.checkpoint_minutes}: must be a finite "
                             "number > 0")
        for name in ("weight_decay", "momentum"):
            if not (np.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)}: must be a finite number >= 0")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> Any:
    """AdamW or SGD over the model's parameters: torch's fused implementation wherever it
    exists for them (CUDA, and the CPU in torch >= 2.4), since only a fused optimizer takes
    GradScaler's `found_inf` / `grad_scale` on the device and so steps without a host sync
    (see `Trainer._device_step`); else torch's own choice. Offloaded: over host copies, with
    a foreach host implementation (one vectorised pass over all master weights)."""
    if cfg.offload_optimizer:
        return OffloadedOptimizer(model, lambda masters: _build(masters, cfg, foreach=True))
    params = list(model.parameters())
    if fused_supported(params):
        return _build(params, cfg, fused=True)
    log.info("no fused %s for these parameters: torch's default implementation, whose "
             "steps read their finiteness flag on the host", cfg.optimizer)
    return _build(params, cfg)


def fused_supported(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch has fused optimizer kernels for every parameter (floating point, on a
    device type it has them for). torch checks only at the first step: this asks first."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without fused kernels
        return False
    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p)
                                for p in params)


def _build(params: Any, cfg: TrainConfig, fused: bool | None = None,
           foreach: bool | None = None) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        sgd = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay, foreach=foreach, fused=fused)
        if fused and cfg.momentum:
            _zero_momentum(sgd)
        return sgd
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             foreach=foreach, fused=fused)


def _zero_momentum(sgd: torch.optim.SGD) -> None:
    """Momentum buffers of zeros before the first step: torch's fused SGD allocates them
    uninitialised at its first step and, when that step is skipped (`found_inf`), keeps the
    garbage as momentum. Zeros give exactly its first step's buffer (0 * m + grad)."""
    for group in sgd.param_groups:
        for p in group["params"]:
            sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)


def rng_state() -> dict[str, Any]:
    """Every global RNG, whole, as tensors, lists and numbers (what weights_only accepts)."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": [version, list(internal), gauss],
            "numpy": [torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos),
                      int(has_gauss), float(cached)]}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class Trainer:
    """The loop's explicit state: task, loader, optimizer, precision, step, counters."""

    def __init__(self, task: Task, loader: Any, cfg: TrainConfig, device: torch.device,
                 fingerprint: dict[str, Any], dist: DistInfo | None = None) -> None:
        self.task, self.loader, self.cfg, self.device = task, loader, cfg, device
        self.dist = dist or DistInfo()
        self.optimizer = make_optimizer(task.model, cfg)
        self.precision = Precision(cfg.precision, device, cfg.max_nonfinite,
                                   offloaded=cfg.offload_optimizer)
        # What a checkpoint must match to continue this run (checked before anything loads).
        self.fingerprint = {**fingerprint, **task.describe(), "precision": self.precision.name,
                            "optimizer": cfg.optimizer,
                            "weight_decay": cfg.weight_decay, "momentum": cfg.momentum,
                            "grad_accum": cfg.grad_accum, "seed": cfg.seed,
                            "offload_optimizer": cfg.offload_optimizer}
        self.step, self.micro = 0, 0
        # Optimizer steps skipped for non-finite gradients (bf16/fp32): a device tensor
        # with a fused optimizer (see bad_steps).
        self._nonfinite: Any = 0
        self.summary_so_far: dict[str, Any] = {}
        self.micro_losses: list[torch.Tensor] = []  # on the device until a log step reads them
        self.last_loss: torch.Tensor | None = None
        self.wait_s = self.compute_s = 0.0
        self.samples = 0
        # Under DDP, each micro-step's vote (a CPU all-reduce; see run.py): whether every
        # rank's batch has samples, and rank 0's checkpoint clock.
        self.vote = rank_vote(self.dist.world_size)
        self.wait_group = wait_group(self.dist)  # evaluation's barrier (see evaluate)
        self.clock_late = False
        self.dropped_for_sync = 0
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            checkpoint.remove_partial(cfg.run_dir)  # left by a kill during a save
        self.last_save = time.monotonic()

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Collective under DDP: every rank's loader position and RNGs are gathered (the
        loader's state holds every rank's: it resumes on another number of ranks too)."""
        return {"model": unwrap(self.task.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict(),
                "loader": self.loader.state_dict(), "world_size": self.dist.world_size,
                "rng": gather(rng_state(), self.dist), "fingerprint": self.fingerprint,
                "nonfinite_skipped_steps": self.bad_steps,
                "train_config": json.dumps(asdict(self.cfg), default=str),
                # every rank's: the error feedback of int8 and PowerSGD is a rank's own
                "compression": self._compression_states()}

    def _compression_states(self) -> list[dict[str, Any]] | None:
        comp = compression_of(self.task.model)
        return None if comp is None else gather_to_main(comp.state_dict(), self.dist)

    def _resume_compression(self, saved: list[dict[str, Any]] | None, saved_world: int) -> None:
        """The gradient compression's state (its error feedback) as this rank saved it; on
        another number of ranks it starts afresh, which the log says."""
        comp = compression_of(self.task.model)
        if comp is None or not saved:
            return
        if saved_world == self.dist.world_size:
            comp.load_state_dict(saved[self.dist.rank])
        elif self.dist.is_main:
            log.warning("resuming on %d ranks a checkpoint of %d: the gradient compression's "
                        "error feedback (each rank's own) starts afresh", self.dist.world_size,
                        saved_world)

    def resume(self) -> bool:
        state = checkpoint.load_newest(self.cfg.run_dir, self.fingerprint)
        steps = gather(None if state is None else int(state["step"]), self.dist)
        if len(set(steps)) > 1:
            raise RuntimeError(f"ranks found different checkpoints to resume from (steps "
                               f"{steps}); the run folder must be one shared folder")
        if state is None:
            return False
        if int(state["step"]) > self.cfg.steps:
            raise ValueError(f"the run folder's checkpoint is at step {state['step']}, past "
                             f"--steps {self.cfg.steps}; use a new --out or more steps")
        self.loader.load_state_dict(_whole(state["loader"]))  # checks, loads nothing else
        unwrap(self.task.model).load_state_dict(state["model"])
        if isinstance(self.optimizer, OffloadedOptimizer):
            self.optimizer.sync_from_model()
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["precision"])
        saved_world = int(state.get("world_size", len(state["rng"])))
        self._resume_compression(state.get("compression"), saved_world)
        if saved_world == self.dist.world_size:
            set_rng_state(state["rng"][self.dist.rank])
        elif self.dist.is_main:  # the ranks' RNGs stay as seeded for this world size
            log.warning("resuming a checkpoint of %d ranks on %d: the data continues with "
                        "the rest of its epoch split over the new ranks; the global batch is "
                        "now %d ranks x --batch-size", saved_world, self.dist.world_size,
                        self.dist.world_size)
        self.step = int(state["step"])
        self._nonfinite = int(state.get("nonfinite_skipped_steps", 0))
        self.summary_so_far = state.get("summary", {})
        return True

    def save(self, summary: dict[str, Any] | None = None) -> None:
        if self._losses_not_finite():
            return  # never replace good checkpoints by ones taken while losses are not finite
        state = self.state_dict()  # on every rank: it gathers
        state["summary"] = summary or {}
        if self.dist.is_main:  # one writer; the run folder is shared
            checkpoint.save(self.cfg.run_dir, self.step, state, self.cfg.keep)
        self.last_save = time.monotonic()

    def _losses_not_finite(self) -> bool:
        """Whether the latest losses of any rank are not finite: collective under DDP, so
        that every rank skips (or takes) the collective save alike. A sync at checkpoints."""
        last = self.last_loss
        mine = bool(self.precision.nonfinite_in_a_row) or \
            (last is not None and not bool(last.isfinite()))
        return sum_over_ranks([float(mine)], self.dist)[0] > 0

    # -- the step ----------------------------------------------------------------------------

    def _lr(self) -> float:
        return self.cfg.lr * warmup_cosine(self.step, warmup=self.cfg.warmup,
                                           total=self.cfg.steps)

    def micro_step(self, batch: Any) -> torch.Tensor | None:
        """Forward and backward of one batch; the optimizer steps every `grad_accum`.
        Returns the mean loss over the micro-batches when the optimizer stepped, as a device
        tensor (read on the host only at log steps), else None. No host sync here."""
        self.task.model.train()
        stepping = (self.micro + 1) % self.cfg.grad_accum == 0
        with self._gradient_sync(stepping):
            with self.precision.forward_context():
                out = self.task.forward(batch)
            self.precision.backward(out.loss / self.cfg.grad_accum)
        self.micro += 1
        self.micro_losses.append(out.loss.detach())
        if self.micro % self.cfg.grad_accum:
            return None
        loss = torch.stack(self.micro_losses).float().mean()
        self.micro_losses, self.last_loss = [], loss
        self._optimizer_step()
        return loss

    def _gradient_sync(self, stepping: bool) -> Any:
        """Under DDP, `no_sync()` on the micro-steps that do not step the optimizer: their
        gradients accumulate locally, and the last micro-step's backward all-reduces the sum
        (one all-reduce per optimizer step, not per micro-step)."""
        ddp = distributed_module(self.task.model)
        return contextlib.nullcontext() if stepping or ddp is None else ddp.no_sync()

    def _optimizer_step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        if isinstance(self.optimizer, OffloadedOptimizer):
            self._offloaded_step(self.optimizer)
        else:
            self._device_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def _device_step(self) -> None:
        """Unscale, clip, step: no host sync with a fused optimizer. A non-finite gradient
        norm (fp16 overflow, or a NaN in bf16/fp32 that would ruin every weight) skips the
        step inside the fused kernel, which reads the device flag `found_inf` (GradScaler
        sets it for fp16; bf16/fp32 set it here as GradScaler would); the skips are counted
        on the device and read at log steps."""
        self.precision.unscale(self.optimizer)
        # The norm is the same on every rank after DDP's all-reduce: every rank decides alike.
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip or float("inf"))
        if self.precision.scaler is not None:
            self.precision.step(self.optimizer, norm)  # fused: GradScaler reads nothing back
        elif self.optimizer.defaults.get("fused"):
            found_inf = (~torch.isfinite(norm)).float()
            self.optimizer.found_inf = found_inf  # what GradScaler.step hands a fused step
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self._nonfinite = self._nonfinite + found_inf.int()
        elif bool(torch.isfinite(norm)):  # no fused kernels here: a host read per step
            self.optimizer.step()
        else:
            self._nonfinite += 1

    def _offloaded_step(self, optimizer: OffloadedOptimizer) -> None:
        """Unscale and clip on the device, before the gradients leave it (offload.py)."""
        grads = optimizer.device_grads()
        self.precision.unscale(optimizer, grads)
        norm = torch.nn.utils.clip_grad_norm_(optimizer.params, self.cfg.clip or float("inf"))
        optimizer.pull_grads()
        # The step's one host sync: the flag, and the gradient copies queued before it.
        finite = bool(torch.isfinite(norm))
        if self.precision.host_scaler is not None:
            self.precision.host_update(finite)
        if finite:
            optimizer.step()
        elif self.precision.host_scaler is None:
            self._nonfinite += 1

    @property
    def bad_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients in bf16/fp32 (fp16's overflows:
        `precision.skipped_steps`). A host read when counted on the device: log steps only."""
        return int(self._nonfinite)

    def setup(self) -> dict[str, Any]:
        """What this run built, read from the objects (not the flags): where the optimizer
        state lives, whether the step is fused, activation checkpointing, compile, DDP."""
        offloaded = isinstance(self.optimizer, OffloadedOptimizer)
        inner = self.optimizer.inner if offloaded else self.optimizer
        bare = unwrap(self.task.model)
        return {"optimizer_state": "host" if offloaded else str(self.device),
                "fused_optimizer": bool(inner.defaults.get("fused")),
                "activation_checkpointing": bool(getattr(bare, "activation_checkpointing",
                                                         False)),
                "compiled": is_compiled(self.task.model),
                "ddp": distributed_module(self.task.model) is not None,
                # the training batches' augmentation, as the task runs it (image only)
                "augment": self.task.describe().get("augment")}

    def due_for_checkpoint(self) -> bool:
        """Every `checkpoint_every` steps, at the end, or when `checkpoint_minutes` passed on
        rank 0's clock (shared with every rank in the step's vote, since saving is collective:
        no extra all-reduce per step)."""
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            return True
        return self.clock_late if self.vote is not None else self.late()

    def late(self) -> bool:
        return time.monotonic() - self.last_save > 60 * self.cfg.checkpoint_minutes

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, loader: Any) -> dict[str, float]:
        """Metrics over the held-out data: `loader` reads this rank's share of it (wiring.py:
        every sample on one rank), and the totals are combined over ranks, as one process
        evaluating all of it would have them. A rank whose share is smaller, or empty, waits
        at a gloo barrier before the combining collective (NCCL's has a watchdog)."""
        wrapped = self.task.model
        # The bare model: DDP's forward syncs buffers across ranks, and ranks may evaluate
        # different numbers of batches.
        self.task.model = unwrap(wrapped)
        self.task.model.eval()
        totals = getattr(self.task, "new_totals", EvalTotals)()
        try:
            for batch in loader:
                if len(batch):
                    with self.precision.forward_context():
                        totals.add(self.task.evaluate(batch))
        finally:
            self.task.model = wrapped
        eval_barrier(self.wait_group)
        return totals.over_ranks(self.dist)


def log_line(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _whole(saved: Any) -> dict[str, Any]:
    """The loader state of a checkpoint: checkpoints written before loader states held every
    rank's kept one state per rank, in a list."""
    if isinstance(saved, list):
        from shardflow.loading.elastic import merge_states

        return merge_states(saved)
    return saved
