#!/usr/bin/env python3
"""Loader throughput: shardflow beside the usual loaders (docs/benchmarks.md).

    shardflow bench [--images 800] [--batch-size 64] [--repeats 5] [--json PATH]
    shardflow bench --modality text [--docs 20000]      # tokens/s
    shardflow bench --modality pointcloud [--clouds 600] # points/s, voxelization
    shardflow bench --modality lidar [--frames 24]  # per frame: overlap, voxels
    shardflow bench --modality tabular [--rows 100000]   # rows/s, hashing/core
    shardflow bench --modality captions  # a Pipeline: image + caption tokens + json
    shardflow bench --source my_images/                  # your data, not ours

Images:
Same JPEG bytes for everyone (a photo-like corpus as an image folder and as shards), same work
(random-resized-crop 224, flip, uint8 out; the RandAugment+mixup pair adds RandAugment and
mixup/cutmix, tools/bench/recipe.py), same batch size and thread count; contenders run
alternately after a warm-up, and every figure is a median of the repeats. Ratios are against
baselines measured in this same run: the median over the rounds of each round's pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from shardflow.builtin import make_large_photos, make_photo_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.image import choose
from shardflow.loading.readers import dali_importable, resolve_backend
from shardflow.tools.bench import beton, peers, recipe
from shardflow.tools.bench import image as bi
from shardflow.tools.bench.core import alternate, cpu_seconds, loader_figures
from shardflow.tools.util import positive_int, setup_logging

# Ours (uint8 out, normalized later on the accelerator) against each baseline; the last is
# the canonical recipe users run today, normalizing to float in the workers.
BASELINES = {"torchvision-style uint8": "tv", "webdataset + PIL": "wds",
             "DALI by hand": "dali", "DALI decode only": "decode",
             "torchvision-style float": "canonical float"}

# Other loaders with their own formats (written from the same photo folder when the contender is
# made), each where its package imports: the bench extra (pip install -e ".[bench]").
OPTIONAL = {"MosaicML Streaming": peers.MosaicStreaming, "LitData": peers.LitData,
            "FFCV": beton.Ffcv}  # FFCV: make bench-ffcv
FLOOR = "PIL 1/8-scale decode of whole photos"  # no loader, no crop: bench/image.py
LARGE = ("large", "camera")  # the built-in corpora of 3000-4000 px photos


def build_corpus(work: Path, images: int, batch: int, threads: int,
                 source: Path | None = None, photos: str = "small") -> bi.Corpus:
    """Shards of `source`, or of the built-in photos: ImageNet-sized ("small") or 3000-4000
    px of about 1 MB ("large", make_large_photos; "camera": the same with a restart marker
    every MCU row)."""
    folder = source or _photos(work / "photos", images, photos)
    images = len([p for p in folder.rglob("*") if p.is_file()]) if source else images
    convert(ConvertConfig(kind="imagefolder", src=str(folder), out=str(work / "shards"),
                          max_count=max(images // 8, 1), workers=threads))
    return bi.Corpus(folder, work / "shards", images, batch, threads)


def _photos(out: Path, count: int, photos: str) -> Path:
    if photos == "small":
        return make_photo_corpus(out, count=count)
    return make_large_photos(out, count=count, restart_rows=int(photos == "camera"))


def contenders(c: bi.Corpus, backend: str = "auto", photos: str = "small") -> dict[str, Any]:
    """Every contender; `backend` is shardflow's (the portable one is always run beside it).
    The DALI baselines only where nvidia.dali imports, MosaicML Streaming and LitData only
    where theirs do; on large photos, the whole-photo 1/8-scale decode (the entropy floor)."""
    # Each float variant runs right after its uint8 one: the pair compared is seconds apart
    # within a round (these machines drift; see Timings.ratio).
    runs = {"shardflow": bi.Ours(c, backend=backend),
            "shardflow float": bi.Ours(c, normalize=True, backend=backend),
            "shardflow portable": bi.Ours(c, backend="portable"),
            "shardflow portable, whole rows": bi.Ours(c, backend="portable", whole_rows=True),
            "torchvision-style uint8": bi.TorchvisionStyle(c),
            "torchvision-style float": bi.TorchvisionStyle(c, normalize=True),
            "webdataset + PIL": bi.WebdatasetPil(c),
            # the same recipe with RandAugment and mixup, each the way it is usually run
            "shardflow RandAugment+mixup": recipe.OursRecipe(c),
            "torchvision-style RandAugment+mixup": recipe.TorchvisionRecipe(c)}
    if dali_importable():
        runs.update({"DALI by hand": bi.DaliByHand(c),
                     "DALI decode only": bi.DaliByHand(c, decode_only=True)})
    runs.update({name: make(c) for name, make in OPTIONAL.items() if peers.importable(name)
                 and (name != "FFCV" or beton.jpeg_only(c.folder))})
    if photos in LARGE:
        runs[FLOOR] = bi.WholeEighthDecode(c)
    return runs


# Below either, a figure is the loader's start and prefetch, or the scheduler's noise.
MIN_BATCHES, MIN_TIMED_S = 4, 1.0  # an epoch's batches; a contender's seconds, all rounds


def too_small(c: bi.Corpus, timings: Any, runs: dict[str, Any]) -> str | None:
    """Why this run cannot be timed, or None: an epoch of a few batches is mostly the
    loader's start and its prefetch, and a contender timed for under a second in all is
    timer and scheduler noise."""
    batches = -(-c.images // c.batch_size)
    name = min(runs, key=timings.median)
    timed = sum(timings.seconds[name])
    if batches >= MIN_BATCHES and timed >= MIN_TIMED_S:
        return None
    return (f"too small to measure: {c.images} images are {batches} batches of "
            f"{c.batch_size}, and {name} was timed for {timed:.2f} s in all (at least "
            f"{MIN_BATCHES} batches and {MIN_TIMED_S:.0f} s are needed), so no ratio is "
            "shown; rerun with more --images or --repeats (the defaults measure)")


def report(c: bi.Corpus, timings: Any, runs: dict[str, Any], args: argparse.Namespace
           ) -> dict[str, Any]:
    rate = {name: timings.rate(name, c.images) for name in runs}
    small = too_small(c, timings, runs)
    ratios = {f"shardflow/{short}": round(timings.ratio("shardflow", name), 3)
              for name, short in {**BASELINES, **{n: n for n in OPTIONAL}}.items()
              if name in runs}
    ratios["shardflow portable/tv"] = round(
        timings.ratio("shardflow portable", "torchvision-style uint8"), 3)
    ratios["shardflow/shardflow portable, whole rows"] = round(
        timings.ratio("shardflow", "shardflow portable, whole rows"), 3)
    if FLOOR in runs:
        ratios[f"shardflow/{FLOOR}"] = round(timings.ratio("shardflow", FLOOR), 3)
    ratios["shardflow float/torchvision-style float"] = round(
        timings.ratio("shardflow float", "torchvision-style float"), 3)
    ratios["shardflow float/shardflow"] = round(timings.ratio("shardflow float", "shardflow"), 3)
    ratios["shardflow RandAugment+mixup/tv RandAugment+mixup"] = round(timings.ratio(
        "shardflow RandAugment+mixup", "torchvision-style RandAugment+mixup"), 3)
    return {
        "images": c.images, "batch_size": c.batch_size, "threads": c.threads,
        "too_small": small,  # then the table prints no ratio (the JSON keeps them)
        "photos": "your source" if args.source else args.photos,
        "backend": runs["shardflow"].loader.backend,  # what "shardflow" ran ("auto" resolved)
        "repeats": args.repeats, "torchvision": runs["torchvision-style uint8"].flavour,
        "recipe_torchvision": runs["torchvision-style RandAugment+mixup"].flavour,
        "images_per_s": {k: round(v, 1) for k, v in rate.items()}, "ratios": ratios,
        "images_read": timings.counts,  # by each timed epoch: the same work for all
        "cpu_s_per_image": {k: round(statistics.median(timings.cpu[k]) / c.images, 5)
                            for k in runs},
        # time to first batch, overlap, memory per epoch (bench/core.py)
        **loader_figures(lambda: bi.Ours(c, backend=args.backend).loader, args.epochs),
    }


def print_table(r: dict[str, Any]) -> str:
    lines = [f"{r['images']} photo-like JPEGs ({r.get('photos', 'small')}), batch "
             f"{r['batch_size']}, {r['threads']} threads,"
             f" median of {r['repeats']} (torchvision: {r['torchvision']}; shardflow: the "
             f"{r['backend']} backend)", "",
             "| loader | images/s | CPU-s/image |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {r['cpu_s_per_image'][k]} |" for k, v in r["images_per_s"].items()]
    if r.get("too_small"):
        lines += ["", r["too_small"]]
    else:
        lines += ["", "| ratio (x faster than) | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in r["ratios"].items()]
    lines += ["", f"time to first batch: {r['time_to_first_batch_s']} s (from building the "
              "loader to its first batch)",
              f"overlap: {r['overlap']} (an epoch beside a stand-in training step as long as "
              "its loading, over the longer of the two alone: 1.0 hides loading entirely)",
              f"memory: RSS after each epoch {r['rss_mb_after_each_epoch']} MB, peak "
              f"{r['peak_rss_mb']} MB (flat: nothing grows from epoch to epoch)"]
    return "\n".join(lines)


def tune(c: bi.Corpus, args: argparse.Namespace) -> None:
    """Every configuration that matters here, alternated; the fastest goes to the file, and
    with backend auto both backends' fastest, as a point of the split choose.py draws."""
    from shardflow.loading import tuning
    from shardflow.loading.tuning import Tuning, default_path

    configs = tune_configs(c, args.backend)
    runs = {json.dumps(cfg): bi.Ours(c, **cfg) for cfg in configs}
    timings = alternate({key: ours.epoch for key, ours in runs.items()}, repeats=args.repeats,
                        expect=c.images)
    table = sorted(({**json.loads(key), "images_per_s": round(timings.rate(key, c.images), 1)}
                    for key in runs), key=lambda row: -row["images_per_s"])
    for row in table:
        print(row)
    # The file's choices are the DALI backend's where it ran (the portable one has none of
    # its own beyond threads and prefetch); the split says when to leave DALI. A backend not
    # measured this time (--backend dali or portable) keeps what the file said of it.
    path = args.tuning_file or default_path()
    old = tuning.load(path)
    dali = [row for row in table if row["backend"] == "dali"]
    portable = next((row for row in table if row["backend"] == "portable"), None)
    best = dali[0] if dali else table[0]
    float_on = tune_float(c, args, best) if "resize_on" in best else None
    split = backend_split(c, table, path)
    mine = {k: portable[k] for k in ("threads", "prefetch")} if portable else \
        (old.portable if old else None)
    if dali or not dali_importable():  # DALI measured, or no DALI loader here to tune
        found = Tuning(best["decode"], best["reader"], best["threads"], best["prefetch"],
                       best["images_per_s"], table, hw_decoder_load=best.get("hw_decoder_load"),
                       resize_on=best.get("resize_on"), resize_on_float=float_on,
                       backend_split=split, portable=mine)
    elif old is not None:  # --backend portable: DALI's choices as the file had them
        found = dataclasses.replace(old, backend_split=split, portable=mine)
    else:  # nothing measured on DALI: its decode and reader left automatic
        found = Tuning("auto", "auto", best["threads"], best["prefetch"],
                       best["images_per_s"], table, backend_split=split, portable=mine)
    found.save(path)
    print(f"fastest: {table[0]}; the file's choices: {found.choices()}, with normalize=True, "
          f"resize_on={found.resize_on_float}; the portable backend's: {mine}; written to "
          f"{path}")
    if split:
        print(f"backend='auto' takes the portable backend from a median shorter side of "
              f"{choose.split(split):.2f}x the output size (both backends: {split})")


