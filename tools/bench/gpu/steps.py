"""The training step on the device, as the trainer runs it: sync_debug (host syncs counted by
torch's sync debug mode over a few Trainer steps, fp16 and bf16: the fused optimizer with
found_inf on the device should make none) and compile (inductor over DDP, wrapped in that
order, with activation checkpointing: compile time, steps/s against eager, and the parameters
after the same steps compared).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shardflow.tools.bench.gpu.context import Ctx, sync
from shardflow.tools.bench.gpu.training import one_process_ddp, one_process_group

if TYPE_CHECKING:
    import torch

    from shardflow.loading.batch import ImageBatch


def image_batches(device: torch.device, n: int, batch: int, side: int, seed: int = 6
                  ) -> list[ImageBatch]:
    """`n` uint8 batches of the small ResNet's inputs, already on `device`."""
    import torch

    from shardflow.loading.batch import ImageBatch

    g = torch.Generator().manual_seed(seed)
    return [ImageBatch(torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8,
                                     generator=g).to(device),
                       torch.randint(0, 10, (batch,), generator=g).to(device),
                       [f"k{seed}-{i}"] * batch) for i in range(n)]


def trainer_for(ctx: Ctx, name: str, precision: str, steps: int, grad_accum: int = 1,
                checkpointing: bool = False) -> Any:
    """shardflow.trainers.loop.Trainer over ImageClassification (the small ResNet), seeded."""
    import torch

    from shardflow.trainers.image_task import ImageClassification
    from shardflow.trainers.loop import TrainConfig, Trainer

    torch.manual_seed(0)
    task = ImageClassification(10, device=ctx.device, activation_checkpointing=checkpointing)
    cfg = TrainConfig(run_dir=ctx.work / name, steps=steps, warmup=1, grad_accum=grad_accum,
                      precision=precision)  # type: ignore[arg-type]
    return Trainer(task, None, cfg, ctx.device, {})


# -- sync_debug ------------------------------------------------------------------------------------

@contextlib.contextmanager
def counted_syncs(ctx: Ctx, found: list[str]) -> Iterator[None]:
    """torch.cuda.set_sync_debug_mode("warn") for the block: each synchronizing call warns;
    the warnings are collected in `found` (one per sync). Without CUDA there is nothing to
    count: `found` stays empty and the caller reports the count as unmeasured."""
    import torch

    if not ctx.cuda:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found += [str(w.message).splitlines()[0][:160] for w in caught
              if "synchroniz" in str(w.message)]


def sync_run(ctx: Ctx, precision: str) -> dict[str, Any]:
    """Two warm-up optimizer steps (lazy state, the first scaler step), then the counted
    ones; grad_accum 2, so no_sync micro-steps are in the window too."""
    s = ctx.sizes
    trainer = trainer_for(ctx, f"sync-{precision}", precision, 2 + s.sync_steps, grad_accum=2)
    data = image_batches(ctx.device, 2 * (2 + s.sync_steps), s.sync_batch, s.sync_side)
    for batch in data[:4]:
        trainer.micro_step(batch)
    sync(ctx)
    found: list[str] = []
    with counted_syncs(ctx, found):
        for batch in data[4:]:
            trainer.micro_step(batch)
    sync(ctx)
    skipped = trainer.precision.skipped_steps + trainer.bad_steps
    return {"host_syncs": len(found) if ctx.cuda else None, "first": found[:5],
            "optimizer_steps_counted": s.sync_steps, "skipped_steps": skipped,
            "optimizer": type(trainer.optimizer).__name__}


def part_sync_debug(ctx: Ctx) -> dict[str, Any]:
    """Host syncs in Trainer steps, counted by torch (fp16 and bf16; fp32 in a dry run)."""
    precisions = ("fp16", "bf16") if ctx.cuda else ("fp32",)
    runs = {p: sync_run(ctx, p) for p in precisions}
    clean = all(r["host_syncs"] == 0 for r in runs.values())
    out: dict[str, Any] = {"runs": runs, "key": {f"{p}_host_syncs": r["host_syncs"]
                                                 for p, r in runs.items()}}
    if ctx.cuda and not clean:
        out.update(status="failed", error="the optimizer steps synchronized with the host: "
                   + "; ".join(f"{p}: {r['first']}" for p, r in runs.items() if r["first"]))
    if not ctx.cuda:
        out["note"] = "no CUDA: the steps ran, host syncs are counted only by CUDA's debug mode"
    return out


# -- compile ---------------------------------------------------------------------------------------

def compile_run(ctx: Ctx, compiled: bool) -> dict[str, Any]:
    """Trainer steps of the small ResNet: eager and bare, or with activation checkpointing,
    in one-process DDP, then torch.compile (shardflow.trainers.distributed.wrap_then_compile)."""
    import torch

    from shardflow.trainers.distributed import distributed_module, unwrap, wrap_then_compile

    s = ctx.sizes
    precision = "bf16" if ctx.cuda else "fp32"
    trainer = trainer_for(ctx, f"compile-{compiled}", precision, s.compile_steps,
                          checkpointing=compiled)
    task = trainer.task
    if compiled:
        backend = "inductor" if ctx.cuda else "aot_eager"  # dry run: no C++ compile here
        task.model = wrap_then_compile(task.model, one_process_ddp(), ctx.device, "none",
                                       backend)
    data = image_batches(ctx.device, s.compile_steps, s.compile_batch, s.compile_side)
    start = time.perf_counter()
    trainer.micro_step(data[0])  # compiles, when compiled
    sync(ctx)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for batch in data[1:]:
        trainer.micro_step(batch)
    sync(ctx)
    rate = (len(data) - 1) / (time.perf_counter() - start)
    params = torch.cat([p.detach().float().flatten() for p in unwrap(task.model).parameters()])
    return {"first_step_s": first_s, "steps_per_s": rate, "params": params.cpu(),
            "ddp_inside": distributed_module(task.model) is not None}


def part_compile(ctx: Ctx) -> dict[str, Any]:
    """inductor over DDP with checkpointing vs eager: time to compile, speed, same training."""
    import torch

    with one_process_group(ctx):
        start = torch.cat([p.detach().float().flatten() for p in
                           trainer_for(ctx, "start", "fp32", 1).task.model.parameters()])
        eager, compiled = compile_run(ctx, False), compile_run(ctx, True)
    plain, fast = eager.pop("params"), compiled.pop("params")
    moved = float((plain - start.cpu()).norm())
    apart = float((plain - fast).norm())
    # inductor fuses and reorders sums, AdamW magnifies tiny gradient differences: the runs
    # must end up near each other compared with how far training moved them
    same = apart <= 0.05 * moved and compiled["ddp_inside"]
    out: dict[str, Any] = {
        "eager": eager, "compiled": compiled, "param_distance": apart, "param_moved": moved,
        "key": {"compile_s": round(compiled["first_step_s"], 1),
                "speedup": round(compiled["steps_per_s"] / eager["steps_per_s"], 2),
                "relative_distance": round(apart / moved, 4) if moved else None}}
    if not same:
        out.update(status="failed", error=f"compiled training went elsewhere: distance "
                   f"{apart:.3g} vs {moved:.3g} moved; DDP inside: {compiled['ddp_inside']}")
    return out
