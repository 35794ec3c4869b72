#!/usr/bin/env python3
"""Shard conversion speed: make_shards (1 and 2 workers) against plain `tar` of the same files,
webdataset's ShardWriter with a PIL decode of every image (what a script checking its inputs
does), and the converters of MosaicML Streaming (MDSWriter) and LitData (litdata.optimize, 2
workers) where they import (the bench extra: pip install -e ".[bench]").

    shardflow bench-convert --out bench-out [--count 2000] [--repeats 3]

Input MB/s on the built-in photo-like corpus, medians of alternating repeats after a warm-up,
and ratios measured in the same run: against `tar -cf`, make_shards' 2 workers against its 1,
and make_shards against ShardWriter + PIL. Every image is checked by both converters that
check: make_shards decodes a JPEG at 1/8 scale (as strong: tests/test_cheap_check.py), the
ShardWriter script fully. Start-up is make_shards on a corpus of 2 photos with the same
settings (in this process: the workers' fork server is already running), and its share of a
run is reported. Every repeat does the whole work: each contender replaces its previous
output. Writes convert.json and convert.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from shardflow.builtin import make_photo_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.tools.bench.core import alternate
from shardflow.tools.util import positive_int, setup_logging

# Shards of about the same size for everyone (make_shards' max_size below).
SHARD_BYTES = 64_000_000
SHARDWRITER = "webdataset ShardWriter + PIL check"
RATIOS = (("make_shards 2 workers", "make_shards 1 worker"),
          ("make_shards 2 workers", SHARDWRITER), ("make_shards 1 worker", SHARDWRITER))


def write_shardwriter(src: Path, out: Path) -> int:
    """The folder as webdataset shards, each image decoded whole by PIL first (a file it
    cannot decode stops the script, as an unchecked one would stop a training run later)."""
    import io

    import webdataset as wds
    from PIL import Image

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from shardflow.tools.bench.image import folder_items

    items = folder_items(src)
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxsize=SHARD_BYTES, maxcount=10**9,
                         verbose=0) as sink:
        for i, (path, label) in enumerate(items):
            data = path.read_bytes()
            with Image.open(io.BytesIO(data)) as img:
                img.load()
            sink.write({"__key__": f"{i:08d}", "jpg": data, "cls": str(label).encode()})
    return len(items)


def startup_seconds(scratch: Path, repeats: int) -> dict[str, float]:
    """make_shards' fixed cost per run, by worker count: the median over `repeats` runs on a
    corpus of 2 photos."""
    tiny = make_photo_corpus(scratch / "tiny", count=2, classes=2)
    found = {}
    for workers in (1, 2):
        def run(workers: int = workers) -> None:
            convert(ConvertConfig(kind="imagefolder", src=str(tiny), out=str(scratch / "tiny-out"),
                                  max_size=SHARD_BYTES, workers=workers, overwrite=True))
        found[f"make_shards {workers} worker{'s' if workers > 1 else ''}"] = \
            alternate({"tiny": run}, repeats=repeats).median("tiny")
    return found


def contenders(src: Path, scratch: Path) -> dict[str, object]:
    # Imported here, not at the top: make_shards' workers import this script again (as every
    # multiprocessing worker imports its main module), and shardflow.tools.bench.peers imports
    # torch, which a make_shards run never does (a second of start-up per worker).
    from shardflow.tools.bench import peers

    def plain_tar() -> None:
        subprocess.run(["tar", "-cf", str(scratch / "plain.tar"), "-C", str(src), "."],
                       check=True)

    def shards(workers: int):  # type: ignore[no-untyped-def]
        def run() -> None:
            convert(ConvertConfig(kind="imagefolder", src=str(src),
                                  out=str(scratch / f"w{workers}"),
                                  max_size=SHARD_BYTES, workers=workers, overwrite=True))
        return run

    def shardwriter() -> None:
        write_shardwriter(src, scratch / "wds")

    def mds() -> None:  # the same columns as the loader benchmark's: JPEG bytes, label
        peers.write_mds(src, scratch / "mds", size_limit=SHARD_BYTES)

    def litdata() -> None:
        peers.write_litdata(src, scratch / "litdata", workers=2, chunk_bytes=SHARD_BYTES)

    runs = {"tar -cf": plain_tar, "make_shards 1 worker": shards(1),
            "make_shards 2 workers": shards(2), SHARDWRITER: shardwriter}
    if peers.importable("MosaicML Streaming"):
        runs["MDSWriter (MosaicML Streaming)"] = mds
    if peers.importable("LitData"):
        runs["litdata.optimize"] = litdata
    return runs


def significant(x: float, figures: int = 4) -> float:
    return float(f"{x:.{figures}g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--count", type=positive_int, default=2000, help="photos in the corpus")
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    setup_logging(quiet=True)
    work = args.out / "convert-work"
    shutil.rmtree(work, ignore_errors=True)
    src = make_photo_corpus(work / "photos", count=args.count)
    mb = sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) / 1e6
    runs = contenders(src, work)
    timings = alternate(runs, repeats=args.repeats)  # type: ignore[arg-type]
    startup = startup_seconds(work, max(args.repeats, 3))
    # Four significant figures: on a small corpus a contender that starts processes (LitData)
    # ran at 0.0004x tar, which three decimals wrote as 0.0.
    rows = [{"contender": name, "MB_per_s": significant(timings.rate(name, mb)),
             "vs_tar": significant(timings.ratio(name, "tar -cf")),
             # to the microsecond: tar of a small corpus takes ~10 ms, and a rate must be
             # reproducible from the seconds shown (0.1 ms steps moved it by 1%)
             "seconds": [round(s, 6) for s in timings.seconds[name]]} for name in runs]
    for row in rows:
        if row["contender"] in startup:
            run_s = timings.median(str(row["contender"]))
            row["startup_s"] = round(startup[row["contender"]], 6)
            row["startup_share"] = round(startup[row["contender"]] / run_s, 4)
    ratios = {f"{a} / {b}": significant(timings.ratio(a, b)) for a, b in RATIOS}
    report = {"input_MB": round(mb, 2), "files": args.count, "repeats": args.repeats,
              "rows": rows, "ratios": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convert.json").write_text(json.dumps(report, indent=1) + "\n")
    table = ["| contender | input MB/s | × tar | start-up share |", "|---|---|---|---|"] + [
        f"| {r['contender']} | {r['MB_per_s']} | {r['vs_tar']} | "
        f"{format(r['startup_share'], '.1%') if 'startup_share' in r else '-'} |"
        for r in rows] + [""] + [f"{name}: {value}x" for name, value in ratios.items()]
    (args.out / "convert.md").write_text("\n".join(table) + "\n")
    print(f"{args.count} photos, {mb:.1f} MB, median of {args.repeats} alternating repeats")
    print("\n".join(table))
    shutil.rmtree(work)
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
