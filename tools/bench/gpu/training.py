"""The trainers' features on the GPU, one part each: the offloaded optimizer (master weights and
AdamW state in host memory) against the on-device one through
shardflow.trainers.loop.Trainer; one-process DDP through shardflow.trainers.distributed.wrap with
every compression mode (fp16, bf16, int8, PowerSGD;
their payload counted by trainers/compression.py); and
peak memory with and without activation checkpointing, gradients and BatchNorm statistics
compared.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shardflow.tools.bench.gpu.context import Ctx, sync, timed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from shardflow.trainers.task import StepOutput

log = logging.getLogger(__name__)


# -- offload ---------------------------------------------------------------------------------------

class MLPTask:
    """A shardflow.trainers.task.Task for the offload check: an MLP regressing fixed targets."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def forward(self, batch: Any) -> StepOutput:
        import torch.nn.functional as F

        from shardflow.trainers.task import StepOutput

        x, y = batch
        return StepOutput(F.mse_loss(self.model(x).float(), y))

    def evaluate(self, batch: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"task": "gpu-check-mlp"}


def offload_data(ctx: Ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    s, gen = ctx.sizes, torch.Generator().manual_seed(3)
    teacher = torch.randn(s.offload_width, 8, generator=gen) / s.offload_width ** 0.5
    batches = []
    for _ in range(s.offload_steps):
        x = torch.randn(s.offload_batch, s.offload_width, generator=gen)
        batches.append((x.to(ctx.device), (x @ teacher).to(ctx.device)))
    return batches


def offload_run(ctx: Ctx, precision: str, offload: bool,
                data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Trainer.micro_step over `data` (grad_accum 1: an optimizer step per batch)."""
    import torch
    from torch import nn

    from shardflow.trainers.loop import TrainConfig, Trainer

    s = ctx.sizes
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(s.offload_layers):
        layers += [nn.Linear(s.offload_width, s.offload_width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(s.offload_width, 8)).to(ctx.device)
    cfg = TrainConfig(run_dir=ctx.work / f"offload-{precision}-{offload}", steps=len(data),
                      lr=1e-3, warmup=5, precision=precision,  # type: ignore[arg-type]
                      offload_optimizer=offload)
    trainer = Trainer(MLPTask(model), None, cfg, ctx.device, {})
    sync(ctx)
    start = time.perf_counter()
    stepped = [trainer.micro_step(batch) for batch in data]  # a float, or a device tensor
    sync(ctx)
    seconds = time.perf_counter() - start
    losses = [float("nan") if loss is None else float(loss) for loss in stepped]
    return {"losses": losses, "steps_per_s": len(data) / seconds,
            "skipped_steps": getattr(trainer.precision, "skipped_steps", None),
            "bad_steps": getattr(trainer, "bad_steps", None),
            "optimizer": type(trainer.optimizer).__name__}


def offload_compare(ctx: Ctx, precision: str) -> dict[str, Any]:
    data = offload_data(ctx)
    plain, offloaded = (offload_run(ctx, precision, flag, data) for flag in (False, True))
    diffs = [abs(a - b) for a, b in zip(plain["losses"], offloaded["losses"], strict=True)]
    return {"max_abs_loss_diff": max(diffs), "first_loss": plain["losses"][0],
            "last_loss": {"on_device": plain["losses"][-1],
                          "offloaded": offloaded["losses"][-1]},
            "steps_per_s": {"on_device": plain["steps_per_s"],
                            "offloaded": offloaded["steps_per_s"]},
            "skipped_steps": {"on_device": plain["skipped_steps"],
                              "offloaded": offloaded["skipped_steps"]},
            "optimizers": [plain["optimizer"], offloaded["optimizer"]]}


def part_offload(ctx: Ctx) -> dict[str, Any]:
    """The offloaded optimizer vs the on-device one: same seed, data, loss trajectory."""
    precisions = ("fp16", "bf16") if ctx.cuda else ("bf16", "fp32")  # fp16 needs CUDA
    results, errors = {}, {}
    for precision in precisions:
        try:
            results[precision] = offload_compare(ctx, precision)
        except Exception as exc:  # noqa: BLE001 - recorded: the API may not allow it
            log.exception("offload with %s failed", precision)
            errors[precision] = f"{type(exc).__name__}: {exc}"
    key = {f"{p}_max_loss_diff": f"{r['max_abs_loss_diff']:.2e}" for p, r in results.items()}
    for p, r in results.items():
        key[f"{p}_offload_steps_per_s"] = round(r["steps_per_s"]["offloaded"], 1)
    out: dict[str, Any] = {"steps": ctx.sizes.offload_steps, "precisions": results, "key": key,
                           "uses": "shardflow.trainers.loop.Trainer.micro_step, TrainConfig("
                                   "offload_optimizer=...), AdamW, clip 1.0"}
    if errors:
        out.update(status="error", errors=errors,
                   error="; ".join(f"{p}: {e}" for p, e in errors.items()))
    return out


# -- ddp -----------------------------------------------------------------------------------------

def one_process_ddp() -> Any:
    """One process that still wants DDP: shardflow.trainers.distributed.wrap leaves the model bare
    when world_size is 1, and this check is about its DDP and hook path."""
    from shardflow.trainers.distributed import DistInfo

    class OneProcessDDP(DistInfo):
        @property
        def active(self) -> bool:  # type: ignore[override]
            return True

    return OneProcessDDP()


def ddp_run(ctx: Ctx, compression: str) -> dict[str, Any]:
    import torch
    from torch import nn

    from shardflow.trainers.distributed import compression_of, wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(ctx.device)
    try:
        ddp = wrap(model, one_process_ddp(), ctx.device, compression)
    except ValueError as exc:
        return {"refused": str(exc)}
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)).to(ctx.device)
    grads = torch.zeros(0)
    for step in range(3):
        loss = ddp(x).square().mean()
        loss.backward()
        if step == 0:
            grads = torch.cat([p.grad.flatten() for p in ddp.parameters()
                               if p.grad is not None]).float().cpu()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(ctx)
    comp = compression_of(ddp)  # its counters: steps whose gradients went through the hook
    return {"ddp": type(ddp).__name__, "hook_steps": comp.steps, "steps": 3,
            **comp.bytes_per_step(), "loss": float(loss.detach()), "grads": grads}


@contextlib.contextmanager
def one_process_group(ctx: Ctx) -> Iterator[str]:
    """A process group of this process alone (NCCL on CUDA, gloo in a dry run) for the block;
    yields its backend."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if ctx.cuda else "gloo"
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    dist.init_process_group(backend, init_method=f"file://{ctx.work / 'store'}", rank=0,
                            world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def part_ddp(ctx: Ctx) -> dict[str, Any]:
    """One-process DDP (NCCL; gloo in a dry run) with the project's compression hooks."""
    from torch import nn

    from shardflow.trainers.distributed import DistInfo, wrap

    with one_process_group(ctx) as backend:
        bare = nn.Linear(2, 2).to(ctx.device)
        noop = wrap(bare, DistInfo(), ctx.device, "fp16") is bare
        runs = {c: ddp_run(ctx, c) for c in ("none", "fp16", "bf16", "int8", "powersgd:1")}
    reference = runs["none"].pop("grads")
    for run in runs.values():
        if "grads" in run:
            run["grad_max_abs_diff_vs_none"] = float((run.pop("grads") - reference).abs().max())
    refused_ok = not ctx.cuda  # wrap refuses bf16 without CUDA, by design
    # Every hook ran on every step ("none" keeps DDP's own all-reduce, no hook).
    hooked = all(r.get("hook_steps") == 3 or ("refused" in r and c == "bf16" and refused_ok)
                 for c, r in runs.items() if c != "none")
    finite = all(r.get("loss", 0.0) == r.get("loss", 0.0) for r in runs.values())
    return {"status": "ok" if hooked and finite else "failed", "backend": backend,
            "world_size": 1, "wrap_is_noop_for_one_process": noop, "runs": runs,
            "key": {c: r.get("ratio_to_fp32", "refused") for c, r in runs.items()}}


# -- checkpointing -------------------------------------------------------------------------------

def checkpoint_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    import torch.nn.functional as F

    F.cross_entropy(model(x), y).backward()


def checkpoint_run(ctx: Ctx, enabled: bool) -> dict[str, Any]:
    """One warm-up step, then one measured forward + backward (fp32, train mode)."""
    import torch

    from shardflow.trainers.models import build_model

    s = ctx.sizes
    torch.manual_seed(0)
    model = build_model("small-resnet", 10, activation_checkpointing=enabled).to(ctx.device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(s.ckpt_batch, 3, s.ckpt_side, s.ckpt_side, generator=gen).to(ctx.device)
    y = torch.randint(0, 10, (s.ckpt_batch,), generator=gen).to(ctx.device)
    checkpoint_step(model, x, y)
    model.zero_grad(set_to_none=True)
    sync(ctx)
    base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    seconds = timed(ctx, lambda: checkpoint_step(model, x, y))
    peak = torch.cuda.max_memory_allocated(ctx.device) - base if ctx.cuda else None
    return {"peak_gb": None if peak is None else peak / 2**30, "step_s": seconds,
            "grads": torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]).cpu(),
            "stats": torch.cat([b.float().flatten() for b in model.buffers()]).cpu()}


def part_checkpointing(ctx: Ctx) -> dict[str, Any]:
    """Peak memory with and without activation checkpointing (the small ResNet)."""
    import torch

    if ctx.cuda:  # the same kernels both times: gradients should then match exactly
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    plain, ckpt = checkpoint_run(ctx, False), checkpoint_run(ctx, True)
    grad_diff = float((plain.pop("grads") - ckpt.pop("grads")).abs().max())
    stats_diff = float((plain.pop("stats") - ckpt.pop("stats")).abs().max())
    ratio = ckpt["peak_gb"] / plain["peak_gb"] if ctx.cuda and plain["peak_gb"] else None
    return {"batch": ctx.sizes.ckpt_batch, "side": ctx.sizes.ckpt_side, "without": plain,
            "with": ckpt, "peak_ratio": ratio, "grad_max_abs_diff": grad_diff,
            "bn_stats_max_abs_diff": stats_diff,
            "key": {"peak_gb_without": plain["peak_gb"] and round(plain["peak_gb"], 2),
                    "peak_gb_with": ckpt["peak_gb"] and round(ckpt["peak_gb"], 2),
                    "grad_diff": f"{grad_diff:.1e}", "bn_stats_diff": f"{stats_diff:.1e}"}}
