"""`shardflow show SRC`: look at a shard set, a picture at a time (access/view.py).

    shardflow show shards/images --grid 8x8 --out grid.png       # a grid of samples
    shardflow show shards/images --grid 4x4 --augment rand-m9-n2 --out aug.png
    shardflow show shards/images --stats --out stats.png         # + stats.json beside it
    shardflow show shards/images --key 03_ring_03_ring_00012     # one sample, whole
    shardflow show shards/text --at 7

A grid draws samples drawn evenly from --seed (or the first ones with --first), captioned with
their label's name (the manifest's classes), their own caption (.txt), their key otherwise:
images fitted in a tile, documents as excerpts, point clouds projected from above, the front
and the side. With --augment each image tile is followed by the same image through those ops
(shardflow.ops, drawn per key), to see what an augmentation does. --stats counts classes, image
sizes and aspects (from headers), text lengths, stored tokens and points per cloud, over every
sample or --limit of them, as a PNG of histograms and the same figures as JSON. --key/--index
print one sample's members and decoded values, and with --out save its picture.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, NoReturn

from shardflow.tools.util import add_storage_options, positive_int, run_main, setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="shards: a folder with manifest.json, a glob, a URL")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--grid", default=None, metavar="COLSxROWS",
                      help="draw a grid of samples (default 8x8 when nothing else is asked)")
    what.add_argument("--stats", action="store_true", help="histograms of what it holds")
    what.add_argument("--key", default=None, help="one sample by key")
    what.add_argument("--at", type=int, default=None, metavar="N",
                      help="one sample by its number in the source (0-based)")
    p.add_argument("--out", type=Path, default=None,
                   help="the PNG to write (grid and stats: default show.png / stats.png; "
                   "stats writes the .json beside it)")
    p.add_argument("--augment", default=None, metavar="SPEC",
                   help="grid: each image again through these ops (rand-m9-n2, trivial, "
                   "original)")
    p.add_argument("--first", action="store_true", help="grid: the first samples, in order")
    p.add_argument("--seed", type=int, default=0, help="which samples a grid draws")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="stats: count this many samples, drawn evenly (default: all)")
    p.add_argument("--index", "--index-dir", dest="index_dir", default=None, metavar="DIR",
                   help="the shards' .idx files and manifest, when not beside them (as "
                   "verify's and train's --index)")
    add_storage_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.index_dir is not None and args.index_dir.isdigit() and \
            not Path(args.index_dir).is_dir():
        raise ValueError(f"--index {args.index_dir}: --index names the index folder, as in "
                         f"verify and train; for sample {args.index_dir}, use --at "
                         f"{args.index_dir}")
    setup_logging(quiet=False)
    from shardflow.access.dataset import ShardDataset

    ds = ShardDataset(args.src, storage_options=args.storage_options, index=args.index_dir,
                      on_error="skip")
    if args.key is not None or args.at is not None:
        return _one(ds, args)
    if args.stats:
        return _stats(ds, args)
    return _grid(ds, args)


def _grid(ds: Any, args: argparse.Namespace) -> int:
    from shardflow.access import view

    cols, rows = _shape(args.grid or "8x8")
    count = min(len(ds), cols * rows // (2 if args.augment else 1))
    picks = list(range(count)) if args.first else \
        sorted(random.Random(args.seed).sample(range(len(ds)), count))
    names = {v: k for k, v in (ds.source.classes or {}).items()}
    ops = _ops(args.augment) if args.augment else None
    tiles = []
    for i in picks:
        sample = ds[i]
        if sample is None:  # bad: named in the log, and a tile says so
            sample = {"__key__": ds.key(i)}
        caption = _caption(sample, names)
        tiles.append(view.tile(sample, caption))
        if ops is not None:
            tiles.append(view.tile(_augmented(sample, ops, args.seed), "+ " + args.augment))
    out = args.out or Path("show.png")
    view.grid(tiles, cols).save(out)
    print(f"{out}: {len(picks)} samples of {len(ds)} from {ds.source.describe()}"
          + (f"; {len(ds.skipped.entries)} bad (named above)" if ds.skipped.entries else ""))
    return 0


def _shape(text: str) -> tuple[int, int]:
    cols, sep, rows = text.lower().partition("x")
    if not sep or not cols.isdigit() or not rows.isdigit() or not int(cols) or not int(rows):
        raise ValueError(f"--grid {text!r}: COLSxROWS, e.g. 8x8")
    return int(cols), int(rows)


def _ops(spec: str) -> Any:
    from shardflow.ops import spec as ops_spec

    return ops_spec.parse(spec)


def _caption(sample: dict[str, Any], names: dict[int, str]) -> str:
    """A tile's caption: the label's class name, else the sample's own caption (`.txt`
    beside an image, as img2dataset writes it), else its key."""
    label, text = sample.get("label"), sample.get("txt")
    name = names.get(label) if isinstance(label, int) else None
    return name or (text.strip() if isinstance(text, str) and text.strip()
                    else str(sample["__key__"]))


def _augmented(sample: dict[str, Any], ops: Any, seed: int) -> dict[str, Any]:
    """The sample's image through `ops`, drawn from (seed, key); others as they are."""
    if "image" not in sample:
        return sample
    import torch

    from shardflow import ops as ops_lib

    image = torch.from_numpy(sample["image"]).permute(2, 0, 1).unsqueeze(0).contiguous()
    rng = random.Random(f"show/{seed}/{sample['__key__']}")
    out = ops_lib.apply(ops, image, [rng])
    return {**sample, "image": out[0].permute(1, 2, 0).numpy()}


