"""The pipeline part of tools/gpu_check.py: a shardflow.Pipeline delivered to CUDA.

  pipeline   image + caption tokens + JSON + a depth map (shards written here with tarfile,
             img2dataset's layout, indexed) through a Pipeline with a flip and an affine,
             delivered to the device against the same pipeline on the CPU: the same keys,
             tokens and JSON, pixels a level apart at most (outside nearest-neighbour ties),
             depth within 1e-3; host syncs counted while iterating; batches/s.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from shardflow.tools.bench.gpu.context import Ctx
from shardflow.tools.bench.gpu.steps import counted_syncs


def write_shards(out: Path, samples: int) -> Path:
    """One tar of `samples` image + caption + JSON + depth samples (plain tarfile: the GPU
    machine has no webdataset), indexed for the loaders."""
    import numpy as np
    from PIL import Image

    from shardflow.shards.indexing import index_folder

    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ys, xs = np.mgrid[0:60, 0:56]
    with tarfile.open(out / "00000.tar", "w") as tar:
        for n in range(samples):
            rgb, depth = io.BytesIO(), io.BytesIO()
            Image.fromarray(np.stack([xs * 4, ys * 4, np.full_like(xs, 8 * n)], -1)
                            .astype(np.uint8)).save(rgb, "PNG")
            np.save(depth, (xs + 2.0 * ys + n).astype(np.float32))
            members = {"png": rgb.getvalue(), "depth.npy": depth.getvalue(),
                       "txt": f"caption number {n}".encode(),
                       "json": json.dumps({"n": n}).encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"p{n:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    index_folder(out)
    return out


def _pipeline(shards: Path, device: str) -> Any:
    import shardflow as sf

    image = sf.fields.Image(size=48, train=True, threads=2, use_tuning=False,
                            augment=[sf.ops.Flip(), sf.ops.Affine(degrees=15)])
    return (sf.Pipeline(shards, seed=0, backend="portable")
            .fields(png=image, txt=sf.fields.Tokens("bytes", length=24),
                    json=sf.fields.Json(), depth=sf.fields.Depth(member="depth.npy"))
            .batch(8).to(device))


def part_pipeline(ctx: Ctx) -> dict[str, Any]:
    """The pipeline on the device against the CPU."""
    shards = write_shards(ctx.work / "pipeline-shards", 24 if ctx.dry else 96)
    with _pipeline(shards, "cpu").loader() as loader:
        want = list(loader)
    found: list[str] = []
    with _pipeline(shards, "cuda" if ctx.cuda else "cpu").loader() as loader:
        start = time.perf_counter()
        with counted_syncs(ctx, found):
            got = list(loader)
        seconds = time.perf_counter() - start
        where = {s["stage"]: s["runs"] for s in loader.describe()}
    pairs = list(zip(got, want, strict=True))
    apart = max(float(((a["png"].cpu().int() - b["png"].int()).abs() > 1).float().mean())
                for a, b in pairs)
    depth = max(float((a["depth"].cpu() - b["depth"]).abs().max()) for a, b in pairs)
    out: dict[str, Any] = {
        "batches": len(got), "keys_match": all(a.keys == b.keys for a, b in pairs),
        "tokens_equal": all(bool((a["txt"].cpu() == b["txt"]).all()) for a, b in pairs),
        "json_equal": all(a["json"] == b["json"] for a, b in pairs),
        "images_apart_share": apart, "depth_max_diff": depth,
        "on_device": str(got[0]["png"].device), "stages": where,
        "host_syncs_while_iterating": len(found) if ctx.cuda else None,
        "first_syncs": found[:5], "batches_per_s": round(len(got) / seconds, 1)}
    out["key"] = {k: out[k] for k in ("keys_match", "images_apart_share", "depth_max_diff",
                                      "host_syncs_while_iterating", "batches_per_s")}
    if not (out["keys_match"] and out["tokens_equal"] and out["json_equal"]) or \
            apart > 0.01 or depth > 1e-3:
        out.update(status="failed", error="the pipeline's device batches are not its CPU "
                   "batches")
    return out
