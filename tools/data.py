"""`shardflow data OUT`: the built-in datasets as raw files, for trying every command and the
docs' examples without data of your own (no download: pipeline/builtin generates them).

    shardflow data sample/                 # sample/images, photos, text, clouds, clicks
    shardflow data sample/ --only photos   # one of them
    shardflow convert imagefolder sample/images shards/train

What each folder holds, and which `convert` kind reads it:

    images/   10 classes of shapes and textures, 64 px (imagefolder): learnable in seconds
    photos/   photo-like JPEGs of 350-500 px in 10 class folders (imagefolder): benchmarks
    text/     generated UTF-8 documents, one .txt each (text)
    clouds/   point clouds of geometric primitives, .npy and .xyz (pointcloud)
    clicks/   Criteo-style click logs, part-00000.tsv, and their planted AUC (tabular
              --preset criteo)

The same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from shardflow.tools.util import positive_int, run_main

# name -> (generator of it into a folder at a size, what it is)
Maker = Callable[[Path, int], Path]


def _makers() -> dict[str, tuple[Maker, int, str]]:
    from shardflow import builtin

    return {
        "images": (lambda p, n: builtin.make_image_folder(p, per_class=n), 40,
                   "images per class"),
        "photos": (lambda p, n: builtin.make_photo_corpus(p, count=n), 200, "photos"),
        "text": (lambda p, n: builtin.make_text_corpus(p, docs=n), 400, "documents"),
        "clouds": (lambda p, n: builtin.make_pointcloud_folder(p, per_class=n), 20,
                   "clouds per class"),
        "clicks": (lambda p, n: builtin.make_ctr_dataset(p, rows=n), 20_000, "rows"),
    }


NAMES = ("images", "photos", "text", "clouds", "clicks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write into (its subfolders must be new "
                   "or empty)")
    p.add_argument("--only", default=",".join(NAMES),
                   help=f"comma-separated subset of {', '.join(NAMES)}")
    p.add_argument("--scale", type=positive_int, default=1,
                   help="multiply every dataset's size (1: a few MB, seconds to make)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(NAMES))
    if unknown or not wanted:
        raise ValueError(f"--only {args.only!r}: choose among {', '.join(NAMES)}")
    makers = _makers()
    for name in wanted:
        make, size, unit = makers[name]
        folder = make(args.out / name, size * args.scale)
        print(f"{folder}: {size * args.scale} {unit}")
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    run_main(lambda: main(argv))


if __name__ == "__main__":
    entry()