def tune_configs(c: bi.Corpus, backend: str) -> list[dict[str, Any]]:
    """The configurations --tune alternates: each backend's own choices (both with 'auto')."""
    import torch

    # Where decoding runs, for batches that land where training will run: the GPU if any.
    # The portable backend has fewer choices: it streams and decodes on the CPU, in torch.
    dali = resolve_backend(backend, "image") == "dali"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decodes = ["cpu", "gpu"] if device == "cuda" and dali else ["cpu"]
    configs: list[dict[str, Any]] = [
        {"device": device, "decode": d, "reader": r, "threads": t, "prefetch": p,
         "backend": "dali"}
        for d in decodes for r in ("dali", "stream")
        for t in (c.threads, c.threads + 1) for p in (2, 4)] if dali else []
    # On a GPU, the share of JPEGs sent to the hardware decoder (the rest: CUDA + CPU Huffman);
    # on the CPU, where resize, flip and normalize run: torch in the decode stage, or the graph
    configs = [{**cfg, "hw_decoder_load": h, "resize_on": on} for cfg in configs
               for h in ((0.0, 0.65, 0.9) if cfg["decode"] == "gpu" else (None,))
               for on in ((None,) if cfg["decode"] == "gpu" else ("torch", "dali"))]
    if backend != "dali":
        configs += [{"device": device, "decode": "cpu", "reader": "stream", "threads": t,
                     "prefetch": p, "backend": "portable"}
                    for t in (c.threads, c.threads + 1) for p in (2, 4)]
    return [{k: v for k, v in cfg.items() if v is not None} for cfg in configs]


