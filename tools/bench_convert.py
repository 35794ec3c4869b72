#!/usr/bin/env python3
"""Shard conversion speed: make_shards (1 and 2 workers) against plain `tar` of the same files,
and against the converters of MosaicML Streaming (MDSWriter) and LitData (litdata.optimize, 2
workers) where they import (the bench extra: pip install -e ".[bench]").

    python tools/bench_convert.py --out bench-out [--count 200] [--repeats 3]

Input MB/s on the built-in photo-like corpus, medians of alternating repeats after a warm-up,
and the ratios against `tar -cf` measured in the same run. Every repeat does the whole work:
each contender replaces its previous output. Writes convert.json and convert.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from cliutil import positive_int, setup_logging

from pipeline.bench import image as bi
from pipeline.bench.core import alternate
from pipeline.builtin import make_photo_corpus
from pipeline.convert import ConvertConfig, convert

# Shards of about the same size for everyone (make_shards' max_size below).
SHARD_BYTES = 64_000_000


def contenders(src: Path, scratch: Path) -> dict[str, object]:
    def plain_tar() -> None:
        subprocess.run(["tar", "-cf", str(scratch / "plain.tar"), "-C", str(src), "."],
                       check=True)

    def shards(workers: int):  # type: ignore[no-untyped-def]
        def run() -> None:
            convert(ConvertConfig(kind="imagefolder", src=str(src), out=scratch / f"w{workers}",
                                  max_size=SHARD_BYTES, workers=workers, overwrite=True))
        return run

    def mds() -> None:  # the same columns as the loader benchmark's: JPEG bytes, label
        bi.write_mds(src, scratch / "mds", size_limit=SHARD_BYTES)

    def litdata() -> None:
        bi.write_litdata(src, scratch / "litdata", workers=2, chunk_bytes=SHARD_BYTES)

    runs = {"tar -cf": plain_tar, "make_shards 1 worker": shards(1),
            "make_shards 2 workers": shards(2)}
    if bi.importable("MosaicML Streaming"):
        runs["MDSWriter (MosaicML Streaming)"] = mds
    if bi.importable("LitData"):
        runs["litdata.optimize"] = litdata
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--count", type=positive_int, default=200, help="photos in the corpus")
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    setup_logging(quiet=True)
    work = args.out / "convert-work"
    shutil.rmtree(work, ignore_errors=True)
    src = make_photo_corpus(work / "photos", count=args.count)
    mb = sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) / 1e6
    runs = contenders(src, work)
    timings = alternate(runs, repeats=args.repeats)  # type: ignore[arg-type]
    rows = [{"contender": name, "MB_per_s": round(timings.rate(name, mb), 2),
             "vs_tar": round(timings.ratio(name, "tar -cf"), 3),
             # to the microsecond: tar of a small corpus takes ~10 ms, and a rate must be
             # reproducible from the seconds shown (0.1 ms steps moved it by 1%)
             "seconds": [round(s, 6) for s in timings.seconds[name]]} for name in runs]
    report = {"input_MB": round(mb, 2), "files": args.count, "repeats": args.repeats,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convert.json").write_text(json.dumps(report, indent=1) + "\n")
    table = ["| contender | input MB/s | × tar |", "|---|---|---|"] + [
        f"| {r['contender']} | {r['MB_per_s']} | {r['vs_tar']} |" for r in rows]
    (args.out / "convert.md").write_text("\n".join(table) + "\n")
    print(f"{args.count} photos, {mb:.1f} MB, median of {args.repeats} alternating repeats")
    print("\n".join(table))
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
