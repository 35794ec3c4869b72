"""The modality parts: text_pointcloud (GPT-style and BERT-style steps of
shardflow.trainers.text_task fed by the text loader on the device; voxelize on the device in a
side stream, as on the CPU; LiDAR scenes with voxel rows delivered to the device, equal to the CPU
loader's, and segvoxels on the device equal to it on the CPU) and dali (CPU vs mixed decode
images/s and a hw_decoder_load sweep, the two decodes' eval batches compared, "skipped" when
nvidia.dali does not import; DALI is imported only there).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardflow.tools.bench.gpu.amp import Amp
from shardflow.tools.bench.gpu.context import Ctx, sync, take, text_shards, timed
from shardflow.tools.bench.gpu.header import dali_probe

if TYPE_CHECKING:
    import torch


# -- text_pointcloud -------------------------------------------------------------------------------

def lm_rate(ctx: Ctx, shards: Path, objective: str) -> dict[str, Any]:
    """Steps of LanguageModelling (bf16) fed by text_loader on the device; rows/s."""
    import torch

    from shardflow.text import text_loader
    from shardflow.text.tokenizer import ByteTokenizer
    from shardflow.trainers.text_task import LanguageModelling

    s = ctx.sizes
    torch.manual_seed(0)
    task = LanguageModelling(objective, ByteTokenizer.vocab_size, s.lm_seq, ctx.device,
                             **s.lm_shape)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    amp = Amp("bf16" if ctx.cuda else "fp32", ctx.device)  # bf16 is emulated on most CPUs
    rows, last = 0, float("nan")
    with text_loader(shards, batch_size=s.lm_batch, seq_len=s.lm_seq,
                     objective=objective,  # type: ignore[arg-type]
                     device=ctx.loader_device, reader="stream", seed=0) as loader:
        start = time.perf_counter()
        for step, batch in enumerate(take(loader, s.lm_warmup + s.lm_steps)):
            if step == s.lm_warmup:
                rows, start = 0, time.perf_counter()
            with amp.autocast():
                loss = task.forward(batch).loss
            amp.step(loss, optimizer)
            rows += len(batch)
            last = float(loss.detach())  # a sync a step, as trainers/loop.py does
        elapsed = time.perf_counter() - start
    return {"samples_per_s": rows / elapsed, "tokens_per_s": rows * s.lm_seq / elapsed,
            "steps": s.lm_steps, "final_loss": last, "batch": s.lm_batch, "seq_len": s.lm_seq}


# The largest difference from the CPU's pillar features (means of float32 coordinates in
# [-1.1, 1.1]) that the order of CUDA's scatter_add_ explains: measured 2.4e-7 on the CPU
# with the points reordered.
PILLAR_TOLERANCE = 1e-5


def voxel_rate(ctx: Ctx, mode: str) -> dict[str, Any]:
    """voxelize on the device in a side stream (points/s), and the result vs the CPU's, or
    the part fails: occupancy equal (both compute each cell by the same float32 multiply,
    then add, each rounded once, then integer indices: a point on a cell boundary lands in
    the same cell on both); pillars within PILLAR_TOLERANCE (their means are sums that
    CUDA's scatter_add_ adds in no fixed order)."""
    import torch

    from shardflow.pointcloud.voxelize import voxelize

    s = ctx.sizes
    host = torch.rand(s.points_batch, s.points_n, 3, generator=torch.Generator().manual_seed(6))
    host = host * 2.2 - 1.1  # some points outside the cube [-1, 1)^3
    points = host.to(ctx.device)
    side = torch.cuda.Stream(ctx.device) if ctx.cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(ctx.device))

    def run() -> torch.Tensor:
        with torch.cuda.stream(side) if side else contextlib.nullcontext():
            return voxelize(points, mode, grid=s.voxel_grid, extent=1.0)  # type: ignore[arg-type]

    run()  # warm-up
    seconds = timed(ctx, lambda: [run() for _ in range(s.voxel_reps)])
    want = voxelize(host, mode, grid=s.voxel_grid, extent=1.0)  # type: ignore[arg-type]
    got = run()
    sync(ctx)  # the side stream's work is done before the default stream reads it
    diff = float((got.cpu() - want).abs().max())
    allowed = PILLAR_TOLERANCE if mode == "pillars" else 0.0
    return {"points_per_s": s.points_batch * s.points_n * s.voxel_reps / seconds,
            "max_abs_diff_vs_cpu": diff, "grid": s.voxel_grid,
            "points": [s.points_batch, s.points_n],
            **({"status": "failed"} if diff > allowed else {})}