def _stats(ds: Any, args: argparse.Namespace) -> int:
    from shardflow.access import stats, view

    found = stats.gather(ds, args.limit, args.seed)
    out = args.out or Path("stats.png")
    panels = []
    if "classes" in found:
        panels.append(view.histogram("samples per class", list(found["classes"]),
                                     list(found["classes"].values())))
    titles = {"width": "image width (px)", "height": "image height (px)",
              "aspect": "aspect (width / height)", "length": "text length (characters)",
              "tokens": "stored tokens per document", "points": "points per cloud"}
    for name, title in titles.items():
        if name in found:
            bins = found[name]["bins"]
            names = [f"{a}" if a == b else f"{a}-{b}" for a, b, _ in bins]
            panels.append(view.histogram(title, names, [c for _, _, c in bins]))
    if not panels:
        bad = ", ".join(f"{reason}={n}" for reason, n in found["bad"].items())
        every = found["bad"] and sum(found["bad"].values()) == found["counted"]
        why = (f"every sample counted is bad ({bad})" if every
               else "no labels, images, text or clouds found")
        raise ValueError(f"{ds.source.describe()}: nothing to count: {why}")
    view.sheet(panels).save(out)
    out.with_suffix(".json").write_text(json.dumps(found, indent=1) + "\n")
    print(f"{out}, {out.with_suffix('.json')}: {found['counted']} of {found['samples']} "
          "samples counted")
    return 0


def _one(ds: Any, args: argparse.Namespace) -> int:
    from shardflow.access import view

    i = args.at if args.at is not None else ds.index_of(args.key)
    raw = ds.raw(i)
    if raw is None:
        return 1  # its shard cut short: the reason was logged, naming shard and key
    print(f"index {i % len(ds)}, key {raw['__key__']!r}, shard {raw['__url__']}")
    for name, value in raw.items():
        if not name.startswith("__"):
            print(f"  .{name}: {len(value)} bytes{_preview(value)}")
    sample = ds[i]
    if sample is None:
        return 1  # the reason was logged, naming shard and key
    for name, value in sample.items():
        if not name.startswith("__"):
            print(f"  {name}: {_describe(value)}")
    if args.out is not None:
        view.tile(sample, str(sample["__key__"]), size=256).save(args.out)
        print(f"{args.out}: its picture")
    return 0


def _preview(value: bytes) -> str:
    if len(value) <= 64 and all(32 <= b < 127 for b in value):
        return f": {value.decode()!r}"
    return ""


def _describe(value: Any) -> str:
    import numpy as np

    if isinstance(value, np.ndarray):
        stats = f", min {value.min()}, max {value.max()}" if value.size else ""
        return f"{value.dtype} {tuple(value.shape)}{stats}"
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv), usage=(KeyError, IndexError))


if __name__ == "__main__":
    entry()