def backend_split(c: bi.Corpus, table: list[dict[str, Any]], path: Path
                  ) -> list[dict[str, float]]:
    """Both backends' fastest on this corpus at its side ratio (choose.py), decoding on the
    CPU (the split is used only there: a GPU's nvJPEG keeps DALI), added to the points the
    tuning file at `path` already holds for this machine (a point at nearly the same ratio
    replaced; all of them kept as they are where one backend was not measured)."""
    from shardflow.loading import tuning
    from shardflow.loading.shardlist import resolve_source

    fastest = {row["backend"]: row["images_per_s"] for row in reversed(table)
               if row["decode"] == "cpu"}
    old = tuning.load(path)
    listed = old.backend_split if old and isinstance(old.backend_split, list) else []
    kept = [o for o in listed if choose.valid(o)]  # the file may have been edited by hand
    ratio = choose.side_ratio(resolve_source(str(c.shards)), c.size)
    if set(fastest) != {"dali", "portable"} or ratio is None:
        return kept
    kept = [o for o in kept if abs(math.log(float(o["side_ratio"]) / ratio)) > 0.1]
    point = {"side_ratio": round(ratio, 3), "dali": fastest["dali"],
             "portable": fastest["portable"]}
    return sorted([*kept, point], key=lambda o: o["side_ratio"])