def scenes_on_device(ctx: Ctx) -> dict[str, Any]:
    """LiDAR scenes (pointcloud_loader per_point_labels, the portable backend: no DALI on
    the lent GPU) delivered to the device against the CPU loader's batches: points, labels,
    voxel rows and each point's voxel equal; then segvoxels alone on the device, points/s."""
    import torch

    from shardflow.pointcloud import segvoxels
    from shardflow.pointcloud.loader import pointcloud_loader
    from shardflow.tools.bench import lidar

    shards = lidar.build(ctx.work / "lidar", frames=4)
    options: dict[str, Any] = dict(batch_size=2, train=False, per_point_labels=True,
                                   backend="portable", voxel_size=lidar.VOXEL_SIZE,
                                   point_range=lidar.POINT_RANGE)
    with pointcloud_loader(str(shards), device="cpu", **options) as host, \
            pointcloud_loader(str(shards), device=ctx.device.type, **options) as dev:
        pairs = list(zip(host, dev, strict=True))
    fields = ("points", "offsets", "labels", "voxel_coords", "voxel_labels", "point_voxel")
    equal = all(torch.equal(getattr(a, f), getattr(b, f).cpu()) for a, b in pairs
                for f in fields)
    batch = pairs[0][1]
    frame = torch.repeat_interleave(torch.arange(len(batch), device=batch.points.device),
                                    torch.diff(batch.offsets))
    grid = segvoxels.VoxelGrid(lidar.VOXEL_SIZE, lidar.POINT_RANGE)

    def rows(on: Any) -> Any:
        return segvoxels.voxel_rows(batch.points.to(on), frame.to(on), batch.labels.to(on),
                                    grid, batch.ignore_label)

    # The loaders above voxelize on the CPU (the portable backend), so segvoxels on the
    # device is compared here, on the same batch: float64 cells, exact on either side.
    on_device, on_cpu = rows(batch.points.device), rows("cpu")
    rows_equal = all(torch.equal(getattr(on_device, f).cpu(), getattr(on_cpu, f))
                     for f in ("coords", "labels", "counts", "point_voxel"))
    reps = ctx.sizes.voxel_reps
    seconds = timed(ctx, lambda: [rows(batch.points.device) for _ in range(reps)])
    return {"batches_equal_to_cpu": equal, "voxel_rows_equal_to_cpu": rows_equal,
            "device": str(batch.points.device), "points": len(batch.points),
            "voxel_rows_points_per_s": len(batch.points) * reps / seconds,
            **({} if equal and rows_equal else {"status": "failed"})}


def part_text_pointcloud(ctx: Ctx) -> dict[str, Any]:
    """Language-model steps fed by the text loader; voxelization on the device; LiDAR scenes
    delivered to it."""
    shards = text_shards(ctx.work / "text", ctx.sizes.lm_docs)
    lm = {objective: lm_rate(ctx, shards, objective) for objective in ("clm", "mlm")}
    vox = {mode: voxel_rate(ctx, mode) for mode in ("occupancy", "pillars")}
    scenes = scenes_on_device(ctx)
    key: dict[str, Any] = {f"{o}_samples_per_s": round(r["samples_per_s"], 1)
                           for o, r in lm.items()}
    key["voxel_Mpoints_per_s"] = round(vox["occupancy"]["points_per_s"] / 1e6, 1)
    key["voxels_as_on_cpu"] = not any("status" in r for r in vox.values())
    key["scenes_equal_to_cpu"] = scenes["batches_equal_to_cpu"] and \
        scenes["voxel_rows_equal_to_cpu"]
    key["seg_voxel_Mpoints_per_s"] = round(scenes["voxel_rows_points_per_s"] / 1e6, 1)
    out = {"lm": lm, "lm_shape": ctx.sizes.lm_shape, "precision": "bf16" if ctx.cuda else "fp32",
           "voxelize": vox, "scenes": scenes, "key": key}
    if any("status" in r for r in (scenes, *vox.values())):
        out["status"] = "failed"
    return out


