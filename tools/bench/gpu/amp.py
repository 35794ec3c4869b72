"""The amp_step part: samples/s of a ResNet SGD step (channels_last) under bf16 autocast and
fp16 autocast + GradScaler, as a plain loop on torch.amp, and the data-stall share of that loop
when a CPU thread feeds uint8 batches through DeviceCopier. `Amp` is shared with the language
model steps of the text_pointcloud part.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from shardflow.tools.bench.gpu.context import (
    MEAN,
    STD,
    Ctx,
    device_copier,
    image_pool,
    on_consumer_stream,
    pool_batch,
    sync,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


class Amp:
    """Autocast, and for fp16 torch's GradScaler, as torch gives them: the loops of amp_step
    and text_pointcloud use these directly, not shardflow.trainers.precision.Precision (whose API is
    being reworked), so that they measure the step and not an API in flux."""

    def __init__(self, name: str, device: torch.device) -> None:
        import torch

        self.name, self.device_type = name, device.type
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def step(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Backward (scaled for fp16), the optimizer step (skipped on overflow), zero_grad."""
        if self.scaler is None:
            loss.backward()
            optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())


def amp_setup(ctx: Ctx, precision: str) -> tuple[nn.Module, Any, Amp]:
    import torch

    from shardflow.trainers.models import build_model

    torch.manual_seed(0)
    model = build_model(ctx.sizes.amp_model, ctx.sizes.amp_classes).to(ctx.device)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, optimizer, Amp(precision, ctx.device)


def amp_train_step(model: nn.Module, optimizer: Any, amp: Amp, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    with amp.autocast():
        loss = F.cross_entropy(model(x), y)
    amp.step(loss, optimizer)
    return loss.detach()


def amp_speed(ctx: Ctx, precision: str) -> dict[str, Any]:
    """Samples/s of the step on a fixed batch already on the device."""
    import torch

    s, batch = ctx.sizes, ctx.amp_batch
    model, optimizer, prec = amp_setup(ctx, precision)
    x = torch.randn(batch, 3, s.amp_side, s.amp_side, device=ctx.device).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, s.amp_classes, (batch,), device=ctx.device)
    for _ in range(s.amp_warmup):
        loss = amp_train_step(model, optimizer, prec, x, y)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    sync(ctx)
    start = time.perf_counter()
    for _ in range(s.amp_steps):
        loss = amp_train_step(model, optimizer, prec, x, y)
    sync(ctx)
    elapsed = time.perf_counter() - start
    return {"samples_per_s": batch * s.amp_steps / elapsed,
            "step_ms": 1000 * elapsed / s.amp_steps, "final_loss": float(loss),
            "loss_scale": prec.scale(),
            "peak_memory_gb": torch.cuda.max_memory_allocated(ctx.device) / 2**30
            if ctx.cuda else None}


def produced_images(ctx: Ctx, copier: Any, steps: int,
                    stop: threading.Event) -> Iterator[tuple[Any, Any, Any]]:
    """The CPU producer: pre-made uint8 batches (offset per batch), through the copier."""
    import torch

    s = ctx.sizes
    pool = image_pool(ctx.amp_batch, s.amp_side)
    for i in range(steps):
        if stop.is_set():
            return
        labels = torch.randint(0, s.amp_classes, (ctx.amp_batch,))
        yield copier(copier.pinned(pool_batch(pool, i)), labels)


def amp_stall(ctx: Ctx, precision: str) -> dict[str, Any]:
    """The loop waits for each batch from a producer thread; stall share = wait / total."""
    import torch

    from shardflow.loading.prefetch import Stage

    s = ctx.sizes
    model, optimizer, prec = amp_setup(ctx, precision)
    copier = device_copier()(ctx.copier_device, MEAN, STD, True)
    steps = s.amp_warmup + s.stall_steps
    stage: Stage[Any] = Stage(lambda stop: produced_images(ctx, copier, steps, stop), depth=2,
                              name="gpu-check-producer")
    waited = total = 0.0
    try:
        batches = iter(stage)
        for step in range(steps):
            start = time.perf_counter()
            image, label, ready = next(batches)
            got = time.perf_counter()
            on_consumer_stream(ctx, ready, image, label)
            x = image.contiguous(memory_format=torch.channels_last)
            float(amp_train_step(model, optimizer, prec, x, label))  # a sync a step, as loop.py
            if step >= s.amp_warmup:
                waited, total = waited + got - start, total + time.perf_counter() - start
    finally:
        stage.close()
    return {"precision": precision, "steps": s.stall_steps, "wait_s": waited, "total_s": total,
            "stall_share": waited / total, "samples_per_s": ctx.amp_batch * s.stall_steps / total,
            "producer": "a thread (Stage): pre-made uint8 batches -> DeviceCopier (pinned, side "
                        "stream, normalized there) -> ready event"}


def part_amp_step(ctx: Ctx) -> dict[str, Any]:
    """Throughput of an AMP training step, and the data-stall share with a CPU producer."""
    import torch

    if ctx.cuda:
        torch.backends.cudnn.benchmark = True
    # On a CPU (a dry run) bf16 is usually emulated, and slow: fp32 there.
    precisions = ("bf16", "fp16") if ctx.cuda else ("fp32",)
    speed = {p: amp_speed(ctx, p) for p in precisions}
    stall = amp_stall(ctx, precisions[0])
    key: dict[str, Any] = {f"{p}_samples_per_s": round(v["samples_per_s"], 1)
                           for p, v in speed.items()}
    key["stall_share"] = round(stall["stall_share"], 3)
    return {"model": ctx.sizes.amp_model, "batch": ctx.amp_batch, "side": ctx.sizes.amp_side,
            "optimizer": "SGD momentum 0.9", "channels_last": True,
            "uses": "plain loop: torch.autocast, torch.amp.GradScaler for fp16, SGD; model "
                    "from shardflow.trainers.models.build_model",
            "precisions": speed, "data_stall": stall, "key": key}