def tune_float(c: bi.Corpus, args: argparse.Namespace, best: dict[str, Any]) -> str:
    """Where float output is made fastest, the rest of the winner kept: normalized per image
    into the batch by torch, or by the DALI graph's crop_mirror_normalize."""
    fixed = {k: v for k, v in best.items() if k not in ("images_per_s", "resize_on")}
    runs = {on: bi.Ours(c, **fixed, resize_on=on, normalize=True) for on in ("torch", "dali")}
    timings = alternate({on: ours.epoch for on, ours in runs.items()}, repeats=args.repeats,
                        expect=c.images)
    for on in runs:
        print({**fixed, "resize_on": on, "normalize": True,
               "images_per_s": round(timings.rate(on, c.images), 1)})
    return min(runs, key=timings.median)


def plot(r: dict[str, Any], path: Path) -> None:
    """Images/s per loader (ours highlighted, ratios written on the bars) and RSS per epoch."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rates = list(r["images_per_s"]), list(r["images_per_s"].values())
    ours = r["images_per_s"]["shardflow"]
    fig, (bars, memory) = plt.subplots(1, 2, figsize=(12, 4.5),
                                       gridspec_kw={"width_ratios": [2, 1]})
    colours = ["tab:orange" if n.startswith("shardflow") else "tab:blue" for n in names]
    bars.barh(names, rates, color=colours)
    for i, rate in enumerate(rates):
        bars.text(rate, i, f" {rate:.0f}  (ours {ours / rate:.2f}x)", va="center", fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("images/s (median)")
    bars.set_xlim(0, max(rates) * 1.35)
    memory.plot(range(1, len(r["rss_mb_after_each_epoch"]) + 1), r["rss_mb_after_each_epoch"],
                marker="o")
    memory.set_xlabel("epoch of shardflow's loader")
    memory.set_ylabel("resident memory of the process (MB)")
    memory.set_ylim(0, max(r["rss_mb_after_each_epoch"]) * 1.1)  # from 0: 1% looks as 1%
    fig.suptitle(f"{r['images']} photo-like JPEGs, batch {r['batch_size']}, "
                 f"{r['threads']} threads; time to first batch {r['time_to_first_batch_s']} s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def other_modality(args: argparse.Namespace) -> int:
    """Text or point clouds: their own contenders and figures (bench/text.py,
    bench/pointcloud.py); the same table, --json and --plot outputs."""
    args.work.mkdir(parents=True, exist_ok=True)
    if args.modality == "text":
        from shardflow.builtin import make_text_corpus
        from shardflow.tools.bench import text as bench_text

        shards = args.source
        if shards is None:
            docs = make_text_corpus(args.work / "docs", docs=args.docs)
            shards = args.work / "shards"
            convert(ConvertConfig(kind="text", src=str(docs), out=shards, max_count=200,
                                  workers=args.threads))
        result, table = bench_text.run(shards, args.work, args.batch_size, args.repeats,
                                       threads=args.threads)
    elif args.modality == "captions":
        from shardflow.tools.bench import captions as bench_captions

        result, table = bench_captions.run(args)
    elif args.modality == "tabular":
        from shardflow.tools.bench import tabular as bench_tabular

        result, table = bench_tabular.run(args)
    elif args.modality == "lidar":
        from shardflow.tools.bench import lidar as bench_lidar

        result, table = bench_lidar.run(args)
    else:
        from shardflow.tools.bench import pointcloud as bench_pointcloud

        result, table = bench_pointcloud.run(args)
    return write_outputs(args, result, table,
                         lambda path: plot_rates(result, path, args.modality))


def write_outputs(args: argparse.Namespace, result: dict[str, Any], table: str,
                  chart: Callable[[Path], None]) -> int:
    """The table on the terminal, --json (and the table as .md beside it), --plot; then the
    work folder goes."""
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table + "\n")
    if args.plot:
        chart(args.plot)
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


def plot_rates(result: dict[str, Any], path: Path, modality: str) -> None:
    """One bar chart of every `*_per_s` figure in the result, grouped by its section."""
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no chart written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = list(_rates(result))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.5))
    ax.barh([name for name, _ in bars], [value for _, value in bars],
            color=["tab:orange" if "shardflow" in name else "tab:gray" for name, _ in bars])
    for i, (_, value) in enumerate(bars):
        ax.text(value, i, f" {value:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{modality} loader throughput (per second; ours in orange)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _rates(tree: Any, prefix: str = "") -> Any:
    for key, value in tree.items() if isinstance(tree, dict) else ():
        if key.endswith("_per_s") and isinstance(value, dict):
            for name, rate in value.items():
                yield f"{prefix}{name} ({key})", float(rate)
        elif isinstance(value, dict):
            yield from _rates(value, f"{prefix}{key}: ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=positive_int, default=None,
                   help="built-in photos (default 800 small, 120 large)")
    p.add_argument("--photos", choices=("small", *LARGE), default="small",
                   help="the built-in corpus: ImageNet-sized photos (350-500 px), or today's "
                   "(3000-4000 px, about 1 MB each); camera: today's with a restart marker "
                   "every MCU row, as phones' and cameras' encoders write them")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="default 64; large photos 16; lidar: 2 frames")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    # 5 rounds: on these shared machines one contender's repeats varied by up to 1.6x in a row
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--epochs", type=positive_int, default=4, help="for the memory figure")
    p.add_argument("--work", type=Path, default=Path("bench-out/loader-work"))
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    p.add_argument("--tune", action="store_true",
                   help="measure loader configurations on this machine and write the fastest "
                   "to the tuning file that image_loader's automatic choices use")
    p.add_argument("--tuning-file", type=Path, default=None,
                   help="where --tune writes (default ~/.cache/shardflow/tuning.json)")
    p.add_argument("--backend", choices=("auto", "dali", "portable"), default="auto",
                   help="shardflow's backend (and --tune's); 'shardflow portable' always runs "
                   "beside it; auto: DALI where it imports")
    p.add_argument("--modality", choices=("image", "captions", "text", "pointcloud", "lidar",
                                          "tabular"),
                   default="image")
    p.add_argument("--source", type=Path, default=None,
                   help="benchmark this data instead of the built-in corpus: an image folder "
                   "(class subfolders) for images, shards with manifest.json for text and "
                   "point clouds, a Criteo-style TSV file for tabular")
    # 20,000 documents (10 M byte tokens): an epoch of 2,000 lasted 0.06 s, a third of it the
    # loader's start (threads, DALI's reader), which a real corpus's epoch never notices
    p.add_argument("--docs", type=positive_int, default=20_000, help="text: built-in documents")
    p.add_argument("--clouds", type=positive_int, default=600,
                   help="pointcloud: built-in clouds")
    p.add_argument("--frames", type=positive_int, default=24,
                   help="lidar: built-in ray-cast frames (~78,000 points each)")
    p.add_argument("--rows", type=positive_int, default=100_000,
                   help="tabular: built-in Criteo-style rows")
    args = p.parse_args(argv)
    _defaults(args)
    setup_logging(quiet=True)
    shutil.rmtree(args.work, ignore_errors=True)
    if args.modality != "image":
        return other_modality(args)
    corpus = build_corpus(args.work, args.images, args.batch_size, args.threads, args.source,
                          args.photos)
    if args.tune:
        tune(corpus, args)
        shutil.rmtree(args.work, ignore_errors=True)
        return 0
    runs = contenders(corpus, args.backend, "your source" if args.source else args.photos)
    timings = alternate({k: v.epoch for k, v in runs.items()}, repeats=args.repeats,
                        cpu_clock=cpu_seconds, expect=corpus.images)
    result = report(corpus, timings, runs, args)
    return write_outputs(args, result, print_table(result), lambda path: plot(result, path))


def _defaults(args: argparse.Namespace) -> None:
    """The batch size and corpus size left to the modality and corpus."""
    large = args.photos in LARGE
    if args.batch_size is None:  # large photos: 16 a batch, as the photos people train on
        args.batch_size = 2 if args.modality == "lidar" else 16 if large else 64
    if args.images is None:  # several batches an epoch: a loader's prefetch is no epoch
        args.images = 120 if large else 800


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
