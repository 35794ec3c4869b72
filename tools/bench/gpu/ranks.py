"""The ranks part: two processes, one GPU each, over NCCL (skipped with fewer than two GPUs;
two gloo processes on the CPU in a dry run). shardflow.trainers.loop.Trainer in DDP with
grad_accum 2: all-reduces only on the micro-steps that step the optimizer (no_sync on the
others), the same parameters on both ranks afterwards; an evaluation whose shares differ (one
rank has three batches, the other one) through Trainer.evaluate, which waits at a gloo barrier
before the combining NCCL collective: both ranks get the metrics of the whole. And the
all-reduce bus bandwidth of a large buffer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from shardflow.tools.bench.gpu.context import Ctx

WORLD = 2


def part_ranks(ctx: Ctx) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    if ctx.cuda and torch.cuda.device_count() < WORLD:
        return {"status": "skipped",
                "reason": f"{torch.cuda.device_count()} GPU here; the part needs {WORLD}"}
    out = ctx.work / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(ctx.cuda, str(out), ctx.sizes.nccl_mb), nprocs=WORLD, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    agree = len({r["param_sum"] for r in ranks}) == 1
    no_sync = all(r["no_sync_held"] for r in ranks)
    metrics = [r["eval"] for r in ranks]
    # what one process would get from the two shares: sample-weighted means (each rank keeps
    # its own BatchNorm statistics under DDP, so each share is evaluated where it was)
    total = sum(r["eval_samples"] for r in ranks)
    expected = {k: sum(r["eval_alone"][k] * r["eval_samples"] for r in ranks) / total
                for k in metrics[0]}
    evaluated = all(m == metrics[0] for m in metrics) and all(
        abs(expected[k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in metrics[0].items())
    result: dict[str, Any] = {
        "backend": ranks[0]["backend"], "world_size": WORLD, "ranks": ranks,
        "eval_expected": expected,
        "key": {"allreduce_bus_GBps": ranks[0]["bus_GBps"], "ranks_agree": agree,
                "no_sync": no_sync, "uneven_eval_combined": evaluated}}
    if not (agree and no_sync and evaluated):
        result.update(status="failed", error=f"ranks agree: {agree}; all-reduces only when "
                      f"the optimizer steps: {no_sync}; uneven evaluation combined: {evaluated}")
    return result


def rank_main(rank: int, cuda: bool, out: str, nccl_mb: int) -> None:
    """One rank (a process torch.multiprocessing started): its figures into rank{N}.json."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{out}/store",
                            rank=rank, world_size=WORLD)
    try:
        figures = {"backend": dist.get_backend(), **train_and_evaluate(rank, device, Path(out)),
                   "bus_GBps": bus_bandwidth(device, nccl_mb)}
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))


def train_and_evaluate(rank: int, device: Any, out: Path) -> dict[str, Any]:
    """Trainer steps (grad_accum 2) in DDP whose all-reduces a hook counts, per micro-step;
    then an evaluation of 3 batches on rank 0 and 1 on rank 1."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from shardflow.tools.bench.gpu.steps import image_batches
    from shardflow.trainers.distributed import DistInfo, wrap
    from shardflow.trainers.image_task import ImageClassification
    from shardflow.trainers.loop import TrainConfig, Trainer

    calls: list[int] = []

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    torch.manual_seed(0)
    task = ImageClassification(10, device=device)
    info = DistInfo(rank, WORLD, rank)
    task.model = wrap(task.model, info, device, "none")
    task.model.register_comm_hook(None, counting)  # type: ignore[operator]
    steps, precision = 3, "bf16" if device.type == "cuda" else "fp32"
    cfg = TrainConfig(run_dir=out / f"run{rank}", steps=steps, warmup=1, grad_accum=2,
                      precision=precision)  # type: ignore[arg-type]
    trainer = Trainer(task, None, cfg, device, {}, dist=info)
    per_micro_step = []
    for batch in image_batches(device, 2 * steps, 8, 16, seed=rank):  # each rank its data
        before = len(calls)
        stepped = trainer.micro_step(batch) is not None
        per_micro_step.append([stepped, len(calls) - before])
    held_out = image_batches(device, 4, 8, 16, seed=100)
    shares = {0: held_out[:3], 1: held_out[3:]}
    metrics = trainer.evaluate(shares[rank])
    # this rank's share evaluated alone (no group: nothing collective), to combine by hand
    solo = dataclasses.replace(cfg, run_dir=out / f"alone{rank}")
    alone = Trainer(task, None, solo, device, {}).evaluate(shares[rank])
    params = sum(float(p.detach().double().sum()) for p in task.model.parameters())
    return {"allreduces_per_micro_step": per_micro_step, "param_sum": params,
            "no_sync_held": all((n > 0) == stepped for stepped, n in per_micro_step),
            "eval": metrics, "eval_alone": alone,
            "eval_samples": sum(len(b) for b in shares[rank])}


def bus_bandwidth(device: Any, mb: int) -> float:
    """All-reduce bus GB/s (nccl-tests' definition: 2(n-1)/n of the buffer per second)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(mb * 2**20 // 4, device=device)
    dist.all_reduce(buf)  # warm-up: NCCL sets up its channels on the first call
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, reps = time.perf_counter(), 5
    for _ in range(reps):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / reps
    return round(2 * (WORLD - 1) / WORLD * buf.numel() * 4 / seconds / 1e9, 2)