# -- dali ----------------------------------------------------------------------------------------

DISTINCT_PHOTOS = 64  # drawn (~35 ms each, one core); the rest of the corpus repeats them


def image_shards(ctx: Ctx, large: bool = False) -> Path:
    """`dali_images` photo-like JPEGs in shards, or `large_images` of 3000-4000 px. Drawing a
    photo takes about 35 ms on one core (a large one 1.6 s), which would be most of the part's
    time; decoding costs the same whether the bytes repeat or not, so DISTINCT_PHOTOS
    (`large_distinct`) are drawn and copied under further names."""
    import shutil

    from shardflow.builtin import make_large_photos, make_photo_corpus
    from shardflow.convert import ConvertConfig, convert

    sizes, name = ctx.sizes, "large" if large else "image"
    count = sizes.large_images if large else sizes.dali_images
    folder = make_large_photos(ctx.work / f"{name}-photos", count=sizes.large_distinct) \
        if large else make_photo_corpus(ctx.work / "photos", count=min(count, DISTINCT_PHOTOS))
    drawn = sorted(folder.glob("*/*.jpg"))
    for k in range(len(drawn), count):
        original = drawn[k % len(drawn)]
        shutil.copyfile(original, original.with_name(f"{original.stem}_copy{k}.jpg"))
    out = ctx.work / f"{name}-shards"
    convert(ConvertConfig(kind="imagefolder", src=str(folder), out=str(out), max_count=200,
                          workers=min(ctx.sizes.convert_workers, os.cpu_count() or 1)))
    return out


def loader_rate(ctx: Ctx, shards: Path, batch_size: int | None = None, **options: Any
                ) -> float:
    """Images/s of the image loader over one pass, after a warm-up pass."""
    from shardflow.image.loader import image_loader

    with image_loader(shards, batch_size=batch_size or ctx.sizes.dali_batch, use_tuning=False,
                      **options) as loader:
        for _ in loader:
            pass
        sync(ctx)
        start, seen = time.perf_counter(), 0
        for batch in loader:
            seen += len(batch)
        sync(ctx)
        elapsed = time.perf_counter() - start  # not the loader's close (DALI's teardown)
    return seen / elapsed


