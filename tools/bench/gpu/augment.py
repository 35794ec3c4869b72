"""The ops part of tools/gpu_check.py: shardflow.ops on the device (issue 26).

  ops   a RandAugment + ColorJitter + Affine + GaussianBlur + RandomErasing recipe and a
        mixup/cutmix over uint8 batches on CUDA against the same draws on the CPU (pixels a
        level apart at most, outside nearest-neighbour ties), masks warped with them, point
        ops; host syncs counted by CUDA's sync debug mode over the device runs ("failed"
        unless none); images/s on the device and on one CPU thread; then image_loader with
        augment, batch_augment and views on device="cuda" against the CPU loader.
"""

from __future__ import annotations

import time
from typing import Any

from shardflow.tools.bench.gpu.context import Ctx, sync
from shardflow.tools.bench.gpu.steps import counted_syncs


def _recipe() -> list[Any]:
    from shardflow import ops

    return [ops.RandAugment(2, 9), ops.ColorJitter(0.4, 0.4, 0.4, 0.1),
            ops.Affine(degrees=15, translate=(0.1, 0.1), scale=(0.9, 1.1)),
            ops.GaussianBlur(5), ops.RandomErasing(p=0.5)]


def _apart(a: Any, b: Any) -> float:
    """The share of values more than one level apart."""
    return float(((a.int() - b.int()).abs() > 1).float().mean())


def _ops_runs(ctx: Ctx) -> dict[str, Any]:
    import torch

    from shardflow import ops

    n, side = (8, 64) if ctx.dry else (32, 224)
    g = torch.Generator().manual_seed(11)
    images = torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=g)
    masks = torch.randint(0, 21, (n, 1, side, side), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    keys = [f"gpu-ops-{i}" for i in range(n)]
    mix = ops.Mix(0.8, 1.0, classes=10)
    clouds = torch.randn(n, 1024, 3, generator=g)
    cloud_ops = [ops.points.RotateZ(180), ops.points.Scale(), ops.points.Jitter(),
                 ops.points.Dropout()]

    def run(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        img, msk, lab, pts = inputs
        img, msk = ops.apply(_recipe(), img, ops.sample_rngs(0, 0, keys), masks=msk)
        mixed, target, _ = mix(img, lab, ops.batch_rng(0, 0, keys))
        pts = ops.points.apply(cloud_ops, pts, ops.sample_rngs(0, 0, keys))
        return mixed, target, msk, pts

    host = (images, masks, labels, clouds)
    on_gpu = tuple(t.to(ctx.device) for t in host)  # before the count: these copies sync
    cpu = run(host)
    run(on_gpu)  # warm-up: kernels, the caching allocator
    sync(ctx)
    found: list[str] = []
    start = time.perf_counter()
    with counted_syncs(ctx, found):
        dev = run(on_gpu)
    sync(ctx)
    device_s = time.perf_counter() - start
    start = time.perf_counter()
    run(host)
    cpu_s = time.perf_counter() - start
    got = [t.cpu() for t in dev]
    return {"images": n, "side": side, "host_syncs": len(found) if ctx.cuda else None,
            "first_syncs": found[:5], "images_apart_share": _apart(got[0], cpu[0]),
            "targets_max_diff": float((got[1] - cpu[1]).abs().max()),
            "masks_apart_share": float((got[2] != cpu[2]).float().mean()),
            "points_max_diff": float((got[3] - cpu[3]).abs().max()),
            "device_images_per_s": round(n / device_s, 1),
            "cpu_images_per_s": round(n / cpu_s, 1)}


def _loader_runs(ctx: Ctx) -> dict[str, Any]:
    """image_loader on the device (portable backend: no DALI needed) against the CPU's."""
    import torch

    from shardflow import ops
    from shardflow.builtin import make_image_folder
    from shardflow.convert import ConvertConfig, convert
    from shardflow.image.loader import ImageLoader, image_loader

    out = ctx.work / "ops-shards"
    if not (out / "manifest.json").exists():
        src = make_image_folder(ctx.work / "ops-src", per_class=4, size=64)
        convert(ConvertConfig(kind="imagefolder", src=str(src), out=str(out), max_count=16,
                              workers=1))
    common: dict[str, Any] = {"batch_size": 8, "size": 48, "threads": 2, "backend": "portable",
              "use_tuning": False, "augment": _recipe(),
              "batch_augment": [ops.CutMix(1.0, classes=10)]}
    views = [[ops.RandomResizedCrop(48), ops.Flip()], [ops.RandomResizedCrop(24)]]
    found: list[str] = []
    with image_loader(out, device="cpu", **common) as loader:
        want = list(loader)
        with image_loader(out, device="cpu", **{**common, "augment": (), "batch_augment": (),
                                                "views": views}) as vloader:
            want_views = list(vloader)
    with image_loader(out, device=ctx.loader_device, **common) as loader:
        with counted_syncs(ctx, found):
            got = list(loader)
        assert isinstance(loader, ImageLoader)  # one source, not a mixture
        where = loader.describe()["augment"][0]["runs"]
    with image_loader(out, device=ctx.loader_device, **{**common, "augment": (),
                                                          "batch_augment": (),
                                                          "views": views}) as vloader:
        got_views = list(vloader)
    apart = max(_apart(a.image.cpu(), b.image) for a, b in zip(got, want, strict=True))
    same_views = all(torch.equal(x.cpu(), y) for a, b in zip(got_views, want_views,
                                                               strict=True)
                     for x, y in zip(a.views, b.views, strict=True))
    return {"batches": len(got), "keys_match": [b.keys for b in got] == [b.keys for b in want],
            "images_apart_share": apart, "views_equal": same_views, "runs": where,
            "host_syncs_while_iterating": len(found) if ctx.cuda else None}


def part_ops(ctx: Ctx) -> dict[str, Any]:
    """The ops on the device against the CPU, and the loader's ops on the device."""
    runs = _ops_runs(ctx)
    loader = _loader_runs(ctx)
    out: dict[str, Any] = {"ops": runs, "loader": loader, "key": {
        "device_images_per_s": runs["device_images_per_s"],
        "cpu_images_per_s": runs["cpu_images_per_s"], "host_syncs": runs["host_syncs"],
        "images_apart_share": runs["images_apart_share"]}}
    problems = []
    if ctx.cuda and runs["host_syncs"]:
        problems.append(f"the ops synchronized with the host: {runs['first_syncs']}")
    if runs["images_apart_share"] > 0.01 or runs["masks_apart_share"] > 0.01:
        problems.append("the device's pixels or masks are not the CPU's")
    if runs["targets_max_diff"] > 1e-5 or runs["points_max_diff"] > 1e-4:
        problems.append("the device's soft targets or points are not the CPU's")
    if not loader["keys_match"] or loader["images_apart_share"] > 0.01 or \
            not loader["views_equal"]:
        problems.append("the loader's device batches are not its CPU batches")
    if problems:
        out.update(status="failed", error="; ".join(problems))
    return out
