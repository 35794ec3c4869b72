"""The delivery and copies parts: host-to-device delivery checked bit for bit while other work
runs on the same GPU, then copy bandwidth (pinned vs pageable) and copy/compute overlap.

delivery compares the text loader's batches on the device with the CPU loader's, and
DeviceCopier's uint8 batches (raw, and normalized on its side stream) with the host tensors,
while a thread allocates, fills, multiplies and frees on the default stream and the copier's
stream is stalled now and then; "failed" on any mismatch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    text_shards,
    timed,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
TEXT_FIELDS = ("input_ids", "labels", "attention_mask")


# -- delivery --------------------------------------------------------------------------------------

@dataclass
class Tally:
    """Batches compared, mismatching batches, the first few mismatches, normalization error."""

    batches: int = 0
    mismatches: int = 0
    examples: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0

    def add(self, problems: list[str]) -> None:
        self.batches += 1
        if problems:
            self.mismatches += 1
            if len(self.examples) < 5:
                self.examples.append(f"batch {self.batches - 1}: {'; '.join(problems)}")


@contextlib.contextmanager
def gpu_noise(ctx: Ctx) -> Iterator[dict[str, Any]]:
    """A thread that allocates, fills, multiplies and frees on the default stream of the same
    device (with an occasional empty_cache: real cudaMalloc/cudaFree) until the block ends."""
    import torch

    stats: dict[str, Any] = {"iterations": 0, "error": None}
    stop = threading.Event()
    s = ctx.sizes

    def run() -> None:
        try:
            while not stop.is_set():
                n = stats["iterations"]
                junk = torch.empty(s.noise_mb[n % len(s.noise_mb)] * 2**20, dtype=torch.uint8,
                                   device=ctx.device).fill_(0xA5)
                a = torch.randn(s.noise_matmul, s.noise_matmul, device=ctx.device)
                b = a @ a
                del junk, a, b
                stats["iterations"] = n + 1
                if n % 4 == 3:
                    sync(ctx)  # keep the queue short, so the noise stays concurrent
                if ctx.cuda and n % 20 == 19:
                    torch.cuda.empty_cache()
                if not ctx.cuda:
                    time.sleep(0.005)  # a dry run must leave the two cores to the parts
        except Exception as exc:  # noqa: BLE001 - reported in the part's result
            stats["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="gpu-check-noise", daemon=True)
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join(60)


def text_problems(ctx: Ctx, want: Any, got: Any) -> list[str]:
    import torch

    if want is None or got is None:
        return ["one loader ended before the other"]
    problems = []
    for name in TEXT_FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        if ctx.cuda and not b.is_cuda:
            problems.append(f"{name} not on the GPU")
        if a.dtype != b.dtype or not torch.equal(a, b.cpu()):
            problems.append(f"{name} differs")
    if want.keys != got.keys:
        problems.append("keys differ")
    return problems


def text_delivery(ctx: Ctx) -> dict[str, Any]:
    """text_loader(device="cpu") vs text_loader(device="gpu"): every TextBatch field."""
    from shardflow.text import text_loader

    s = ctx.sizes
    shards = text_shards(ctx.work / "text", s.text_docs)
    opts: dict[str, Any] = {"batch_size": s.text_batch, "seq_len": s.text_seq,
                            "objective": "mlm", "reader": "stream", "seed": 0}
    tally = Tally()
    with text_loader(shards, device="cpu", **opts) as ref, \
            text_loader(shards, device=ctx.loader_device, **opts) as dev:
        for _ in range(s.text_passes):
            for want, got in itertools.zip_longest(ref, dev):
                tally.add(text_problems(ctx, want, got))
    log.info("text loader: %d batches compared, %d differ", tally.batches, tally.mismatches)
    return {**vars(tally), "loader_device": ctx.loader_device, "objective": "mlm"}


def stall_copier(ctx: Ctx, copier: Any, i: int) -> bool:
    """Now and then queue a sleep on the copier's stream: the copies after it wait, which is
    when a pinned buffer reused too early (a ring of buffers) would be overwritten."""
    import torch

    if not ctx.cuda or i % ctx.sizes.stall_every or not hasattr(torch.cuda, "_sleep"):
        return False
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(ctx.sizes.stall_cycles)
    return True


def copier_items(ctx: Ctx, copier: Any, stalls: list[int],
                 stop: threading.Event) -> Iterator[tuple[Any, ...]]:
    """The producer thread: (host batch, host labels, device image, device label, ready)."""
    import torch

    pool = image_pool(ctx.sizes.image_batch, ctx.sizes.image_side)
    for i in range(ctx.sizes.image_batches):
        if stop.is_set():
            return
        host = pool_batch(pool, i)
        labels = torch.arange(len(host)) + i * len(host)
        stalls[0] += stall_copier(ctx, copier, i)
        image, label, ready = copier(copier.pinned(host), labels)
        yield host, labels, image, label, ready


def image_problems(ctx: Ctx, item: tuple[Any, ...], normalize: bool, tally: Tally) -> list[str]:
    import torch

    host, labels, image, label, ready = item
    on_consumer_stream(ctx, ready, image, label)
    problems = [] if image.device.type == ctx.device.type else ["image not on the device"]
    if not torch.equal(label.cpu(), labels):
        problems.append("labels differ")
    got = image.cpu()
    if not normalize:
        if got.dtype != torch.uint8 or not torch.equal(got, host):
            problems.append(f"image differs ({int((got != host).sum())} bytes)")
        return problems
    want = (host.float() - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1)
    diff = (got.float() - want).abs()
    tally.max_abs_diff = max(tally.max_abs_diff, float(diff.max()))
    rel = float((diff / want.abs().clamp(min=1.0)).max())
    tally.max_rel_diff = max(tally.max_rel_diff, rel)
    if got.dtype != torch.float32 or rel > 1e-5:
        problems.append(f"normalized image off by {rel:.3g} (relative)")
    return problems


def copier_delivery(ctx: Ctx, normalize: bool) -> dict[str, Any]:
    """DeviceCopier's public calls only: copier(copier.pinned(host), label) in a producer
    thread (a Stage, as the loaders run it), the consumer waits on the ready event."""
    from shardflow.loading.prefetch import Stage

    copier = device_copier()(ctx.copier_device, MEAN if normalize else None,
                             STD if normalize else None, True)
    tally, stalls = Tally(), [0]
    stage: Stage[Any] = Stage(lambda stop: copier_items(ctx, copier, stalls, stop), depth=3,
                              name="gpu-check-copier")
    try:
        for item in stage:
            tally.add(image_problems(ctx, item, normalize, tally))
    finally:
        stage.close()
    log.info("copier (normalize=%s): %d batches compared, %d differ", normalize,
             tally.batches, tally.mismatches)
    return {**vars(tally), "side_stream_stalls": stalls[0],
            "shape": [ctx.sizes.image_batch, 3, ctx.sizes.image_side, ctx.sizes.image_side]}


def part_delivery(ctx: Ctx) -> dict[str, Any]:
    """Correctness of host -> device delivery under concurrent GPU work."""
    with gpu_noise(ctx) as noise:
        checks = {"text_loader": text_delivery(ctx),
                  "copier_uint8": copier_delivery(ctx, normalize=False),
                  "copier_normalized": copier_delivery(ctx, normalize=True)}
    short = [k for k, v in checks.items() if v["batches"] < ctx.sizes.min_batches]
    mismatches = sum(v["mismatches"] for v in checks.values())
    ok = not mismatches and not short and not noise["error"] and noise["iterations"] > 0
    return {"status": "ok" if ok else "failed", **checks, "noise": noise,
            "min_batches": ctx.sizes.min_batches, "too_few_batches": short,
            "key": {"batches": sum(v["batches"] for v in checks.values()),
                    "mismatches": mismatches, "noise_iterations": noise["iterations"]}}


# -- copies ----------------------------------------------------------------------------------------

def copy_n(target: torch.Tensor, host: torch.Tensor, n: int) -> None:
    for _ in range(n):
        target.copy_(host, non_blocking=True)


def copy_rates(ctx: Ctx) -> dict[str, float]:
    import torch

    s = ctx.sizes
    pageable = torch.randint(0, 256, (s.copy_mb * 2**20,), dtype=torch.uint8)
    pinned = pageable.pin_memory() if ctx.cuda else pageable.clone()
    target = torch.empty_like(pageable, device=ctx.device)
    out = {}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        target.copy_(host, non_blocking=True)  # warm-up
        seconds = timed(ctx, functools.partial(copy_n, target, host, s.copy_repeats))
        out[f"{name}_GBps"] = s.copy_repeats * s.copy_mb / 1024 / seconds
    return out


def overlap(ctx: Ctx) -> dict[str, float]:
    """N side-stream copies alone, N matmuls alone, both at once."""
    import torch

    s = ctx.sizes
    chunk = s.overlap_chunk_mb * 2**20
    host = torch.zeros(chunk, dtype=torch.uint8)
    host = host.pin_memory() if ctx.cuda else host
    target = torch.empty(chunk, dtype=torch.uint8, device=ctx.device)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(s.overlap_matmul, s.overlap_matmul, device=ctx.device, dtype=dtype)
    side = torch.cuda.Stream(ctx.device) if ctx.cuda else None

    def copies() -> None:
        with torch.cuda.stream(side) if side else contextlib.nullcontext():
            for _ in range(s.overlap_n):
                target.copy_(host, non_blocking=True)

    def matmuls() -> None:
        for _ in range(s.overlap_n):
            a @ a

    def both() -> None:
        copies()
        matmuls()

    both()  # warm-up
    t_copy, t_mm, t_both = timed(ctx, copies), timed(ctx, matmuls), timed(ctx, both)
    hidden = (t_copy + t_mm - t_both) / min(t_copy, t_mm)
    return {"copies_s": t_copy, "matmuls_s": t_mm, "both_s": t_both,
            "hidden_share": hidden, "copy_GBps_alone": s.overlap_n * chunk / 2**30 / t_copy}


def part_copies(ctx: Ctx) -> dict[str, Any]:
    """Host-to-device bandwidth and copy/compute overlap."""
    rates, both = copy_rates(ctx), overlap(ctx)
    return {"megabytes": ctx.sizes.copy_mb, "repeats": ctx.sizes.copy_repeats, **rates,
            "overlap": {**both, "n": ctx.sizes.overlap_n, "chunk_mb": ctx.sizes.overlap_chunk_mb,
                        "matmul": ctx.sizes.overlap_matmul},
            "key": {"pinned_GBps": round(rates["pinned_GBps"], 1),
                    "pageable_GBps": round(rates["pageable_GBps"], 1),
                    "overlap_hidden": round(both["hidden_share"], 2)}}