def large_photo_rates(ctx: Ctx) -> dict[str, float]:
    """On 3000-4000 px photos (issue 30): the portable backend's scaled decode of the rows a
    crop needs, which backend="auto" takes on a CPU, against DALI's CPU decode and, on a GPU,
    nvJPEG's whole decode, which "auto" keeps there (image/choose.py): the figure that says
    whether it should."""
    shards, device = image_shards(ctx, large=True), ctx.device.type  # batches land there
    batch = max(1, ctx.sizes.large_images // 4)  # several batches a pass, as bench_loader's
    rates = {"portable": loader_rate(ctx, shards, batch, backend="portable", device=device),
             "dali_cpu_decode": loader_rate(ctx, shards, batch, backend="dali", device=device,
                                            decode="cpu")}
    if ctx.cuda:
        rates["dali_mixed_decode"] = loader_rate(ctx, shards, batch, backend="dali",
                                                 device=device, decode="gpu")
        rates["mixed_over_portable"] = rates["dali_mixed_decode"] / rates["portable"]
    return rates


# The mean of |a - b| over the pixels of two eval batches of the same samples (0..255) above
# which two decodes disagree: nvJPEG's and libjpeg-turbo's IDCTs, and DALI's resize against
# torch's, differ by a level or two; a wrong window, flip or channel order by tens.
PIXELS_APART = 6.0


def decode_agreement(ctx: Ctx, shards: Path) -> dict[str, Any]:
    """Eval batches (centre crops, the stored order) of two decodes of the same shards: on a
    GPU the CPU decode against nvJPEG's, elsewhere torch's resize against the graph's (the
    same comparison on the CPU, so that the dry run drives it). The keys and labels must be
    the same, and the pixels close (PIXELS_APART); "failed" otherwise."""
    import torch

    from shardflow.image.loader import image_loader

    options: dict[str, Any] = dict(batch_size=ctx.sizes.dali_batch, use_tuning=False,
                                   train=False, backend="dali", device=ctx.device.type)
    second: dict[str, Any] = {"decode": "gpu"} if ctx.cuda else \
        {"decode": "cpu", "resize_on": "dali"}
    with image_loader(shards, decode="cpu", resize_on="torch", **options) as a, \
            image_loader(shards, **options, **second) as b:
        pairs = list(zip(a, b, strict=True))
    same = all(x.keys == y.keys and torch.equal(x.label.cpu(), y.label.cpu())
               for x, y in pairs)
    apart = max(float((x.image.float() - y.image.float()).abs().mean()) for x, y in pairs)
    return {"compared": "cpu vs nvjpeg decode" if ctx.cuda else "torch vs dali resize",
            "batches": len(pairs), "keys_and_labels_equal": same,
            "mean_abs_pixel_diff": round(apart, 3),
            **({} if same and apart <= PIXELS_APART else {"status": "failed"})}


@contextlib.contextmanager
def stage(seconds: dict[str, float], name: str) -> Iterator[None]:
    """How long a stage of the part took: the report says where its time went."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = time.perf_counter() - start


def part_dali(ctx: Ctx) -> dict[str, Any]:
    """CPU vs mixed decode, and the hw_decoder_load sweep (needs DALI); on large photos, the
    portable backend beside both."""
    probe = dali_probe()
    if not probe["dali_imports"]:
        return {"status": "skipped", "reason": f"nvidia.dali does not import: "
                                               f"{probe['dali_error']}"}
    seconds: dict[str, float] = {}
    with stage(seconds, "corpus_and_conversion"):
        shards = image_shards(ctx)
    rates: dict[str, Any] = {}
    with stage(seconds, "cpu_decode"):
        rates["cpu_decode"] = loader_rate(ctx, shards, device="cpu")
    if ctx.cuda:
        # the loader's default hw_decoder_load (0.65) is mixed_decode: three builds, not four
        with stage(seconds, "mixed_decode_and_sweep"):
            rates["mixed_decode"] = loader_rate(ctx, shards, device="gpu")
            rates["hw_decoder_load"] = {str(x): loader_rate(ctx, shards, device="gpu",
                                                            hw_decoder_load=x)
                                        for x in (0.0, 1.0)}
            rates["hw_decoder_load"]["0.65"] = rates["mixed_decode"]
    with stage(seconds, "agreement"):
        agreement = decode_agreement(ctx, shards)
    with stage(seconds, "large_photos"):
        rates["large"] = large_photo_rates(ctx)
    key = {k: round(v, 1) for k, v in rates.items() if isinstance(v, float)}
    key.update({f"large_{k}": round(v, 2 if k.endswith("_over_portable") else 1)
                for k, v in rates["large"].items()})
    key["pixel_diff"] = agreement["mean_abs_pixel_diff"]
    return {**probe, "images": ctx.sizes.dali_images, "images_per_s": rates, "key": key,
            "agreement": agreement, "stage_seconds": {k: round(v, 1) for k, v in seconds.items()},
            **({"status": "failed"} if "status" in agreement else {})}
